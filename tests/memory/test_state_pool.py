"""StatePool: reserved row 0, runtime and checkpoint roles sharing one LIFO free list."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridcache.errors import (
    DoubleFreeError,
    HybridCacheError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTypeError,
    OutOfStateSlotsError,
    WrongRoleError,
)
from hybridcache.memory import SlotRole, StatePool

# --- helpers -------------------------------------------------------------------------------------


def snapshot(pool: StatePool) -> dict:
    """Everything a failed call must leave untouched."""
    return {
        "roles": [pool.role_of(slot) for slot in range(pool.num_slots)],
        # The free-list order decides which slot the next allocation returns (LIFO).
        "free_list": list(pool._free),
        "num_free": pool.num_free,
        "num_free_runtime": pool.num_free_runtime,
        "num_free_checkpoint": pool.num_free_checkpoint,
        "num_runtime": pool.num_runtime,
        "num_checkpoint": pool.num_checkpoint,
    }


def assert_unchanged(pool: StatePool, before: dict) -> None:
    assert snapshot(pool) == before
    pool.check_invariants()


# --- construction ---------------------------------------------------------------------------------


def test_new_pool_state():
    pool = StatePool(6, checkpoint_budget=3)
    assert pool.num_slots == 6
    assert pool.checkpoint_budget == 3
    assert pool.runtime_cap == 2
    assert pool.num_free == 5  # row 0 is reserved
    assert pool.num_free_checkpoint == 5
    assert pool.num_free_runtime == 2
    assert (pool.num_runtime, pool.num_checkpoint) == (0, 0)
    assert pool.role_of(0) is SlotRole.RESERVED
    assert all(pool.role_of(slot) is SlotRole.FREE for slot in range(1, 6))
    pool.check_invariants()


@pytest.mark.parametrize(
    ("slots", "budget"), [(0, 0), (-1, 0), (1.0, 0), (True, 0), ("3", 0), (3, -1), (3, True), (3, 1.0), (3, None)]
)
def test_constructor_rejects_bad_arguments(slots, budget):
    with pytest.raises(InvalidArgumentError):
        StatePool(slots, budget)


@pytest.mark.parametrize(("slots", "budget", "cap"), [(1, 0, 0), (2, 0, 1), (3, 0, 2), (6, 3, 2), (4, 3, 0), (2, 9, 0)])
def test_runtime_cap_is_total_minus_reserved_minus_budget(slots, budget, cap):
    pool = StatePool(slots, budget)
    assert pool.runtime_cap == cap
    assert pool.num_free_runtime == cap


def test_single_slot_pool_has_nothing_to_hand_out():
    pool = StatePool(1)
    before = snapshot(pool)
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_runtime()
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_checkpoint()
    assert_unchanged(pool, before)


# --- allocation -------------------------------------------------------------------------------------


def test_slot_zero_is_never_handed_out():
    pool = StatePool(3)
    assert pool.allocate_runtime() == 1
    assert pool.allocate_runtime() == 2
    before = snapshot(pool)
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_runtime()
    assert_unchanged(pool, before)


def test_out_of_state_slots_is_a_memory_error():
    pool = StatePool(2)
    pool.allocate_runtime()
    with pytest.raises(MemoryError):
        pool.allocate_runtime()
    assert pool.num_runtime == 1


def test_allocations_set_roles_and_counters():
    pool = StatePool(4)
    runtime = pool.allocate_runtime()
    checkpoint = pool.allocate_checkpoint()
    assert isinstance(runtime, int) and isinstance(checkpoint, int)
    assert pool.role_of(runtime) is SlotRole.RUNTIME
    assert pool.role_of(checkpoint) is SlotRole.CHECKPOINT
    assert (pool.num_runtime, pool.num_checkpoint, pool.num_free) == (1, 1, 1)
    pool.check_invariants()


def test_checkpoints_can_take_every_free_row():
    pool = StatePool(4, checkpoint_budget=1)
    assert [pool.allocate_checkpoint() for _ in range(3)] == [1, 2, 3]
    assert pool.num_free == 0
    assert pool.num_free_runtime == 0
    before = snapshot(pool)
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_checkpoint()
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_runtime()  # below its cap, but no row is free
    assert_unchanged(pool, before)


def test_freed_rows_come_back_lifo():
    pool = StatePool(6)
    a, b, c = pool.allocate_runtime(), pool.allocate_checkpoint(), pool.allocate_runtime()
    assert (a, b, c) == (1, 2, 3)
    pool.free_runtime(a)
    pool.free_runtime(c)
    assert pool.allocate_checkpoint() == c
    assert pool.allocate_runtime() == a
    assert pool.allocate_runtime() == 4  # then the never-used rows
    pool.check_invariants()


def test_runtime_cap_is_enforced_even_with_free_rows():
    pool = StatePool(6, checkpoint_budget=3)
    assert [pool.allocate_runtime(), pool.allocate_runtime()] == [1, 2]
    assert pool.num_free == 3
    assert pool.num_free_runtime == 0
    before = snapshot(pool)
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_runtime()
    assert_unchanged(pool, before)
    assert pool.allocate_checkpoint() == 3  # the budget is still there for checkpoints


def test_a_freed_runtime_row_restores_runtime_capacity():
    pool = StatePool(6, checkpoint_budget=3)
    first = pool.allocate_runtime()
    pool.allocate_runtime()
    pool.free_runtime(first)
    assert pool.num_free_runtime == 1
    assert pool.allocate_runtime() == first


def test_num_free_runtime_is_the_smaller_of_cap_headroom_and_free_rows():
    pool = StatePool(6, checkpoint_budget=3)  # cap 2, five free rows
    observed = [pool.num_free_runtime]
    for _ in range(5):
        pool.allocate_checkpoint()
        observed.append(pool.num_free_runtime)
    # free rows 5,4,3,2,1,0 against a headroom of 2
    assert observed == [2, 2, 2, 2, 1, 0]
    pool.check_invariants()


def test_num_free_runtime_with_runtime_and_checkpoints_mixed():
    pool = StatePool(5, checkpoint_budget=1)  # cap 3
    pool.allocate_runtime()
    assert pool.num_free_runtime == 2  # headroom 2, free 3
    pool.allocate_checkpoint()
    pool.allocate_checkpoint()
    assert pool.num_free == 1
    assert pool.num_free_runtime == 1  # headroom 2, free 1
    expected = max(0, min(pool.runtime_cap - pool.num_runtime, pool.num_free))
    assert pool.num_free_runtime == expected


def test_num_free_checkpoint_equals_num_free():
    pool = StatePool(5, checkpoint_budget=2)
    pool.allocate_runtime()
    pool.allocate_checkpoint()
    assert pool.num_free_checkpoint == pool.num_free == 2


# --- freeing -------------------------------------------------------------------------------------


def test_free_returns_rows_and_updates_counters():
    pool = StatePool(4)
    runtime, checkpoint = pool.allocate_runtime(), pool.allocate_checkpoint()
    pool.free_runtime(runtime)
    pool.free_checkpoint(checkpoint)
    assert pool.role_of(runtime) is SlotRole.FREE
    assert pool.role_of(checkpoint) is SlotRole.FREE
    assert (pool.num_runtime, pool.num_checkpoint, pool.num_free) == (0, 0, 3)
    pool.check_invariants()


def test_free_accepts_numpy_ints():
    pool = StatePool(3)
    slot = pool.allocate_runtime()
    pool.free_runtime(np.int64(slot))
    assert pool.num_free == 2
    assert pool.allocate_runtime() == slot
    pool.check_invariants()


def test_freeing_in_the_wrong_role_raises_and_changes_nothing():
    pool = StatePool(4)
    runtime, checkpoint = pool.allocate_runtime(), pool.allocate_checkpoint()
    before = snapshot(pool)
    with pytest.raises(WrongRoleError):
        pool.free_checkpoint(runtime)
    assert_unchanged(pool, before)
    with pytest.raises(WrongRoleError):
        pool.free_runtime(checkpoint)
    assert_unchanged(pool, before)


@pytest.mark.parametrize("role", ["runtime", "checkpoint"])
def test_double_free_raises_and_changes_nothing(role):
    pool = StatePool(4)
    slot = getattr(pool, f"allocate_{role}")()
    getattr(pool, f"free_{role}")(slot)
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError):
        getattr(pool, f"free_{role}")(slot)
    assert_unchanged(pool, before)


@pytest.mark.parametrize("method", ["free_runtime", "free_checkpoint"])
def test_freeing_a_never_allocated_slot_is_a_double_free(method):
    pool = StatePool(4)
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError):
        getattr(pool, method)(3)
    assert_unchanged(pool, before)


@pytest.mark.parametrize("method", ["free_runtime", "free_checkpoint"])
@pytest.mark.parametrize("slot", [0, -1, 4, 100])
def test_freeing_slot_zero_or_out_of_range_raises_and_changes_nothing(method, slot):
    pool = StatePool(4)
    pool.allocate_runtime()
    pool.allocate_checkpoint()
    before = snapshot(pool)
    with pytest.raises(InvalidBlockIdError):
        getattr(pool, method)(slot)
    assert_unchanged(pool, before)


@pytest.mark.parametrize("method", ["free_runtime", "free_checkpoint", "role_of"])
@pytest.mark.parametrize("slot", [1.0, "1", None, True])
def test_non_int_slots_raise_and_change_nothing(method, slot):
    pool = StatePool(4)
    pool.allocate_runtime()
    before = snapshot(pool)
    with pytest.raises(HybridCacheError):
        getattr(pool, method)(slot)
    assert_unchanged(pool, before)


@pytest.mark.parametrize("slot", [-1, 4])
def test_role_of_out_of_range_raises(slot):
    pool = StatePool(4)
    with pytest.raises(InvalidBlockIdError):
        pool.role_of(slot)
    assert pool.num_free == 3


def test_error_families():
    pool = StatePool(3)
    slot = pool.allocate_runtime()
    with pytest.raises(RuntimeError):
        pool.free_checkpoint(slot)
    with pytest.raises(IndexError):
        pool.free_runtime(0)
    pool.free_runtime(slot)
    with pytest.raises(RuntimeError):
        pool.free_runtime(slot)
    pool.check_invariants()


# --- check_invariants -------------------------------------------------------------------------------


def test_check_invariants_detects_a_lost_reservation():
    pool = StatePool(3)
    pool._role[0] = SlotRole.FREE
    with pytest.raises(AssertionError, match="reservation"):
        pool.check_invariants()


def test_check_invariants_detects_a_leaked_slot():
    pool = StatePool(3)
    pool._free.pop()
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_invariants()


def test_check_invariants_detects_a_used_slot_on_the_free_list():
    pool = StatePool(3)
    slot = pool.allocate_runtime()
    pool._free.append(slot)
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_check_invariants_detects_a_miscounted_role():
    pool = StatePool(3)
    pool.allocate_checkpoint()
    pool._num_checkpoint = 0
    with pytest.raises(AssertionError):
        pool.check_invariants()


# --- stateful model test ------------------------------------------------------------------------


class StatePoolMachine(RuleBasedStateMachine):
    """Random allocations and frees, good and bad, against a model of roles and the free stack."""

    @initialize(num_slots=st.integers(1, 7), budget=st.integers(0, 7))
    def setup(self, num_slots, budget):
        self.pool = StatePool(num_slots, budget)
        self.cap = max(0, num_slots - 1 - budget)
        self.roles = {slot: SlotRole.FREE for slot in range(1, num_slots)}
        self.free_stack = list(range(num_slots - 1, 0, -1))

    def _held(self, role: SlotRole) -> list[int]:
        return sorted(slot for slot, r in self.roles.items() if r == role)

    def _expect_failure(self, error, call) -> None:
        before = snapshot(self.pool)
        with pytest.raises(error):
            call()
        assert_unchanged(self.pool, before)

    @rule()
    def allocate_runtime(self):
        if len(self._held(SlotRole.RUNTIME)) >= self.cap or not self.free_stack:
            self._expect_failure(OutOfStateSlotsError, self.pool.allocate_runtime)
            return
        slot = self.pool.allocate_runtime()
        assert slot == self.free_stack.pop()
        self.roles[slot] = SlotRole.RUNTIME

    @rule()
    def allocate_checkpoint(self):
        if not self.free_stack:
            self._expect_failure(OutOfStateSlotsError, self.pool.allocate_checkpoint)
            return
        slot = self.pool.allocate_checkpoint()
        assert slot == self.free_stack.pop()
        self.roles[slot] = SlotRole.CHECKPOINT

    @precondition(lambda self: any(r != SlotRole.FREE for r in self.roles.values()))
    @rule(data=st.data())
    def free_in_its_role(self, data):
        slot = data.draw(st.sampled_from(sorted(s for s, r in self.roles.items() if r != SlotRole.FREE)))
        if self.roles[slot] == SlotRole.RUNTIME:
            self.pool.free_runtime(slot)
        else:
            self.pool.free_checkpoint(slot)
        self.roles[slot] = SlotRole.FREE
        self.free_stack.append(slot)

    @precondition(lambda self: any(r != SlotRole.FREE for r in self.roles.values()))
    @rule(data=st.data())
    def free_in_the_wrong_role(self, data):
        slot = data.draw(st.sampled_from(sorted(s for s, r in self.roles.items() if r != SlotRole.FREE)))
        wrong = self.pool.free_checkpoint if self.roles[slot] == SlotRole.RUNTIME else self.pool.free_runtime
        self._expect_failure(WrongRoleError, lambda: wrong(slot))

    @precondition(lambda self: self.free_stack)
    @rule(data=st.data(), as_runtime=st.booleans())
    def free_a_free_slot(self, data, as_runtime):
        slot = data.draw(st.sampled_from(self.free_stack))
        free = self.pool.free_runtime if as_runtime else self.pool.free_checkpoint
        self._expect_failure(DoubleFreeError, lambda: free(slot))

    @rule(data=st.data(), as_runtime=st.booleans())
    def free_an_invalid_slot(self, data, as_runtime):
        slot = data.draw(st.sampled_from([0, -1, self.pool.num_slots, self.pool.num_slots + 3]))
        free = self.pool.free_runtime if as_runtime else self.pool.free_checkpoint
        self._expect_failure(InvalidBlockIdError, lambda: free(slot))

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        runtime, checkpoint = len(self._held(SlotRole.RUNTIME)), len(self._held(SlotRole.CHECKPOINT))
        assert self.pool._free == self.free_stack
        assert (self.pool.num_runtime, self.pool.num_checkpoint) == (runtime, checkpoint)
        assert self.pool.num_free == len(self.free_stack)
        assert self.pool.num_free_runtime == max(0, min(self.cap - runtime, len(self.free_stack)))
        assert self.pool.role_of(0) is SlotRole.RESERVED
        assert all(self.pool.role_of(slot) == role for slot, role in self.roles.items())


StatePoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestStatePoolStateful = StatePoolMachine.TestCase


@settings(max_examples=60, deadline=None)
@given(count=st.integers(0, 4), freed=st.integers(0, 3))
def test_allocate_runtimes_hands_out_what_consecutive_allocations_would(count, freed):
    """Runtime slots for ``count`` deferred admissions, then checkpoint slots freed after
    them: one ``allocate_runtimes`` beneath the freed ones ends as the calls one by one."""
    one_by_one, batched = StatePool(12, checkpoint_budget=3), StatePool(12, checkpoint_budget=3)
    held = [[pool.allocate_checkpoint() for _ in range(3)] for pool in (one_by_one, batched)]
    slots = [one_by_one.allocate_runtime() for _ in range(count)]
    for pool, checkpoints in zip((one_by_one, batched), held):
        for slot in checkpoints[:freed]:
            pool.free_checkpoint(slot)
    assert batched.allocate_runtimes(count, beneath=freed) == slots
    assert [batched.role_of(s) for s in range(12)] == [one_by_one.role_of(s) for s in range(12)]
    assert batched.num_runtime == one_by_one.num_runtime
    assert [batched.allocate_checkpoint() for _ in range(batched.num_free)] == [
        one_by_one.allocate_checkpoint() for _ in range(one_by_one.num_free)
    ]
    batched.check_invariants()


def test_allocate_runtimes_refuses_beyond_the_runtime_cap_and_changes_nothing():
    pool = StatePool(6, checkpoint_budget=2)  # runtime cap 3
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_runtimes(4)
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate_runtimes(1, beneath=5)
    assert pool.num_runtime == 0 and pool.num_free == 5
    pool.check_invariants()


@pytest.mark.parametrize("count, beneath", [(-1, 0), (1.5, 0), ("2", 0), (True, 0), (1, -1), (1, 0.5)])
def test_allocate_runtimes_refuses_malformed_counts_with_our_errors_and_changes_nothing(count, beneath):
    pool = StatePool(6, checkpoint_budget=2)
    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        pool.allocate_runtimes(count, beneath=beneath)
    assert pool.num_runtime == 0 and pool.num_free == 5
    pool.check_invariants()
