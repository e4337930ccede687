"""The engine/tier seam's root rule, probed at every tier-side call the engine reaches (issue
19): whatever raises there, in the restore before a request is queued or the publish after a
forward, costs a miss or a failed publish counted by error class, never a request or a block."""

from __future__ import annotations

import pytest

from hybridcache.engine import Engine, Request
from hybridcache.engine import tiering
from hybridcache.tiers import client, restore_cost, tiered
from tests.engine.test_engine_tier_seam import _assert_nothing_held, _published
from tests.engine.test_engine_tiers import config, prompt, uncached

# (owner, method): every tier-side call on the restore and the publish path
CALLS = [
    (tiered.TieredStore, "lookup_prefix"),
    (tiered.TieredStore, "store_prefix"),
    (restore_cost.RestoreCost, "observe_recompute"),
    (client.TierClient, "chain"),
    (tiering.EngineDevice, "cached_prefix"),
    (tiering.EngineDevice, "payloads"),
    (tiering.EngineDevice, "adopt"),
    (tiering.EngineDevice, "_write"),
    (tiering._BlockReads, "chunk"),
    (tiering._BlockReads, "state"),
]
ERRORS = [MemoryError("no room"), RecursionError("deep"), ZeroDivisionError("bug"), OverflowError("1e10 s")]


@pytest.mark.parametrize("owner, method", CALLS, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_any_tier_side_exception_costs_a_counted_miss_or_publish_never_a_request(monkeypatch, owner, method, error):
    base = prompt(100, 41)
    shared = _published(base)

    def raising(*args, **kwargs):
        raise error

    monkeypatch.setattr(owner, method, raising)
    engine = Engine(config(), tiers=tiered.TieredStore(shared=shared))
    requests = [Request(base + prompt(9, 42), max_new_tokens=4), Request(prompt(70, 43), max_new_tokens=3)]
    results = engine.generate(requests)
    assert all(r.error is None for r in results)
    assert [r.tokens for r in results] == uncached(requests)
    counters = engine.stats()["tiers"]
    failures = {**counters["publish_failed"], **counters["restore_failed"]}
    # counted by its class (a failed device write reaches the tiers as the cache's AdoptionWriteError)
    expected = "AdoptionWriteError" if method == "_write" else type(error).__name__
    assert failures.get(expected, 0) > 0
    _assert_nothing_held(engine)

