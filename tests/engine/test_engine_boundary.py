"""The engine's public boundary against careless and hostile callers: caller-owned buffers are
copied, names are checked, requests that can never fit are refused, a failure tied to one
request ends that request only, and every caller gets exactly its own results."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from hybridcache.engine import Engine, EngineConfig, MultimodalInput, Request, TinyHybridConfig
from hybridcache.errors import (
    HybridCacheError,
    InvalidConfigError,
    InvalidNamespaceError,
    InvalidTypeError,
    RequestFailedError,
    RequestTooLargeError,
)
from tests.engine.faults import arm

MAX_STEPS = 2_000


def small(**overrides) -> EngineConfig:
    values = dict(block_size=4, num_kv_blocks=48, num_state_slots=8, checkpoint_budget=4, max_batch_tokens=32,
                  prefill_chunk=8, model=TinyHybridConfig(vocab_size=64, hidden_size=16, attention_head_dim=8,
                                                          ssm_head_dim=8, expert_hidden_size=16))
    values.update(overrides)
    return EngineConfig(**values)


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 64, length).tolist()


def drain(engine: Engine, ids: list[int]) -> dict:
    done = {}
    for _ in range(MAX_STEPS):
        if len(done) == len(ids):
            return done
        for result in engine.step():
            done[result.request_id] = result
        engine.check_invariants()
    raise AssertionError("the engine did not finish")


# --- caller-owned input is copied --------------------------------------------------------------


def test_changing_the_callers_image_buffer_after_add_cannot_poison_the_cache():
    first, second = bytearray(b"cat" * 10), bytearray(b"dog" * 10)
    poisoned = Engine(small())
    text = prompt(24, 1)
    poisoned.add_request(Request(prompt=text, max_new_tokens=4, multimodal=[MultimodalInput(4, 12, first)]))
    first[:] = second  # the caller reuses its buffer before the forward runs
    drain(poisoned, [0])
    hit = poisoned.generate([Request(prompt=text + [5], max_new_tokens=4, multimodal=[MultimodalInput(4, 12, b"cat" * 10)])])[0]
    clean = Engine(small(prefix_caching=False)).generate(
        [Request(prompt=text + [5], max_new_tokens=4, multimodal=[MultimodalInput(4, 12, b"cat" * 10)])])[0]
    assert hit.cached_tokens > 0 and hit.tokens == clean.tokens


def test_changing_the_callers_lists_after_add_changes_nothing():
    engine = Engine(small())
    text, images = prompt(20, 2), [MultimodalInput(2, 6, b"x")]
    request = Request(prompt=text, max_new_tokens=3, multimodal=images)
    rid = engine.add_request(request)
    text.extend([1, 2, 3])
    images.append(MultimodalInput(10, 12, b"y"))
    result = drain(engine, [rid])[rid]
    assert result.prompt_tokens == 20 and len(result.tokens) == 3
    assert request.prompt.size == 20 and len(request.multimodal) == 1
    assert not request.prompt.flags.writeable and isinstance(request.multimodal[0].data, bytes)


def test_generators_are_read_once_and_kept():
    request = Request(prompt=(t for t in [3, 4, 5, 6]), multimodal=(m for m in [MultimodalInput(1, 3, b"i")]))
    assert request.prompt.tolist() == [3, 4, 5, 6] and len(request.multimodal) == 1
    results = Engine(small()).generate([request, Request(prompt=[7, 8])])
    assert [r.prompt_tokens for r in results] == [4, 2] and all(r.error is None for r in results)


# --- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["adapter", "cache_salt"])
@pytest.mark.parametrize("bad", ["\ud800", "a\udfffb", ""])
def test_names_that_are_not_text_are_refused_when_the_request_is_built(field, bad):
    with pytest.raises(InvalidNamespaceError):
        Request(prompt=[1, 2], **{field: bad})


@pytest.mark.parametrize(
    "fields",
    [{"modality": bad} for bad in (5, b"image", None, ["image"], 1.5)]
    + [{"data": bad} for bad in (5, "text", None, ["x"])]
    + [{"start": bad} for bad in ("0", None, 1.5, True)],
    ids=repr,
)
def test_a_multimodal_field_of_the_wrong_type_is_a_type_error(fields):
    with pytest.raises(InvalidTypeError):
        MultimodalInput(**{"start": 0, "end": 2, "data": b"pixels", **fields})


@pytest.mark.parametrize("adapters", ["lora1", ("lora1", "\ud800"), ("a", "a"), {"a"}, (1,)])
def test_adapter_lists_must_be_ordered_names(adapters):
    with pytest.raises(InvalidConfigError):
        small(adapters=adapters)


def test_a_substring_of_a_configured_adapter_is_unknown():
    engine = Engine(small(adapters=["lora1"]))
    assert engine.config.adapters == ("lora1",)
    with pytest.raises(InvalidNamespaceError):
        engine.add_request(Request(prompt=[1, 2], adapter="lora"))


# --- failures tied to one request --------------------------------------------------------------


POISON = 63


def poison_forwards(engine: Engine) -> None:
    """Make every forward that carries token POISON raise, as a model does on bad input."""
    real = engine.model.forward

    def forward(chunks, cache):
        if any(POISON in chunk.token_ids for chunk in chunks):
            raise ValueError("the model cannot embed this request")
        return real(chunks, cache)

    engine.model.forward = forward


@pytest.mark.parametrize("async_depth", [0, 1])
@pytest.mark.parametrize("caching", [True, False])
def test_a_request_whose_forwards_always_fail_is_ended_and_the_others_are_served(async_depth, caching):
    engine = Engine(small(async_depth=async_depth, prefix_caching=caching))
    poison_forwards(engine)
    good = [Request(prompt=prompt(10 + i, 10 + i), max_new_tokens=5) for i in range(3)]
    bad = Request(prompt=prompt(6, 3) + [POISON], max_new_tokens=5)
    ids = [engine.add_request(r) for r in (good[0], bad, *good[1:])]
    done = drain(engine, ids)
    assert isinstance(done[ids[1]].error, RequestFailedError)
    assert isinstance(done[ids[1]].error.__cause__, ValueError)
    expected = Engine(small(async_depth=async_depth, prefix_caching=False)).generate(good)
    assert [done[i].tokens for i in (ids[0], *ids[2:])] == [r.tokens for r in expected]
    assert all(done[i].error is None for i in (ids[0], *ids[2:]))
    engine.check_invariants()
    engine.clear_cache()
    assert engine.pool.num_free == engine.config.num_kv_blocks


def test_a_transient_failure_is_retried_and_the_request_completes():
    engine = Engine(small())
    arm(engine, "before_save")
    results = engine.generate([Request(prompt=prompt(9, 4), max_new_tokens=4)])
    assert results[0].error is None and len(results[0].tokens) == 4


# --- requests that can never fit -----------------------------------------------------------------


@pytest.mark.parametrize("async_depth", [0, 1])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize(("length", "new"), [(48 * 4 + 1, 1), (48 * 4 - 3, 5), (100, 200)])
def test_a_request_larger_than_the_pool_is_refused_when_added(async_depth, caching, length, new):
    engine = Engine(small(async_depth=async_depth, prefix_caching=caching))
    huge = Request(prompt=prompt(length, 5), max_new_tokens=new)
    with pytest.raises(RequestTooLargeError):
        engine.add_request(huge)
    with pytest.raises(RequestTooLargeError):
        engine.generate([Request(prompt=[1, 2]), huge])
    assert engine.add_request(Request(prompt=[1, 2])) == 0  # nothing was queued, ids included
    engine.check_invariants()


@pytest.mark.parametrize("async_depth", [0, 1])
@pytest.mark.parametrize("caching", [True, False])
def test_requests_that_fit_alone_all_run_even_when_they_cannot_run_together(async_depth, caching):
    engine = Engine(small(async_depth=async_depth, prefix_caching=caching, num_kv_blocks=12))
    # 12 blocks of 4 tokens: each request needs all of them (prompt + decode - 1 == 48 tokens)
    requests = [Request(prompt=prompt(41 + i, 20 + i), max_new_tokens=8 - i) for i in range(3)]
    requests.append(Request(prompt=prompt(41, 20), max_new_tokens=8))  # a repeat: a cache hit if kept
    ids = [engine.add_request(r) for r in requests]
    done = drain(engine, ids)
    expected = Engine(small(async_depth=async_depth, prefix_caching=False, num_kv_blocks=12)).generate(requests)
    assert [done[i].tokens for i in ids] == [r.tokens for r in expected]
    assert all(done[i].error is None for i in ids)


# --- results belong to their caller ------------------------------------------------------------


def test_generate_leaves_results_of_added_requests_to_step():
    engine = Engine(small())
    early = engine.add_request(Request(prompt=prompt(5, 6), max_new_tokens=2))
    mine = engine.generate([Request(prompt=prompt(7, 7), max_new_tokens=12)])
    assert [r.request_id for r in mine] == [early + 1]
    handed = drain(engine, [early])
    assert len(handed[early].tokens) == 2
    assert engine.step() == []


# --- types at the boundary ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.generate([Request(prompt=np.array(5))]),
        lambda e: e.generate(None),
        lambda e: e.generate(Request(prompt=[1])),
        lambda e: e.generate("abc"),
        lambda e: e.generate([[1, 2]]),
        lambda e: e.cancel([1]),
        lambda e: e.cancel(True),
        lambda e: e.add_request(Request(prompt={1, 2, 3})),
        lambda e: e.add_request(Request(prompt={1: 2})),
        lambda e: e.add_request(Request(prompt=[1], multimodal=None)),
        lambda e: e.add_request(Request(prompt=[1], multimodal=MultimodalInput(0, 1, b"x"))),
        lambda e: e.add_request(Request(prompt=[1], max_new_tokens=2.0)),
        lambda e: e.add_request(Request(prompt=[1], return_routed_experts=1)),
        lambda e: e.add_request(Request(prompt=[1], multimodal=[MultimodalInput(0, 1, "text")])),
    ],
)
def test_bad_arguments_raise_hybridcache_errors_and_change_nothing(call):
    engine = Engine(small())
    with pytest.raises(HybridCacheError):
        call(engine)
    assert engine.add_request(Request(prompt=[1, 2])) == 0
    engine.check_invariants()


def test_numpy_integers_are_ints_everywhere():
    engine = Engine(small(num_kv_blocks=np.int64(48), block_size=np.int32(4)))
    assert type(engine.config.num_kv_blocks) is int
    request = Request(prompt=np.array([1, 2, 3], dtype=np.int16), max_new_tokens=np.int64(3),
                      multimodal=[MultimodalInput(np.int64(0), np.int32(2), b"z")])
    assert len(engine.generate([request])[0].tokens) == 3
    assert engine.cancel(np.int64(99)) is False


@pytest.mark.parametrize(
    "overrides",
    [
        {"block_size": "16"}, {"block_size": None}, {"block_size": 3}, {"num_kv_blocks": 0},
        {"num_state_slots": 8, "checkpoint_budget": 7}, {"num_state_slots": 1}, {"prefix_caching": 1},
        {"checkpoint_chunk_ends": "yes"}, {"shared_write_guard": None}, {"max_checkpoints_per_anchor": 0},
        {"async_depth": 2}, {"async_depth": True}, {"seed": -1}, {"dtype": "float16"}, {"max_running": 0},
        {"decode_checkpoint_interval": 6}, {"model": "tiny"},
    ],
)
def test_engine_config_refuses_what_could_never_serve_when_it_is_built(overrides):
    with pytest.raises(InvalidConfigError):
        small(**overrides)


def test_rejected_prompts_are_typed_errors_not_builtins():
    with pytest.raises(InvalidTypeError):
        Request(prompt=np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(InvalidTypeError):
        Request(prompt=[1.0, 2.0])


# --- bounded memory and stranded requests -----------------------------------------------------


def test_distinct_salts_and_adapters_leave_nothing_behind_after_clear_cache():
    engine = Engine(small())
    for index in range(200):
        engine.generate([Request(prompt=[1, 2, 3, 4, 5], max_new_tokens=1, cache_salt=f"s{index}", adapter=f"a{index}")])
    assert len(engine.model._adapters) <= 64
    # what stays cached is bounded by the pools, and so are the namespaces holding it
    assert len(engine.trie.nodes._roots) <= engine.config.num_kv_blocks + engine.config.checkpoint_budget
    engine.clear_cache()
    assert engine.trie.nodes._roots == {} and engine.trie.keyer._namespace_seeds == {}
    engine.check_invariants()


def test_check_invariants_sees_a_request_in_flight_with_no_forward_queued():
    engine = Engine(small())
    engine.add_request(Request(prompt=prompt(12, 8), max_new_tokens=3))
    engine.step()
    engine.scheduler.running[0].in_flight = True  # what a forward lost after scheduling leaves
    with pytest.raises(AssertionError, match="in flight"):
        engine.check_invariants()


@pytest.mark.parametrize("clone", [lambda t: pickle.loads(pickle.dumps(t)), copy.deepcopy])
def test_a_copied_trie_with_shared_anchor_paths_keeps_its_invariants(clone):
    engine = Engine(small(block_size=16, num_kv_blocks=64))
    text = prompt(99, 9)
    engine.generate([Request(prompt=text, max_new_tokens=3)])
    assert engine.generate([Request(prompt=text + [5], max_new_tokens=3)])[0].cached_tokens > 0
    clone(engine.trie).check_invariants()
