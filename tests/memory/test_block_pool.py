"""BlockPool: reference-counted KV block ids, LIFO free list, logical-clock stamps."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridcache import Sequence
from hybridcache.errors import (
    DoubleFreeError,
    HybridCacheError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTypeError,
    OutOfBlocksError,
    RefcountUnderflowError,
)
from hybridcache.memory import BlockPool

# --- helpers -----------------------------------------------------------------------------------


def snapshot(pool: BlockPool) -> dict:
    """Everything a failed call must leave untouched, copied."""
    every = np.arange(pool.num_blocks)
    return {
        "refcounts": pool.refcounts(every),
        "stamps": pool.stamps(every),
        "num_free": pool.num_free,
        "clock": pool.clock,
        # The free-list order decides which ids the next allocate returns (LIFO).
        "free_list": pool._free[: pool.num_free].copy(),
    }


def assert_unchanged(pool: BlockPool, before: dict) -> None:
    after = snapshot(pool)
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(after[key], value, err_msg=key)
        else:
            assert after[key] == value, key
    pool.check_invariants()


def expected_from(pool: BlockPool, overrides: dict[int, int]) -> np.ndarray:
    expected = np.zeros(pool.num_blocks, dtype=np.int32)
    for block, count in overrides.items():
        expected[block] = count
    return expected


# --- construction ------------------------------------------------------------------------------


def test_new_pool_is_all_free():
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free == 5
    assert pool.clock == 0
    np.testing.assert_array_equal(pool.refcounts(np.arange(5)), 0)
    np.testing.assert_array_equal(pool.stamps(np.arange(5)), 0)
    pool.check_invariants(np.zeros(5, dtype=np.int32))


@pytest.mark.parametrize("num_blocks", [-1, 1.5, "4", None, True])
def test_constructor_rejects_bad_sizes(num_blocks):
    with pytest.raises(HybridCacheError):
        BlockPool(num_blocks)


def test_constructor_rejects_negative_size_as_invalid_argument():
    with pytest.raises(InvalidArgumentError):
        BlockPool(-1)


def test_empty_pool():
    pool = BlockPool(0)
    assert pool.allocate(0).shape == (0,)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.check_invariants()


# --- allocate ---------------------------------------------------------------------------------


def test_allocate_hands_out_ascending_ids_on_a_new_pool_with_one_reference():
    pool = BlockPool(8)
    ids = pool.allocate(3)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [0, 1, 2])
    np.testing.assert_array_equal(pool.allocate(2), [3, 4])
    np.testing.assert_array_equal(pool.refcounts(np.arange(8)), [1, 1, 1, 1, 1, 0, 0, 0])
    assert pool.num_free == 3
    pool.check_invariants(expected_from(pool, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}))


def test_allocate_zero_returns_nothing():
    pool = BlockPool(4)
    ids = pool.allocate(0)
    assert ids.shape == (0,)
    assert pool.num_free == 4
    pool.check_invariants()


def test_allocate_accepts_numpy_ints():
    pool = BlockPool(4)
    assert pool.allocate(np.int64(2)).tolist() == [0, 1]


def test_allocate_every_block():
    pool = BlockPool(4)
    np.testing.assert_array_equal(pool.allocate(4), [0, 1, 2, 3])
    assert pool.num_free == 0
    pool.check_invariants(np.ones(4, dtype=np.int32))


@pytest.mark.parametrize("count", [5, 100])
def test_allocate_more_than_free_raises_and_changes_nothing(count):
    pool = BlockPool(6)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(count)
    assert_unchanged(pool, before)


def test_out_of_blocks_is_a_memory_error():
    pool = BlockPool(1)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free == 1


@pytest.mark.parametrize("count", [-1, 1.0, True, "2", None])
def test_allocate_rejects_bad_counts_and_changes_nothing(count):
    pool = BlockPool(4)
    before = snapshot(pool)
    with pytest.raises(InvalidArgumentError):
        pool.allocate(count)
    assert_unchanged(pool, before)


# --- ref ----------------------------------------------------------------------------------------


def test_ref_counts_each_occurrence():
    pool = BlockPool(4)
    a, b, _ = pool.allocate(3)
    pool.ref([a, a, b])
    assert pool.refcounts([a, b]).tolist() == [3, 2]
    pool.check_invariants(expected_from(pool, {0: 3, 1: 2, 2: 1}))


def test_ref_unique_adds_one_per_id():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    pool.ref(ids, unique=True)
    assert pool.refcounts(ids).tolist() == [2, 2, 2]
    pool.check_invariants(expected_from(pool, {0: 2, 1: 2, 2: 2}))


def test_ref_empty_is_a_no_op():
    pool = BlockPool(4)
    pool.allocate(1)
    before = snapshot(pool)
    pool.ref([])
    pool.ref(np.empty(0, dtype=np.float64))
    assert_unchanged(pool, before)
    assert pool.refcount_of(0) == 1


@pytest.mark.parametrize("unique", [False, True])
def test_ref_of_a_free_block_raises_double_free_and_changes_nothing(unique):
    pool = BlockPool(4)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.ref([0, 3], unique=unique)  # 0 is held, 3 is free: nothing may change
    assert_unchanged(pool, before)


# --- unref --------------------------------------------------------------------------------------


def test_unref_returns_only_the_ids_that_reached_zero():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.ref([b])
    freed = pool.unref([a, b, c])
    np.testing.assert_array_equal(np.sort(freed), [a, c])
    np.testing.assert_array_equal(pool.refcounts([a, b, c]), [0, 1, 0])
    assert pool.num_free == 3
    pool.check_invariants(expected_from(pool, {int(b): 1}))


def test_unref_with_duplicates_drops_each_occurrence():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.ref([a, a])
    assert pool.unref([a, a]).shape == (0,)
    assert pool.refcount_of(a) == 1
    np.testing.assert_array_equal(pool.unref([a]), [a])
    pool.check_invariants(np.zeros(4, dtype=np.int32))


def test_unref_unique_with_distinct_ids():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    freed = pool.unref(ids[::-1], unique=True)
    assert sorted(freed.tolist()) == ids.tolist()
    pool.check_invariants(np.zeros(4, dtype=np.int32))


def test_unref_empty_is_a_no_op():
    pool = BlockPool(4)
    pool.allocate(1)
    before = snapshot(pool)
    assert pool.unref([]).shape == (0,)
    assert_unchanged(pool, before)


def test_freed_blocks_are_reused_lifo():
    pool = BlockPool(8)
    pool.allocate(6)  # 0..5
    pool.unref([2])
    pool.unref([4])
    assert pool.allocate(1).tolist() == [4]
    assert pool.allocate(1).tolist() == [2]
    assert pool.allocate(1).tolist() == [6]  # then the never-used ones
    pool.check_invariants()


def test_blocks_freed_together_come_back_in_ascending_order():
    pool = BlockPool(8)
    pool.allocate(6)
    pool.unref([5, 1, 3])
    assert pool.allocate(3).tolist() == [1, 3, 5]
    pool.check_invariants()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.unref([a])
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.unref([a])
    assert_unchanged(pool, before)


def test_unref_of_a_never_allocated_block_is_a_double_free():
    pool = BlockPool(4)
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.unref([3])
    assert_unchanged(pool, before)


def test_dropping_more_references_than_held_is_an_underflow_and_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(RefcountUnderflowError):
        pool.unref([b, a, a])  # a has one reference, two are dropped
    assert_unchanged(pool, before)


def test_underflow_with_a_free_block_in_the_batch_is_reported_as_double_free():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.unref([b])
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.unref([a, a, b])  # a underflows, b is already free
    assert_unchanged(pool, before)


def test_unref_unique_double_free_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.unref([b])
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.unref([a, b], unique=True)
    assert_unchanged(pool, before)


# --- id validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[-1], [4], [0, 100], np.array([2**40]), [[0, 5]]], ids=repr)
@pytest.mark.parametrize("method", ["ref", "unref", "touch", "refcounts", "stamps"])
def test_out_of_range_ids_raise_and_change_nothing(method, bad):
    pool = BlockPool(4)
    pool.allocate(4)
    before = snapshot(pool)
    with pytest.raises(InvalidBlockIdError):
        getattr(pool, method)(bad)
    assert_unchanged(pool, before)


@pytest.mark.parametrize("bad", [[0.0], np.array([1.5]), [True], np.array(["1"]), [None]], ids=repr)
@pytest.mark.parametrize("method", ["ref", "unref", "touch", "refcounts", "stamps"])
def test_non_integer_ids_raise_type_error_and_change_nothing(method, bad):
    pool = BlockPool(4)
    pool.allocate(4)
    before = snapshot(pool)
    with pytest.raises(InvalidTypeError):
        getattr(pool, method)(bad)
    assert_unchanged(pool, before)


def test_bad_ids_are_index_errors_and_type_errors():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(IndexError):
        pool.ref([2])
    with pytest.raises(TypeError):
        pool.ref([1.0])
    pool.check_invariants(np.ones(2, dtype=np.int32))


def test_ids_accept_any_integer_dtype_and_scalars():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.ref(np.array([0], dtype=np.uint8))
    pool.ref(np.int64(1))
    pool.ref(2)
    assert pool.refcounts([0, 1, 2]).tolist() == [2, 2, 2]
    pool.check_invariants(expected_from(pool, {0: 2, 1: 2, 2: 2}))


# --- stamps and the logical clock ---------------------------------------------------------------


def test_stamps_come_from_a_strictly_increasing_logical_clock():
    pool = BlockPool(8)
    first = pool.allocate(2)
    second = pool.allocate(2)
    s1, s2 = pool.stamps(first), pool.stamps(second)
    assert s1[0] == s1[1] == 1
    assert s2[0] == s2[1] == 2
    assert pool.clock == 2
    assert isinstance(pool.stamp_of(int(first[0])), int)


def test_every_mutating_call_advances_the_clock_by_one_and_stamps_its_blocks():
    pool = BlockPool(8)
    a, b, c = pool.allocate(3)
    clocks = [pool.clock]
    pool.ref([a])
    clocks.append(pool.clock)
    assert pool.stamp_of(a) == pool.clock
    pool.touch([b])
    clocks.append(pool.clock)
    assert pool.stamp_of(b) == pool.clock
    pool.unref([c])
    clocks.append(pool.clock)
    assert pool.stamp_of(c) == pool.clock
    assert clocks == list(range(clocks[0], clocks[0] + 4))
    assert pool.stamp_of(a) < pool.stamp_of(b) < pool.stamp_of(c)


def test_queries_do_not_advance_the_clock():
    pool = BlockPool(4)
    pool.allocate(2)
    clock = pool.clock
    pool.refcounts([0, 1])
    pool.stamps([0, 1])
    pool.stamp_of(0)
    pool.refcount_of(1)
    pool.check_invariants()
    assert pool.clock == clock


def test_touch_of_nothing_does_not_advance_the_clock():
    pool = BlockPool(4)
    pool.allocate(1)
    before = snapshot(pool)
    pool.touch([])
    assert_unchanged(pool, before)
    assert pool.clock == 1


def test_stamps_do_not_read_wall_time(monkeypatch):
    def forbidden(*_args):
        raise AssertionError("wall time was read")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"):
        monkeypatch.setattr(time, name, forbidden)
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.ref(ids)
    pool.touch(ids[:1])
    assert pool.stamps(ids).tolist() == [3, 2]
    pool.unref(ids)
    assert pool.stamps(ids).tolist() == [4, 4]
    assert pool.stamps(ids).dtype.kind == "i"


def test_many_ticks_keep_distinct_stamps():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    seen = set()
    for _ in range(1000):
        pool.touch([a])
        seen.add(pool.stamp_of(a))
    assert len(seen) == 1000
    assert pool.clock == 1001


# --- sequence block tables ------------------------------------------------------------------------


def test_grow_table_allocates_until_the_tokens_are_covered():
    pool = BlockPool(8)
    seq = Sequence(list(range(40)))
    ids = pool.grow_table(seq, 40, 16)
    np.testing.assert_array_equal(ids, [0, 1, 2])
    np.testing.assert_array_equal(seq.block_table, [0, 1, 2])
    assert pool.grow_table(seq, 48, 16).shape == (0,)
    np.testing.assert_array_equal(pool.grow_table(seq, 49, 16), [3])
    np.testing.assert_array_equal(seq.block_table, [0, 1, 2, 3])
    assert pool.grow_table(seq, 10, 16).shape == (0,)  # never shrinks
    assert seq.num_blocks == 4
    pool.check_invariants(expected_from(pool, {0: 1, 1: 1, 2: 1, 3: 1}))


def test_grow_table_out_of_blocks_takes_nothing():
    pool = BlockPool(2)
    seq = Sequence(list(range(40)))
    pool.grow_table(seq, 16, 16)
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError):
        pool.grow_table(seq, 64, 16)
    assert_unchanged(pool, before)
    np.testing.assert_array_equal(seq.block_table, [0])


def test_release_table_frees_unshared_blocks_and_empties_the_table():
    pool = BlockPool(8)
    seq = Sequence(list(range(48)))
    ids = pool.grow_table(seq, 48, 16)
    pool.ref(ids[:1])  # another holder (say the trie) keeps block 0
    freed = pool.release_table(seq)
    np.testing.assert_array_equal(np.sort(freed), ids[1:])
    assert seq.num_blocks == 0
    assert pool.num_free == 7
    pool.check_invariants(expected_from(pool, {int(ids[0]): 1}))


def test_release_of_an_empty_table_is_a_no_op():
    pool = BlockPool(2)
    seq = Sequence([1])
    before = snapshot(pool)
    assert pool.release_table(seq).shape == (0,)
    assert_unchanged(pool, before)


def test_release_table_error_leaves_the_pool_and_the_table_unchanged():
    pool = BlockPool(4)
    seq = Sequence(list(range(32)))
    ids = pool.grow_table(seq, 32, 16)
    pool.unref(ids[1:])  # a bug elsewhere dropped the table's reference on block 1
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.release_table(seq)
    assert_unchanged(pool, before)
    np.testing.assert_array_equal(seq.block_table, ids)


def test_two_sequences_sharing_blocks():
    pool = BlockPool(8)
    first, second = Sequence(list(range(32))), Sequence(list(range(48)))
    shared = pool.grow_table(first, 32, 16)
    pool.ref(shared)
    second.write_blocks(0, shared)
    pool.grow_table(second, 48, 16)
    pool.check_invariants(expected_from(pool, {0: 2, 1: 2, 2: 1}))
    assert pool.release_table(first).shape == (0,)
    np.testing.assert_array_equal(np.sort(pool.release_table(second)), [0, 1, 2])
    pool.check_invariants(np.zeros(8, dtype=np.int32))


# --- check_invariants -------------------------------------------------------------------------------


def test_check_invariants_detects_a_refcount_that_differs_from_its_owners():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.check_invariants(expected_from(pool, {0: 1, 1: 1}))
    with pytest.raises(AssertionError, match="refcount differs"):
        pool.check_invariants(expected_from(pool, {0: 1, 1: 2}))
    with pytest.raises(AssertionError):
        pool.check_invariants(expected_from(pool, {0: 1}))


def test_check_invariants_detects_a_leaked_block():
    pool = BlockPool(4)
    pool.allocate(1)
    pool._refcount[0] = 0  # block 0 is unowned but not on the free list
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_invariants()


def test_check_invariants_detects_a_referenced_block_on_the_free_list():
    pool = BlockPool(4)
    pool._refcount[3] = 1
    with pytest.raises(AssertionError, match="free block has references"):
        pool.check_invariants()


def test_check_invariants_detects_a_stamp_from_the_future():
    pool = BlockPool(4)
    pool._stamp[2] = pool.clock + 1
    with pytest.raises(AssertionError, match="future"):
        pool.check_invariants()


# --- stateful model test ------------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/ref/unref/touch plus bad calls against a dict-of-refcounts model.

    The model also tracks the free stack (top = end of the list) and the logical clock, so the
    exact ids handed out and every stamp are checked, not just the counts.
    """

    @initialize(num_blocks=st.integers(0, 8))
    def setup(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.refs: dict[int, int] = {}
        self.free_stack = list(range(num_blocks - 1, -1, -1))
        self.clock = 0
        self.stamp = dict.fromkeys(range(num_blocks), 0)

    # model helpers

    def _expected(self) -> np.ndarray:
        expected = np.zeros(self.pool.num_blocks, dtype=np.int32)
        for block, count in self.refs.items():
            expected[block] = count
        return expected

    def _tick(self, blocks) -> None:
        self.clock += 1
        for block in blocks:
            self.stamp[block] = self.clock

    def _expect_failure(self, error, call) -> None:
        before = snapshot(self.pool)
        with pytest.raises(error):
            call()
        assert_unchanged(self.pool, before)

    def _held_multiset(self, data, within_refcount: bool) -> list[int]:
        held = sorted(self.refs)
        picks = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=6))
        if within_refcount:
            counts: dict[int, int] = {}
            kept = []
            for block in picks:
                if counts.get(block, 0) < self.refs[block]:
                    counts[block] = counts.get(block, 0) + 1
                    kept.append(block)
            return kept
        return picks

    # good calls

    @rule(count=st.integers(0, 4))
    def allocate(self, count):
        if count > len(self.free_stack):
            self._expect_failure(OutOfBlocksError, lambda: self.pool.allocate(count))
            return
        ids = self.pool.allocate(count)
        expected = [self.free_stack.pop() for _ in range(count)]
        assert ids.tolist() == expected
        for block in expected:
            self.refs[block] = 1
        self._tick(expected)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def ref(self, data):
        blocks = self._held_multiset(data, within_refcount=False)
        self.pool.ref(blocks)
        for block in blocks:
            self.refs[block] += 1
        self._tick(blocks)

    @precondition(lambda self: self.refs)
    @rule(data=st.data(), shuffle=st.randoms())
    def unref(self, data, shuffle):
        blocks = self._held_multiset(data, within_refcount=True)
        shuffle.shuffle(blocks)
        freed = self.pool.unref(blocks)
        for block in blocks:
            self.refs[block] -= 1
        expected_freed = sorted(b for b in set(blocks) if self.refs[b] == 0)
        assert sorted(freed.tolist()) == expected_freed
        for block in expected_freed:
            del self.refs[block]
        # freed ids are pushed so that the smallest comes out first
        self.free_stack.extend(reversed(expected_freed))
        self._tick(set(blocks))

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def touch(self, data):
        blocks = self._held_multiset(data, within_refcount=False)
        self.pool.touch(blocks)
        self._tick(blocks)

    # bad calls

    @precondition(lambda self: self.free_stack and self.pool.num_blocks)
    @rule(data=st.data())
    def ref_or_unref_a_free_block(self, data):
        free_block = data.draw(st.sampled_from(self.free_stack))
        extra = sorted(self.refs)[:1]
        op = data.draw(st.sampled_from(["ref", "unref"]))
        self._expect_failure(DoubleFreeError, lambda: getattr(self.pool, op)(extra + [free_block]))

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def drop_more_references_than_held(self, data):
        block = data.draw(st.sampled_from(sorted(self.refs)))
        self._expect_failure(RefcountUnderflowError, lambda: self.pool.unref([block] * (self.refs[block] + 1)))

    @rule(data=st.data())
    def out_of_range_ids(self, data):
        bad = data.draw(st.one_of(st.integers(-5, -1), st.integers(self.pool.num_blocks, self.pool.num_blocks + 5)))
        op = data.draw(st.sampled_from(["ref", "unref", "touch"]))
        self._expect_failure(InvalidBlockIdError, lambda: getattr(self.pool, op)([bad]))

    @rule(op=st.sampled_from(["ref", "unref", "touch"]))
    def float_ids(self, op):
        self._expect_failure(InvalidTypeError, lambda: getattr(self.pool, op)([0.0]))

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants(self._expected())
        assert self.pool.num_free == len(self.free_stack)
        assert self.pool._free[: self.pool.num_free].tolist() == self.free_stack
        assert self.pool.clock == self.clock
        every = np.arange(self.pool.num_blocks)
        assert self.pool.stamps(every).tolist() == [self.stamp[b] for b in range(self.pool.num_blocks)]


BlockPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPoolStateful = BlockPoolMachine.TestCase


# --- scalar fast paths ---------------------------------------------------------------------------


class ArrayPathPool(BlockPool):
    """The same pool with every single-id fast path routed to the general array path."""

    def _single_id(self, block_ids: object) -> None:
        return None

    def _allocate_one(self) -> np.ndarray:
        return self._allocate_run(1)


def _one_id_forms(rng: np.random.Generator, block_id: int) -> object:
    """One id spelled the ways callers spell it (fast path) or as an array (general path)."""
    forms = (block_id, np.int64(block_id), np.int32(block_id), [block_id], (block_id,), np.array([block_id]))
    return forms[int(rng.integers(len(forms)))]


def _random_call(rng: np.random.Generator, num_blocks: int) -> tuple[str, tuple, dict]:
    """One mutating call, often on one id, sometimes invalid (freed, out of range, several ids)."""
    kind = int(rng.integers(6))
    if kind == 0:
        return "allocate", (int(rng.integers(0, 4)),), {}
    if kind in (1, 2):  # one id, in or out of range
        block_id = int(rng.integers(-2, num_blocks + 2))
        return ("ref" if kind == 1 else "unref"), (_one_id_forms(rng, block_id),), {}
    if kind == 3:
        return "unref", (_one_id_forms(rng, int(rng.integers(num_blocks))),), {"unique": bool(rng.integers(2))}
    ids = rng.integers(0, num_blocks, size=int(rng.integers(0, 4))).tolist()
    return ("ref" if kind == 4 else "unref"), (ids,), {}


