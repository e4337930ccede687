"""Recurrent-state slot pool.

Owns: the state rows, the role of each row (reserved, free, runtime, checkpoint) and the free
list. Row 0 is reserved (padding target for engines) and never handed out. Runtime rows are
capped at ``total - 1 - checkpoint_budget`` so the checkpoint budget is never eaten by running
sequences; checkpoints may borrow any free row, including idle runtime capacity.
"""

from __future__ import annotations

import enum

import numpy as np

from hybridcache.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTypeError,
    OutOfStateSlotsError,
    WrongRoleError,
)
from hybridcache.types import as_int


class SlotRole(enum.IntEnum):
    RESERVED = -1
    FREE = 0
    RUNTIME = 1
    CHECKPOINT = 2


class StatePool:
    """State slots with two roles sharing one LIFO free list."""

    def __init__(self, num_slots: int, checkpoint_budget: int = 0) -> None:
        for name, value, minimum in (("num_slots", num_slots, 1), ("checkpoint_budget", checkpoint_budget, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
        self.num_slots = num_slots
        self.checkpoint_budget = checkpoint_budget
        self.runtime_cap = max(0, num_slots - 1 - checkpoint_budget)
        self._role = np.zeros(num_slots, dtype=np.int8)
        self._role[0] = SlotRole.RESERVED
        self._free: list[int] = list(range(num_slots - 1, 0, -1))
        self._num_runtime = 0
        self._num_checkpoint = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_free_runtime(self) -> int:
        return max(0, min(self.runtime_cap - self._num_runtime, len(self._free)))

    @property
    def num_free_checkpoint(self) -> int:
        return len(self._free)

    @property
    def num_runtime(self) -> int:
        return self._num_runtime

    @property
    def num_checkpoint(self) -> int:
        return self._num_checkpoint

    def role_of(self, slot: int) -> SlotRole:
        self._check_range(slot)
        return SlotRole(int(self._role[slot]))

    def allocate_runtime(self) -> int:
        if self.num_free_runtime == 0:
            raise OutOfStateSlotsError(
                f"no runtime slot: {self._num_runtime}/{self.runtime_cap} used, {len(self._free)} free"
            )
        self._num_runtime += 1
        return self._take(SlotRole.RUNTIME)

    def allocate_runtimes(self, count: int, beneath: int = 0) -> list[int]:
        """``count`` runtime slots, the ones consecutive ``allocate_runtime`` calls would have
        handed out when the top ``beneath`` slots of the free list were freed after them
        (they stay on top): one batch of admissions at once."""
        count, beneath = as_int("count", count, 0), as_int("beneath", beneath, 0)
        free = self._free
        top = len(free) - beneath
        if top < count or count > self.runtime_cap - self._num_runtime:
            raise OutOfStateSlotsError(
                f"no {count} runtime slots: {self._num_runtime}/{self.runtime_cap} used, {top} free beneath {beneath}"
            )
        slots = free[top - count : top][::-1]
        del free[top - count : top]
        self._role[slots] = SlotRole.RUNTIME
        self._num_runtime += count
        return slots

    def allocate_checkpoint(self) -> int:
        if not self._free:
            raise OutOfStateSlotsError("no free state slot for a checkpoint")
        self._num_checkpoint += 1
        return self._take(SlotRole.CHECKPOINT)

    def free_runtime(self, slot: int) -> None:
        self._release(slot, SlotRole.RUNTIME)
        self._num_runtime -= 1

    def free_checkpoint(self, slot: int) -> None:
        self._release(slot, SlotRole.CHECKPOINT)
        self._num_checkpoint -= 1

    def _take(self, role: SlotRole) -> int:
        slot = self._free.pop()
        self._role[slot] = role
        return slot

    def _check_range(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise InvalidTypeError(f"slot must be an int, got {slot!r}")
        if not 0 <= slot < self.num_slots:
            raise InvalidBlockIdError(f"slot {slot} outside [0, {self.num_slots})")

    def _release(self, slot: int, role: SlotRole) -> None:
        self._check_range(slot)
        current = SlotRole(int(self._role[slot]))
        if current == SlotRole.RESERVED:
            raise InvalidBlockIdError("slot 0 is reserved")
        if current == SlotRole.FREE:
            raise DoubleFreeError(f"slot {slot} is already free")
        if current != role:
            raise WrongRoleError(f"slot {slot} holds a {current.name.lower()} state, not {role.name.lower()}")
        self._role[slot] = SlotRole.FREE
        self._free.append(int(slot))

    def check_invariants(self) -> None:
        roles = self._role
        assert roles[0] == SlotRole.RESERVED, "slot 0 lost its reservation"
        assert len(set(self._free)) == len(self._free), "free list holds a slot twice"
        assert 0 not in self._free, "reserved slot on the free list"
        assert all(roles[s] == SlotRole.FREE for s in self._free), "a used slot is on the free list"
        assert int(np.count_nonzero(roles == SlotRole.FREE)) == len(self._free), "a slot leaked"
        assert int(np.count_nonzero(roles == SlotRole.RUNTIME)) == self._num_runtime
        assert int(np.count_nonzero(roles == SlotRole.CHECKPOINT)) == self._num_checkpoint
        assert self._num_runtime <= self.runtime_cap, "runtime slots above their cap"
