"""Benchmark scenarios. Each one builds its workload untimed and times exactly what its
docstring names, on every implementation given, interleaving the implementations sample by
sample on the same prompts (so machine noise hits both alike).

Every scenario returns one record per implementation with at least ``scenario``, ``impl``,
``batch``, ``context``, ``block_size``, ``p50_ms``, ``p99_ms`` and ``per_request_us``.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from hybridcache.bench.impl import HybridcacheImpl, Impl
from hybridcache.bench.workload import VOCAB, distinct_prompts
from hybridcache.cache import CacheComponents
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.protocol import CacheProtocol
from hybridcache.sequence import Sequence

SUFFIX_TOKENS = 16
Progress = Callable[[], None]


@dataclass(frozen=True)
class Case:
    batch: int
    context: int
    block_size: int = 64
    steps: int = 1  # published steps in the namespace (``miss``)
    warmups: int = 2
    samples: int = 10

    @property
    def rounds(self) -> int:
        return self.warmups + self.samples


def percentiles(samples_ms: list[float]) -> dict:
    return {"p50_ms": float(np.percentile(samples_ms, 50)), "p99_ms": float(np.percentile(samples_ms, 99))}


def _record(scenario: str, impl: Impl, case: Case, samples_ms: list[float], per: int, **extra) -> dict:
    record = {
        "scenario": scenario,
        "impl": impl.name,
        "batch": case.batch,
        "context": case.context,
        "block_size": case.block_size,
        **percentiles(samples_ms),
        "samples_ms": samples_ms,
        **extra,
    }
    record["per_request_us"] = record["p50_ms"] * 1000 / per
    return record


@contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector paused inside (as ``timeit`` does), as it was after, even on an
    error: it runs between samples, so no implementation pays for collecting another's heap."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def timed(action: Callable[[], object]) -> tuple[object, float]:
    """Run ``action`` once and return its value and wall time in ms (``gc_paused``)."""
    with gc_paused():
        started = time.perf_counter_ns()
        value = action()
        elapsed = time.perf_counter_ns() - started
    return value, elapsed / 1e6


def _timed_cpu(action: Callable[[], object]) -> tuple[object, float, float]:
    """``timed`` that also returns the process CPU time in ms: on a loaded machine wall time
    includes other processes' turns on this CPU, CPU time does not."""
    started = time.process_time_ns()
    value, wall_ms = timed(action)
    return value, wall_ms, (time.process_time_ns() - started) / 1e6


def with_suffix(prompts: list[np.ndarray], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.concatenate([p, rng.integers(0, VOCAB, SUFFIX_TOKENS, dtype=np.int32)]) for p in prompts]


