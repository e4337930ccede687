"""Path pins: a match from the root borrows the cached path with one pin on its deepest node
instead of one block reference per block (KVLifecycle.pin_path / unpin_path)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import LifecycleError, RefcountUnderflowError
from hybridcache.types import NO_NODE
from hybridcache.sequence import Sequence

from . import _hybrid
from ._helpers import (
    B,
    admit,
    cursor_depth,
    leaves,
    make_trie,
    path_blocks,
    prefill,
    produce,
    refs,
    seq_state,
    tokens,
)


def all_refcounts(pool) -> list[int]:
    return pool.refcounts(np.arange(pool.num_blocks)).tolist()


def borrow(seq: Sequence) -> tuple[int, int]:
    """The sequence's borrow: (pinned slot, borrowed depth)."""
    state = seq.prefix_state
    return state.borrow.node, state.borrow.depth


def block_of(trie, slot: int) -> int:
    return int(trie.nodes.block[slot])


def test_a_root_match_borrows_the_path_with_one_pin():
    """A 3-block cached path hit from the root: one pin on the leaf, no block reference and
    no stamp (a pinned path cannot be evicted; it is stamped when the pin is returned)."""
    pool, trie = make_trie(16)
    produce(trie, tokens(3 * B + 1))
    (leaf,) = leaves(trie)
    seq = Sequence(tokens(3 * B + 1))
    refcounts_before = all_refcounts(pool)
    stamps_before = pool.stamps(np.arange(pool.num_blocks)).tolist()
    txn = trie.match(seq)
    assert txn.borrowed and txn.hit_tokens == 3 * B
    assert borrow(seq) == (leaf, 3) and cursor_depth(trie, seq) == 3
    assert trie.kv.pins() == {leaf: 1}
    assert seq.block_table.tolist() == path_blocks(trie, seq)
    assert all_refcounts(pool) == refcounts_before  # nothing referenced per block
    ancestors, leaf_block = seq.block_table[:2].tolist(), block_of(trie, leaf)
    assert pool.stamps(np.arange(pool.num_blocks)).tolist() == stamps_before
    trie.check_invariants([seq])
    trie.commit(txn)
    assert trie.kv.pins() == {leaf: 1} and borrow(seq) == (leaf, 3)
    trie.free_sequence(seq)
    assert pool.stamp_of(leaf_block) > stamps_before[leaf_block]
    assert pool.stamps(ancestors).tolist() == [stamps_before[b] for b in ancestors]
    trie.check_invariants([seq])


def test_two_borrowers_share_one_pin_count():
    """Two sequences borrow the same path: pin count 2; the leaf is evictable only once both
    are freed."""
    pool, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    (leaf,) = leaves(trie)
    first, second = Sequence(tokens(2 * B + 1)), Sequence(tokens(2 * B + 5))
    prefill(trie, first)
    prefill(trie, second)
    assert trie.kv.pins() == {leaf: 2}
    assert refs(pool, first)[:2] == refs(pool, second)[:2] == [1, 1]
    trie.check_invariants([first, second])
    trie.free_sequence(first)
    assert trie.kv.pins() == {leaf: 1} and borrow(first) == (NO_NODE, 0)
    assert trie.free_kv_blocks(10) == 0
    trie.check_invariants([second])
    trie.free_sequence(second)
    assert trie.kv.pins() == {}
    trie.check_invariants()
    assert trie.free_kv_blocks(1) == 1 and not trie.nodes.attached[leaf]
    trie.check_invariants()


def test_a_pinned_path_survives_evict_and_clear():
    """evict and clear take every unpinned path but not a pinned leaf nor its ancestors; once
    the borrower is freed, clear takes it too."""
    pool, trie = make_trie(16)
    produce(trie, tokens(3 * B + 1, start=100))
    produce(trie, tokens(2 * B + 1, start=500))
    reader = Sequence(tokens(3 * B + 1, start=100))
    prefill(trie, reader)
    pinned_path = reader.block_table[:3].tolist()
    assert trie.free_kv_blocks(100) == 2  # the unpinned path only
    assert trie.clear() == 0
    assert sorted(block_of(trie, s) for s in trie.nodes.attached_slots().tolist()) == sorted(pinned_path)
    trie.check_invariants([reader])
    trie.free_sequence(reader)
    assert trie.clear() == 3
    assert pool.num_free == 16 and trie.nodes.num_attached == 0
    trie.check_invariants()


