"""The seams an engine uses to put its own allocators under the cache: pools handed to
``build_cache``, one reference per block per holder, and tables the engine grew itself."""

import numpy as np
import pytest

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import InvalidArgumentError, InvalidBlockIdError, InvalidTypeError, LifecycleError
from hybridcache.memory import BlockPool, StatePool
from hybridcache.memory.protocols import KVBlockAllocator, StateSlotAllocator

BLOCK = 4


class EngineBlocks(BlockPool):
    """An engine's own allocator: records every reference change it is asked for."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.calls: list[str] = []

    def ref(self, block_ids, *, unique=False):
        self.calls.append("ref")
        super().ref(block_ids, unique=unique)

    def unref(self, block_ids, *, unique=False):
        self.calls.append("unref")
        return super().unref(block_ids, unique=unique)


def _engine_cache(borrow_paths: bool = False):
    config = CacheConfig(block_size=BLOCK, num_kv_blocks=16)
    pool = EngineBlocks(16)
    return build_cache(config, pools=(pool, StatePool(1)), borrow_paths=borrow_paths), pool


def _serve(trie, pool, tokens):
    """Engine-side admission: match, grow the table with the engine's own blocks, attach."""
    seq = Sequence(tokens)
    txn = trie.match(seq)
    trie.commit(txn)
    own = pool.allocate(-(-seq.num_tokens // BLOCK) - seq.num_blocks)
    trie.attach_table(seq, own)
    seq.set_computed(seq.num_tokens)
    return seq


def test_the_project_pools_satisfy_the_protocols():
    assert isinstance(BlockPool(2), KVBlockAllocator) and isinstance(StatePool(2), StateSlotAllocator)


def test_build_cache_composes_the_engines_own_allocators():
    parts, pool = _engine_cache()
    assert parts.pool is pool and parts.trie.pool is pool
    _serve(parts.trie, pool, list(range(12)))
    assert "ref" in pool.calls


def test_a_pool_of_the_wrong_size_or_kind_is_refused():
    config = CacheConfig(block_size=BLOCK, num_kv_blocks=16)
    with pytest.raises(InvalidArgumentError):
        build_cache(config, pools=(BlockPool(8), StatePool(1)))
    with pytest.raises(InvalidTypeError):
        build_cache(config, pools=(object(), StatePool(1)))
    with pytest.raises(InvalidTypeError):
        build_cache(config, pools=BlockPool(16))


def test_per_block_ownership_counts_one_reference_per_holder():
    parts, pool = _engine_cache(borrow_paths=False)
    trie = parts.trie
    first = _serve(trie, pool, list(range(13)))
    second = Sequence(list(range(13)))
    txn = trie.match(second)
    shared = second.block_table.copy()
    assert shared.size == 3 and np.array_equal(shared, first.block_table[:3])
    assert pool.refcounts(shared).tolist() == [3, 3, 3]  # trie, first, second
    assert second.prefix_state.borrow.depth == 0 and not trie.kv.pins()
    trie.check_invariants([first, second], [txn])
    trie.rollback(txn)
    assert pool.refcounts(shared).tolist() == [2, 2, 2] and second.num_blocks == 0
    trie.check_invariants([first, second])


def test_the_default_mode_still_borrows_with_one_pin():
    parts, pool = _engine_cache(borrow_paths=True)
    trie = parts.trie
    first = _serve(trie, pool, list(range(13)))
    second = Sequence(list(range(13)))
    trie.commit(trie.match(second))
    assert pool.refcounts(second.block_table).tolist() == [2, 2, 2] and second.prefix_state.borrow.depth == 3
    trie.check_invariants([first, second])


def test_a_table_the_engine_grew_joins_the_trie_and_is_deduplicated():
    parts, pool = _engine_cache()
    trie = parts.trie
    first = _serve(trie, pool, list(range(8)))
    twin = Sequence(list(range(8)))  # no match: the engine allocates a private copy
    own = pool.allocate(2)
    twin.set_computed(8)
    trie.attach_table(twin, own)
    assert np.array_equal(twin.block_table, first.block_table)  # swapped to the canonical blocks
    assert pool.refcounts(own).tolist() == [0, 0]
    trie.check_invariants([first, twin])


def test_attach_table_refuses_free_duplicate_or_foreign_ids_and_changes_nothing():
    parts, pool = _engine_cache()
    trie = parts.trie
    seq = Sequence(list(range(8)))
    held = pool.allocate(1)
    with pytest.raises(LifecycleError):
        trie.attach_table(seq, [int(held[0]), 9])  # block 9 is free
    with pytest.raises(InvalidBlockIdError):
        trie.attach_table(seq, [int(held[0]), int(held[0])])
    with pytest.raises(InvalidBlockIdError):
        trie.attach_table(seq, [99])
    with pytest.raises(InvalidTypeError):
        trie.attach_table(seq, [0.5])
    assert seq.num_blocks == 0 and trie.nodes.num_attached == 0


@pytest.mark.parametrize("wrap", [lambda ids: ids.astype(np.int64) + 2**32, lambda ids: ids.astype(np.uint64) + 2**63,
                                  lambda ids: [int(block) + 2**40 for block in ids]])
def test_attach_table_checks_ids_before_the_int32_cast_could_wrap_them(wrap):
    parts, pool = _engine_cache()
    trie = parts.trie
    held = pool.allocate(2)  # the engine's blocks: an id 2**32 + k would wrap onto block k
    seq = Sequence(list(range(8)))
    with pytest.raises(InvalidBlockIdError):
        trie.attach_table(seq, wrap(held))
    with pytest.raises(InvalidTypeError):
        trie.attach_table(seq, [[int(held[0])], [int(held[1]), 3]])  # ragged
    assert seq.num_blocks == 0 and trie.nodes.num_attached == 0
    assert pool.refcounts(held).tolist() == [1, 1]
    trie.attach_table(seq, held, upto=8)
    assert seq.block_table.tolist() == held.tolist()
    trie.check_invariants([seq])
