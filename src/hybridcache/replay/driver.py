"""Replay a synthesized trace through the cache in arrival order and measure what it saves.

Owns, during one ``replay`` call, one adapter per replica (pools and trie, see ``adapter``),
each replica's tiers when asked for (``tiering``; the shared store is the caller's, and the
run removes what it put there), and the counters of the run. A request goes to the replica
``routing`` chooses; with tiers it first restores the deepest verified prefix they hold
(``CacheProtocol.adopt``), and after it publishes the chunk-aligned prefixes it computed. Each request is one turn: admission (the cache reuses the deepest exact
checkpoint), then virtual chunks to the ends its admission policy plans, checkpoints where the
plan asks, its output appended at the prompt end and processed as one more virtual chunk (or
several, when the policy checkpoints inside it), and release. A request the pools cannot hold
even when empty is counted as dropped.

Budgets and the pools they buy: ``budgets``.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError, StoreError
from hybridcache.policies import Policy, TurnView, first_end, kind_of_step
from hybridcache.policies.eviction import MarconiState
from hybridcache.policies.tuning import AlphaTuner
from hybridcache.profiles import ModelProfile
from hybridcache.replay.adapter import CacheAdapter, PoolGeometry, Turn
from hybridcache.replay.budgets import Budget, pool_geometry
from hybridcache.replay.oracle import foresee
from hybridcache.replay.routing import AnnouncedReplica, check_routing
from hybridcache.router.policy import choose
from hybridcache.router.replica_index import Depths
from hybridcache.router.request_key import RequestKey
from hybridcache.replay.tiering import (
    NominalSizes,
    ReplicaTiers,
    TierSetup,
    replay_fingerprint,
    restore_limit,
    tier_report,
)
from hybridcache.tiers.keys import KeyChain
from hybridcache.types import as_int
from hybridcache.workloads.records import TraceRequest

DEFAULT_BLOCK_SIZE = 32  # Marconi's vLLM+ block; interval:32 checkpoints stay block aligned
DEFAULT_PREFILL_CHUNK = 2048  # the engine's prefill chunk: no chunk allocates more blocks at once
DEFAULT_DEVICE_TFLOPS = 400.0  # ~40 % of an H100's dense BF16 peak: the TTFT estimate's device


@dataclass
class _Counters:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    flops_saved: float = 0.0
    flops_needed: float = 0.0
    checkpoints_written: int = 0
    dropped: int = 0


# Called after every request with every replica's adapter (``turn.replica`` served it).
Observer = Callable[[list[CacheAdapter], TraceRequest, Turn], None]
# Called while Marconi's tuning replays its window: (window requests replayed, to replay).
TuningProgress = Callable[[int, int], None]


def _serve(
    adapter: CacheAdapter,
    request: TraceRequest,
    policy: Policy,
    counters: _Counters,
    chunk: int,
    before_admission: Callable[[Turn], object] | None = None,
    forward_ends: list[int] | None = None,
) -> Turn:
    """One turn: admission, prefill chunks of at most ``chunk`` tokens from the resume point
    (as the engine's scheduler cuts them) also ended at every planned checkpoint, the output
    as one more chunk, release. ``before_admission(turn)`` runs once the turn is prepared (a
    tier restore); the end of every computed chunk is appended to ``forward_ends``."""
    admission = policy.admission
    turn = adapter.start_turn(request.prompt)
    if before_admission is not None:
        before_admission(turn)
    prompt_length = request.prompt_length
    final_end = prompt_length + max(0, request.output_length - 1)
    block_size = adapter.geometry.block_size

    def view(start: int) -> TurnView:
        return TurnView(start, prompt_length, final_end, min(turn.branch, prompt_length), block_size)

    def stop_at(start: int) -> int:
        return min(start + chunk, first_end(admission.save_steps(view(start)), view(start)))

    first = adapter.admit(turn, prompt_length, stop_at)
    if first is None:
        counters.dropped += 1
        adapter.finish(turn)
        return turn
    ends_out = forward_ends if forward_ends is not None else []
    turn_view = view(turn.hit_tokens)
    saves = admission.save_steps(turn_view)
    grid = range(turn.hit_tokens + chunk, prompt_length, chunk)
    ends = sorted(end for end in {first, *saves, *grid, prompt_length, final_end} if end >= first)
    kinds = {end: kind_of_step(turn_view, end) for end in saves if end >= first}
    prompt_ends = [end for end in ends if end <= prompt_length]
    output_ends = ends[len(prompt_ends):]
    parent = turn.hit_tokens
    for group, chunk_ends in enumerate((prompt_ends, output_ends)):
        if not chunk_ends:
            continue
        if group and not adapter.grow(turn, chunk_ends[0]):
            counters.dropped += 1
            break
        published = adapter.forward(turn, chunk_ends, kinds, parent)
        counters.checkpoints_written += sum(published)
        parent = max((end for end, done in zip(chunk_ends, published) if done), default=parent)
        ends_out.extend(chunk_ends[: len(published)])
        if len(published) < len(chunk_ends):
            counters.dropped += 1
            break
        if chunk_ends[-1] == prompt_length:
            adapter.append(turn, request.output)
    adapter.finish(turn)
    return turn


class _Tuning:
    """Marconi's alpha autotuning inside one replay (``policies.tuning``): a snapshot of the
    cache at the first eviction, the bootstrap window replayed from it once per weight."""

    def __init__(self, adapter: CacheAdapter, policy: Policy, prefill_chunk: int,
                 progress: TuningProgress | None = None) -> None:
        self.adapter, self.policy, self.chunk = adapter, policy, prefill_chunk
        self.tuner = AlphaTuner() if isinstance(adapter.eviction, MarconiState) else None
        self.snapshot: CacheAdapter | None = None
        self.progress = progress

    def after(self, request: TraceRequest) -> None:
        tuner = self.tuner
        if tuner is None or tuner.tuned:
            return
        tuner.record(request)
        if tuner.wants_snapshot(_evicted(self.adapter)):
            self.snapshot = copy.deepcopy(self.adapter)
            tuner.took_snapshot()
        elif tuner.due():
            hits = {alpha: self._replay_window(alpha, trial) for trial, alpha in enumerate(tuner.grid)}
            self.adapter.eviction.set_alpha(tuner.choose(hits))
            self.snapshot = None

    def _replay_window(self, alpha: float, trial_number: int) -> int:
        trial = copy.deepcopy(self.snapshot)
        trial.eviction.set_alpha(alpha)
        scratch = _Counters()
        window = self.tuner.window
        total = len(window) * len(self.tuner.grid)
        hits = 0
        for number, request in enumerate(window, start=trial_number * len(window) + 1):
            hits += _serve(trial, request, self.policy, scratch, self.chunk).hit_tokens
            if self.progress is not None:
                self.progress(number, total)
        return hits


def _evicted(adapter: CacheAdapter) -> bool:
    stats = adapter.stats()
    return bool(stats["evicted_blocks"] or stats["evicted_checkpoints"] or stats["evicted_checkpoints_for_state_slots"])


@dataclass
class _Replica:
    """One replica of the run: its device cache, its alpha tuning, its tiers, what it served."""

    adapter: CacheAdapter
    tuning: _Tuning
    tiers: ReplicaTiers | None
    announced: AnnouncedReplica | None = None  # what a router would know of it (routed runs only)
    requests: int = 0
    hit_tokens: int = 0


def replay(
    requests: SequenceLike[TraceRequest],
    profile: ModelProfile,
    policy: Policy,
    budget: Budget,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    progress: Callable[[], None] | None = None,
    tuning_progress: TuningProgress | None = None,
    observer: Observer | None = None,
    replicas: int = 1,
    routing: str = "round-robin",
    tiers: TierSetup | None = None,
    device_tflops: float = DEFAULT_DEVICE_TFLOPS,
) -> dict:
    """Serve ``requests`` in order on ``replicas`` replicas, each with ``budget`` and, when
    ``tiers`` enables any, its own host and disk tiers and the run's shared one; returns the
    run's measurements (see ``_record``). ``progress`` is called after every request,
    ``tuning_progress`` while Marconi's tuning replays its window."""
    _validate(requests, profile, policy, budget)
    prefill_chunk = as_int("prefill_chunk", prefill_chunk, 1)
    replicas = as_int("replicas", replicas, 1)
    routing = check_routing(routing)
    if tiers is not None and not isinstance(tiers, TierSetup):
        raise InvalidTypeError(f"tiers must be a TierSetup, got {type(tiers).__name__}")
    if not device_tflops > 0:
        raise InvalidArgumentError(f"device_tflops must be > 0, got {device_tflops!r}")
    geometry = pool_geometry(budget, profile, block_size, replicas)
    fitted = policy.admission.fitted(geometry.kv_blocks * block_size, geometry.checkpoint_slots)
    policy, foresight = foresee(dataclasses.replace(policy, admission=fitted), requests, block_size)
    tiered = tiers is not None and tiers.enabled
    if tiered and tiers.chunk_size % block_size:
        raise InvalidArgumentError(f"--tier-chunk {tiers.chunk_size} must be a multiple of the block size {block_size}")
    fleet = [_new_replica(geometry, profile, policy, prefill_chunk, tuning_progress) for _ in range(replicas)]
    if replicas > 1 and routing != "round-robin":
        for replica in fleet:
            replica.announced = AnnouncedReplica(replica.adapter.cache, block_size)
    run = _TierRun(tiers, profile, block_size, device_tflops, requests, fleet) if tiered else None
    counters = _Counters()
    began = time.perf_counter()
    try:
        for number, request in enumerate(requests):
            if foresight is not None:
                foresight.advance(number)
            chain = run.prompt_chain(request) if run is not None else None
            index = _route(fleet, routing, request, number, chain, run)
            replica = fleet[index]
            ends: list[int] = []
            restore = None if replica.tiers is None else (lambda turn: replica.tiers.restore(replica.adapter, turn, chain))
            turn = _serve(replica.adapter, request, policy, counters, prefill_chunk, restore, ends if run else None)
            turn.replica = index
            if run is not None:
                run.publish(replica, request, turn, ends)
            if replica.announced is not None:
                replica.announced.refresh()
            replica.tuning.after(request)
            replica.requests += 1
            replica.hit_tokens += turn.hit_tokens
            counters.prompt_tokens += request.prompt_length
            counters.hit_tokens += turn.hit_tokens
            counters.hit_requests += turn.hit_tokens > 0
            counters.flops_saved += profile.prefill_flops(0, turn.hit_tokens)
            counters.flops_needed += profile.prefill_flops(0, request.prompt_length)
            if observer is not None:
                observer([r.adapter for r in fleet], request, turn)
            if progress is not None:
                progress()
        wall_s = time.perf_counter() - began
        record = _record(fleet, counters, len(requests), wall_s, (profile, policy, budget, block_size))
        record.update(replicas=replicas, routing=routing, shared_tier=tiers.shared_name if tiers else "none")
        record["remote_hit_tokens"] = run.remote_hit_tokens() if run is not None else 0
        if run is not None:
            record["tiers"] = run.report()
        return record
    finally:
        if run is not None:
            run.close()


def _new_replica(geometry: PoolGeometry, profile: ModelProfile, policy: Policy, prefill_chunk: int,
                 tuning_progress: TuningProgress | None) -> _Replica:
    adapter = CacheAdapter(geometry, policy.eviction.new_state(profile))
    return _Replica(adapter, _Tuning(adapter, policy, prefill_chunk, tuning_progress), None)


def _route(fleet: list[_Replica], routing: str, request: TraceRequest, number: int, chain, run) -> int:
    """The replica serving ``request``, chosen by the router's policy from what each replica
    announced (``routing``); with tiers, ``restorable`` counts the steps they make reachable."""
    if len(fleet) == 1 or routing == "round-robin":
        return number % len(fleet)
    key = RequestKey(request.prompt.tolist())
    depths = [replica.announced.depths(key) for replica in fleet]
    if routing == "restorable" and run is not None and chain is not None:
        shared = run.shared_presence(chain)
        depths = [
            Depths(d.kv_tokens, replica.tiers.store.reachable_step(
                chain, local_step=d.restorable, local_kv_tokens=d.kv_tokens, shared_located=shared))
            for replica, d in zip(fleet, depths)
        ]
    return choose(routing, request.prompt_length, depths, [0] * len(fleet), number).index  # served one at a time: nothing queued


class _TierRun:
    """The tiers of one run: each replica's ``ReplicaTiers``, the run's namespace, the keys put
    into the shared store (removed at the end, so a sweep's runs start from an empty store)."""

    def __init__(self, setup: TierSetup, profile: ModelProfile, block_size: int, device_tflops: float,
                 requests: SequenceLike[TraceRequest], fleet: list[_Replica]) -> None:
        self.setup, self.profile, self.fleet = setup, profile, fleet
        self.chunk = setup.chunk_size
        self.fingerprint = replay_fingerprint(profile, block_size, self.chunk, uuid.uuid4().hex[:16])
        self.sizes = NominalSizes(profile, self.chunk)
        mean_prompt = max(1, round(mean_prompt_tokens(requests)))
        flops = device_tflops * 1e12
        rate = profile.prefill_flops(0, mean_prompt) / mean_prompt / flops  # mean per-token cost of a mean prompt
        self.published: set[str] = set()
        try:
            for index, replica in enumerate(fleet):
                replica.tiers = ReplicaTiers(setup, self.sizes, self.fingerprint, rate, flops, profile, index)
        except BaseException:
            self.close()
            raise

    def prompt_chain(self, request: TraceRequest) -> KeyChain | None:
        """The chain of the prompt's restorable prefix (None: too short for one chunk)."""
        limit = restore_limit(request.prompt_length, self.chunk)
        return KeyChain(self.fingerprint, request.prompt[:limit]) if limit > 0 else None

    def shared_presence(self, chain: KeyChain) -> dict[str, list[str]] | None:
        """Where the chain's objects are in the shared store: one lookup for every replica
        (None without a shared tier)."""
        if self.setup.shared is None:
            return None
        names = [chain.checkpoint_key(step).name for step in chain.checkpoint_steps()]
        names += [chain.chunk_key(index).name for index in range(chain.num_chunks)]
        return self.fleet[0].tiers.store.locate(names, ["shared"])

    def publish(self, replica: _Replica, request: TraceRequest, turn: Turn, ends: list[int]) -> None:
        """Publish what the turn computed beyond its hit: every chunk-aligned chunk end (the engine
        publishes those), the deepest aligned step of the prompt and of the turn end."""
        if not ends:
            return
        computed = ends[-1]
        chunk = self.chunk
        wanted = {end for end in ends if end % chunk == 0}
        wanted |= {min(request.prompt_length, computed) // chunk * chunk, computed // chunk * chunk}
        steps = sorted(step for step in wanted if step > turn.hit_tokens)
        replica.tiers.publish(request.tokens, steps, self.published)

    def remote_hit_tokens(self) -> int:
        return sum(replica.tiers.counters["remote_hit_tokens"] for replica in self.fleet)

    def report(self) -> dict:
        return tier_report(self.setup, self.sizes, [replica.tiers for replica in self.fleet])

    def close(self) -> None:
        """Remove this run's objects from the shared store and close every replica's own tiers."""
        shared = self.setup.shared
        if shared is not None and self.published:
            names = sorted(self.published)
            for at in range(0, len(names), 512):
                try:
                    shared.remove(names[at : at + 512])
                except StoreError:
                    break  # the store is gone; so is what it held
        self.published.clear()
        for replica in self.fleet:
            if replica.tiers is not None:
                replica.tiers.close()


def _validate(requests: SequenceLike[TraceRequest], profile: ModelProfile, policy: Policy, budget: Budget) -> None:
    for value, kind in ((profile, ModelProfile), (policy, Policy), (budget, Budget)):
        if not isinstance(value, kind):
            raise InvalidTypeError(f"expected a {kind.__name__}, got {type(value).__name__}")
    if any(not isinstance(request, TraceRequest) for request in requests):
        raise InvalidTypeError("requests must be TraceRequest records (see hybridcache.workloads.synthesize)")


def _merged_stats(fleet: list[_Replica]) -> dict:
    """The adapters' statistics summed over replicas (one replica: its own, unchanged)."""
    if len(fleet) == 1:
        return fleet[0].adapter.stats()
    merged: dict = {}
    for replica in fleet:
        for name, value in replica.adapter.stats().items():
            if isinstance(value, dict):
                bucket = merged.setdefault(name, {})
                for key, count in value.items():
                    bucket[key] = bucket.get(key, 0) + count
            else:
                merged[name] = merged.get(name, 0) + value
    merged["hit_rate"] = merged["hit_tokens"] / merged["query_tokens"] if merged["query_tokens"] else 0.0
    return merged


def _record(fleet: list[_Replica], counters: _Counters, requests: int, wall_s: float, setup: tuple) -> dict:
    profile, policy, budget, block_size = setup
    stats = _merged_stats(fleet)
    geometry = fleet[0].adapter.geometry
    record = {
        "policy": policy.name,
        "admission": policy.admission.name,
        "eviction": policy.eviction.name,
        "model": profile.name,
        "cache_bytes": budget.cache_bytes,
        "kv_bytes": budget.kv_bytes,
        "state_bytes": budget.state_bytes,
        "block_size": block_size,
        "kv_blocks": geometry.kv_blocks,
        "checkpoint_slots": geometry.checkpoint_slots,
        "requests": requests,
        "dropped_requests": counters.dropped,
        "prompt_tokens": counters.prompt_tokens,
        "token_hit_rate": counters.hit_tokens / counters.prompt_tokens if counters.prompt_tokens else 0.0,
        "request_hit_rate": counters.hit_requests / requests if requests else 0.0,
        "prefill_tokens_saved": counters.hit_tokens,
        "flops_saved": counters.flops_saved,
        "flops_saved_fraction": counters.flops_saved / counters.flops_needed if counters.flops_needed else 0.0,
        "checkpoints_written": counters.checkpoints_written,
        "checkpoint_bytes_written": counters.checkpoints_written * profile.state_bytes,
        "evictions": {
            "kv_blocks": stats["evicted_blocks"],
            "checkpoints_by_trie": stats["evicted_checkpoints"],
            "checkpoints_for_state_slots": stats["evicted_checkpoints_for_state_slots"],
            "checkpoints_over_anchor_cap": stats["released_checkpoints_over_anchor_cap"],
        },
        "misses": stats["misses"],
        "shortened": stats["shortened"],
        "trie_hit_rate": stats["hit_rate"],
        "wall_s": wall_s,
        "alpha": getattr(fleet[0].adapter.eviction, "alpha", None),
    }
    if len(fleet) > 1:
        record["per_replica"] = [
            {"requests": r.requests, "hit_tokens": r.hit_tokens, "alpha": getattr(r.adapter.eviction, "alpha", None)}
            for r in fleet
        ]
    return record


def with_ttft(record: dict, device_tflops: float) -> dict:
    """Add the TTFT saving estimated from the FLOPs saved at ``device_tflops`` sustained."""
    if not device_tflops > 0:
        raise InvalidArgumentError(f"device_tflops must be > 0, got {device_tflops!r}")
    seconds = record["flops_saved"] / (device_tflops * 1e12)
    requests = max(1, record["requests"])
    per_request_ms = 1e3 * seconds / requests
    return {**record, "device_tflops": device_tflops, "ttft_saved_s": seconds, "ttft_saved_ms_per_request": per_request_ms}


def mean_prompt_tokens(requests: SequenceLike[TraceRequest]) -> float:
    return float(np.mean([request.prompt_length for request in requests])) if requests else 0.0
