"""Replays of small traces: invariants after every request, every hit exact and within the bound."""

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError
from hybridcache.profiles import load_profile
from hybridcache.replay import RunConfig, replay, resolve_policy, split_budget
from hybridcache.replay.budgets import mean_prompt_tokens
from hybridcache.workloads import read_trace, synthesize
from tests.replay._helpers import PROFILE, budget, request, run
from tests.paths import SHARED_TRACE


def _conversational(seed, count=40):
    """System prompts shared across requests, follow-up turns that extend earlier ones."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 50, size=int(rng.integers(20, 120))) for _ in range(3)]
    requests = []
    for index in range(count):
        if requests and rng.random() < 0.4:
            parent = requests[int(rng.integers(len(requests)))]
            prompt = np.concatenate([parent.tokens, rng.integers(0, 50, size=int(rng.integers(1, 60)))])
        else:
            system = systems[int(rng.integers(len(systems)))]
            prompt = np.concatenate([system, rng.integers(0, 50, size=int(rng.integers(1, 200)))])
        requests.append(request(index, prompt, int(rng.integers(1, 30)), seed))
    return requests


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["reference", "interval:16", "interval:48"])
@pytest.mark.parametrize("space", [(24, 6), (4096, 512)])
def test_small_replays_are_exact(seed, policy, space):
    requests = _conversational(seed)
    record, hits = run(requests, policy, budget(*space, block_size=16), block_size=16, prefill_chunk=64)
    assert record.requests == len(requests) and record.prefill_tokens_saved == sum(hits)
    if space[0] == 4096:  # the small pools drop the longest follow-ups and evict all the time
        assert sum(hits) > 0 and record.dropped_requests == 0


def test_ample_reference_cache_reaches_the_turn_ends():
    requests = _conversational(5)
    _, hits = run(requests, "interval:16", budget(8192, 8192, block_size=16), block_size=16)
    from hybridcache.workloads import infinite_cache_bound

    bound = infinite_cache_bound(requests).shared_tokens
    # with nothing evicted, interval:16 reaches the bound's last multiple of 16 below the prompt end
    for hit, shared, req in zip(hits, bound, requests):
        assert hit >= min(shared, req.prompt_length - 1) // 16 * 16 - 16


def test_synthesized_mooncake_prefix_is_exact():
    requests = synthesize(read_trace(SHARED_TRACE, limit=60)).requests
    record, hits = run(requests, "reference", budget(40_000, 400))
    assert record.requests == 60 and hits[49] > 20_000  # request 49 shares 29,184 tokens


def test_a_request_larger_than_the_pool_is_dropped():
    requests = [request(0, np.arange(64 * 40) % 50), request(1, np.arange(100) % 50)]
    record, hits = run(requests, "reference", budget(8, 4))
    assert record.dropped_requests == 1 and hits == [0, 0]


def test_budget_split_covers_equal_tokens():
    requests = _conversational(0)
    policy = resolve_policy("interval:32")
    split = split_budget(400 * 10**9, PROFILE, policy, mean_prompt_tokens(requests))
    assert split.kv_bytes + split.state_bytes == 400 * 10**9
    kv_tokens = split.kv_bytes / PROFILE.kv_bytes_per_token
    checkpoints = split.state_bytes / PROFILE.state_bytes
    assert kv_tokens == pytest.approx(32 * checkpoints, rel=1e-6)


def test_tiny_budget_is_refused():
    with pytest.raises(InvalidArgumentError, match="budget too small"):
        RunConfig(load_profile("marconi-7b"), resolve_policy("reference"), budget(0, 1))


def test_wrong_types_are_refused():
    from hybridcache.errors import InvalidTypeError
    from hybridcache.workloads import infinite_cache_bound

    policy = resolve_policy("reference")
    with pytest.raises(InvalidTypeError):
        replay([object()], RunConfig(PROFILE, policy, budget(64, 4)))
    with pytest.raises(InvalidTypeError):
        RunConfig("marconi-7b", policy, budget(64, 4))
    with pytest.raises(InvalidTypeError):
        replay([], {"policy": "reference"})
    with pytest.raises(InvalidTypeError):
        infinite_cache_bound([object()])
    with pytest.raises(InvalidTypeError):
        read_trace(42)
