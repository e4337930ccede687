"""KVLifecycle: the trie's block references and LRU leaf eviction (lazy heap, logical clock)."""

from __future__ import annotations


import numpy as np

from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.sequence import Sequence

from ._helpers import B, leaves, make_trie, prefill, produce, slots_at_depth, tokens


def test_fill_pool_free_sequence_and_evict_cascades():
    """A 15.5-block sequence fills a 16-block pool; once it is freed, evict(4) cascades up the
    path and leaves 5 blocks free."""
    pool, trie = make_trie(16)
    seq = Sequence(tokens(15 * B + 8))
    prefill(trie, seq)
    assert pool.num_free == 0 and trie.nodes.num_attached == 15
    trie.free_sequence(seq)
    assert pool.num_free == 1  # only the partial block was private
    trie.check_invariants()
    assert trie.free_kv_blocks(4) == 4
    assert pool.num_free == 5
    assert trie.nodes.num_attached == 11
    # the deepest four went (a leaf at a time), the new leaf is the node at depth 11
    assert [int(trie.nodes.depth[s]) for s in leaves(trie)] == [11]
    assert trie.stats.evicted_blocks == 4
    trie.check_invariants()
    assert trie.clear() == 11
    assert pool.num_free == 16 and trie.nodes.num_attached == 0
    trie.check_invariants()


def test_least_recently_used_leaf_goes_first():
    pool, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1, start=100))  # leaf X (2 blocks)
    produce(trie, tokens(2 * B + 1, start=500))  # leaf Y (2 blocks)
    x_leaf, y_leaf = sorted(leaves(trie))
    # touch X's path by matching it again: X becomes the most recent
    seq = Sequence(tokens(2 * B + 1, start=100))
    prefill(trie, seq)
    trie.free_sequence(seq)
    assert trie.free_kv_blocks(1) == 1
    assert trie.nodes.attached[x_leaf] and not trie.nodes.attached[y_leaf]
    # Y's parent is now a leaf, older than X: it goes next
    assert trie.free_kv_blocks(1) == 1
    assert [int(trie.nodes.depth[s]) for s in leaves(trie)] == [2]
    assert leaves(trie) == [x_leaf]
    trie.check_invariants()


def test_blocks_a_sequence_holds_are_not_evicted_but_stay_candidates():
    pool, trie = make_trie(16)
    held = Sequence(tokens(3 * B + 1))
    prefill(trie, held)
    assert trie.free_kv_blocks(10) == 0
    assert trie.nodes.num_attached == 3
    trie.check_invariants([held])
    trie.free_sequence(held)
    assert trie.free_kv_blocks(10) == 3
    assert pool.num_free == 16
    trie.check_invariants()


def test_partly_held_path_evicts_only_the_unheld_tail():
    pool, trie = make_trie(16)
    produce(trie, tokens(4 * B + 1))
    reader = Sequence(tokens(2 * B + 1))  # holds the first two blocks
    prefill(trie, reader)
    assert trie.free_kv_blocks(10) == 2
    assert sorted(int(trie.nodes.depth[s]) for s in trie.nodes.attached_slots()) == [1, 2]
    trie.check_invariants([reader])


def test_stale_non_leaf_entry_is_skipped():
    """A stale entry for a node that is no longer a leaf, older than every live one, is
    skipped: evict(2) still frees 2."""
    pool, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    (parent,) = slots_at_depth(trie, 1)
    trie.kv._heap.restore([(0, parent, int(trie.nodes.generation[parent]), parent)])
    assert trie.free_kv_blocks(2) == 2
    assert pool.num_free == 16 and trie.nodes.num_attached == 0
    assert not any(trie.kv._is_candidate(slot, gen) for gen, slot in trie.kv._heap.entries())
    trie.check_invariants()


def test_entry_of_a_detached_generation_is_ignored():
    pool, trie = make_trie(16)
    produce(trie, tokens(B + 1))
    (old,) = leaves(trie)
    old_generation = int(trie.nodes.generation[old])
    assert trie.free_kv_blocks(1) == 1
    # the slot is reused by a new node; a stale entry for the old generation must not evict it
    held = Sequence(tokens(B + 1, start=900))
    prefill(trie, held)
    (new,) = leaves(trie)
    assert new == old
    trie.kv._heap.restore([(0, old, old_generation, old)])
    trie.free_sequence(held)
    assert trie.free_kv_blocks(1) == 1  # evicts the new node through its own entry
    assert trie.kv.evict(1) == []
    trie.check_invariants()


def test_touched_entry_is_requeued_with_its_new_stamp():
    pool, trie = make_trie(16)
    produce(trie, tokens(B + 1, start=1))
    produce(trie, tokens(B + 1, start=100))
    first, second = sorted(leaves(trie))
    pool.touch([int(trie.nodes.block[first])])  # the older one becomes the newest
    assert trie.free_kv_blocks(1) == 1
    assert trie.nodes.attached[first] and not trie.nodes.attached[second]
    trie.check_invariants()


def test_protected_leaves_are_kept_and_stay_candidates():
    pool, trie = make_trie(16)
    produce(trie, tokens(B + 1, start=1))
    produce(trie, tokens(B + 1, start=100))
    first, second = sorted(leaves(trie))
    evicted = trie.kv.evict(5, is_protected=lambda slot: slot == first)
    assert evicted == [second]
    assert trie.nodes.attached[first]
    trie.check_invariants()
    assert trie.kv.evict(5) == [first]
    assert pool.num_free == 16


def test_heap_is_compacted():
    pool, trie = make_trie(16)
    produce(trie, tokens(B + 1))
    (leaf,) = leaves(trie)
    for _ in range(1100):
        trie.kv.offer_leaf(leaf)
    assert len(trie.kv._heap) <= 2 * trie.nodes.num_attached + 1024 + 1
    trie.kv._heap.compact()
    assert len(trie.kv._heap) == 1
    trie.check_invariants()
    assert trie.free_kv_blocks(1) == 1


def test_take_references_adds_one_trie_reference():
    pool, trie = make_trie(8)
    root = trie.nodes.root(Sequence([1]).namespace)
    ids = pool.allocate(2)
    slots = trie.nodes.attach_run(root, np.array([1, 2], dtype=np.uint64), ids.astype(np.int64), {})
    trie.tokens.ensure_capacity(trie.nodes.capacity)
    lifecycle = KVLifecycle(trie.nodes, pool)
    lifecycle.take_references(slots)
    assert pool.refcounts(ids).tolist() == [2, 2]
    lifecycle.offer_leaf(int(slots[-1]))
    lifecycle.check_invariants()
    pool.unref(ids)
    assert lifecycle.evict(2) == [int(slots[1]), int(slots[0])]
    assert pool.num_free == 8


def test_evict_zero_and_disabled():
    pool, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    assert trie.free_kv_blocks(0) == 0
    assert trie.nodes.num_attached == 2
    _, disabled = make_trie(16, enabled=False)
    assert disabled.free_kv_blocks(5) == 0


def test_evict_more_than_available():
    pool, trie = make_trie(16)
    produce(trie, tokens(3 * B + 1))
    assert trie.free_kv_blocks(100) == 3
    assert trie.free_kv_blocks(100) == 0
    assert trie.stats.evicted_blocks == 3
    assert pool.num_free == 16
