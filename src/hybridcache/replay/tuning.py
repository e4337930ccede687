"""Marconi's alpha autotuning inside one replay (``policies.tuning``), for one replica.

Owns, per replica, the ``AlphaTuner`` and the snapshot of that replica's cache taken at its
first eviction (dropped once alpha is chosen); each trial of the bootstrap window replays on
its own copy of the snapshot, so the replica itself is changed only by ``set_alpha``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from hybridcache.policies import Policy
from hybridcache.policies.eviction import MarconiState
from hybridcache.policies.tuning import AlphaTuner
from hybridcache.replay.adapter import CacheAdapter
from hybridcache.replay.serving import serve_turn
from hybridcache.workloads.records import TraceRequest

# Called while Marconi's tuning replays its window: (window requests replayed, to replay).
TuningProgress = Callable[[int, int], None]


def tuning_for(adapter: CacheAdapter, policy: Policy, prefill_chunk: int,
               progress: TuningProgress | None = None) -> Tuning | None:
    """The tuning of the replica of ``adapter``; None when its eviction is not Marconi's (it
    tunes nothing, so its requests need not pass here)."""
    return Tuning(adapter, policy, prefill_chunk, progress) if isinstance(adapter.eviction, MarconiState) else None


class Tuning:
    """A snapshot of the cache at the first eviction, the bootstrap window replayed from it once
    per weight."""

    def __init__(self, adapter: CacheAdapter, policy: Policy, prefill_chunk: int,
                 progress: TuningProgress | None = None) -> None:
        self.adapter, self.policy, self.chunk = adapter, policy, prefill_chunk
        self.tuner = AlphaTuner()
        self.snapshot: CacheAdapter | None = None
        self.progress = progress

    def after(self, request: TraceRequest) -> bool:
        """Let the tuning see a request its replica served; True once alpha is chosen (the
        tuning is done and need see no more)."""
        tuner = self.tuner
        if tuner.tuned:
            return True
        tuner.record(request)
        if tuner.wants_snapshot(_evicted(self.adapter)):
            self.snapshot = copy.deepcopy(self.adapter)
            tuner.took_snapshot()
        elif tuner.due():
            hits = {alpha: self._replay_window(alpha, trial) for trial, alpha in enumerate(tuner.grid)}
            self.adapter.eviction.set_alpha(tuner.choose(hits))
            self.snapshot = None
        return tuner.tuned

    def _replay_window(self, alpha: float, trial_number: int) -> int:
        trial = copy.deepcopy(self.snapshot)
        trial.eviction.set_alpha(alpha)
        window = self.tuner.window
        total = len(window) * len(self.tuner.grid)
        hits = 0
        for number, request in enumerate(window, start=trial_number * len(window) + 1):
            hits += serve_turn(trial, request.prompt, request.output, self.policy, self.chunk).turn.hit_tokens
            if self.progress is not None:
                self.progress(number, total)
        return hits


def _evicted(adapter: CacheAdapter) -> bool:
    stats = adapter.stats()
    return bool(stats["evicted_blocks"] or stats["evicted_checkpoints"] or stats["evicted_checkpoints_for_state_slots"])
