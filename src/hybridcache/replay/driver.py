"""Replay a synthesized trace through the cache in arrival order and measure what it saves.

Owns, during one ``replay`` call, the run's fleet (``fleet``: each replica's cache, tuning and
tiers, and the run's counters, ``record.RunCounters``). What a run is asked to do is a
``run_config.RunConfig``, checked when it is built; what it measured is a ``record.RunRecord``.
How one request is served: ``serving``; budgets and the pools they buy: ``budgets``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceLike

from hybridcache.errors import InvalidTypeError
from hybridcache.replay.adapter import CacheAdapter, Turn
from hybridcache.replay.fleet import Fleet
from hybridcache.replay.oracle import foresee
from hybridcache.replay.record import RunRecord
from hybridcache.replay.run_config import RunConfig
from hybridcache.replay.tuning import TuningProgress
from hybridcache.workloads.records import TraceRequest

# Called after every request with every replica's adapter and the turn that served it.
Observer = Callable[[list[CacheAdapter], TraceRequest, Turn], None]


def replay(
    requests: SequenceLike[TraceRequest],
    config: RunConfig,
    *,
    progress: Callable[[], None] | None = None,
    tuning_progress: TuningProgress | None = None,
    observer: Observer | None = None,
) -> RunRecord:
    """Serve ``requests`` in order as ``config`` says (its replicas, each with the whole budget
    and, when its tiers enable any, its own host and disk tiers and the run's shared one);
    returns what the run measured. ``progress`` is called after every request,
    ``tuning_progress`` while Marconi's tuning replays its window, ``observer`` after every
    request with every replica's adapter (a debugging hook: invariants, exactness)."""
    if not isinstance(config, RunConfig):
        raise InvalidTypeError(f"config must be a RunConfig, got {type(config).__name__}")
    if any(not isinstance(request, TraceRequest) for request in requests):
        raise InvalidTypeError("requests must be TraceRequest records (see hybridcache.workloads.synthesize)")
    geometry = config.geometry
    weighed = config.policy.admission.for_state_weight(config.profile.state_tokens_equivalent)
    fitted = weighed.fitted(geometry.kv_blocks * config.block_size, geometry.checkpoint_slots)
    policy, foresight = foresee(dataclasses.replace(config.policy, admission=fitted), requests, config.block_size)
    fleet = Fleet(config, policy, requests, tuning_progress)
    began = time.perf_counter()
    try:
        for number, request in enumerate(requests):
            if foresight is not None:
                foresight.advance(number)
            served = fleet.serve(request, number)
            if observer is not None:
                observer(fleet.adapters, request, served.turn)
            if progress is not None:
                progress()
        wall_s = time.perf_counter() - began
        return RunRecord.measured(config, policy, fleet.measures(), wall_s)
    finally:
        fleet.close()

