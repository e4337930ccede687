"""A forward that fails at any stage (``tests.engine.faults``) leaves nothing it would have
produced matchable: its reserved or published checkpoint saves are released, the trie nodes
it attached for blocks it did not write are detached (or stay unmatchable), its sequences are
recomputed from scratch and finish with exactly the tokens of an uncached run; invariants
hold after every step and nothing leaks."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hybridcache.engine import Engine, EngineConfig, MultimodalInput, Request, Result, TinyHybridConfig
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from tests.engine.faults import FAULT_STAGES, arm

VOCAB = TinyHybridConfig().vocab_size
MAX_STEPS = 3000


def engine_config(pattern: str, caching: bool, async_depth: int = 0) -> EngineConfig:
    return EngineConfig(
        block_size=8,
        num_kv_blocks=40,
        num_state_slots=12,
        checkpoint_budget=6,
        prefix_caching=caching,
        max_batch_tokens=40,
        max_running=3,
        prefill_chunk=12,
        decode_checkpoint_interval=8,
        async_depth=async_depth,
        model=TinyHybridConfig(layer_pattern=pattern),
    )


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def round_requests(round_index: int, previous: list[tuple[Request, Result]]) -> list[Request]:
    """Round 0: three requests sharing a prefix (one with an image, one with routed experts);
    later rounds: the next turn of each conversation plus one new request."""
    if round_index == 0:
        prefix = _tokens(19, 1)
        return [
            Request(prompt=prefix + _tokens(5, 2), max_new_tokens=5, return_routed_experts=True),
            Request(prompt=prefix + _tokens(9, 3), max_new_tokens=4, multimodal=(MultimodalInput(3, 9, b"cat"),)),
            Request(prompt=prefix + _tokens(2, 4), max_new_tokens=6, adapter="a"),
        ]
    turns = [
        Request(
            prompt=list(request.prompt) + result.tokens + _tokens(3 + i, 10 * round_index + i),
            max_new_tokens=3,
            adapter=request.adapter,
            multimodal=request.multimodal,
            return_routed_experts=request.return_routed_experts,
        )
        for i, (request, result) in enumerate(previous[-3:])
    ]
    return turns + [Request(prompt=_tokens(13, 99 + round_index), max_new_tokens=2)]


def serve(engine: Engine, requests: list[Request], on_step=None) -> list[Result]:
    ids = [engine.add_request(r) for r in requests]
    done: dict[int, Result] = {}
    for step in range(MAX_STEPS):
        if len(done) == len(ids):
            break
        if on_step is not None:
            on_step(step)
        for result in engine.step():
            done[result.request_id] = result
        engine.check_invariants()
        if on_step is not None:
            on_step(None)
    else:
        raise AssertionError("the engine did not finish")
    return [done[i] for i in ids]


@functools.lru_cache(maxsize=None)
def reference(pattern: str) -> tuple[tuple[tuple[Request, ...], tuple[Result, ...]], ...]:
    """The workload's rounds served without prefix caching."""
    engine = Engine(engine_config(pattern, caching=False))
    history: list[tuple[Request, Result]] = []
    rounds = []
    for index in range(3):
        requests = round_requests(index, history)
        results = serve(engine, requests)
        history.extend(zip(requests, results))
        rounds.append((tuple(requests), tuple(results)))
    return tuple(rounds)


def same_result(expected: Result, got: Result) -> bool:
    if got.tokens != expected.tokens:
        return False
    if (got.routed_experts is None) != (expected.routed_experts is None):
        return False
    return got.routed_experts is None or np.array_equal(got.routed_experts, expected.routed_experts)


