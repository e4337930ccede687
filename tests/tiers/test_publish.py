"""The write phase: PublishLedger stores a prefix chunks first and judges host evictions by
what it remembers; an EncodedPrefix encodes each object once; the PublishIndex it remembers
with holds one small node per chunk, bounded in bytes, exact about what it knows."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.tiers import KeyChain
from hybridcache.tiers.backends import DiskStore, HostMemoryStore
from hybridcache.tiers.breaker import CircuitBreaker
from hybridcache.tiers.publish import NODE_BYTES, EncodedPrefix, PublishIndex, PublishLedger
from hybridcache.tiers.tier_calls import TierCalls

from .helpers import CHUNK, chain, fingerprint, kv_arrays, state_arrays


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


def long_chain(tokens: int = 2048, chunk: int = 8, first: int = 1) -> KeyChain:
    return KeyChain(fingerprint(block_size=chunk, chunk_size=chunk), np.arange(first, first + tokens))


def test_a_long_request_at_a_small_chunk_holds_a_node_per_chunk_not_names_per_checkpoint():
    keys = long_chain()  # 256 checkpoints; per-checkpoint name tuples held 5.9 MB
    index = PublishIndex()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in keys.checkpoint_steps():
        index.end(index.begin(keys, step))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.nbytes == 256 * NODE_BYTES
    assert grown <= index.nbytes  # the per-node bound holds: 82 kB for the whole request
    deepest = keys.chunk_key(255).digest
    assert index.chunks_needed(deepest) == [keys.chunk_key(i).digest for i in range(256)]
    assert len(index.checkpoints_needing(keys.chunk_key(250).digest)) == 6
    index.check_invariants()


def test_the_budget_forgets_the_oldest_roots_with_their_subtrees():
    index = PublishIndex(budget_bytes=300 * NODE_BYTES)
    old, new = long_chain(first=1), long_chain(first=5000)
    index.end(index.begin(old, 2048))
    index.end(index.begin(new, 2048))  # 512 nodes do not fit 300: the old tree goes whole
    assert index.nbytes == 256 * NODE_BYTES
    assert index.chunks_needed(old.chunk_key(255).digest) is None
    assert index.checkpoints_needing(old.chunk_key(0).digest) is None
    assert index.chunks_needed(new.chunk_key(255).digest) is not None
    index.check_invariants()


def test_a_chunk_under_a_checkpoint_being_published_is_not_judged():
    keys = long_chain(tokens=32)
    index = PublishIndex()
    digest = index.begin(keys, 32)
    assert index.checkpoints_needing(keys.chunk_key(0).digest) is None
    index.end(digest)
    assert index.checkpoints_needing(keys.chunk_key(0).digest) == [digest]
    index.forget_checkpoint(digest)
    assert index.chunks_needed(digest) is None and index.checkpoints_needing(keys.chunk_key(0).digest) is None
    index.check_invariants()


@pytest.mark.parametrize("bad, error", [(1, InvalidArgumentError), ("1", InvalidTypeError), (True, InvalidTypeError)])
def test_bad_budgets_are_refused(bad, error):
    with pytest.raises(error):
        PublishIndex(budget_bytes=bad)