def _outcome(pool: BlockPool, name: str, args: tuple, kwargs: dict) -> tuple:
    try:
        value = getattr(pool, name)(*args, **kwargs)
    except HybridCacheError as error:
        return ("raised", type(error))
    return ("returned", None if value is None else (value.dtype, value.tolist()))


@pytest.mark.parametrize("seed", range(20))
def test_scalar_and_array_paths_leave_identical_pools(seed):
    rng = np.random.default_rng(seed)
    fast, general = BlockPool(12), ArrayPathPool(12)
    for _ in range(300):
        name, args, kwargs = _random_call(rng, fast.num_blocks)
        assert _outcome(fast, name, args, kwargs) == _outcome(general, name, args, kwargs), (name, args, kwargs)
        fast.check_invariants()
        general.check_invariants()
        mine, theirs = snapshot(fast), snapshot(general)
        for key, value in mine.items():
            assert np.array_equal(value, theirs[key]), (key, name, args)


def test_single_id_fast_path_raises_the_array_paths_errors():
    pool = BlockPool(4)
    with pytest.raises(DoubleFreeError):
        pool.unref(2)
    with pytest.raises(DoubleFreeError):
        pool.ref([1])
    with pytest.raises(InvalidBlockIdError):
        pool.unref([4])
    with pytest.raises(InvalidTypeError):
        pool.unref(True)
    (block,) = pool.allocate(1).tolist()
    assert pool.unref((block,)).tolist() == [block] and pool.num_free == 4
    pool.check_invariants()



