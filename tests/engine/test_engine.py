"""The engine's public API and behaviour: generate / streaming, the cache between calls,
multi-turn reuse up to the finish checkpoint, statistics, request validation, clear_cache."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.engine import (
    Engine,
    EngineConfig,
    MultimodalInput,
    Request,
    Result,
    TinyHybridConfig,
)
from hybridcache.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    InvalidNamespaceError,
    InvalidSpanError,
    InvalidTokenError,
    InvalidTypeError,
)

VOCAB = TinyHybridConfig().vocab_size


def config(**overrides) -> EngineConfig:
    base = dict(
        block_size=8,
        num_kv_blocks=64,
        num_state_slots=8,
        checkpoint_budget=4,
        max_batch_tokens=64,
        max_running=4,
        prefill_chunk=32,
        seed=0,
    )
    base.update(overrides)
    return EngineConfig(**base)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def drive(engine: Engine, requests, limit=5000) -> list[Result]:
    """Serve ``requests`` through add_request/step, checking invariants after every step."""
    ids = [engine.add_request(r) for r in requests]
    done = {}
    for _ in range(limit):
        if len(done) == len(ids):
            break
        for result in engine.step():
            assert result.request_id not in done
            done[result.request_id] = result
        engine.check_invariants()
    assert len(done) == len(ids), "the engine did not finish"
    return [done[i] for i in ids]


def assert_idle_and_clearable(engine: Engine) -> None:
    engine.clear_cache()
    engine.check_invariants()
    assert engine.pool.num_free == engine.config.num_kv_blocks
    assert engine.states.num_free == engine.config.num_state_slots - 1  # slot 0 is reserved
    assert engine.trie.nodes.num_attached == 0


# --- serving --------------------------------------------------------------------------------


def test_generate_returns_results_in_request_order():
    engine = Engine(config())
    requests = [Request(prompt=tokens(5 + 7 * i, i), max_new_tokens=1 + i) for i in range(4)]
    results = engine.generate(requests)
    assert [r.request_id for r in results] == [0, 1, 2, 3]
    assert [len(r.tokens) for r in results] == [1, 2, 3, 4]
    assert [r.prompt_tokens for r in results] == [len(r.prompt) for r in requests]
    assert all(0 <= t < VOCAB for r in results for t in r.tokens)
    assert all(r.routed_experts is None for r in results)
    engine.check_invariants()


def test_results_do_not_depend_on_batching():
    requests = [Request(prompt=tokens(9 + 5 * i, 10 + i), max_new_tokens=4) for i in range(4)]
    one_by_one = Engine(config(prefix_caching=False, max_running=1, max_batch_tokens=8, prefill_chunk=5))
    together = Engine(config(prefix_caching=False))
    a = [one_by_one.generate([r])[0].tokens for r in requests]
    b = [r.tokens for r in together.generate(requests)]
    assert a == b


def test_streaming_add_request_and_step():
    requests = [Request(prompt=tokens(10 + 3 * i, 20 + i), max_new_tokens=2 + i) for i in range(3)]
    engine = Engine(config())
    assert engine.step() == []  # idle
    ids = [engine.add_request(r) for r in requests]
    assert ids == [0, 1, 2]
    finished = {}
    steps = 0
    while len(finished) < 3:
        for result in engine.step():
            finished[result.request_id] = result
        engine.check_invariants()
        steps += 1
        assert steps < 100
    assert steps > 1
    reference = Engine(config()).generate(requests)
    assert [finished[i].tokens for i in ids] == [r.tokens for r in reference]
    assert engine.step() == []
    assert not engine.scheduler.has_work


def test_request_added_while_others_run():
    engine = Engine(config())
    first = engine.add_request(Request(prompt=tokens(20, 1), max_new_tokens=6))
    engine.step()
    second = engine.add_request(Request(prompt=tokens(12, 2), max_new_tokens=2))
    results = {}
    while len(results) < 2:
        for result in engine.step():
            results[result.request_id] = result
        engine.check_invariants()
    alone = Engine(config()).generate([Request(prompt=tokens(12, 2), max_new_tokens=2)])[0]
    assert results[second].tokens == alone.tokens and len(results[first].tokens) == 6


@pytest.mark.parametrize("async_depth", [0, 1])
def test_routed_experts_cover_every_processed_token(async_depth):
    engine = Engine(config(async_depth=async_depth))
    request = Request(prompt=tokens(21, 3), max_new_tokens=5, return_routed_experts=True)
    result = engine.generate([request])[0]
    width = engine.config.model.routed_expert_width
    # prompt and every generated token but the last went through the model
    assert result.routed_experts.shape == (21 + 5 - 1, width)
    follow = Request(prompt=list(request.prompt) + result.tokens + tokens(4, 30), max_new_tokens=2, return_routed_experts=True)
    second = engine.generate([follow])[0]  # served from the cache: the experts are replayed
    assert second.cached_tokens >= 21 + 5 - 1
    assert second.routed_experts.shape == (len(follow.prompt) + 1, width)
    # the same positions routed to the same experts
    assert np.array_equal(second.routed_experts[: 21 + 5 - 1], result.routed_experts)
    uncached = Engine(config(prefix_caching=False)).generate([follow])[0]
    assert second.tokens == uncached.tokens
    assert np.array_equal(second.routed_experts, uncached.routed_experts)


# --- the cache between calls ------------------------------------------------------------------


def test_cache_persists_between_generate_calls():
    engine = Engine(config())
    prompt = tokens(30, 4)
    first = engine.generate([Request(prompt=prompt, max_new_tokens=4)])[0]
    assert first.cached_tokens == 0
    stats = engine.stats()
    assert stats["hits"] == 0 and stats["hit_tokens"] == 0
    follow = prompt + first.tokens + tokens(5, 5)
    second = engine.generate([Request(prompt=follow, max_new_tokens=3)])[0]
    stats = engine.stats()
    assert second.cached_tokens > 0
    assert stats["hits"] == 1 and stats["hit_tokens"] == second.cached_tokens
    assert stats["query_tokens"] == len(prompt) + len(follow)
    uncached = Engine(config(prefix_caching=False)).generate([Request(prompt=follow, max_new_tokens=3)])[0]
    assert second.tokens == uncached.tokens and uncached.cached_tokens == 0


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("pattern", ["RARA", "R", "AA"])
@pytest.mark.parametrize("prompt_len", [13, 16, 29])
def test_multi_turn_reuses_up_to_the_finish_checkpoint(pattern, block_size, prompt_len):
    cfg = config(block_size=block_size, model=TinyHybridConfig(layer_pattern=pattern))
    engine = Engine(cfg)
    prompt = tokens(prompt_len, 6)
    new = 4
    turn1 = engine.generate([Request(prompt=prompt, max_new_tokens=new)])[0]
    turn2_prompt = prompt + turn1.tokens + tokens(6, 7)
    turn2 = engine.generate([Request(prompt=turn2_prompt, max_new_tokens=3)])[0]
    processed = prompt_len + new - 1  # the last generated token never went through the model
    if "R" in pattern:  # the finish checkpoint (mid-block when needed)
        assert turn2.cached_tokens >= processed
    else:  # attention only: whole blocks
        assert turn2.cached_tokens >= processed - processed % block_size
    assert turn2.cached_tokens < len(turn2_prompt)
    turn3_prompt = turn2_prompt + turn2.tokens + tokens(3, 8)
    turn3 = engine.generate([Request(prompt=turn3_prompt, max_new_tokens=2)])[0]
    processed = len(turn2_prompt) + 3 - 1
    assert turn3.cached_tokens >= (processed if "R" in pattern else processed - processed % block_size)
    reference = Engine(config(block_size=block_size, prefix_caching=False, model=cfg.model))
    assert [r.tokens for r in reference.generate([Request(prompt=p, max_new_tokens=n) for p, n in (
        (prompt, new), (turn2_prompt, 3), (turn3_prompt, 2))])] == [turn1.tokens, turn2.tokens, turn3.tokens]


def test_identical_request_hits_at_a_chunk_end_and_reproduces():
    # a hybrid hit needs a checkpoint before the last prompt token: here a prefill chunk end
    engine = Engine(config(prefill_chunk=8))
    request = Request(prompt=tokens(25, 9), max_new_tokens=3)
    first = engine.generate([request])[0]
    second = engine.generate([request])[0]
    assert second.cached_tokens == 24 and second.tokens == first.tokens


def test_namespaces_do_not_share():
    engine = Engine(config(prefill_chunk=8, num_state_slots=32))  # chunk-end checkpoints: identical prompts hit
    prompt = tokens(30, 10)
    engine.generate([Request(prompt=prompt, max_new_tokens=2)])
    for kwargs in ({"adapter": "a"}, {"cache_salt": "tenant"}, {"adapter": "a", "cache_salt": "tenant"}):
        result = engine.generate([Request(prompt=prompt, max_new_tokens=2, **kwargs)])[0]
        assert result.cached_tokens == 0, kwargs
    again = engine.generate([Request(prompt=prompt, max_new_tokens=2, adapter="a")])[0]
    assert again.cached_tokens > 0


def test_adapter_changes_the_output_and_is_cached_separately():
    prompt = tokens(20, 11)
    base = Engine(config(prefix_caching=False)).generate([Request(prompt=prompt, max_new_tokens=8)])[0]
    engine = Engine(config())
    adapted = engine.generate([Request(prompt=prompt, max_new_tokens=8, adapter="a")])[0]
    assert adapted.tokens != base.tokens
    assert engine.generate([Request(prompt=prompt, max_new_tokens=8, adapter="a")])[0].tokens == adapted.tokens


def test_multimodal_content_is_part_of_the_identity():
    prompt = tokens(24, 12)
    image_a = (MultimodalInput(4, 10, b"image-a"),)
    image_b = (MultimodalInput(4, 10, b"image-b"),)
    engine = Engine(config(prefill_chunk=8, num_state_slots=32))  # chunk-end checkpoints: identical prompts hit
    first = engine.generate([Request(prompt=prompt, max_new_tokens=3, multimodal=image_a)])[0]
    other = engine.generate([Request(prompt=prompt, max_new_tokens=3, multimodal=image_b)])[0]
    assert other.cached_tokens <= 4  # nothing from the first image's span onwards
    same = engine.generate([Request(prompt=prompt, max_new_tokens=3, multimodal=image_a)])[0]
    assert same.cached_tokens >= 10 and same.tokens == first.tokens
    uncached = Engine(config(prefix_caching=False))
    assert uncached.generate([Request(prompt=prompt, max_new_tokens=3, multimodal=image_b)])[0].tokens == other.tokens


def test_stats_report_queries_hits_and_misses():
    engine = Engine(config())
    stats = engine.stats()
    for key in ("query_tokens", "hit_tokens", "misses", "hits", "hit_rate", "forwards", "failed_forwards",
                "preemptions", "free_blocks", "free_state_slots", "evicted_blocks"):
        assert key in stats, key
    assert stats["query_tokens"] == 0 and stats["hit_tokens"] == 0 and stats["misses"] == {}
    prompt = tokens(20, 13)
    engine.generate([Request(prompt=prompt, max_new_tokens=2)])
    stats = engine.stats()
    assert stats["query_tokens"] == 20 and stats["hit_tokens"] == 0
    assert sum(stats["misses"].values()) == 1
    engine.generate([Request(prompt=prompt + [1, 2, 3], max_new_tokens=2)])
    stats = engine.stats()
    assert stats["query_tokens"] == 43 and stats["hit_tokens"] == 20 and stats["hits"] == 1
    assert stats["hit_rate"] == pytest.approx(20 / 43)
    assert stats["forwards"] >= 4 and stats["failed_forwards"] == 0
    assert stats["free_blocks"] == engine.pool.num_free


def test_disabled_cache_never_hits():
    engine = Engine(config(prefix_caching=False))
    request = Request(prompt=tokens(30, 14), max_new_tokens=2)
    engine.generate([request, request])
    assert engine.generate([request])[0].cached_tokens == 0
    assert engine.stats()["hit_tokens"] == 0
    assert engine.pool.num_free == engine.config.num_kv_blocks
    assert engine.states.num_checkpoint == 0


# --- clear_cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["RARA", "AA", "R"])
def test_clear_cache_with_an_idle_engine_fills_the_pools(pattern):
    engine = Engine(config(model=TinyHybridConfig(layer_pattern=pattern), decode_checkpoint_interval=8))
    request = Request(prompt=tokens(37, 15), max_new_tokens=12)
    first = engine.generate([request, Request(prompt=tokens(11, 16), max_new_tokens=3)])[0]
    assert engine.pool.num_free < engine.config.num_kv_blocks  # the cache holds blocks
    assert engine.clear_cache() > 0
    assert_idle_and_clearable(engine)
    assert engine.stats()["free_blocks"] == engine.config.num_kv_blocks
    again = engine.generate([request])[0]
    assert again.cached_tokens == 0 and again.tokens == first.tokens
    assert engine.clear_cache() > 0
    assert engine.clear_cache() == 0


def test_clear_cache_keeps_what_running_requests_hold():
    engine = Engine(config())
    engine.generate([Request(prompt=tokens(30, 17), max_new_tokens=2)])
    engine.add_request(Request(prompt=tokens(30, 18), max_new_tokens=5))
    engine.step()
    engine.step()
    engine.clear_cache()
    engine.check_invariants()
    (running,) = engine.scheduler.running
    table = set(running.seq.block_table.tolist())
    nodes = engine.trie.nodes
    assert set(nodes.block[nodes.attached_slots()].tolist()) <= table  # only the running request's path
    held = table | set(engine.trie.checkpoints.frozen_blocks())
    assert engine.pool.num_free == engine.config.num_kv_blocks - len(held)
    while engine.scheduler.has_work:
        engine.step()
        engine.check_invariants()
    assert_idle_and_clearable(engine)


# --- validation ----------------------------------------------------------------------------------


def _image(engine: Engine):
    return (
        engine.stats(),
        len(engine.scheduler.waiting),
        len(engine.scheduler.running),
        engine.pool.num_free,
        engine.states.num_free,
        engine.trie.nodes.num_attached,
    )


BAD_REQUESTS = [
    (lambda: Request(prompt=[]), InvalidTokenError),
    (lambda: Request(prompt=[1, 2, VOCAB]), InvalidTokenError),
    (lambda: Request(prompt=[1, -1, 2]), InvalidTokenError),
    (lambda: Request(prompt=[1, 2.0, 3]), InvalidTypeError),
    (lambda: Request(prompt=[1.5]), InvalidTypeError),
    (lambda: Request(prompt=[1, True]), InvalidTypeError),
    (lambda: Request(prompt=[1, 2], adapter="unknown"), InvalidNamespaceError),
    (lambda: Request(prompt=[1, 2], adapter=""), InvalidNamespaceError),
    (lambda: Request(prompt=[1, 2], cache_salt=""), InvalidNamespaceError),
    (lambda: Request(prompt=list(range(10)), multimodal=[MultimodalInput(2, 6, b"x"), MultimodalInput(5, 8, b"y")]),
     InvalidSpanError),
    (lambda: Request(prompt=list(range(10)), multimodal=[MultimodalInput(8, 11, b"x")]), InvalidSpanError),
]


@pytest.mark.parametrize("make, error", BAD_REQUESTS)
def test_bad_requests_raise_and_change_nothing(make, error):
    engine = Engine(config(adapters=("a",)))
    engine.generate([Request(prompt=tokens(20, 19), max_new_tokens=2)])
    before = _image(engine)
    with pytest.raises(error):
        engine.add_request(make())
    with pytest.raises(error):
        engine.generate([make()])
    assert _image(engine) == before
    engine.check_invariants()
    assert engine.add_request(Request(prompt=[1, 2, 3], adapter="a")) == 1  # no id was used up
    assert len(engine.generate([Request(prompt=[4, 5, 6])])[0].tokens) == 8


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: Request(prompt=[1, 2], max_new_tokens=0), InvalidArgumentError),
        (lambda: Request(prompt=[1, 2], max_new_tokens=-3), InvalidArgumentError),
        (lambda: Request(prompt=[1, 2], max_new_tokens=2.0), InvalidTypeError),
        (lambda: Request(prompt=[1, 2], multimodal=MultimodalInput(0, 1, b"x")), InvalidTypeError),
        (lambda: MultimodalInput(3, 3, b"x"), InvalidSpanError),
        (lambda: MultimodalInput(-1, 3, b"x"), InvalidSpanError),
        (lambda: MultimodalInput(0, 3, "not bytes"), InvalidTypeError),
    ],
)
def test_invalid_request_values_are_refused_at_construction(make, error):
    with pytest.raises(error):
        make()


def test_add_request_refuses_non_requests():
    engine = Engine(config())
    with pytest.raises(InvalidTypeError):
        engine.add_request([1, 2, 3])
    assert engine.stats()["query_tokens"] == 0 and not engine.scheduler.has_work


def test_any_adapter_is_allowed_without_an_adapter_list():
    engine = Engine(config())
    assert len(engine.generate([Request(prompt=[1, 2, 3], adapter="whatever")])[0].tokens) == 8


@pytest.mark.parametrize(
    "overrides",
    [
        {"async_depth": 2},
        {"block_size": 7},
        {"block_size": 0},
        {"num_state_slots": 1},
        {"decode_checkpoint_interval": 12},
        {"model": "RARA"},
        {"max_running": 0},
    ],
)
def test_bad_configs_are_refused(overrides):
    with pytest.raises(InvalidConfigError):
        Engine(config(**overrides))


def test_engine_refuses_a_non_config():
    with pytest.raises(InvalidTypeError):
        Engine({"block_size": 8})


# --- forced rejection after a match -------------------------------------------------------------


def test_forced_rejection_after_match_leaves_engine_and_cache_unchanged():
    from hybridcache.sequence import Sequence

    engine = Engine(config(num_kv_blocks=12, prefill_chunk=64, max_batch_tokens=64))
    prompt = tokens(21, 20)
    first = engine.generate([Request(prompt=prompt, max_new_tokens=1)])[0]
    seq = Sequence(prompt + first.tokens + tokens(9, 21))
    hog = Sequence([0])  # another holder takes every free block; nothing else is evictable
    hog.write_blocks(0, engine.pool.allocate(engine.pool.num_free))

    def image():
        state = seq.prefix_state
        return (
            _image(engine),
            engine.pool.refcounts(np.arange(engine.pool.num_blocks)).tolist(),
            [(r.record_id, r.state.value, r.restore_pins, r.producer_pins) for r in engine.trie.checkpoints.live_records()],
            seq.num_computed,
            seq.block_table.tolist(),
            (state.trie.cursor, state.checkpoints.restore, state.checkpoints.restore_pinned, state.overlap.fresh_range, dict(state.overlap.trie_block_map)),
        )

    before = image()
    for budget in (64, 0):
        assert not engine.prefix_cache.admit(seq, budget).admitted
        assert image() == before
        engine.trie.check_invariants([seq, hog])
        engine.scheduler.check_invariants()
    engine.pool.release_table(hog)
    admitted = engine.prefix_cache.admit(seq, 64)
    assert admitted.admitted and admitted.hit_tokens == 21 and admitted.restore is not None
    engine.trie.checkpoints.unpin_restore(seq)
    engine.states.free_runtime(admitted.runtime_slot)
    engine.trie.free_sequence(seq)
    assert_idle_and_clearable(engine)


def test_generate_validates_every_request_before_queueing_any():
    engine = Engine(config())
    good = Request(prompt=tokens(12, 1), max_new_tokens=2)
    bad = Request(prompt=[VOCAB], max_new_tokens=2)
    with pytest.raises(InvalidTokenError):
        engine.generate([good, bad])
    assert not engine.scheduler.has_work
    (result,) = engine.generate([good])
    assert len(result.tokens) == 2


def test_engine_config_rejects_bad_batching_limits_at_construction():
    with pytest.raises(InvalidConfigError):
        config(max_running=0)


@pytest.mark.parametrize("length", [25, 33])
def test_identical_prompt_hits_up_to_its_last_block_boundary_without_chunk_end_checkpoints(length):
    # the reference rule caches nothing here: its only checkpoint sits at the prompt end, and a
    # hit must stop before the last prompt token; auto also checkpoints the last block boundary
    request = Request(prompt=tokens(length, 4), max_new_tokens=3)
    for policy, expected in (("reference", 0), ("auto", (length - 1) // 8 * 8)):
        engine = Engine(config(checkpoint_chunk_ends=False, checkpoint_policy=policy))
        first = engine.generate([request])[0]
        second = engine.generate([request])[0]
        assert second.cached_tokens == expected and second.tokens == first.tokens
        engine.check_invariants()


def test_branch_point_gets_a_checkpoint_in_the_engine():
    # the second request reveals where it leaves the first one's path (block 3); the engine ends
    # a prefill chunk there and checkpoints it, so the third resumes at the branch point
    shared = tokens(24, 6)
    prompts = [np.concatenate([shared, tokens(19, seed)]) for seed in (7, 8, 9)]
    engine = Engine(config(checkpoint_chunk_ends=False, checkpoint_policy="marconi", prefill_chunk=64))
    hits = [engine.generate([Request(prompt=p, max_new_tokens=2)])[0].cached_tokens for p in prompts]
    assert hits == [0, 0, 24]
    engine.check_invariants()


def test_unknown_checkpoint_policy_is_refused():
    with pytest.raises(InvalidConfigError, match="checkpoint_policy"):
        config(checkpoint_policy="lfu")


def test_auto_plans_its_grid_for_what_this_models_state_weighs():
    """A state of 2,433.5 KV tokens (the bytes of one slot against one token's KV, read back from
    the cache tensors): ``auto``'s grid is 6,144, the first multiple of 2,048 past twice that."""
    engine = Engine(config(model=TinyHybridConfig(ssm_state_size=4096), checkpoint_policy="auto"))
    slot_bytes = sum(array.nbytes for array in engine.cache.read_slot(0).values())
    token_bytes = sum(array.nbytes for array in engine.cache.read_blocks([0]).values()) / engine.config.block_size
    layout = engine.model.layout
    assert (layout.state_bytes, layout.kv_bytes_per_token) == (slot_bytes, token_bytes)
    assert layout.state_weight_tokens == slot_bytes / token_bytes == 2433.5
    assert engine.scheduler.admission.grid == 6144
    light = Engine(config(checkpoint_policy="auto"))  # 6.25 tokens a state: the grid stays
    assert light.model.layout.state_weight_tokens == 6.25 and light.scheduler.admission.grid == 2048
