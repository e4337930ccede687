"""KV block pool.

Owns: the KV block ids, one reference count and one recency stamp per block, the free list
and the logical clock that produces the stamps. Every holder of a block (a sequence's own
block table entry, the trie's node, a frozen checkpoint) owns exactly one reference. A
sequence that borrows a cached path holds one pin on the path's deepest node instead of a
reference per block (see ``prefix_cache.kv_lifecycle``).

Stamps come from an integer logical clock that advances once per mutating call, so recency
has no resolution limit and ties only happen inside one call.
"""

from __future__ import annotations

import numpy as np

from hybridcache.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTypeError,
    LifecycleError,
    OutOfBlocksError,
    RefcountUnderflowError,
)
from hybridcache.sequence import Sequence
from hybridcache.types import as_int

BLOCK_DTYPE = np.int32


class BlockPool:
    """Reference-counted KV block ids with a LIFO free list."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refcount = np.zeros(num_blocks, dtype=np.int32)
        self._stamp = np.zeros(num_blocks, dtype=np.int64)
        # The free list is a stack; block 0 is handed out first on a new pool.
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=BLOCK_DTYPE)
        self._num_free = num_blocks
        self._clock = 0

    # --- queries -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def clock(self) -> int:
        """The logical time of the last mutating call."""
        return self._clock

    def refcounts(self, block_ids: object) -> np.ndarray:
        return self._refcount[self._validated(block_ids)[0]].copy()

    def stamps(self, block_ids: object) -> np.ndarray:
        return self._stamp[self._validated(block_ids)[0]].copy()

    def stamp_of(self, block_id: int) -> int:
        """Recency of one block (hot path of eviction: no validation beyond indexing)."""
        return int(self._stamp[block_id])

    def refcount_of(self, block_id: int) -> int:
        return int(self._refcount[block_id])

    # --- mutations -----------------------------------------------------------------------------

    def allocate(self, count: int) -> np.ndarray:
        """Take ``count`` free blocks, each with one reference, stamped now."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise InvalidArgumentError(f"count must be a non-negative int, got {count!r}")
        if count > self._num_free:
            raise OutOfBlocksError(f"need {count} blocks, {self._num_free} free")
        if count == 1:  # the common request (a frozen checkpoint block): scalar indexing
            return self._allocate_one()
        return self._allocate_run(count)

    def allocate_stamped(self, stamps: np.ndarray, beneath: int = 0) -> np.ndarray:
        """Take ``stamps.size`` free blocks, the one for entry k stamped ``stamps[k]``: the ids
        consecutive ``allocate`` calls would have handed out, when those calls' ticks were
        taken (``tick``) at the time each would have run and the top ``beneath`` ids of the
        free list were freed after them (they stay on top). One array operation for a batch
        of admissions; the clock does not move."""
        stamps = np.asarray(stamps)
        if stamps.ndim != 1 or (stamps.size and stamps.dtype.kind not in "iu"):
            raise InvalidTypeError(f"stamps must be a 1-D integer array, got {stamps.dtype} of shape {stamps.shape}")
        beneath = as_int("beneath", beneath, 0)
        count = int(stamps.size)
        top = self._num_free - beneath
        if top < count:
            raise OutOfBlocksError(f"need {count} blocks beneath {beneath}, {self._num_free} free")
        if count and (int(stamps.min()) <= 0 or int(stamps.max()) > self._clock):
            raise InvalidArgumentError("stamps must be ticks the clock already handed out")
        ids = self._free[top - count : top][::-1].copy()
        self._free[top - count : self._num_free - count] = self._free[top : self._num_free].copy()
        self._num_free -= count
        self._refcount[ids] = 1
        self._stamp[ids] = stamps
        return ids

    def ref(self, block_ids: object, *, unique: bool = False) -> None:
        """Add one reference per occurrence of each id; every id must already be in use.

        ``unique=True`` promises the ids are distinct and skips the duplicate count.
        """
        single = self._single_id(block_ids)
        if single is not None:
            self._ref_one(single)
            return
        ids, low, high = self._validated(block_ids)
        if ids.size == 0:
            return
        where = self._run_or_ids(ids, low, high) if unique else ids
        if int(self._refcount[where].min()) <= 0:
            raise DoubleFreeError("cannot reference a free block")
        if unique:
            self._refcount[where] += 1
        else:
            np.add.at(self._refcount, ids, 1)
        self._stamp[where] = self.tick()

    def unref(self, block_ids: object, *, unique: bool = False) -> np.ndarray:
        """Drop one reference per occurrence; blocks reaching zero return to the free list.

        Returns the ids that were freed. Dropping more references than a block holds raises
        and changes nothing.
        """
        single = self._single_id(block_ids)
        if single is not None:
            return self._unref_one(single)
        ids, low, high = self._validated(block_ids)
        if ids.size == 0:
            return ids.astype(BLOCK_DTYPE)
        if unique:
            distinct, counts = self._run_or_ids(ids, low, high), 1
        else:
            distinct, counts = np.unique(ids.astype(np.intp), return_counts=True)
        if np.any(self._refcount[distinct] < counts):
            if np.any(self._refcount[distinct] == 0):
                raise DoubleFreeError("block freed twice")
            raise RefcountUnderflowError("more references dropped than held")
        self._refcount[distinct] -= counts
        self._stamp[distinct] = self.tick()
        remaining = self._refcount[distinct]
        if int(remaining.min()) > 0:
            return np.empty(0, dtype=BLOCK_DTYPE)
        if isinstance(distinct, slice):
            freed = (np.flatnonzero(remaining == 0) + distinct.start).astype(BLOCK_DTYPE)
        else:
            freed = distinct[remaining == 0].astype(BLOCK_DTYPE)
        self._free[self._num_free : self._num_free + freed.size] = freed[::-1]
        self._num_free += freed.size
        return freed

    def stamp_now(self, block_id: int) -> None:
        """Stamp one block as used now (hot path: no validation beyond indexing)."""
        self._stamp[block_id] = self.tick()

    def raise_stamp(self, block_id: int, stamp: int) -> None:
        """Make one block at least as recent as ``stamp`` (recency a child hands to its parent)."""
        if stamp > self._stamp[block_id]:
            self._stamp[block_id] = stamp

    def touch(self, block_ids: object) -> None:
        """Stamp blocks as used now."""
        ids, _, _ = self._validated(block_ids)
        if ids.size:
            self._stamp[ids] = self.tick()

    # --- sequence block tables -------------------------------------------------------------

    def grow_table(self, seq: Sequence, num_tokens: int, block_size: int) -> np.ndarray:
        """Give ``seq`` fresh blocks until its table covers ``num_tokens`` tokens.

        Returns the new ids. Raises ``OutOfBlocksError`` (nothing taken) when short.
        """
        needed = -(-num_tokens // block_size) - seq.num_blocks
        if needed <= 0:
            return np.empty(0, dtype=BLOCK_DTYPE)
        ids = self.allocate(needed)
        seq.write_blocks(seq.num_blocks, ids)
        return ids

    def release_table(self, seq: Sequence) -> np.ndarray:
        """Drop the sequence's reference on every block of its table and empty the table.

        The table is emptied only after ``unref`` succeeded, so an error changes nothing. A
        sequence that borrows a cached path holds no reference on the borrowed entries: it is
        released by ``BlockTrie.free_sequence``, and refused here.
        """
        if seq.prefix_state.borrow.depth:
            raise LifecycleError("the sequence borrows a cached path: release it with BlockTrie.free_sequence")
        freed = self.unref(seq.block_table)
        seq.truncate_blocks(0)
        return freed

    def tick_many(self, count: int) -> int:
        """Advance the clock by ``count`` ticks (what ``count`` ``tick`` calls would hand out)
        and return the first of them."""
        count = as_int("count", count, 0)
        first = self._clock + 1
        self._clock += count
        return first

    def tick(self) -> int:
        """Advance the logical clock and return the new time (also used for recency stamps
        kept elsewhere, such as checkpoints, so they compare with block stamps)."""
        self._clock += 1
        return self._clock

    # --- internals -------------------------------------------------------------------------

    # One id is the common case of ``ref``/``unref``/``allocate`` outside a hit (a checkpoint's
    # frozen block, one swapped block). The array path pays several NumPy calls (asarray, min,
    # max, unique, fancy indexing) of about a microsecond each; scalar indexing pays none. The
    # scalar paths make the same changes and raise the same errors as the array path.

    def _single_id(self, block_ids: object) -> int | None:
        """The id when ``block_ids`` names one valid block as an int, a NumPy integer or a
        one-element list or tuple of those; None otherwise, so the array path decides
        (including every error: an id out of range is left to it)."""
        if type(block_ids) is list or type(block_ids) is tuple:
            if len(block_ids) != 1:
                return None
            block_ids = block_ids[0]
        if type(block_ids) is int or isinstance(block_ids, np.integer):
            block_id = int(block_ids)
            if 0 <= block_id < self.num_blocks:
                return block_id
        return None

    def _allocate_run(self, count: int) -> np.ndarray:
        ids = self._free[self._num_free - count : self._num_free][::-1].copy()
        self._num_free -= count
        self._refcount[ids] = 1
        self._stamp[ids] = self.tick()
        return ids

    def _allocate_one(self) -> np.ndarray:
        top = self._num_free - 1
        ids = self._free[top : top + 1].copy()
        self._num_free = top
        block_id = int(ids[0])
        self._refcount[block_id] = 1
        self._stamp[block_id] = self.tick()
        return ids

    def _ref_one(self, block_id: int) -> None:
        held = int(self._refcount[block_id])
        if held <= 0:
            raise DoubleFreeError("cannot reference a free block")
        self._refcount[block_id] = held + 1
        self._stamp[block_id] = self.tick()

    def _unref_one(self, block_id: int) -> np.ndarray:
        held = int(self._refcount[block_id])
        if held == 0:
            raise DoubleFreeError("block freed twice")
        self._refcount[block_id] = held - 1
        self._stamp[block_id] = self.tick()
        if held > 1:
            return np.empty(0, dtype=BLOCK_DTYPE)
        self._free[self._num_free] = block_id
        self._num_free += 1
        return np.array([block_id], dtype=BLOCK_DTYPE)

    def _validated(self, block_ids: object) -> tuple[np.ndarray, int, int]:
        """The ids as a flat integer array with their min and max; raises on a bad id."""
        ids = np.asarray(block_ids)
        if ids.size == 0:
            return np.empty(0, dtype=np.intp), 0, -1
        if ids.dtype.kind not in "iu":
            raise InvalidTypeError(f"block ids must be integers, got {ids.dtype}")
        ids = ids.reshape(-1)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_blocks:
            raise InvalidBlockIdError(f"block id outside [0, {self.num_blocks})")
        return ids, low, high

    @staticmethod
    def _run_or_ids(ids: np.ndarray, low: int, high: int) -> np.ndarray | slice:
        """Distinct ids that fill a whole range are addressed as a slice, several times faster
        than fancy indexing (the common case on a hit: blocks handed out together). Callers
        pass distinct ids, so ``max - min + 1 == size`` means exactly that range."""
        return slice(low, high + 1) if high - low + 1 == ids.size else ids.astype(np.intp, copy=False)

    def check_invariants(self, expected_refcounts: np.ndarray | None = None) -> None:
        """Free list disjoint from used blocks and complete; refcounts equal their owners."""
        free = self._free[: self._num_free]
        assert np.unique(free).size == free.size, "free list holds a block twice"
        assert np.all(self._refcount >= 0), "negative refcount"
        assert np.all(self._refcount[free] == 0), "a free block has references"
        assert int(np.count_nonzero(self._refcount == 0)) == self._num_free, "a block leaked"
        assert np.all(self._stamp <= self._clock), "stamp from the future"
        if expected_refcounts is not None:
            mismatch = np.flatnonzero(self._refcount != expected_refcounts)
            assert mismatch.size == 0, (
                f"refcount differs from its owners at blocks {mismatch[:8].tolist()}: "
                f"{self._refcount[mismatch[:8]].tolist()} != {expected_refcounts[mismatch[:8]].tolist()}"
            )