def test_rollback_returns_the_pin_and_restores_everything():
    """A borrowed match rolled back leaves refcounts, pins and the sequence as before it; the
    same match committed keeps the pin."""
    pool, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    (leaf,) = leaves(trie)
    seq = Sequence(tokens(2 * B + 1))
    refcounts_before, state_before = all_refcounts(pool), seq_state(seq)
    txn = trie.match(seq)
    assert txn.borrowed and trie.kv.pins() == {leaf: 1}
    trie.rollback(txn)
    assert trie.kv.pins() == {} and borrow(seq) == (NO_NODE, 0)
    assert all_refcounts(pool) == refcounts_before and seq_state(seq) == state_before
    trie.check_invariants([seq])
    txn = trie.match(seq)
    trie.commit(txn)
    assert trie.kv.pins() == {leaf: 1} and borrow(seq) == (leaf, 2)
    trie.check_invariants([seq])


def test_free_sequence_releases_own_blocks_and_returns_the_pin():
    """A borrower that attached blocks of its own: freeing it drops its own references, leaves
    the borrowed blocks to the trie and returns the pin."""
    pool, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    seq = Sequence(tokens(4 * B + 5))
    prefill(trie, seq)
    assert borrow(seq)[1] == 2
    assert refs(pool, seq) == [1, 1, 2, 2, 1]  # borrowed, borrowed, own + trie, own + trie, own
    table = seq.block_table.copy()
    free_before = pool.num_free
    trie.check_invariants([seq])
    trie.free_sequence(seq)
    assert trie.kv.pins() == {} and seq.num_blocks == 0 and borrow(seq) == (NO_NODE, 0)
    assert pool.num_free == free_before + 1  # only the partial block was private
    assert pool.refcounts(table[:4]).tolist() == [1, 1, 1, 1]
    trie.check_invariants()


def test_a_used_path_ages_as_a_whole():
    """Path A (3 blocks) is older than path B (2 blocks), then a borrower uses A's leaf: B goes
    first, leaf then parent, then A from the leaf up. An evicted leaf hands its stamp to its
    parent."""
    pool, trie = make_trie(16)
    produce(trie, tokens(3 * B + 1, start=100))
    produce(trie, tokens(2 * B + 1, start=500))
    a_leaf, b_leaf = sorted(leaves(trie))
    b_parent = int(trie.nodes.parent[b_leaf])
    a_parent = int(trie.nodes.parent[a_leaf])
    reader = Sequence(tokens(3 * B + 1, start=100))
    prefill(trie, reader)
    trie.free_sequence(reader)
    a_leaf_stamp = pool.stamp_of(block_of(trie, a_leaf))
    assert a_leaf_stamp > pool.stamp_of(block_of(trie, b_leaf)) > pool.stamp_of(block_of(trie, a_parent))
    assert trie.kv.evict(3) == [b_leaf, b_parent, a_leaf]
    assert pool.stamp_of(block_of(trie, a_parent)) == a_leaf_stamp  # raised, not the parent's own
    assert leaves(trie) == [a_parent]
    trie.check_invariants()


def test_exclusive_blocks_never_include_borrowed_blocks():
    """Borrowed blocks have refcount 1 (the trie's) yet are not writable by the borrower."""
    pool, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    seq = Sequence(tokens(2 * B + 5))
    admit(trie, seq)
    assert borrow(seq)[1] == 2 and refs(pool, seq) == [1, 1, 1]
    assert trie.exclusive_blocks(seq, 0, seq.num_tokens) == frozenset([int(seq.block_table[2])])
    assert trie.exclusive_blocks(seq, 0, 2 * B) == frozenset()
    trie.check_invariants([seq])


def test_a_match_below_the_borrowed_depth_materializes_the_borrow():
    """A borrower moved back to one computed block matches again from depth 1: the pin becomes
    one reference per borrowed block, then the path is referenced per block."""
    pool, trie = make_trie(16)
    produce(trie, tokens(4 * B + 1))
    seq = Sequence(tokens(4 * B + 1))
    prefill(trie, seq)
    assert borrow(seq)[1] == 4 and refs(pool, seq) == [1, 1, 1, 1, 1]
    seq.set_computed(B)
    txn = trie.match(seq)
    assert not txn.borrowed and txn.table_start == 1 and seq.num_computed == 4 * B
    assert borrow(seq) == (NO_NODE, 0) and trie.kv.pins() == {}
    trie.commit(txn)  # drops the displaced references the open match still held
    assert refs(pool, seq) == [2, 2, 2, 2, 1]  # trie + the sequence, the partial block its own
    trie.check_invariants([seq])
    path = seq.block_table[:4].copy()
    trie.free_sequence(seq)
    assert pool.refcounts(path).tolist() == [1, 1, 1, 1]
    trie.check_invariants()


def test_rolling_back_a_materializing_match_borrows_the_path_again():
    """The rollback undoes the second match exactly, materialization included: the sequence
    borrows its path again and holds no reference on the borrowed blocks."""
    pool, trie = make_trie(16)
    produce(trie, tokens(4 * B + 1))
    seq = Sequence(tokens(4 * B + 1))
    prefill(trie, seq)
    table, pins, before = seq.block_table.tolist(), trie.kv.pins(), refs(pool, seq)
    borrowed = borrow(seq)
    seq.set_computed(B)
    txn = trie.match(seq)
    assert txn.materialized == borrowed and borrow(seq) == (NO_NODE, 0)
    trie.rollback(txn)
    assert seq.num_computed == B and seq.block_table.tolist() == table
    assert borrow(seq) == borrowed and trie.kv.pins() == pins and refs(pool, seq) == before
    trie.check_invariants([seq])
    trie.free_sequence(seq)
    trie.check_invariants()


