import numpy as np
import pytest

from hybridcache.errors import InvalidTypeError
from hybridcache.workloads import infinite_cache_bound, read_trace, synthesize
from hybridcache.workloads.records import TraceRequest, frozen_array
from tests.paths import SHARED_TRACE


def _oracle(requests):
    """Brute force: every earlier request, token by token."""
    shared = []
    for i, request in enumerate(requests):
        best = 0
        for earlier in requests[:i]:
            common = 0
            while common < min(request.prompt_length, earlier.tokens.size) and request.tokens[common] == earlier.tokens[common]:
                common += 1
            best = max(best, common)
        shared.append(best)
    return shared


def _random_requests(seed, count=60):
    rng = np.random.default_rng(seed)
    requests, pool = [], []
    for index in range(count):
        if pool and rng.random() < 0.7:
            base = pool[rng.integers(len(pool))]
            keep = int(rng.integers(0, base.size + 1))
            tail = rng.integers(0, 3, size=int(rng.integers(0, 6)))
            tokens = np.concatenate([base[:keep], tail])
        else:
            tokens = rng.integers(0, 3, size=int(rng.integers(1, 12)))
        if tokens.size == 0:
            tokens = np.array([0])
        prompt_length = int(rng.integers(1, tokens.size + 1))
        requests.append(TraceRequest(index, float(index), prompt_length, frozen_array(tokens, np.int32)))
        pool.append(tokens)
    return requests


@pytest.mark.parametrize("seed", range(8))
def test_bound_equals_brute_force(seed):
    requests = _random_requests(seed)
    bound = infinite_cache_bound(requests)
    assert bound.shared_tokens.tolist() == _oracle(requests)
    assert bound.prompt_tokens == sum(r.prompt_length for r in requests)


def test_bound_on_synthesized_trace_prefix():
    requests = synthesize(read_trace(SHARED_TRACE, limit=40)).requests
    assert infinite_cache_bound(requests).shared_tokens.tolist() == _oracle(requests)


def test_rates():
    tokens = frozen_array([1, 2, 3, 4], np.int32)
    requests = [TraceRequest(0, 0.0, 4, tokens), TraceRequest(1, 1.0, 4, tokens)]
    bound = infinite_cache_bound(requests)
    assert bound.token_hit_rate == 0.5 and bound.request_hit_rate == 0.5
    assert infinite_cache_bound([]).token_hit_rate == 0.0


def test_any_ordered_iterable_of_requests_is_bounded_and_nothing_else():
    tokens = frozen_array([1, 2, 3, 4], np.int32)
    requests = [TraceRequest(0, 0.0, 4, tokens), TraceRequest(1, 1.0, 4, tokens)]
    assert infinite_cache_bound(request for request in requests).shared_tokens.tolist() == [0, 4]
    with pytest.raises(InvalidTypeError, match="ordered sequence"):
        infinite_cache_bound(None)
    with pytest.raises(InvalidTypeError, match="TraceRequest records"):
        infinite_cache_bound([1])
