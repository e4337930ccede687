"""The match transaction: a tentative match, then exactly one commit or rollback.

Owns: the undo records (``MatchTxn``) and the sequences' borrowed-path state
(``prefix_state.borrow``): a match from the root borrows the matched
path with one pin on its deepest node (``KVLifecycle.pin_path``) instead of one reference per
block; a match resuming below a computed prefix references each block it takes. Without
``borrow_paths`` (an engine whose own block manager counts one reference per block per
holder) every match references each block it takes. A rollback
restores the table, the references (or the borrow), the step, the cursor, the fresh range,
the restore selection and the statistics exactly.
"""

from __future__ import annotations

import numpy as np

from hybridcache.errors import InvalidTypeError, StaleHandleError
from hybridcache.memory.protocols import KVBlockAllocator
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.stats import MissReason, PrefixCacheStats
from hybridcache.sequence import Sequence
from hybridcache.types import NO_NODE

_NO_IDS = np.empty(0, dtype=np.int32)  # shared: read-only
_NO_IDS.flags.writeable = False


class MatchTxn:
    """Undo record of one tentative match; the caller commits or rolls it back exactly once.

    Blocks the match displaced from the sequence's table stay referenced by the transaction
    until commit, so a rollback can put them back even if pools were used in between.
    (A plain slotted class: one is built per match on the scheduler's hot path.)
    """

    __slots__ = (
        "seq", "step_before", "cursor_before", "fresh_before", "num_blocks_before",
        "restore_before", "table_start", "taken", "displaced", "step_after", "cursor_after", "hit_tokens",
        "recorded", "borrowed", "materialized", "open",
    )

    def __init__(self, seq: Sequence) -> None:
        state = seq.prefix_state
        position = state.trie
        self.seq = seq
        self.step_before = self.step_after = seq.num_computed
        self.cursor_before = self.cursor_after = (position.cursor, position.cursor_generation)
        self.fresh_before = state.overlap.fresh_range
        self.num_blocks_before = seq.num_blocks
        self.restore_before: CheckpointRecord | None = state.checkpoints.restore
        self.table_start = 0
        self.taken = self.displaced = _NO_IDS
        self.hit_tokens = 0
        self.recorded: tuple[int, int, MissReason | None] | None = None  # the stats delta, undone on rollback
        self.borrowed = False  # the taken blocks are borrowed with one path pin
        self.materialized: tuple[int, int] | None = None  # (node, depth) of a borrow it turned into references
        self.open = True


def require_txn(txn: object) -> None:
    if not isinstance(txn, MatchTxn):
        raise InvalidTypeError(f"expected a MatchTxn, got {type(txn).__name__}")