@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 3), min_size=1, max_size=6), freed=st.integers(0, 3))
def test_allocate_stamped_hands_out_what_consecutive_allocates_would(counts, freed):
    """Deferred allocations (ticks taken in their turn), then blocks freed after them: one
    ``allocate_stamped`` beneath the freed ones ends exactly as the calls one by one."""
    one_by_one, batched = BlockPool(24), BlockPool(24)
    for pool in (one_by_one, batched):
        pool.allocate(3)  # held elsewhere, freed after the deferred allocations
    taken = [one_by_one.allocate(count) if count else np.empty(0, np.int32) for count in counts]
    stamps = [batched.tick() if count else 0 for count in counts]
    for pool in (one_by_one, batched):
        pool.unref(np.arange(freed, dtype=np.int32), unique=True)
    ids = batched.allocate_stamped(np.repeat(np.array(stamps, dtype=np.int64), counts), beneath=freed)
    assert ids.tolist() == np.concatenate(taken).tolist()
    every = np.arange(24)
    assert batched.stamps(every).tolist() == one_by_one.stamps(every).tolist()
    assert batched.refcounts(every).tolist() == one_by_one.refcounts(every).tolist()
    assert batched.clock == one_by_one.clock
    assert batched.allocate(batched.num_free).tolist() == one_by_one.allocate(one_by_one.num_free).tolist()
    batched.check_invariants()


