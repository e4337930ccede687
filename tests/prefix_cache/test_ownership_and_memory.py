"""A sequence belongs to one trie: every entry point that takes a sequence (or a transaction of
one) refuses another trie's before changing anything. Per-namespace memory goes with the last
thing cached in the namespace, and copies of a trie keep its invariants."""

from __future__ import annotations

import copy
import pickle

import pytest

from hybridcache.errors import ForeignSequenceError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache import BlockTrie
from hybridcache.sequence import Sequence
from tests.prefix_cache._helpers import B, prefill, snapshot, tokens


def hybrid_trie() -> BlockTrie:
    return BlockTrie(BlockPool(32), B, state_pool=StatePool(10, checkpoint_budget=6), track_pending=True)


def owned_by_first() -> tuple[BlockTrie, BlockTrie, Sequence]:
    first, second = hybrid_trie(), hybrid_trie()
    seq = Sequence(tokens(3 * B + 5))
    first.prepare(seq)
    prefill(first, seq)
    return first, second, seq


ENTRY_POINTS = {
    "free_sequence": lambda t, s: t.free_sequence(s),
    "prepare": lambda t, s: t.prepare(s),
    "match": lambda t, s: t.match(s),
    "allocate": lambda t, s: t.allocate(s),
    "mark_computed": lambda t, s: t.mark_computed(s, 0),
    "discard_pending": lambda t, s: t.discard_pending(s),
    "cache_routed_experts": lambda t, s: t.cache_routed_experts(s),
    "exclusive_blocks": lambda t, s: t.exclusive_blocks(s, 0, B),
    "reserve_save": lambda t, s: t.checkpoints.reserve_save(s, 2 * B),
    "reserve_decode_save": lambda t, s: t.checkpoints.reserve_decode_save(s, B),
    "publish_save": lambda t, s: t.checkpoints.publish_save(s),
    "release_reservation": lambda t, s: t.checkpoints.release_reservation(s),
    "release_failed_save": lambda t, s: t.checkpoints.release_failed_save(s),
    "pin_restore": lambda t, s: t.checkpoints.pin_restore(s),
    "unpin_restore": lambda t, s: t.checkpoints.unpin_restore(s),
    "unpin_save": lambda t, s: t.checkpoints.unpin_save(s),
    "release_sequence": lambda t, s: t.checkpoints.release_sequence(s),
    "attach_pending_tail_experts": lambda t, s: t.checkpoints.attach_pending_tail_experts(s),
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_every_entry_point_refuses_another_tries_sequence_and_changes_nothing(name):
    first, second, seq = owned_by_first()
    first.checkpoints.reserve_save(seq, B + 3)
    before = snapshot(first, second, seq)
    with pytest.raises(ForeignSequenceError):
        ENTRY_POINTS[name](second, seq)
    assert snapshot(first, second, seq) == before
    first.check_invariants([seq])
    second.check_invariants()


def test_a_transaction_of_another_tries_sequence_is_refused():
    first, second = hybrid_trie(), hybrid_trie()
    seq = Sequence(tokens(2 * B))
    txn = first.match(seq)
    with pytest.raises(ForeignSequenceError):
        second.commit(txn)
    with pytest.raises(ForeignSequenceError):
        second.rollback(txn)
    first.rollback(txn)
    first.check_invariants([seq])


def test_a_freed_sequence_moves_to_another_trie():
    first, second, seq = owned_by_first()
    first.free_sequence(seq)
    second.prepare(seq)
    prefill(second, seq)
    second.check_invariants([seq])
    first.check_invariants()


def test_per_namespace_memory_goes_with_the_last_cached_entry():
    trie = hybrid_trie()
    capacity = None
    for index in range(300):
        seq = Sequence(tokens(B + 3, index), cache_salt=f"tenant-{index}")
        trie.prepare(seq)
        trie.free_kv_blocks(max(0, 2 - trie.pool.num_free))  # pressure: the pool holds 32 blocks
        prefill(trie, seq)
        trie.checkpoints.reserve_save(seq)
        trie.checkpoints.publish_save(seq)
        trie.free_sequence(seq)
        trie.check_invariants()
        if index == 20:
            capacity = trie.nodes.capacity
    # the checkpoint budget and the pool bound what stays cached, so the roots kept are bounded too
    assert len(trie.nodes.childless_roots()) <= 6
    assert trie.nodes.capacity == capacity
    assert len(trie.keyer._namespace_seeds) <= len(trie.nodes._roots) <= 32
    trie.clear()
    assert trie.nodes._roots == {} and trie.keyer._namespace_seeds == {}
    trie.check_invariants()


def test_a_namespace_used_again_after_its_root_went_still_hits():
    trie = BlockTrie(BlockPool(16), B)
    producer = Sequence(tokens(3 * B), cache_salt="a")
    prefill(trie, producer)
    trie.free_sequence(producer)
    trie.clear()
    assert trie.nodes._roots == {}
    second = Sequence(tokens(3 * B), cache_salt="a")
    prefill(trie, second)
    trie.free_sequence(second)
    again = Sequence(tokens(3 * B + 1), cache_salt="a")
    trie.prepare(again)
    txn = trie.match(again)
    assert txn.hit_tokens == 3 * B
    trie.rollback(txn)
    trie.check_invariants([again])


@pytest.mark.parametrize("clone", [lambda t: pickle.loads(pickle.dumps(t)), copy.deepcopy])
def test_a_copied_trie_keeps_its_invariants(clone):
    trie = hybrid_trie()
    for extra in range(3):
        seq = Sequence(tokens(3 * B + 2 + extra))
        trie.prepare(seq)
        prefill(trie, seq)
        trie.checkpoints.reserve_save(seq)
        trie.checkpoints.publish_save(seq)
        trie.free_sequence(seq)
    probe = Sequence(tokens(3 * B + 9))
    trie.prepare(probe)
    prefill(trie, probe)
    copied_trie, copied_probe = clone((trie, probe))
    copied_trie.check_invariants([copied_probe])
    trie.check_invariants([probe])