class MatchBook:
    """Takes and gives back the blocks of matches, and closes their transactions."""

    def __init__(
        self, pool: KVBlockAllocator, kv: KVLifecycle, stats: PrefixCacheStats, checkpoints, borrow_paths: bool = True
    ) -> None:
        self.pool = pool
        self.borrow_paths = borrow_paths
        self.kv = kv
        self.stats = stats
        self.checkpoints = checkpoints  # CheckpointLifecycle or its null object

    def commit(self, txn: MatchTxn) -> None:
        """Make a match final: drop the references on blocks it displaced."""
        require_txn(txn)
        self._close(txn)
        if txn.displaced.size:
            self.pool.unref(txn.displaced)

    def commit_undisplacing(self, txns: list[MatchTxn]) -> None:
        """``commit`` of matches that displaced no block (so closing them is all it does), in
        one call; every one is checked before the first is closed."""
        for txn in txns:
            if not isinstance(txn, MatchTxn):
                raise InvalidTypeError(f"expected a MatchTxn, got {type(txn).__name__}")
            if not txn.open or txn.displaced.size:
                raise StaleHandleError("commit_undisplacing takes open matches that displaced no block")
        if len({id(txn) for txn in txns}) != len(txns):
            raise StaleHandleError("commit_undisplacing got one match twice (a match commits once)")
        for txn in txns:
            txn.open = False

    def rollback(self, txn: MatchTxn) -> None:
        """Undo a match exactly: table, references, step, cursor, fresh range and statistics."""
        require_txn(txn)
        seq = txn.seq
        expected_blocks = max(txn.num_blocks_before, txn.table_start + txn.taken.size)
        state = seq.prefix_state
        position = state.trie
        refs = state.checkpoints
        if (
            seq.num_computed != txn.step_after
            or seq.num_blocks != expected_blocks
            or (position.cursor, position.cursor_generation) != txn.cursor_after
        ):
            raise StaleHandleError("the sequence changed after the match; roll back before allocating")
        self._close(txn)
        if txn.taken.size:
            seq.place_blocks(txn.table_start, txn.displaced)
            seq.truncate_blocks(txn.num_blocks_before)
            if txn.borrowed:
                self.return_borrow(seq)
            else:
                self.pool.unref(txn.taken, unique=True)
        if txn.materialized is not None:  # borrow the path again instead of referencing its blocks
            node, depth = txn.materialized
            self.pool.unref(seq.block_table[:depth], unique=True)
            self.borrow(seq, node, depth)
        seq.set_computed(txn.step_before)
        state = seq.prefix_state
        if refs.restore_pinned:
            self.checkpoints.unpin_restore(seq)
        refs.restore = txn.restore_before
        position.cursor, position.cursor_generation = txn.cursor_before
        state.overlap.fresh_range = txn.fresh_before
        if txn.recorded is not None:
            self.stats.unrecord_match(*txn.recorded)

    @staticmethod
    def _close(txn: MatchTxn) -> None:
        if not txn.open:
            raise StaleHandleError("this match was already committed or rolled back")
        txn.open = False

    def take_path_blocks(self, seq: Sequence, txn: MatchTxn, ids: np.ndarray, base_depth: int, node: int) -> None:
        """Hold the blocks ``ids`` (of the path from ``base_depth`` down to ``node``; possibly
        a shared view, never written) and write them at their table positions: a path from the
        root is borrowed with one pin on ``node`` (with ``borrow_paths``), anything else
        referenced per block."""
        if ids.size == 0:
            return
        state = seq.prefix_state
        borrowing = state.borrow
        if base_depth == 0 and borrowing.depth == 0 and self.borrow_paths:
            self.borrow(seq, node, ids.size)
            txn.borrowed = True
        else:
            if borrowing.depth > base_depth:
                txn.materialized = (borrowing.node, borrowing.depth)
                self._materialize_borrow(seq)
            ids = ids.copy()  # the transaction drops exactly these references on rollback
            self.pool.ref(ids, unique=True)
        txn.table_start = base_depth
        txn.taken = ids
        txn.displaced = seq.place_blocks(base_depth, ids)

    def borrow_paths_of(self, seqs: list[Sequence], anchors: list[int], path_ids: list[np.ndarray]) -> None:
        """For each of ``seqs`` (holding no block, borrowing nothing), borrow the path from
        the root to ``anchors[k]`` (its block ids ``path_ids[k]``) with one pin and write its
        blocks at the start of the table: ``take_path_blocks`` of a remembered hit, without
        a transaction."""
        self.kv.pin_paths(anchors)
        for seq, anchor, ids in zip(seqs, anchors, path_ids):
            borrowing = seq.prefix_state.borrow
            borrowing.node, borrowing.depth = anchor, ids.size
            seq.place_blocks(0, ids)

    def _materialize_borrow(self, seq: Sequence) -> None:
        """Turn the sequence's path pin into one reference per borrowed block (before a match
        rewrites part of the borrowed range)."""
        state = seq.prefix_state
        self.pool.ref(seq.block_table[: state.borrow.depth], unique=True)
        self.return_borrow(seq)

    def borrow(self, seq: Sequence, node: int, depth: int) -> None:
        self.kv.pin_path(node)
        borrowing = seq.prefix_state.borrow
        borrowing.node, borrowing.depth = node, depth

    def return_borrow(self, seq: Sequence) -> None:
        state = seq.prefix_state
        borrowing = state.borrow
        self.kv.unpin_path(borrowing.node)
        borrowing.node, borrowing.depth = NO_NODE, 0
