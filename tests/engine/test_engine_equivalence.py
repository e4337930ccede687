"""Prefix caching is invisible in the results: randomized workloads (shared prefixes, multi-turn
chains, adapters, cache salts, multimodal spans, routed experts, staggered arrivals) on tiny
pools that force eviction, preemption and failed admissions, with both async depths, several
block sizes and layer patterns, give exactly the tokens and routed experts of the same engine
with prefix caching off. Invariants are checked after every step; at the end every pool is
full again after ``clear_cache``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from hybridcache.protocol import CacheProtocol
from hybridcache.engine import Engine, EngineConfig, MultimodalInput, Request, Result, TinyHybridConfig

VOCAB = TinyHybridConfig().vocab_size
MAX_PROMPT = 60
MAX_STEPS = 5000


@dataclass(frozen=True)
class Fresh:
    prefix: int  # index of a shared prefix, -1 for none
    suffix: int
    max_new: int
    adapter: str | None
    salt: str | None
    image: int  # -1: no multimodal span; else the content (one of a few byte strings)
    experts: bool
    arrival: int  # the step of its round at which it is added


@dataclass(frozen=True)
class Turn:
    parent: int  # an earlier request (index into every request so far, modulo their count)
    extra: int  # new user tokens after the parent's prompt and answer
    max_new: int
    experts: bool
    arrival: int


@dataclass(frozen=True)
class Workload:
    block_size: int
    pattern: str
    async_depth: int
    seed: int
    prefixes: tuple[int, ...]
    rounds: tuple[tuple[object, ...], ...]
    extra_blocks: int
    state_slots: int
    checkpoint_budget: int
    max_batch_tokens: int
    max_running: int
    prefill_chunk: int
    decode_interval_blocks: int
    chunk_ends: bool


fresh_ops = st.builds(
    Fresh,
    prefix=st.integers(-1, 2),
    suffix=st.integers(1, 16),
    max_new=st.integers(1, 6),
    adapter=st.sampled_from([None, None, "a", "b"]),
    salt=st.sampled_from([None, None, None, "tenant"]),
    image=st.sampled_from([-1, -1, 0, 1]),
    experts=st.booleans(),
    arrival=st.integers(0, 3),
)
turn_ops = st.builds(
    Turn,
    parent=st.integers(0, 50),
    extra=st.integers(1, 8),
    max_new=st.integers(1, 6),
    experts=st.booleans(),
    arrival=st.integers(0, 3),
)


@st.composite
def workloads(draw, patterns=("RARA", "AA", "R")):
    first_round = draw(st.lists(fresh_ops, min_size=1, max_size=5))
    later = draw(st.lists(st.lists(st.one_of(turn_ops, turn_ops, fresh_ops), min_size=1, max_size=4), min_size=1, max_size=2))
    return Workload(
        block_size=draw(st.sampled_from([8, 16])),
        pattern=draw(st.sampled_from(patterns)),
        async_depth=draw(st.sampled_from([0, 1])),
        seed=draw(st.integers(0, 2**16)),
        prefixes=tuple(draw(st.lists(st.integers(1, 32), min_size=1, max_size=3))),
        rounds=(tuple(first_round), *map(tuple, later)),
        # tiny pools (preemption, failed admissions), small ones (eviction), or room to cache
        extra_blocks=draw(st.one_of(st.integers(0, 2), st.integers(3, 12), st.integers(13, 48))),
        state_slots=draw(st.integers(1, 4)),  # runtime slots on top of the checkpoint budget
        checkpoint_budget=draw(st.integers(0, 3)),
        max_batch_tokens=draw(st.integers(4, 64)),
        max_running=draw(st.sampled_from([1, 2, 3, 4, 4])),
        prefill_chunk=draw(st.integers(3, 40)),
        decode_interval_blocks=draw(st.integers(0, 2)),
        chunk_ends=draw(st.booleans()),
    )


# --- building requests --------------------------------------------------------------------------


class Builder:
    """Turns a workload into requests, round by round (a turn needs its parent's answer)."""

    def __init__(self, workload: Workload) -> None:
        self.rng = np.random.default_rng(workload.seed)
        self.prefixes = [self.rng.integers(0, VOCAB, n).tolist() for n in workload.prefixes]
        self.history: list[tuple[Request, Result]] = []

    def lengths_bound(self, workload: Workload) -> int:
        """Tokens the longest request ever processes (its prompt and answer but the last)."""
        lengths: list[int] = []
        longest = 0
        for ops in workload.rounds:
            new = []
            for op in ops:
                prompt_len, max_new = self._shape(op, lengths)
                new.append(prompt_len + max_new)
                longest = max(longest, prompt_len + max_new - 1)
            lengths.extend(new)
        return longest

    def _shape(self, op, lengths) -> tuple[int, int]:
        if isinstance(op, Turn) and lengths:
            total = lengths[op.parent % len(lengths)] + op.extra
            if total <= MAX_PROMPT:
                return total, op.max_new
            op = Fresh(0, op.extra, op.max_new, None, None, -1, op.experts, op.arrival)
        prefix = len(self.prefixes[op.prefix % len(self.prefixes)]) if isinstance(op, Fresh) and op.prefix >= 0 else 0
        if isinstance(op, Turn):
            return op.extra, op.max_new
        return prefix + op.suffix, op.max_new

    def round(self, ops) -> list[tuple[int, Request]]:
        requests = []
        count = len(self.history)
        for op in ops:
            if isinstance(op, Turn) and count:
                parent, answer = self.history[op.parent % count]
                prompt = list(parent.prompt) + answer.tokens + self.rng.integers(0, VOCAB, op.extra).tolist()
                if len(prompt) <= MAX_PROMPT:
                    requests.append((op.arrival, Request(
                        prompt=prompt,
                        max_new_tokens=op.max_new,
                        adapter=parent.adapter,
                        cache_salt=parent.cache_salt,
                        multimodal=tuple(parent.multimodal),
                        return_routed_experts=op.experts,
                    )))
                    continue
                op = Fresh(0, op.extra, op.max_new, None, None, -1, op.experts, op.arrival)
            if isinstance(op, Turn):  # no parent yet: a plain fresh request
                op = Fresh(-1, op.extra, op.max_new, None, None, -1, op.experts, op.arrival)
            prefix = self.prefixes[op.prefix % len(self.prefixes)] if op.prefix >= 0 else []
            prompt = prefix + self.rng.integers(0, VOCAB, op.suffix).tolist()
            spans = ()
            if op.image >= 0 and len(prompt) >= 6:
                start = len(prefix) // 3 if len(prefix) >= 6 else len(prompt) - 5
                spans = (MultimodalInput(start, start + 4, bytes([op.image]) * 3),)
            requests.append((op.arrival, Request(
                prompt=prompt,
                max_new_tokens=op.max_new,
                adapter=op.adapter,
                cache_salt=op.salt,
                multimodal=spans,
                return_routed_experts=op.experts,
            )))
        return requests


def engine_config(workload: Workload, builder: Builder, caching: bool) -> EngineConfig:
    size = workload.block_size
    minimum = -(-builder.lengths_bound(workload) // size) + 1
    return EngineConfig(
        block_size=size,
        num_kv_blocks=minimum + workload.extra_blocks,
        num_state_slots=1 + workload.checkpoint_budget + workload.state_slots,
        checkpoint_budget=workload.checkpoint_budget,
        prefix_caching=caching,
        max_batch_tokens=workload.max_batch_tokens,
        max_running=workload.max_running,
        prefill_chunk=workload.prefill_chunk,
        decode_checkpoint_interval=size * workload.decode_interval_blocks,
        checkpoint_chunk_ends=workload.chunk_ends,
        async_depth=workload.async_depth if caching else 0,
        seed=0,
        dtype="float64",
        model=TinyHybridConfig(layer_pattern=workload.pattern),
    )


def serve(engine: Engine, timed: list[tuple[int, Request]]) -> list[Result]:
    """Add each request at its arrival step, step to completion, check invariants every step."""
    pending = sorted(range(len(timed)), key=lambda i: timed[i][0])
    ids: dict[int, int] = {}
    done: dict[int, Result] = {}
    for step in range(MAX_STEPS):
        while pending and timed[pending[0]][0] <= step:
            index = pending.pop(0)
            ids[index] = engine.add_request(timed[index][1])
        if not pending and len(done) == len(timed):
            break
        for result in engine.step():
            assert result.request_id not in done
            done[result.request_id] = result
        engine.check_invariants()
    else:
        raise AssertionError("the engine did not finish")
    return [done[ids[i]] for i in range(len(timed))]


def assert_same(expected: Result, got: Result, request: Request) -> None:
    assert got.tokens == expected.tokens
    assert got.prompt_tokens == expected.prompt_tokens == len(request.prompt)
    assert len(got.tokens) == request.max_new_tokens
    if request.return_routed_experts:
        assert got.routed_experts is not None and expected.routed_experts is not None
        assert got.routed_experts.shape[0] == len(request.prompt) + request.max_new_tokens - 1
        assert np.array_equal(got.routed_experts, expected.routed_experts)
    else:
        assert got.routed_experts is None and expected.routed_experts is None
    assert expected.cached_tokens == 0
    assert 0 <= got.cached_tokens < len(request.prompt)


def assert_pools_full(engine: Engine) -> None:
    assert not engine.scheduler.has_work
    engine.clear_cache()
    engine.check_invariants()
    assert engine.pool.num_free == engine.config.num_kv_blocks
    assert engine.states.num_free == engine.config.num_state_slots - 1
    assert engine.states.num_runtime == 0 and engine.states.num_checkpoint == 0
    assert engine.trie.nodes.num_attached == 0


def run_workload(workload: Workload) -> dict:
    builder = Builder(workload)
    hit_tokens = query_tokens = 0
    reference = Engine(engine_config(workload, builder, caching=False))
    cached = Engine(engine_config(workload, builder, caching=True))
    for ops in workload.rounds:
        timed = builder.round(ops)
        expected = serve(reference, timed)
        got = serve(cached, timed)
        for (_, request), want, have in zip(timed, expected, got):
            assert_same(want, have, request)
            hit_tokens += have.cached_tokens
            query_tokens += len(request.prompt)
        builder.history.extend((request, result) for (_, request), result in zip(timed, expected))
    stats = cached.stats()
    assert stats["failed_forwards"] == 0 and reference.stats()["failed_forwards"] == 0
    # a recompute after preemption and a rolled-back admission are not new queries
    assert stats["hit_tokens"] == hit_tokens and stats["query_tokens"] == query_tokens
    assert_pools_full(cached)
    assert_pools_full(reference)
    return stats


SLOW = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SLOW
@given(workloads())
def test_prefix_caching_never_changes_results(workload):
    stats = run_workload(workload)  # compares every result with the uncached engine
    assert stats["failed_forwards"] == 0
    target(float(stats["preemptions"]), label="preemptions")  # steer towards pressure
    target(float(stats["hit_tokens"]), label="hit tokens")
    event(f"pattern={workload.pattern}")
    event("hit" if stats["hit_tokens"] else "no hit")
    if stats["preemptions"]:
        event("preemption")
    if stats["evicted_blocks"] or stats["evicted_checkpoints"]:
        event("eviction")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads(patterns=("RARA",)))
def test_multi_turn_chains_on_a_hybrid_model(workload):
    stats = run_workload(workload)  # compares every result with the uncached engine
    assert stats["query_tokens"] > 0


# --- fixed scenarios that must reach the pressure paths ---------------------------------------------


def _pressure_workload(pattern: str, block_size: int, async_depth: int) -> Workload:
    """Three concurrent requests in a pool that fits the longest one plus one block: decode
    preempts, waiting requests fail admission, the cache is evicted; then a second turn of one
    conversation hits what survived. (If a policy change makes a scenario miss a path, the
    assertions below say which one.)"""
    first = tuple(
        Fresh(prefix=-1, suffix=14 + 2 * i, max_new=6, adapter=None, salt=None, image=-1, experts=i == 0, arrival=0)
        for i in range(3)
    )
    second = (Turn(parent=1, extra=3, max_new=3, experts=False, arrival=0),)
    return Workload(
        block_size=block_size, pattern=pattern, async_depth=async_depth, seed=3, prefixes=(8,), rounds=(first, second),
        extra_blocks=0, state_slots=3, checkpoint_budget=4, max_batch_tokens=32, max_running=3, prefill_chunk=16,
        decode_interval_blocks=0, chunk_ends=False,
    )


@pytest.mark.parametrize("async_depth", [0, 1])
@pytest.mark.parametrize("pattern, block_size", [("RARA", 8), ("AA", 16), ("R", 8)])
def test_tiny_pools_reach_eviction_preemption_and_failed_admissions(monkeypatch, pattern, block_size, async_depth):
    outcomes = {"failed": 0, "admitted": 0}
    real = CacheProtocol.admit

    def counting(self, *args, **kwargs):
        admitted = real(self, *args, **kwargs)
        outcomes["admitted" if admitted.admitted else "failed"] += 1
        return admitted

    monkeypatch.setattr(CacheProtocol, "admit", counting)
    stats = run_workload(_pressure_workload(pattern, block_size, async_depth))
    assert stats["hit_tokens"] > 0
    assert stats["preemptions"] > 0
    assert stats["evicted_blocks"] + stats["evicted_checkpoints"] > 0
    assert outcomes["failed"] > 0 and outcomes["admitted"] > 0


def test_overlapped_forwards_on_a_pool_for_one_request_finish():
    # Regression (livelock): with a forward in flight, two requests that cannot fit together
    # used to preempt themselves and be re-admitted at once, forever (round 3 here).
    first = tuple(
        Fresh(prefix=i % 2, suffix=5 + 3 * i, max_new=4 + i % 3, adapter=[None, "a"][i % 2 and i > 2], salt=None,
              image=[-1, 0, -1, 1][i], experts=i % 2 == 0, arrival=i % 2)
        for i in range(4)
    )
    second = tuple(Turn(parent=i, extra=3 + i, max_new=3, experts=i == 1, arrival=0) for i in range(4))
    third = (
        Turn(parent=5, extra=4, max_new=5, experts=True, arrival=0),
        Fresh(prefix=1, suffix=2, max_new=3, adapter=None, salt="tenant", image=-1, experts=False, arrival=1),
        Turn(parent=6, extra=2, max_new=2, experts=False, arrival=2),
    )
    workload = Workload(
        block_size=8, pattern="RARA", async_depth=1, seed=7, prefixes=(24, 17), rounds=(first, second, third),
        extra_blocks=0, state_slots=2, checkpoint_budget=2, max_batch_tokens=24, max_running=2, prefill_chunk=11,
        decode_interval_blocks=1, chunk_ends=True,
    )
    assert run_workload(workload)["preemptions"] > 0