def test_allocate_stamped_refuses_what_it_cannot_give_and_changes_nothing():
    pool = BlockPool(4)
    tick = pool.tick()
    with pytest.raises(OutOfBlocksError):
        pool.allocate_stamped(np.full(5, tick))
    with pytest.raises(OutOfBlocksError):
        pool.allocate_stamped(np.full(2, tick), beneath=3)
    with pytest.raises(InvalidArgumentError):
        pool.allocate_stamped(np.array([tick + 1]))  # a tick the clock has not handed out
    assert pool.num_free == 4 and pool.clock == tick
    pool.check_invariants()


@pytest.mark.parametrize(
    "call",
    [
        lambda pool, tick: pool.allocate_stamped([tick, tick]),  # a list is taken as an array: fine
        lambda pool, tick: pool.allocate_stamped(np.array([1.0])),
        lambda pool, tick: pool.allocate_stamped(np.full((1, 1), tick)),
        lambda pool, tick: pool.allocate_stamped(np.array([tick]), beneath=0.5),
        lambda pool, tick: pool.allocate_stamped(np.array([tick]), beneath=-1),
        lambda pool, tick: pool.tick_many(2.5),
        lambda pool, tick: pool.tick_many("3"),
        lambda pool, tick: pool.tick_many(True),
        lambda pool, tick: pool.tick_many(-1),
    ],
)
def test_batch_calls_refuse_malformed_arguments_with_our_errors_and_change_nothing(call):
    pool = BlockPool(4)
    tick = pool.tick()
    try:
        call(pool, tick)
    except HybridCacheError as error:
        assert isinstance(error, (InvalidTypeError, InvalidArgumentError))
        assert pool.num_free == 4 and pool.clock == tick
    else:  # only the well-formed list is accepted
        assert pool.num_free == 2 and pool.clock == tick
    assert isinstance(pool.clock, int)
    pool.check_invariants()