def test_a_non_root_match_references_per_block():
    """A sequence that computed its first block itself resumes at depth 1: the rest of the path
    is referenced per block and nothing is pinned."""
    pool, trie = make_trie(16)
    seq = Sequence(tokens(B + 1))
    prefill(trie, seq)  # nothing cached: block 0 is its own
    produce(trie, tokens(4 * B + 1))
    seq.append_tokens(tokens(3 * B, start=B + 2))
    txn = trie.match(seq)
    assert not txn.borrowed and txn.table_start == 1 and txn.hit_tokens == 3 * B - 1
    assert borrow(seq) == (NO_NODE, 0) and trie.kv.pins() == {}
    trie.commit(txn)
    assert refs(pool, seq) == [2, 2, 2, 2]
    trie.check_invariants([seq])


def test_a_match_beyond_the_borrow_keeps_it():
    """A borrower of two blocks that grows resumes at depth 2: the deeper blocks are referenced
    per block and the borrow stays as it was."""
    pool, trie = make_trie(16)
    produce(trie, tokens(4 * B + 1))
    seq = Sequence(tokens(2 * B + 1))
    prefill(trie, seq)
    pinned, depth = borrow(seq)
    assert depth == 2
    seq.append_tokens(tokens(2 * B, start=2 * B + 2))
    txn = trie.match(seq)
    assert not txn.borrowed and txn.table_start == 2
    trie.commit(txn)
    assert borrow(seq) == (pinned, 2) and trie.kv.pins() == {pinned: 1}
    assert refs(pool, seq) == [1, 1, 2, 2]
    trie.check_invariants([seq])
    trie.free_sequence(seq)
    assert trie.kv.pins() == {}
    trie.check_invariants()


def test_a_checkpoint_hit_borrows_the_path_to_its_anchor():
    """Hybrid trie: KV for 3 blocks, a checkpoint at 2 blocks. The hit pins the anchor; the
    leaf below it is evictable, the anchor and its ancestor are not."""
    pool, _, trie = _hybrid.make_hybrid()
    _, record = _hybrid.produce(trie, tokens(3 * B), 2 * B)
    request = Sequence(tokens(3 * B + 1))
    txn = trie.match(request)
    assert request.prefix_state.checkpoints.restore is record
    assert txn.borrowed and borrow(request) == (record.anchor, 2)
    assert trie.kv.pins() == {record.anchor: 1} and refs(pool, request) == [1, 1]
    trie.check_invariants([request])
    trie.rollback(txn)
    assert trie.kv.pins() == {} and borrow(request) == (NO_NODE, 0)
    trie.check_invariants([request])
    txn = trie.match(request)
    trie.commit(txn)
    assert trie.free_kv_blocks(100) == 1  # the unpinned leaf below the anchor
    assert trie.nodes.attached[record.anchor] and trie.nodes.num_attached == 2
    trie.check_invariants([request])
    trie.free_sequence(request)
    assert trie.kv.pins() == {}
    trie.check_invariants()


def test_the_invariant_check_counts_every_borrower():
    """Leaving a live borrower out of check_invariants is reported (its pin has no owner)."""
    _, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    seq = Sequence(tokens(2 * B + 1))
    prefill(trie, seq)
    with pytest.raises(AssertionError):
        trie.check_invariants([])
    trie.check_invariants([seq])


def test_unpinning_a_slot_that_is_not_pinned_raises():
    _, trie = make_trie(16)
    produce(trie, tokens(B + 1))
    (leaf,) = leaves(trie)
    with pytest.raises(RefcountUnderflowError):
        trie.kv.unpin_path(leaf)
    trie.kv.pin_path(leaf)
    trie.kv.unpin_path(leaf)
    with pytest.raises(RefcountUnderflowError):
        trie.kv.unpin_path(leaf)
    assert trie.kv.pins() == {}
    trie.check_invariants()


def test_the_pool_refuses_to_release_a_borrowing_table():
    """``BlockPool.release_table`` would drop references a borrowing sequence never took (the
    trie's own): it refuses and changes nothing; ``free_sequence`` is the way out."""
    pool, trie = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    seq = Sequence(tokens(2 * B + 1))
    prefill(trie, seq)
    before = refs(pool, seq)
    with pytest.raises(LifecycleError):
        pool.release_table(seq)
    assert refs(pool, seq) == before and seq.prefix_state.borrow.depth == 2
    trie.check_invariants([seq])
