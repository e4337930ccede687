"""Why the tiers served a request less than expected (``Result.tier_miss_reason``), and which
tier served the tokens they restored (``restored_tokens`` by tier): a store that fails, times
out or is skipped by its breaker, a checkpoint this engine published and then lost, an object
that fails verification. Outputs stay exact whatever the tiers say."""

from __future__ import annotations

import pytest

from hybridcache.engine import Engine, Request
from hybridcache.errors import StoreTimeoutError, StoreUnavailableError
from hybridcache.tiers.backends import HostMemoryStore
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.breaker import CircuitBreaker
from hybridcache.tiers.tier_calls import TierAccess
from hybridcache.tiers.tiered import TieredStore
from tests.engine.test_engine_tier_seam import RaisingStore
from tests.engine.test_engine_tiers import config, prompt, uncached
from tests.tiers.faults import Fault, FaultInjectingStore, Operation

FOLLOW = 20


class RecordingStore(HostMemoryStore):
    """A host-memory store that remembers every key put into it."""

    def __init__(self) -> None:
        super().__init__(1 << 26)
        self.put_keys: list[str] = []

    def _put_if_absent(self, items, timeout):
        self.put_keys.extend(key for key, _ in items)
        return super()._put_if_absent(items, timeout)


def _published(base: list[int], store: HostMemoryStore | None = None) -> HostMemoryStore:
    shared = HostMemoryStore(1 << 26) if store is None else store
    Engine(config(), tiers=TieredStore(shared=shared)).generate([Request(base, max_new_tokens=2)])
    return shared


def _serve(engine: Engine, base: list[int], seed: int):
    request = Request(base + prompt(FOLLOW, seed), max_new_tokens=3)
    (result,) = engine.generate([request])
    assert result.tokens == uncached([request])[0] and result.error is None
    engine.check_invariants()
    return result


@pytest.mark.parametrize(("error", "reason"), [(StoreUnavailableError("down"), "tier_unavailable"),
                                               (StoreTimeoutError("paused"), "tier_timeout")])
def test_a_store_that_cannot_answer_names_its_reason(error, reason):
    base = prompt(100, 41)
    engine = Engine(config(), tiers=TieredStore(shared=RaisingStore(_published(base), "exists", error)))
    result = _serve(engine, base, 42)
    assert result.cached_tokens == 0 and result.tier_miss_reason == reason
    assert engine.stats()["tiers"]["misses"] == {reason: 1}


def test_a_tier_its_breaker_skips_is_unavailable():
    base = prompt(100, 43)
    failing = FaultInjectingStore(_published(base))
    failing.add(Fault.fail(Operation.EXISTS, times=None))
    engine = Engine(config(), tiers=TieredStore(shared=failing, access=TierAccess(breaker=CircuitBreaker(backoff_s=3600, failures_to_open=1))))
    first = _serve(engine, base, 44)
    engine.clear_cache()  # the next request asks the tiers again, whose breaker is now open
    second = _serve(engine, base, 45)
    assert first.tier_miss_reason == second.tier_miss_reason == "tier_unavailable"
    assert engine.stats()["tiers"]["store"]["counters"]["shared_skipped"] >= 1


def test_a_checkpoint_this_engine_published_and_lost_is_evicted():
    base = prompt(100, 46)
    shared = RecordingStore()
    engine = Engine(config(), tiers=TieredStore(shared=shared))
    engine.generate([Request(base, max_new_tokens=2)])
    engine.clear_cache()
    shared.remove(shared.put_keys)  # the store evicted everything this engine put
    result = _serve(engine, base, 47)
    assert result.cached_tokens == 0 and result.tier_miss_reason == "evicted"


def test_an_object_failing_verification_is_rejected():
    base = prompt(100, 48)
    corrupted = FaultInjectingStore(_published(base))
    corrupted.add(Fault.corrupt(times=None))
    engine = Engine(config(), tiers=TieredStore(shared=corrupted))
    result = _serve(engine, base, 49)
    assert result.cached_tokens == 0 and result.tier_miss_reason == "tier_rejected"


def test_nothing_ever_published_is_no_tier_miss():
    engine = Engine(config(), tiers=TieredStore(shared=HostMemoryStore(1 << 26)))
    assert _serve(engine, prompt(100, 50), 51).tier_miss_reason is None
    assert engine.stats()["tiers"]["misses"] == {}


def test_a_restore_is_counted_under_the_tier_that_served_it(tmp_path):
    base = prompt(100, 52)
    tiers = {"host": dict(host=HostMemoryStore(1 << 26)), "disk": dict(disk=DiskStore(tmp_path, 1 << 26))}
    for tier, stores in tiers.items():
        engine = Engine(config(), tiers=TieredStore(**stores))
        engine.generate([Request(base, max_new_tokens=2)])
        engine.clear_cache()
        result = _serve(engine, base, 53)
        stats = engine.stats()["tiers"]
        assert result.cached_tokens == 96 and result.tier_miss_reason is None
        assert stats["restored_tokens"] == {tier: 96} and stats["remote_hit_tokens"] == 96
    second = Engine(config(), tiers=TieredStore(shared=_published(base)))
    assert _serve(second, base, 54).cached_tokens == 96
    assert second.stats()["tiers"]["restored_tokens"] == {"shared": 96}


def test_device_checkpoints_written_are_counted():
    engine = Engine(config())
    assert engine.stats()["written_checkpoints"] == 0
    engine.generate([Request(prompt(100, 55), max_new_tokens=2)])
    assert engine.stats()["written_checkpoints"] > 0
