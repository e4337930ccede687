"""Replay a synthesized trace through the cache in arrival order and measure what it saves.

Owns, during one ``replay`` call, the adapter (pools and trie, see ``adapter``) and the
counters of the run. Each request is one turn: admission (the cache reuses the deepest exact
checkpoint), then virtual chunks to the ends its admission policy plans, checkpoints where the
plan asks, its output appended at the prompt end and processed as one more virtual chunk (or
several, when the policy checkpoints inside it), and release. A request the pools cannot hold
even when empty is counted as dropped.

Budgets. ``kv_bytes`` buys KV blocks of ``block_size`` tokens, ``state_bytes`` buys checkpoint
slots of one profile state each (the running turn's own state is not charged). One combined
``cache_bytes`` is split so that both pools cover the same number of prompt tokens at the
admission policy's checkpoint density on this trace: state share = S / (S + K * spacing), with
S the checkpoint bytes, K the KV bytes per token and ``spacing`` the policy's tokens per
checkpoint (interval: N; reference: mean prompt / (ceil(mean prompt / chunk) + 1)).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.policies import Policy, TurnView, first_end, kind_of_step
from hybridcache.policies.eviction import MarconiState
from hybridcache.policies.tuning import AlphaTuner
from hybridcache.profiles import ModelProfile
from hybridcache.replay.adapter import CacheAdapter, PoolGeometry, Turn
from hybridcache.types import as_int
from hybridcache.workloads.records import Request

DEFAULT_BLOCK_SIZE = 32  # Marconi's vLLM+ block; interval:32 checkpoints stay block aligned
DEFAULT_PREFILL_CHUNK = 2048  # the engine's prefill chunk: no chunk allocates more blocks at once
DEFAULT_DEVICE_TFLOPS = 400.0  # ~40 % of an H100's dense BF16 peak: the TTFT estimate's device


@dataclass(frozen=True)
class Budget:
    kv_bytes: int
    state_bytes: int
    cache_bytes: int | None = None  # set when the two were split from one budget


def split_budget(cache_bytes: int, profile: ModelProfile, policy: Policy, mean_prompt: float) -> Budget:
    """Split one budget between KV and checkpoints by the equal-coverage rule (module doc)."""
    spacing = policy.admission.checkpoint_spacing(mean_prompt)
    state_share = profile.state_bytes / (profile.state_bytes + profile.kv_bytes_per_token * spacing)
    state_bytes = int(cache_bytes * state_share)
    return Budget(cache_bytes - state_bytes, state_bytes, cache_bytes)


def pool_geometry(budget: Budget, profile: ModelProfile, block_size: int) -> PoolGeometry:
    kv_blocks = budget.kv_bytes // (profile.kv_bytes_per_token * block_size)
    slots = budget.state_bytes // profile.state_bytes
    if kv_blocks < 1 or slots < 1:
        raise InvalidArgumentError(
            f"budget too small for {profile.name}: {kv_blocks} KV blocks, {slots} checkpoint slots"
        )
    return PoolGeometry(block_size, int(kv_blocks), int(slots))


@dataclass
class _Counters:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    flops_saved: float = 0.0
    flops_needed: float = 0.0
    checkpoints_written: int = 0
    dropped: int = 0


Observer = Callable[[CacheAdapter, Request, Turn], None]


def _serve(adapter: CacheAdapter, request: Request, policy: Policy, counters: _Counters, chunk: int) -> Turn:
    """One turn: admission, prefill chunks of at most ``chunk`` tokens from the resume point
    (as the engine's scheduler cuts them) also ended at every planned checkpoint, the output
    as one more chunk, release."""
    admission = policy.admission
    turn = adapter.start_turn(request.prompt)
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
    turn_view = view(turn.hit_tokens)
    saves = admission.save_steps(turn_view)
    grid = range(turn.hit_tokens + chunk, prompt_length, chunk)
    ends = sorted(end for end in {first, *saves, *grid, prompt_length, final_end} if end >= first)
    parent = turn.hit_tokens
    for index, end in enumerate(ends):
        if index and not adapter.grow(turn, end):
            counters.dropped += 1
            break
        kind = kind_of_step(turn_view, end) if end in saves else None
        if adapter.forward(turn, end, kind, parent):
            counters.checkpoints_written += 1
            parent = end
        if end == prompt_length:
            adapter.append(turn, request.output)
    adapter.finish(turn)
    return turn


class _Tuning:
    """Marconi's alpha autotuning inside one replay (``policies.tuning``): a snapshot of the
    cache at the first eviction, the bootstrap window replayed from it once per weight."""

    def __init__(self, adapter: CacheAdapter, policy: Policy, prefill_chunk: int) -> None:
        self.adapter, self.policy, self.chunk = adapter, policy, prefill_chunk
        self.tuner = AlphaTuner() if isinstance(adapter.eviction, MarconiState) else None
        self.snapshot: CacheAdapter | None = None

    def after(self, request: Request) -> None:
        tuner = self.tuner
        if tuner is None or tuner.tuned:
            return
        tuner.record(request)
        if tuner.wants_snapshot(_evicted(self.adapter)):
            self.snapshot = copy.deepcopy(self.adapter)
            tuner.took_snapshot()
        elif tuner.due():
            hits = {alpha: self._replay_window(alpha) for alpha in tuner.grid}
            self.adapter.eviction.set_alpha(tuner.choose(hits))
            self.snapshot = None

    def _replay_window(self, alpha: float) -> int:
        trial = copy.deepcopy(self.snapshot)
        trial.eviction.set_alpha(alpha)
        scratch = _Counters()
        return sum(_serve(trial, request, self.policy, scratch, self.chunk).hit_tokens for request in self.tuner.window)


def _evicted(adapter: CacheAdapter) -> bool:
    stats = adapter.trie.stats
    return bool(stats.evicted_blocks or stats.evicted_checkpoints or adapter.evicted_for_slots)


def replay(
    requests: SequenceLike[Request],
    profile: ModelProfile,
    policy: Policy,
    budget: Budget,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    progress: Callable[[], None] | None = None,
    observer: Observer | None = None,
) -> dict:
    """Serve ``requests`` in order; returns the run's measurements (see ``_record``)."""
    _validate(requests, profile, policy, budget)
    prefill_chunk = as_int("prefill_chunk", prefill_chunk, 1)
    geometry = pool_geometry(budget, profile, block_size)
    adapter = CacheAdapter(geometry, policy.eviction.new_state(profile))
    fitted = policy.admission.fitted(geometry.kv_blocks * block_size, geometry.checkpoint_slots)
    policy = dataclasses.replace(policy, admission=fitted)
    counters = _Counters()
    tuning = _Tuning(adapter, policy, prefill_chunk)
    began = time.perf_counter()
    for request in requests:
        turn = _serve(adapter, request, policy, counters, prefill_chunk)
        tuning.after(request)
        counters.prompt_tokens += request.prompt_length
        counters.hit_tokens += turn.hit_tokens
        counters.hit_requests += turn.hit_tokens > 0
        counters.flops_saved += profile.prefill_flops(0, turn.hit_tokens)
        counters.flops_needed += profile.prefill_flops(0, request.prompt_length)
        if observer is not None:
            observer(adapter, request, turn)
        if progress is not None:
            progress()
    return _record(adapter, counters, len(requests), time.perf_counter() - began, (profile, policy, budget, block_size))


def _validate(requests: SequenceLike[Request], profile: ModelProfile, policy: Policy, budget: Budget) -> None:
    for value, kind in ((profile, ModelProfile), (policy, Policy), (budget, Budget)):
        if not isinstance(value, kind):
            raise InvalidTypeError(f"expected a {kind.__name__}, got {type(value).__name__}")
    if any(not isinstance(request, Request) for request in requests):
        raise InvalidTypeError("requests must be Request records (see hybridcache.workloads.synthesize)")


def _record(adapter: CacheAdapter, counters: _Counters, requests: int, wall_s: float, setup: tuple) -> dict:
    profile, policy, budget, block_size = setup
    stats = adapter.stats()
    geometry = adapter.geometry
    return {
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
        "alpha": getattr(adapter.eviction, "alpha", None),
    }


def with_ttft(record: dict, device_tflops: float) -> dict:
    """Add the TTFT saving estimated from the FLOPs saved at ``device_tflops`` sustained."""
    if not device_tflops > 0:
        raise InvalidArgumentError(f"device_tflops must be > 0, got {device_tflops!r}")
    seconds = record["flops_saved"] / (device_tflops * 1e12)
    requests = max(1, record["requests"])
    per_request_ms = 1e3 * seconds / requests
    return {**record, "device_tflops": device_tflops, "ttft_saved_s": seconds, "ttft_saved_ms_per_request": per_request_ms}


def mean_prompt_tokens(requests: SequenceLike[Request]) -> float:
    return float(np.mean([request.prompt_length for request in requests])) if requests else 0.0
