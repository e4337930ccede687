"""The write phase: PublishLedger stores a prefix chunks first and judges host evictions by
what it remembers; an EncodedPrefix encodes each object once."""

from __future__ import annotations

from hybridcache.tiers.backends import DiskStore, HostMemoryStore
from hybridcache.tiers.breaker import CircuitBreaker
from hybridcache.tiers.publish_ledger import EncodedPrefix, PublishLedger
from hybridcache.tiers.tier_calls import TierCalls

from .helpers import CHUNK, chain, kv_arrays, state_arrays


def encoded(keys, step: int, calls: list) -> EncodedPrefix:
    def chunk_arrays(index: int):
        calls.append(index)
        return kv_arrays(index)

    def states():
        calls.append("state")
        return state_arrays(step)

    return EncodedPrefix(keys, step, chunk_arrays, states, None)


def test_a_prefix_is_encoded_once_for_every_tier_it_goes_to():
    calls = TierCalls({"host": HostMemoryStore(1 << 24), "shared": HostMemoryStore(1 << 24)}, CircuitBreaker(), None)
    ledger = PublishLedger(calls)
    keys = chain()
    read: list = []
    report = ledger.store(encoded(keys, 2 * CHUNK, read))
    assert read == [0, 1, "state"]  # once each, though two tiers took them
    assert report.checkpoint_stored == {"host": True, "shared": True} and report.chunks_stored == {"host": 2, "shared": 2}
    again: list = []
    assert ledger.store(encoded(keys, 2 * CHUNK, again)).chunks_stored == {"host": 0, "shared": 0}
    assert again == []  # every tier holds it all: nothing read, nothing encoded
    assert ledger.was_published(keys.checkpoint_key(2 * CHUNK))
    ledger.check_invariants()
    calls.check_invariants()


def test_an_eviction_no_checkpoint_needs_is_dropped_one_a_checkpoint_needs_is_demoted(tmp_path):
    host, disk = HostMemoryStore(1 << 24), DiskStore(tmp_path / "disk", 1 << 24)
    calls = TierCalls({"host": host, "disk": disk}, CircuitBreaker(), None)
    ledger = PublishLedger(calls)
    keys = chain()
    ledger.store(encoded(keys, 2 * CHUNK, []))
    ledger.demote(keys.chunk_key(0).name, b"chunk 0")  # its checkpoint is still in the host tier
    assert calls.counters["demoted_to_disk"] == 1 and disk.exists([keys.chunk_key(0).name]) == [True]
    host.remove([keys.checkpoint_key(2 * CHUNK).name])
    ledger.demote(keys.chunk_key(1).name, b"chunk 1")  # its only user is gone from every tier
    assert calls.counters["host_dropped_dead_weight"] == 1 and disk.exists([keys.chunk_key(1).name]) == [False]
    ledger.check_invariants()
    calls.check_invariants()
