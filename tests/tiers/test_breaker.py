"""The tiers' circuit breaker: a paused store costs its timeout once per back-off window, not on
every request; it is probed once per window and closes when the store answers again."""

from __future__ import annotations

import uuid

import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.tiers.backends import RedisStore
from hybridcache.tiers.breaker import BreakerDecision, CircuitBreaker
from hybridcache.tiers.tier_calls import TierAccess
from hybridcache.tiers.tiered import TieredStore

from .conftest import redis_url
from .faults import paused
from .helpers import CHUNK, chain, kv_arrays, state_arrays


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_after_a_run_of_failures_and_probes_once_per_window():
    clock = FakeClock()
    breaker = CircuitBreaker(backoff_s=10, failures_to_open=2, clock=clock)
    assert breaker.admit("shared") is BreakerDecision.CALL
    assert not breaker.failed("shared") and breaker.admit("shared") is BreakerDecision.CALL  # one failure is not an outage
    assert breaker.failed("shared") and breaker.admit("shared") is BreakerDecision.SKIP
    clock.now = 10
    assert breaker.admit("shared") is BreakerDecision.PROBE
    assert breaker.admit("shared") is BreakerDecision.SKIP  # one probe per window
    breaker.failed("shared")  # the probe failed: a new window at once
    clock.now = 15
    assert breaker.admit("shared") is BreakerDecision.SKIP
    clock.now = 20
    assert breaker.admit("shared") is BreakerDecision.PROBE
    breaker.answered("shared")
    assert breaker.admit("shared") is BreakerDecision.CALL and not breaker.is_open("shared")
    breaker.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True])
def test_bad_backoffs_are_refused(bad):
    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        CircuitBreaker(backoff_s=bad)


def test_a_paused_redis_costs_one_window_not_every_request(redis_server):
    """SIGSTOP the real server: the first request pays the timeouts that open the breaker, the
    next ones skip the tier (counted), a probe per window finds it still paused, then back."""
    clock = FakeClock()
    shared = RedisStore(redis_url(redis_server), key_prefix=f"b{uuid.uuid4().hex[:8]}:", default_timeout=5)
    store = TieredStore(shared=shared, access=TierAccess(timeout=0.2, breaker=CircuitBreaker(backoff_s=60, clock=clock)))
    keys = chain()
    store.store_prefix(keys, 2 * CHUNK, kv_arrays, lambda: state_arrays(2 * CHUNK))
    with paused(redis_server):
        for _ in range(5):  # each request: one lookup, one publish
            assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None
            assert store.store_prefix(keys, CHUNK, kv_arrays, lambda: state_arrays(CHUNK)).checkpoint_stored == {"shared": False}
        # The first request's two calls timed out and opened the breaker; the other eight skipped.
        assert store.counters["shared_breaker_opened"] == 1
        assert store.counters["shared_skipped"] == 8 and store.counters["shared_probes"] == 0
        assert store.counters["shared_publish_skipped"] == 4 and store.counters["shared_publish_failed_timeout"] == 1
        clock.now = 60
        assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None  # the probe: still paused
        assert store.counters["shared_probes"] == 1
        assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None  # skipped again, no new probe
        assert store.counters["shared_probes"] == 1
    assert store.misses["timeout"] >= 1 and store.misses["unavailable"] >= 1  # by reason, never "missing"
    clock.now = 120
    restore = store.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
    assert restore is not None and restore.step == 2 * CHUNK and store.counters["shared_probes"] == 2
    assert not store.breaker.is_open("shared")
    store.check_invariants()
    store.close()
