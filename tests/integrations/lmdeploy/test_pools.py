"""The pool facades keep hybridcache's pool contract over lmdeploy's allocator and state
manager: lmdeploy's own counts change, refused calls change nothing."""

import numpy as np
import pytest
from lmdeploy.pytorch.paging.block_manager.base_block_manager import LogicalAllocator
from lmdeploy.pytorch.paging.state_manager import StateManager

from hybridcache.errors import (
    DoubleFreeError,
    InvalidBlockIdError,
    InvalidTypeError,
    OutOfBlocksError,
    OutOfStateSlotsError,
    RefcountUnderflowError,
    WrongRoleError,
)
from hybridcache.integrations.lmdeploy.pools import AllocatorBlocks, StateManagerSlots
from hybridcache.memory.protocols import KVBlockAllocator, StateSlotAllocator
from hybridcache.memory.state_pool import SlotRole


def test_block_references_are_lmdeploys_own_counts():
    allocator = LogicalAllocator(num_cpu_blocks=0, num_gpu_blocks=8)
    blocks = AllocatorBlocks(allocator)
    assert isinstance(blocks, KVBlockAllocator) and blocks.num_blocks == 8
    ids = blocks.allocate(3)
    blocks.ref(ids[:2])
    assert allocator.get_ref_count(ids).tolist() == [2, 2, 1]
    freed = blocks.unref([int(ids[2]), int(ids[0])])
    assert freed.tolist() == [int(ids[2])] and allocator.get_ref_count(ids).tolist() == [1, 2, 0]
    expected = np.zeros(8, dtype=np.int64)
    expected[ids] = [1, 2, 0]
    blocks.check_invariants(expected)


def test_a_reference_writes_no_lmdeploy_access_time_but_moves_the_tries_recency():
    allocator = LogicalAllocator(num_cpu_blocks=0, num_gpu_blocks=8)
    blocks = AllocatorBlocks(allocator)
    ids = blocks.allocate(2)
    allocator._log_mem.access_time[ids] = 0  # lmdeploy stamps wall-clock times at allocate
    before = blocks.stamp_of(int(ids[0]))
    blocks.ref(ids[:1])
    assert allocator.get_access_time(ids).tolist() == [0, 0]
    assert blocks.stamp_of(int(ids[0])) > before and allocator.get_ref_count(ids).tolist() == [2, 1]


def test_duplicates_free_once_and_in_the_callers_order():
    allocator = LogicalAllocator(num_cpu_blocks=0, num_gpu_blocks=8)
    blocks = AllocatorBlocks(allocator)
    ids = blocks.allocate(3)
    blocks.ref(ids)
    freed = blocks.unref(np.r_[ids[::-1], ids[::-1]])
    assert freed.tolist() == ids[::-1].tolist() and allocator.get_num_free_blocks() == 8
    assert blocks.allocate(3).tolist() == ids[::-1].tolist()  # lmdeploy reuses them in that order


def test_refused_block_calls_change_nothing():
    allocator = LogicalAllocator(num_cpu_blocks=0, num_gpu_blocks=4)
    blocks = AllocatorBlocks(allocator)
    ids = blocks.allocate(2)
    with pytest.raises(DoubleFreeError):
        blocks.ref([3])
    with pytest.raises(RefcountUnderflowError):
        blocks.unref([int(ids[0]), int(ids[0])])
    with pytest.raises(InvalidBlockIdError):
        blocks.unref([9])
    for bad in ([9], [-1], np.array([-1], dtype=np.int32), np.array([2**40], dtype=np.int64), np.array([1], dtype=np.int8) - 3):
        with pytest.raises(InvalidBlockIdError):  # one gather checks the range, a negative id included
            blocks.ref(bad)
    with pytest.raises(InvalidTypeError):
        blocks.ref(np.array([0.0]))
    with pytest.raises(OutOfBlocksError):
        blocks.allocate(3)
    assert allocator.get_ref_count(ids).tolist() == [1, 1] and allocator.get_num_free_blocks() == 2


def test_checkpoint_rows_come_from_lmdeploys_state_manager():
    manager = StateManager(num_states=4, num_reserved=1, num_runtime_states=2)
    slots = StateManagerSlots(manager)
    assert isinstance(slots, StateSlotAllocator)
    runtime = slots.allocate_runtime()
    checkpoint = slots.allocate_checkpoint()
    assert slots.role_of(checkpoint) is SlotRole.CHECKPOINT and slots.role_of(0) is SlotRole.RESERVED
    assert manager.get_num_allocated_checkpoint_states() == 1 and slots.num_free == 1
    with pytest.raises(WrongRoleError):
        slots.free_checkpoint(runtime)
    slots.allocate_checkpoint()
    with pytest.raises(OutOfStateSlotsError):
        slots.allocate_checkpoint()
    slots.free_checkpoint(checkpoint)
    slots.free_runtime(runtime)
    assert manager.get_num_free() == 2
