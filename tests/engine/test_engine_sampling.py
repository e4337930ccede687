"""Seeded sampling (temperature, top_p, seed), the progress of an unfinished request, and the
miss reason a result carries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig
from hybridcache.engine.sampling import sample_token
from hybridcache.errors import InvalidArgumentError, InvalidTypeError, RequestFailedError

VOCAB = TinyHybridConfig().vocab_size


def engine(**overrides) -> Engine:
    base = dict(block_size=8, num_kv_blocks=64, num_state_slots=8, checkpoint_budget=4, max_batch_tokens=64,
                max_running=4, prefill_chunk=32)
    base.update(overrides)
    return Engine(EngineConfig(**base))


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def test_a_seed_gives_the_same_tokens_with_caching_on_and_off_and_differs_from_another_seed():
    shared = prompt(40, 1)
    turns = [Request(shared + prompt(5, 2 + i), max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7) for i in range(3)]
    cached, uncached = engine(), engine(prefix_caching=False)
    with_cache = [cached.generate([r])[0] for r in turns]
    without = [uncached.generate([r])[0] for r in turns]
    assert [r.tokens for r in with_cache] == [r.tokens for r in without]
    assert with_cache[-1].cached_tokens > 0
    other = cached.generate([Request(turns[0].prompt, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=8)])[0]
    assert other.tokens != with_cache[0].tokens
    cached.check_invariants()


def test_temperature_zero_is_the_greedy_path_whatever_the_seed():
    request = prompt(30, 3)
    greedy = engine().generate([Request(request, max_new_tokens=8)])[0]
    seeded = engine().generate([Request(request, max_new_tokens=8, temperature=0.0, seed=5)])[0]
    assert greedy.tokens == seeded.tokens


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    logits = np.array([0.1, 3.0, 2.9, -1.0])
    generator = torch.Generator().manual_seed(0)
    assert {sample_token(logits, 1.0, 1e-6, generator) for _ in range(50)} == {1}


@pytest.mark.parametrize(
    "field, value, error",
    [("temperature", -0.1, InvalidArgumentError), ("temperature", float("nan"), InvalidArgumentError),
     ("temperature", "hot", InvalidTypeError), ("top_p", 0.0, InvalidArgumentError), ("top_p", 1.5, InvalidArgumentError),
     ("seed", -1, InvalidArgumentError), ("seed", 2**63, InvalidArgumentError), ("seed", 1.5, InvalidTypeError),
     ("temperature", 10**400, InvalidArgumentError), ("temperature", -(10**400), InvalidArgumentError),
     ("top_p", 10**400, InvalidArgumentError)],
)
def test_bad_sampling_arguments_are_refused_when_the_request_is_built(field, value, error):
    with pytest.raises(error):
        Request([1, 2, 3], **{field: value})


def test_progress_shows_tokens_so_far_and_cancel_frees_the_generator():
    served = engine()
    request_id = served.add_request(Request(prompt(20, 4), max_new_tokens=50, temperature=1.0, seed=1))
    while len(served.progress(request_id).tokens) < 3:
        assert served.step() == []
        served.check_invariants()
    assert served.cancel(request_id)
    assert served.progress(request_id) is None
    served.check_invariants()
    served.clear_cache()
    assert served.pool.num_free == 64
    served.check_invariants()


def test_a_result_names_why_a_cached_prefix_was_not_restored():
    served = engine(checkpoint_budget=0, num_state_slots=2)  # KV is cached but no checkpoint can be kept
    shared = prompt(40, 5)
    first = served.generate([Request(shared, max_new_tokens=2)])[0]
    second = served.generate([Request(shared + prompt(8, 6), max_new_tokens=2)])[0]
    assert first.miss_reason in ("no_cached_prefix", "nothing_to_match")
    assert second.cached_tokens == 0 and second.miss_reason == "no_checkpoint"


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-12])
def test_a_temperature_as_small_as_a_float_allows_draws_the_greedy_token(temperature):
    built = engine()
    request = Request(prompt(20, 3), max_new_tokens=6, temperature=temperature, seed=1)
    greedy = built.generate([Request(request.prompt, max_new_tokens=6)])[0]
    drawn = built.generate([request])[0]
    assert drawn.error is None and drawn.tokens == greedy.tokens
    built.check_invariants()


def test_sample_token_never_sees_inf_over_inf():
    logits = np.array([3.0, -1.0, 3.0 - 1e-9, -np.inf])
    generator = torch.Generator().manual_seed(0)
    assert {sample_token(logits, 5e-324, 1.0, generator) for _ in range(20)} == {0}


def test_a_draw_that_fails_ends_its_request_alone_and_strands_nothing(monkeypatch):
    built = engine()
    failing = built.add_request(Request(prompt(30, 4), max_new_tokens=5, temperature=0.7, seed=2))
    healthy = built.add_request(Request(prompt(30, 5), max_new_tokens=5))
    draw = built._sampler.choose

    def broken(request_id, *args):
        if request_id == failing:
            raise RuntimeError("probability tensor contains inf or nan")
        return draw(request_id, *args)

    monkeypatch.setattr(built._sampler, "choose", broken)
    results = {}
    while len(results) < 2:
        for result in built.step():
            results[result.request_id] = result
        built.check_invariants()
    assert isinstance(results[failing].error, RequestFailedError)
    assert results[healthy].error is None and len(results[healthy].tokens) == 5
    assert not built.scheduler.running and not built.scheduler.waiting
    assert built.generate([Request(prompt(30, 4), max_new_tokens=3)])[0].error is None  # the engine serves on