class FailureWatch:
    """Records, when a forward fails, the checkpoint saves and the pending trie nodes its
    chunks' sequences had; checks after the step that none of them became matchable."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.saves = []
        self.nodes = []
        self.aborted = 0
        scheduler = engine.scheduler
        real_abort = scheduler.abort

        def abort(chunk, **options):
            self.aborted += 1
            if chunk.save is not None:
                self.saves.append(chunk.save)
            self.nodes.extend(self._pending_path(chunk.entry.seq))
            real_abort(chunk, **options)

        scheduler.abort = abort

    def _pending_path(self, seq):
        nodes, state = self.engine.trie.nodes, seq.prefix_state
        found = []
        node = state.trie.cursor
        if node < 0 or not nodes.is_valid(node, state.trie.cursor_generation):
            return found
        while not nodes.is_root[node]:
            if nodes.pending[node]:
                found.append((int(node), int(nodes.generation[node])))
            node = int(nodes.parent[node])
        return found

    def check(self) -> None:
        engine = self.engine
        indexed = {id(record) for _, record in engine.trie.index.entries()} if engine.trie.index is not None else set()
        for record in self.saves:
            assert record.state is CheckpointState.RELEASED, record
            assert id(record) not in indexed
        nodes = engine.trie.nodes
        for slot, generation in self.nodes:
            assert not nodes.is_valid(slot, generation) or nodes.pending[slot], "a failed forward's node is matchable"


def run_with_faults(pattern: str, async_depth: int, faults: dict[tuple[int, int], list[str]]) -> FailureWatch:
    """Serve the workload with prefix caching, arming ``faults[(round, step)]`` before that step."""
    engine = Engine(engine_config(pattern, caching=True, async_depth=async_depth))
    watch = FailureWatch(engine)
    failures = 0
    for index, (requests, expected) in enumerate(reference(pattern)):
        def on_step(step, index=index):
            nonlocal failures
            if step is None:  # after the step
                if engine.stats()["failed_forwards"] > failures:
                    failures = engine.stats()["failed_forwards"]
                    watch.check()
                return
            for stage in faults.get((index, step), ()):
                arm(engine, stage)

        got = serve(engine, list(requests), on_step)
        for want, have in zip(expected, got):
            assert same_result(want, have)
    watch.check()
    assert engine.stats()["failed_forwards"] == sum(len(v) for v in faults.values())
    assert watch.aborted >= engine.stats()["failed_forwards"]
    assert engine.stats()["hit_tokens"] > 0  # the cache kept serving after the failure
    nodes = engine.trie.nodes
    assert not nodes.pending[nodes.attached_slots()].any(), "a node stayed pending after every forward ended"
    if engine.trie.checkpoints is not None:
        assert all(r.ready and r.pin_count == 0 for r in engine.trie.checkpoints.live_records())
    engine.clear_cache()
    engine.check_invariants()
    assert engine.pool.num_free == engine.config.num_kv_blocks
    assert engine.states.num_free == engine.config.num_state_slots - 1
    return watch


@pytest.mark.parametrize("step", [0, 3])
@pytest.mark.parametrize("async_depth", [0, 1])
@pytest.mark.parametrize("stage", FAULT_STAGES)
def test_fault_at_each_stage_leaves_nothing_matchable(stage, async_depth, step):
    # round 1 starts with restores of round 0's checkpoints; step 3 is mid-decode
    watch = run_with_faults("RARA", async_depth, {(1, step): [stage]})
    if step == 0:  # the failed forward carried saves and attached nodes: the checks had work
        assert watch.saves and watch.nodes


@pytest.mark.parametrize("pattern", ["AA", "R"])
@pytest.mark.parametrize("stage", ["before_restore", "after_save"])
def test_faults_on_other_layer_patterns(pattern, stage):
    watch = run_with_faults(pattern, 1, {(1, 0): [stage]})
    assert watch.nodes


@pytest.mark.parametrize("async_depth", [0, 1])
def test_consecutive_and_repeated_faults(async_depth):
    faults = {
        (0, 2): ["after_restore", "before_save"],  # two forwards in a row fail
        (1, 1): ["after_save"],
        (2, 0): ["before_restore"],
        (2, 4): ["after_restore"],
    }
    watch = run_with_faults("RARA", async_depth, faults)
    assert watch.aborted >= 1


def test_failed_forward_is_counted_and_the_request_recomputed():
    engine = Engine(engine_config("RARA", caching=True))
    request = Request(prompt=_tokens(20, 5), max_new_tokens=3)
    arm(engine, "after_save")
    result = engine.generate([request])[0]
    stats = engine.stats()
    assert stats["failed_forwards"] == 1 and stats["preemptions"] == 1
    assert result.cached_tokens == 0
    expected = Engine(engine_config("RARA", caching=False)).generate([request])[0]
    assert result.tokens == expected.tokens
    engine.check_invariants()


def test_fault_armed_on_an_idle_engine_hits_the_next_forward():
    engine = Engine(engine_config("RARA", caching=True))
    arm(engine, "before_restore")
    assert engine.step() == [] and engine.stats()["failed_forwards"] == 0  # nothing ran
    engine.generate([Request(prompt=_tokens(9, 6), max_new_tokens=2)])
    assert engine.stats()["failed_forwards"] == 1
    engine.generate([Request(prompt=_tokens(9, 7), max_new_tokens=2)])
    assert engine.stats()["failed_forwards"] == 1  # a fault fires once


# --- cancellation ---------------------------------------------------------------------------


def _cancel_scenario(async_depth: int, cancel_after_steps: int, prefill_chunk: int):
    from hybridcache.engine import Engine, EngineConfig, Request

    rng = np.random.default_rng(7)
    shared = rng.integers(0, 512, 40).tolist()
    victim = Request(prompt=shared + rng.integers(0, 512, 30).tolist(), max_new_tokens=6)
    others = [Request(prompt=shared + rng.integers(0, 512, 9).tolist(), max_new_tokens=3) for _ in range(3)]
    config = dict(block_size=8, num_kv_blocks=96, num_state_slots=10, checkpoint_budget=4, max_batch_tokens=48,
                  max_running=4, prefill_chunk=prefill_chunk, async_depth=async_depth)
    engine = Engine(EngineConfig(**config))
    victim_id = engine.add_request(victim)
    other_ids = [engine.add_request(r) for r in others]
    done = {}
    for step in range(400):
        if step == cancel_after_steps:
            assert engine.cancel(victim_id)
        for result in engine.step():
            done[result.request_id] = result
        engine.check_invariants()
        if len(done) == len(other_ids) and not engine.scheduler.has_work:
            break
    assert victim_id not in done and set(done) == set(other_ids)
    reference = Engine(EngineConfig(**dict(config, prefix_caching=False)))
    expected = reference.generate(others)
    assert [done[i].tokens for i in other_ids] == [r.tokens for r in expected]
    engine.clear_cache()
    engine.check_invariants()
    assert engine.pool.num_free == config["num_kv_blocks"]
    assert engine.states.num_free == config["num_state_slots"] - 1
    return engine


@pytest.mark.parametrize("async_depth", [0, 1])
@pytest.mark.parametrize(("cancel_after_steps", "label"), [(1, "mid-prefill"), (6, "mid-decode"), (0, "waiting")])
def test_cancelled_request_leaves_nothing_behind(async_depth, cancel_after_steps, label):
    engine = _cancel_scenario(async_depth, cancel_after_steps, prefill_chunk=16)
    assert not engine.cancel(12345)  # unknown ids are refused


def test_cancel_while_the_restore_is_pinned_unpins_it():
    """Between admission (restore pinned) and queueing, a cancel must drop the pin."""
    from hybridcache.memory import BlockPool, StatePool
    from hybridcache.prefix_cache import BlockTrie
    from hybridcache.cache import CacheComponents
    from hybridcache.protocol import CacheProtocol
    from hybridcache.scheduler import Scheduler, SchedulerConfig, ServingSequence
    from hybridcache.sequence import Sequence

    pool, states = BlockPool(64), StatePool(8, checkpoint_budget=4)
    trie = BlockTrie(pool, 8, state_pool=states, track_pending=True)
    scheduler = Scheduler(
        SchedulerConfig(max_batch_tokens=64, prefill_chunk=64), CacheProtocol(CacheComponents(pool, states, trie))
    )
    producer = ServingSequence(0, Sequence(list(range(20))), max_new_tokens=1)
    scheduler.add(producer)
    (chunk,) = scheduler.schedule().chunks
    assert trie.checkpoints.publish_save(producer.seq)  # as the engine does once the forward is queued
    scheduler.complete(chunk, 7, None)
    consumer = ServingSequence(1, Sequence(list(range(20)) + [7, 1, 2]), max_new_tokens=1)
    scheduler.add(consumer)
    batch = scheduler.schedule()
    record = consumer.seq.prefix_state.checkpoints.restore
    assert record is not None and consumer.seq.prefix_state.checkpoints.restore_pinned and record.restore_pins == 1
    consumer.in_flight = False  # cancelled before the forward was queued
    scheduler.cancel(consumer)
    assert consumer.seq.prefix_state.checkpoints.restore is None and not consumer.seq.prefix_state.checkpoints.restore_pinned
    assert record.restore_pins == 0 and record.is_published
    assert batch.chunks and scheduler.running == []
    trie.check_invariants(scheduler.live_sequences())
    scheduler.check_invariants()
