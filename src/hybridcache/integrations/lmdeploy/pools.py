"""Pool facades: lmdeploy's ``LogicalAllocator`` and ``StateManager`` as hybridcache pools.

Owns: the recency stamps of lmdeploy's blocks and their logical clock (lmdeploy's own access
times have one clock-second resolution in ties; the facade writes none of them, as nothing but
lmdeploy's replaced trie reads them), and the set of state rows the trie holds as
checkpoints. The block ids, their reference counts and the state rows stay lmdeploy's: every
reference the trie takes or drops is one ``add_ref_count`` or ``free`` on lmdeploy's
allocator, so lmdeploy's ``get_ref_count`` shows one reference per block per holder.
"""

from __future__ import annotations

import numpy as np

from hybridcache.errors import (
    DoubleFreeError,
    InvalidBlockIdError,
    InvalidTypeError,
    OutOfBlocksError,
    OutOfStateSlotsError,
    RefcountUnderflowError,
    WrongRoleError,
)
from hybridcache.memory.state_pool import SlotRole
from hybridcache.sequence import Sequence

_NO_IDS = np.empty(0, dtype=np.int32)


class AllocatorBlocks:
    """``KVBlockAllocator`` over an lmdeploy ``LogicalAllocator`` (GPU blocks)."""

    def __init__(self, allocator: object) -> None:
        self.allocator = allocator
        self.num_blocks = int(np.asarray(allocator.get_ref_count(slice(None))).size)
        self._stamp = np.zeros(self.num_blocks, dtype=np.int64)
        self._clock = 0

    @property
    def num_free(self) -> int:
        return int(self.allocator.get_num_free_blocks())

    def refcounts(self, block_ids: object) -> np.ndarray:
        ids = self._validated(block_ids)
        return np.asarray(self.allocator.get_ref_count(ids)).astype(np.int64)

    def refcount_of(self, block_id: int) -> int:
        return int(self.allocator.get_ref_count(int(block_id)))

    def stamp_of(self, block_id: int) -> int:
        return int(self._stamp[block_id])

    def stamp_now(self, block_id: int) -> None:
        self._stamp[block_id] = self.tick()

    def raise_stamp(self, block_id: int, stamp: int) -> None:
        if stamp > self._stamp[block_id]:
            self._stamp[block_id] = stamp

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def allocate(self, count: int) -> np.ndarray:
        if count > self.num_free:
            raise OutOfBlocksError(f"need {count} blocks, {self.num_free} free")
        try:
            ids = np.asarray(self.allocator.allocate(int(count), "gpu"))
        except MemoryError as error:  # no free physical GPU block behind the logical ones
            raise OutOfBlocksError(str(error)) from None
        ids = ids.astype(np.int32)
        self._stamp[ids] = self.tick()
        return ids

    def ref(self, block_ids: object, *, unique: bool = False) -> None:
        ids, held = self._with_refcounts(block_ids)
        if ids.size == 0:
            return
        # lmdeploy's counts are never negative (check_invariants), so "no count is zero" is
        # "every block is in use": count_nonzero is one C pass, a min reduction is ~3x that
        if np.count_nonzero(held) != ids.size:
            raise DoubleFreeError("cannot reference a free block")
        self.allocator.add_ref_count(ids, 1)
        # No lmdeploy access-time write: only lmdeploy's own trie reads those times (its LRU),
        # and this trie evicts by the stamps below; lmdeploy's allocate and free keep theirs.
        self._stamp[ids] = self.tick()

    def unref(self, block_ids: object, *, unique: bool = False) -> np.ndarray:
        ids = self._validated(block_ids)
        if ids.size == 0:
            return _NO_IDS
        # distinct ids in the caller's order: lmdeploy's free list reuses freed blocks in the
        # order they are freed, so the same evictions hand out the same ids as lmdeploy's trie
        distinct, first, counts = np.unique(ids, return_index=True, return_counts=True)
        order = np.argsort(first, kind="stable")
        distinct, counts = distinct[order], counts[order]
        held = np.asarray(self.allocator.get_ref_count(distinct))
        if np.any(held < counts):
            raise (DoubleFreeError("block freed twice") if np.any(held == 0) else RefcountUnderflowError("more references dropped than held"))
        extra = counts - 1
        if extra.any():  # lmdeploy's free drops one reference per distinct id
            self.allocator.add_ref_count(distinct, -extra)
        self.allocator.free(distinct)
        self._stamp[distinct] = self.tick()
        return distinct[held == counts].astype(np.int32)

    def grow_table(self, seq: Sequence, num_tokens: int, block_size: int) -> np.ndarray:
        needed = -(-num_tokens // block_size) - seq.num_blocks
        if needed <= 0:
            return _NO_IDS
        ids = self.allocate(needed)
        seq.write_blocks(seq.num_blocks, ids)
        return ids

    def _with_refcounts(self, block_ids: object) -> tuple[np.ndarray, np.ndarray]:
        """The ids (flat, intp) and lmdeploy's reference counts of them. One gather checks
        both ends of the range: a negative id, read as unsigned, lies beyond every block."""
        ids = np.asarray(block_ids)
        dtype = ids.dtype
        if dtype == np.int32:  # the trie's ids; as uint32 a negative one is >= 2**31 > num_blocks
            ids = ids.reshape(-1).view(np.uint32).astype(np.intp)
        elif dtype.kind not in "iu":
            raise InvalidTypeError(f"block ids must be integers, got {ids.dtype}")
        else:
            if dtype.kind == "i" and ids.size and int(ids.min()) < 0:
                raise InvalidBlockIdError(f"block id outside [0, {self.num_blocks})")
            ids = ids.reshape(-1).astype(np.intp, copy=False)
        try:
            held = np.asarray(self.allocator.get_ref_count(ids))
        except IndexError:
            raise InvalidBlockIdError(f"block id outside [0, {self.num_blocks})") from None
        return ids, held

    def _validated(self, block_ids: object) -> np.ndarray:
        ids = np.asarray(block_ids)
        if ids.size == 0:
            return ids.reshape(-1).astype(np.int64)
        if ids.dtype.kind not in "iu":
            raise InvalidTypeError(f"block ids must be integers, got {ids.dtype}")
        ids = ids.reshape(-1).astype(np.intp, copy=False)  # NumPy indexes by intp: widened once, not per use
        if int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks:
            raise InvalidBlockIdError(f"block id outside [0, {self.num_blocks})")
        return ids

    def check_invariants(self, expected_refcounts: np.ndarray | None = None) -> None:
        """lmdeploy's counts equal the holders the caller knows (trie, shadows, frozen blocks)."""
        counts = np.asarray(self.allocator.get_ref_count(slice(None)))
        assert np.all(counts >= 0), "negative refcount"
        assert np.all(self._stamp <= self._clock), "stamp from the future"
        if expected_refcounts is not None:
            mismatch = np.flatnonzero(counts != expected_refcounts)
            assert mismatch.size == 0, (
                f"lmdeploy refcount differs from its holders at blocks {mismatch[:8].tolist()}: "
                f"{counts[mismatch[:8]].tolist()} != {np.asarray(expected_refcounts)[mismatch[:8]].tolist()}"
            )


class StateManagerSlots:
    """``StateSlotAllocator`` over an lmdeploy ``StateManager``; the checkpoint rows it
    hands out are the only ones it knows the role of (runtime rows are lmdeploy's)."""

    def __init__(self, state_manager: object) -> None:
        self.state_manager = state_manager
        self.num_reserved = int(getattr(state_manager, "num_reserved", 0))
        self._checkpoints: set[int] = set()

    @property
    def num_free(self) -> int:
        return int(self.state_manager.get_num_free())

    @property
    def num_free_runtime(self) -> int:
        return int(self.state_manager.get_num_free_runtime())

    @property
    def num_free_checkpoint(self) -> int:
        return int(self.state_manager.get_num_free_checkpoint())

    @property
    def num_runtime(self) -> int:
        return int(self.state_manager.get_num_runtime_states())

    @property
    def num_checkpoint(self) -> int:
        return int(self.state_manager.get_num_allocated_checkpoint_states())

    def role_of(self, slot: int) -> SlotRole:
        if slot in self._checkpoints:
            return SlotRole.CHECKPOINT
        return SlotRole.RESERVED if slot < self.num_reserved else SlotRole.RUNTIME

    def allocate_runtime(self) -> int:
        if self.num_free_runtime <= 0:
            raise OutOfStateSlotsError("no runtime state row free")
        return int(self.state_manager.allocate_state())

    def allocate_checkpoint(self) -> int:
        if self.num_free_checkpoint <= 0:
            raise OutOfStateSlotsError("no free state row for a checkpoint")
        slot = int(self.state_manager.allocate_checkpoint_state())
        self._checkpoints.add(slot)
        return slot

    def free_runtime(self, slot: int) -> None:
        if slot in self._checkpoints:
            raise WrongRoleError(f"slot {slot} holds a checkpoint")
        self.state_manager.free_state(int(slot))

    def free_checkpoint(self, slot: int) -> None:
        if slot not in self._checkpoints:
            raise WrongRoleError(f"slot {slot} is not a checkpoint of this trie")
        self._checkpoints.discard(slot)
        self.state_manager.free_checkpoint_state(int(slot))

    def check_invariants(self) -> None:
        assert len(self._checkpoints) <= self.num_checkpoint, "a checkpoint row was freed behind the trie's back"
