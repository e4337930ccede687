"""Every public entry point rejects invalid input with the documented exception and changes
nothing: a deep snapshot of pool, trie and sequences taken before equals the one after."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import (
    DoubleFreeError,
    ForeignSequenceError,
    InvalidArgumentError,
    InvalidTypeError,
    OutOfBlocksError,
    StaleHandleError,
    TopologyError,
)
from hybridcache.memory.block_pool import BlockPool
from hybridcache.prefix_cache import BlockKeyer, BlockTrie
from hybridcache.sequence import Sequence

from ._helpers import B, leaves, make_trie, prefill, produce, snapshot, tokens


@pytest.fixture
def world():
    """A trie with a cached path, a live sequence holding part of it, and a fresh sequence."""
    pool, trie = make_trie(16)
    produce(trie, tokens(3 * B + 1))
    live = Sequence(tokens(2 * B + 5))
    prefill(trie, live)
    fresh = Sequence(tokens(3 * B + 1))
    return pool, trie, live, fresh


def unchanged(world, call, error):
    before = snapshot(*world)
    with pytest.raises(error):
        call()
    assert snapshot(*world) == before
    pool, trie, live, _ = world
    trie.check_invariants([live])
    return True


# --- construction -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [15, 1, 0, -2, True, "16", 16.0, None])
def test_trie_block_size_must_be_an_even_int(block_size):
    pool = BlockPool(4)
    before = snapshot(pool)
    with pytest.raises(InvalidArgumentError):
        BlockTrie(pool, block_size)
    assert snapshot(pool) == before


def test_trie_keyer_block_size_must_match():
    with pytest.raises(InvalidArgumentError):
        BlockTrie(BlockPool(4), 16, keyer=BlockKeyer(32))
    with pytest.raises(InvalidArgumentError):
        BlockTrie(BlockPool(4), 16, keyer=BlockKeyer.deterministic(8))
    assert BlockTrie(BlockPool(4), 16, keyer=BlockKeyer(16)).block_size == 16


@pytest.mark.parametrize("pool", [None, "pool", 16, np.zeros(4)])
def test_trie_pool_must_be_a_block_pool(pool):
    with pytest.raises(InvalidTypeError):
        BlockTrie(pool, 16)


@pytest.mark.parametrize("keyer", ["keyer", 16, object()])
def test_trie_keyer_must_be_a_block_keyer(keyer):
    with pytest.raises(InvalidTypeError):
        BlockTrie(BlockPool(4), 16, keyer=keyer)


@pytest.mark.parametrize("block_size", [15, 1, 0, -4, True, "16", 16.0])
def test_keyer_block_size_must_be_an_even_int(block_size):
    with pytest.raises(InvalidArgumentError):
        BlockKeyer(block_size)


def test_keyer_secret_must_be_bytes():
    with pytest.raises(InvalidTypeError):
        BlockKeyer(16, secret="not bytes")
    assert BlockKeyer(16, secret=b"x").extend(Sequence(tokens(16))).size == 1


def test_errors_are_also_builtin_families():
    with pytest.raises(ValueError):
        BlockTrie(BlockPool(4), 3)
    with pytest.raises(TypeError):
        BlockTrie("pool", 16)
    _, trie = make_trie(4)
    with pytest.raises(RuntimeError):
        txn = trie.match(Sequence(tokens(5)))
        trie.commit(txn)
        trie.commit(txn)


# --- evict ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [-1, -100])
def test_evict_negative(world, count):
    pool, trie, live, fresh = world
    assert unchanged(world, lambda: trie.free_kv_blocks(count), InvalidArgumentError)


@pytest.mark.parametrize("count", ["x", 1.5, True, None, [1], np.float64(2.0)])
def test_evict_wrong_type(world, count):
    pool, trie, live, fresh = world
    assert unchanged(world, lambda: trie.free_kv_blocks(count), (InvalidArgumentError, InvalidTypeError))


def test_evict_accepts_numpy_ints(world):
    pool, trie, live, fresh = world
    assert trie.free_kv_blocks(np.int64(1)) == 1


# --- sequence arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["match", "allocate", "free_sequence", "cache_routed_experts"])
@pytest.mark.parametrize("arg", [None, "seq", 3, [1, 2, 3], np.arange(4)])
def test_sequence_entry_points_reject_non_sequences(world, entry, arg):
    pool, trie, live, fresh = world
    assert unchanged(world, lambda: getattr(trie, entry)(arg), InvalidTypeError)


@pytest.mark.parametrize("entry", ["commit", "rollback"])
@pytest.mark.parametrize("arg", [None, "txn", 0, object()])
def test_transaction_entry_points_reject_non_transactions(world, entry, arg):
    pool, trie, live, fresh = world
    assert unchanged(world, lambda: getattr(trie, entry)(arg), InvalidTypeError)


# --- transactions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("first, second", [("commit", "commit"), ("rollback", "rollback"), ("commit", "rollback"), ("rollback", "commit")])
def test_closing_a_transaction_twice_is_stale(world, first, second):
    pool, trie, live, fresh = world
    txn = trie.match(fresh)
    assert txn.hit_tokens == 3 * B
    getattr(trie, first)(txn)
    before = snapshot(pool, trie, live, fresh, txn)
    with pytest.raises(StaleHandleError):
        getattr(trie, second)(txn)
    assert snapshot(pool, trie, live, fresh, txn) == before


def test_rollback_after_the_table_grew_is_stale(world):
    pool, trie, live, fresh = world
    txn = trie.match(fresh)
    pool.grow_table(fresh, fresh.num_tokens, B)
    before = snapshot(pool, trie, live, fresh, txn)
    with pytest.raises(StaleHandleError):
        trie.rollback(txn)
    assert snapshot(pool, trie, live, fresh, txn) == before
    assert txn.open
    # the transaction is still usable the right way
    trie.allocate(fresh)
    trie.commit(txn)
    trie.check_invariants([live, fresh])


def test_rollback_after_the_step_moved_is_stale(world):
    pool, trie, live, fresh = world
    txn = trie.match(fresh)
    fresh.set_computed(fresh.num_computed - 1)
    before = snapshot(pool, trie, live, fresh, txn)
    with pytest.raises(StaleHandleError):
        trie.rollback(txn)
    assert snapshot(pool, trie, live, fresh, txn) == before


def test_rollback_after_free_is_stale(world):
    pool, trie, live, fresh = world
    txn = trie.match(fresh)
    trie.free_sequence(fresh)
    before = snapshot(pool, trie, live, fresh, txn)
    with pytest.raises(StaleHandleError):
        trie.rollback(txn)
    assert snapshot(pool, trie, live, fresh, txn) == before
    trie.commit(txn)  # drops nothing: the match displaced nothing
    trie.check_invariants([live])


def test_out_of_blocks_after_a_match_changes_nothing_then_rolls_back(world):
    pool, trie, live, fresh = world
    before_match = snapshot(pool.refcounts(np.arange(16)), pool.num_free, trie.stats.match, fresh.block_table, fresh.num_computed)
    txn = trie.match(fresh)
    before = snapshot(pool, trie, live, fresh, txn)
    with pytest.raises(OutOfBlocksError):
        pool.grow_table(fresh, fresh.num_tokens + 100 * B, B)
    assert snapshot(pool, trie, live, fresh, txn) == before
    trie.rollback(txn)
    after = snapshot(pool.refcounts(np.arange(16)), pool.num_free, trie.stats.match, fresh.block_table, fresh.num_computed)
    assert after == before_match


# --- topology -------------------------------------------------------------------------------------


def test_detach_errors_leave_the_whole_trie_unchanged(world):
    pool, trie, live, fresh = world
    nodes = trie.nodes
    (leaf,) = leaves(trie)
    inner = int(nodes.parent[leaf])
    root = nodes.root(live.namespace)
    for bad in (inner, root, -1, nodes.capacity + 5):
        unchanged(world, lambda: nodes.detach_leaf(bad), TopologyError)
    # a detached node
    assert trie.free_kv_blocks(1) == 1
    assert not nodes.attached[leaf]
    unchanged(world, lambda: nodes.detach_leaf(leaf), TopologyError)
    unchanged(
        world,
        lambda: nodes.attach_run(leaf, np.array([1], dtype=np.uint64), np.array([0]), {}),
        TopologyError,
    )


# --- pool misuse seen through the trie ----------------------------------------------------------


def test_free_sequence_whose_block_was_already_freed(world):
    pool, trie, live, fresh = world
    private = int(live.block_table[-1])
    assert pool.refcount_of(private) == 1
    pool.unref([private])  # misuse: somebody else dropped the sequence's reference
    before = snapshot(pool, trie, live, fresh)
    with pytest.raises(DoubleFreeError):
        trie.free_sequence(live)
    assert snapshot(pool, trie, live, fresh) == before



def test_a_sequence_holding_blocks_of_another_trie_is_refused():
    """Node handles cached on a sequence belong to one trie: handing a sequence that still
    holds blocks there to another trie raises and changes nothing; once freed it moves, and
    forgets what the first trie verified."""
    pool, trie = make_trie(16)
    other_pool, other = make_trie(16)
    produce(trie, tokens(2 * B + 1))
    seq = Sequence(tokens(2 * B + 1))
    prefill(trie, seq)
    before = snapshot(pool, trie, other_pool, other, seq)
    for call in (other.prepare, other.match, other.allocate):
        with pytest.raises(ForeignSequenceError):
            call(seq)
        assert snapshot(pool, trie, other_pool, other, seq) == before
    trie.free_sequence(seq)
    txn = other.match(seq)
    assert txn.hit_tokens == 0 and seq.num_computed == 0 and seq.prefix_state.trie.owner == other.trie_id
    other.rollback(txn)
    trie.check_invariants()
    other.check_invariants([seq])