def _setup_all(impls: Iterable[Impl], case: Case, *, hybrid: bool, checkpoints: int, extra_blocks: int = 0) -> None:
    blocks = case.batch * (case.context // case.block_size + 4) + extra_blocks + 64
    for impl in impls:
        impl.setup(num_blocks=blocks, num_checkpoints=checkpoints, block_size=case.block_size, hybrid=hybrid)


# --- matching --------------------------------------------------------------------------------


def _match_scenario(
    name: str, impls: list[Impl], case: Case, progress: Progress, *, hybrid: bool, save_step: int | None
) -> list[dict]:
    """Time one match per new request (the seed's scope) and, separately, each request's
    ingest; also the bare exact comparison of the same tokens (the physical floor)."""
    prompts = distinct_prompts(case.batch, case.context)
    _setup_all(impls, case, hybrid=hybrid, checkpoints=case.batch)
    saves = () if save_step is None else (save_step,)
    for prompt in prompts:
        for impl in impls:
            impl.prefill(prompt, saves)
        progress()
    expected_hit = case.context if save_step is None else save_step
    timings = {impl.name: ([], [], []) for impl in impls}
    cpu_totals = {impl.name: [] for impl in impls}
    floor, floor_cpu = [], []
    for round_index in range(case.rounds):
        request_tokens = with_suffix(prompts, round_index + 1)
        for impl in impls:
            requests = impl.new_requests(request_tokens)
            _, ingest_ms, ingest_cpu_ms = _timed_cpu(lambda: impl.ingest(requests))
            handles, match_ms, match_cpu_ms = _timed_cpu(lambda: impl.match(requests))
            assert all(impl.hit_tokens(r) == expected_hit for r in requests), f"{impl.name} missed in {name}"
            impl.rollback(requests, handles)
            if round_index >= case.warmups:
                match_samples, ingest_samples, total_samples = timings[impl.name]
                match_samples.append(match_ms)
                ingest_samples.append(ingest_ms)
                total_samples.append(match_ms + ingest_ms)
                cpu_totals[impl.name].append(match_cpu_ms + ingest_cpu_ms)
        _, floor_ms, floor_cpu_ms = _timed_cpu(
            lambda: [np.array_equal(t[: case.context], p) for t, p in zip(request_tokens, prompts)]
        )
        if round_index >= case.warmups:
            floor.append(floor_ms)
            floor_cpu.append(floor_cpu_ms)
    floor_p50 = float(np.percentile(floor, 50))
    floor_cpu_p50 = float(np.percentile(floor_cpu, 50))
    records = []
    for impl in impls:
        match_samples, ingest_samples, total_samples = timings[impl.name]
        total_p50 = float(np.percentile(total_samples, 50))
        records.append(
            _record(
                name, impl, case, match_samples, case.batch,
                ingest_p50_ms=float(np.percentile(ingest_samples, 50)),
                total_p50_ms=total_p50,
                floor_p50_ms=floor_p50,
                overhead_over_floor=total_p50 / floor_p50 if floor_p50 else float("inf"),
                **_cpu_columns(cpu_totals[impl.name], floor_cpu_p50),
            )
        )
    return records


def _cpu_columns(cpu_totals: list[float], floor_cpu_p50: float) -> dict:
    total = float(np.percentile(cpu_totals, 50))
    return {"total_cpu_p50_ms": total, "floor_cpu_p50_ms": floor_cpu_p50,
            "cpu_overhead_over_floor": total / floor_cpu_p50 if floor_cpu_p50 else float("inf")}


def bench_match(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """Aligned exact checkpoint hit at the last block boundary of each prompt."""
    return _match_scenario("match", impls, case, progress, hybrid=True, save_step=case.context)


def bench_match_partial(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """Hit on a mid-block checkpoint half a block before each prompt's end."""
    return _match_scenario(
        "match-partial", impls, case, progress, hybrid=True, save_step=case.context - case.block_size // 2
    )


def bench_kv_match(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """Attention-only model: every full block of each prompt is a hit."""
    return _match_scenario("kv-match", impls, case, progress, hybrid=False, save_step=None)


def bench_miss(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """No hit while the namespace holds ``case.steps`` published steps: one cached prompt with
    checkpoints spread over its blocks; the requests share no block with it."""
    (prompt,) = distinct_prompts(1, case.context, seed=99)
    blocks = case.context // case.block_size
    spacing = max(1, blocks // case.steps)
    saves = tuple(case.block_size * spacing * (k + 1) for k in range(min(case.steps, blocks)))
    _setup_all(impls, case, hybrid=True, checkpoints=len(saves) + 2)
    for impl in impls:
        impl.prefill(prompt, saves)
    progress()
    prompts = distinct_prompts(case.batch, case.context, seed=7)
    timings = {impl.name: [] for impl in impls}
    for round_index in range(case.rounds):
        request_tokens = with_suffix(prompts, round_index + 1)
        for impl in impls:
            requests = impl.new_requests(request_tokens)
            handles, ms = timed(lambda: (impl.ingest(requests), impl.match(requests))[1])
            assert all(impl.hit_tokens(r) == 0 for r in requests), f"{impl.name} hit in miss"
            impl.rollback(requests, handles)
            if round_index >= case.warmups:
                timings[impl.name].append(ms)
    return [_record("miss", impl, case, timings[impl.name], case.batch, steps=len(saves)) for impl in impls]


def bench_rollback(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """Time undoing ``batch`` aligned checkpoint hits (the match itself is untimed)."""
    return _after_match("rollback", impls, case, progress, time_rollback=True)


def bench_rematch(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """Time matching again after each request's first admission was rolled back."""
    return _after_match("rematch", impls, case, progress, time_rollback=False)


def _after_match(name: str, impls: list[Impl], case: Case, progress: Progress, *, time_rollback: bool) -> list[dict]:
    prompts = distinct_prompts(case.batch, case.context)
    _setup_all(impls, case, hybrid=True, checkpoints=case.batch)
    for prompt in prompts:
        for impl in impls:
            impl.prefill(prompt, (case.context,))
        progress()
    timings = {impl.name: [] for impl in impls}
    for round_index in range(case.rounds):
        request_tokens = with_suffix(prompts, round_index + 1)
        for impl in impls:
            requests = impl.new_requests(request_tokens)
            impl.ingest(requests)
            handles = impl.match(requests)
            if time_rollback:
                _, ms = timed(lambda: impl.rollback(requests, handles))
            else:
                impl.rollback(requests, handles)
                handles, ms = timed(lambda: impl.match(requests))
                assert all(impl.hit_tokens(r) == case.context for r in requests)
                impl.rollback(requests, handles)
            if round_index >= case.warmups:
                timings[impl.name].append(ms)
    return [_record(name, impl, case, timings[impl.name], case.batch) for impl in impls]


# --- admission -------------------------------------------------------------------------------

ADMIT_BUDGET = 2048  # tokens per first chunk: every request's 16-token suffix after its hit


def admission_protocol(case: Case) -> CacheProtocol:
    blocks = case.batch * (case.context // case.block_size + 4) + 64
    pool, states = BlockPool(blocks), StatePool(2 * case.batch + 2, checkpoint_budget=case.batch)
    return CacheProtocol(CacheComponents(pool, states, BlockTrie(pool, case.block_size, state_pool=states)))


def cache_with_checkpoint(protocol: CacheProtocol, prompt: np.ndarray) -> None:
    seq = Sequence(prompt)
    admitted = protocol.admit(seq, prompt.size)
    protocol.reserve_save(seq, prompt.size)
    protocol.forward_queued(seq)
    seq.set_computed(prompt.size)
    protocol.forward_done(seq, 0)
    protocol.free(seq, admitted.runtime_slot)


def bench_admit_many(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """Scheduler-time admission of ``batch`` ingested requests, each hitting an aligned
    checkpoint at its prompt's last block boundary (the ``match`` workload) through the whole
    protocol (match, restore pin, first chunk's blocks, runtime slot, attach, commit): one
    ``CacheProtocol.admit_many`` call per batch (kind ``admit_many``) against one ``admit``
    call per request (kind ``admit``), interleaved round by round. Ours only: the reference
    has no protocol of this shape."""
    protocol = admission_protocol(case)
    prompts = distinct_prompts(case.batch, case.context)
    for prompt in prompts:
        cache_with_checkpoint(protocol, prompt)
        progress()
    kinds = {"admit_many": lambda seqs: protocol.admit_many(seqs, ADMIT_BUDGET),
             "admit": lambda seqs: [protocol.admit(seq, ADMIT_BUDGET) for seq in seqs]}
    timings = {kind: [] for kind in kinds}
    for round_index in range(case.rounds):
        for kind, admit in kinds.items():
            requests = [Sequence(tokens) for tokens in with_suffix(prompts, round_index + 1)]
            for seq in requests:
                protocol.prepare(seq)
            admitted, ms = timed(lambda: admit(requests))
            assert all(a.hit_tokens == case.context for a in admitted), f"{kind} missed"
            for seq, admission in zip(requests, admitted):
                protocol.free(seq, admission.runtime_slot)
            if round_index >= case.warmups:
                timings[kind].append(ms)
    ours = impls[0] if impls and impls[0].name == "hybridcache" else HybridcacheImpl()
    return [_record("admit-many", ours, case, samples, case.batch, kind=kind) for kind, samples in timings.items()]


# --- lifecycle -------------------------------------------------------------------------------


def bench_publish(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """Time reserving and publishing one checkpoint at each request's full length, for
    ``batch`` prefilled requests per sample."""
    prompts = distinct_prompts(case.batch, case.context)
    _setup_all(impls, case, hybrid=True, checkpoints=case.batch)
    timings = {impl.name: [] for impl in impls}
    for round_index in range(case.rounds):
        for impl in impls:
            requests = [impl.admit(prompt) for prompt in prompts]
            _, ms = timed(lambda: [impl.reserve_and_publish(r, case.context) for r in requests])
            for request in requests:
                impl.release(request)
            impl.evict_checkpoints(case.batch)
            impl.evict_blocks(case.batch * (case.context // case.block_size + 1))  # room for the next round
            if round_index >= case.warmups:
                timings[impl.name].append(ms)
        progress()
    return [_record("publish", impl, case, timings[impl.name], case.batch) for impl in impls]


def bench_evict(impls: list[Impl], case: Case, progress: Progress) -> list[dict]:
    """Evict ``batch`` of at least ``10 * batch`` checkpoints (state-slot pressure), and
    ``batch`` of at least ``10 * batch`` KV leaves (block pressure), per sample."""
    keep = 10 * case.batch
    total = keep + case.rounds * case.batch
    block = case.block_size
    prompts = distinct_prompts(total, block * 2, seed=3)
    _setup_all(impls, Case(batch=total, context=block * 2, block_size=block), hybrid=True, checkpoints=total)
    for index, prompt in enumerate(prompts):
        for impl in impls:
            impl.prefill(prompt, (block,))
        if index % max(1, total // 100) == 0:
            progress()
    checkpoint_times = {impl.name: [] for impl in impls}
    block_times = {impl.name: [] for impl in impls}
    for round_index in range(case.rounds):
        for impl in impls:
            released, ms = timed(lambda: impl.evict_checkpoints(case.batch))
            assert released == case.batch, f"{impl.name} released {released}"
            freed, block_ms = timed(lambda: impl.evict_blocks(case.batch))
            assert freed >= case.batch, f"{impl.name} freed {freed}"
            if round_index >= case.warmups:
                checkpoint_times[impl.name].append(ms)
                block_times[impl.name].append(block_ms)
    records = []
    for impl in impls:
        records.append(_record("evict", impl, case, checkpoint_times[impl.name], case.batch, kind="checkpoints", pool=total))
        records.append(_record("evict-kv", impl, case, block_times[impl.name], case.batch, kind="kv-leaves", pool=total))
    return records


SCENARIOS: dict[str, Callable[[list[Impl], Case, Progress], list[dict]]] = {
    "match": bench_match,
    "match-partial": bench_match_partial,
    "kv-match": bench_kv_match,
    "admit-many": bench_admit_many,
    "miss": bench_miss,
    "rollback": bench_rollback,
    "rematch": bench_rematch,
    "publish": bench_publish,
    "evict": bench_evict,
}
