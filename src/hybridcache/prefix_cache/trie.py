"""BlockTrie: the prefix-cache facade.

Owns: the composition of the prefix-cache components, chosen once here, and the claim of a
sequence (``prefix_state.trie.owner``: the trie whose node handles its cached facts refer to).
Every public call validates its arguments, refuses another trie's sequence, and delegates:

* ``PathLookup`` (lookup.py): exact path verification;
* ``BlockMatcher`` / ``CheckpointMatcher`` (matchers.py): prepare and match, one per kind;
* ``MatchBook`` (match_txn.py): the match transaction, borrowed paths, commit and rollback;
* ``Attacher`` (attach.py): allocate, pending nodes, private blocks, routed-expert enrichment;
* ``KVLifecycle`` / ``CheckpointLifecycle`` (or ``NoCheckpoints``): references, pins, eviction;
* ``Pressure`` (pressure.py): what KV and state pressure take, and in which order;
* invariants.py: the cross-owner checks;
* an eviction policy (``EvictionScores``, eviction_view.py): the heaps' scores; it sees the
  trie only through an ``EvictionView``.

It never holds a reference to a sequence beyond one call, except inside a ``MatchTxn`` the
caller holds.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from hybridcache.errors import ForeignSequenceError, InvalidArgumentError, InvalidTypeError, PinnedError
from hybridcache.memory.protocols import KVBlockAllocator, StateSlotAllocator
from hybridcache.prefix_cache.attach import Attacher
from hybridcache.prefix_cache.change_log import CacheChanges, ChangeLog
from hybridcache.prefix_cache.checkpoint_index import CheckpointIndex
from hybridcache.prefix_cache.checkpoint_lifecycle import CheckpointLifecycle
from hybridcache.prefix_cache.checkpoint_record import CheckpointSearch
from hybridcache.prefix_cache.eviction_view import EvictionScores, EvictionView
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.invariants import check_trie
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.lookup import PathLookup
from hybridcache.prefix_cache.match_txn import MatchBook, MatchTxn, require_txn
from hybridcache.prefix_cache.matchers import BlockMatcher, CheckpointMatcher
from hybridcache.prefix_cache.no_checkpoints import NoCheckpoints
from hybridcache.prefix_cache.node import NodePath, NodeTable
from hybridcache.prefix_cache.pressure import Pressure
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_cache.stats import PrefixCacheStats
from hybridcache.prefix_cache.token_store import TokenStore
from hybridcache.prefix_state import NO_FRESH_RANGE
from hybridcache.sequence import Sequence
from hybridcache.types import NO_NODE, as_int

_TRIE_IDS = itertools.count()
_PINNED_MATCH = "match while the sequence's restore is pinned; unpin or roll back first"


def _require_sequence(seq: object) -> None:
    if not isinstance(seq, Sequence):
        raise InvalidTypeError(f"expected a Sequence, got {type(seq).__name__}")


class BlockTrie:
    def __init__(
        self,
        pool: KVBlockAllocator,
        block_size: int,
        *,
        enabled: bool = True,
        keyer: BlockKeyer | None = None,
        state_pool: StateSlotAllocator | None = None,
        max_checkpoints_per_anchor: int = 4,
        track_pending: bool = False,
        borrow_paths: bool = True,
        eviction: EvictionScores | None = None,
    ) -> None:
        """``state_pool`` makes the trie hybrid (every hit needs a published checkpoint);
        ``borrow_paths=False``: a match references every block it gives a sequence instead of
        pinning the path (each holder counts one reference per block, as engines whose block
        manager owns the ids expect); ``eviction``: an eviction policy's state, read once here
        (its scores order the eviction heaps, its ``states_with_leaves`` or ``shortfall_costs``
        the KV-pressure order, see ``free_kv_blocks``) and bound to this trie's ``EvictionView``; None: recency, and
        mid-block states first."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
            raise InvalidArgumentError(f"block_size must be an even int >= 2, got {block_size!r}")
        if not isinstance(pool, KVBlockAllocator):
            raise InvalidTypeError(f"pool must be a KV block allocator (BlockPool or alike), got {type(pool).__name__}")
        if keyer is not None and not isinstance(keyer, BlockKeyer):
            raise InvalidTypeError(f"keyer must be a BlockKeyer, got {type(keyer).__name__}")
        if keyer is not None and keyer.block_size != block_size:
            raise InvalidArgumentError("keyer block size differs from the trie's")
        if state_pool is not None and not isinstance(state_pool, StateSlotAllocator):
            raise InvalidTypeError(f"state_pool must be a state slot allocator (StatePool or alike), got {type(state_pool).__name__}")
        if eviction is not None and not isinstance(eviction, EvictionScores):
            raise InvalidTypeError("eviction must be an eviction policy state (kv_score, checkpoint_score, states_with_leaves, bind)")
        self.trie_id = next(_TRIE_IDS)
        self.pool = pool
        self.block_size = block_size
        self.enabled = bool(enabled)
        self.track_pending = bool(track_pending)
        self.borrow_paths = bool(borrow_paths)
        self.keyer = keyer or BlockKeyer(block_size)
        self.nodes = NodeTable()
        self.tokens = TokenStore(block_size, self.nodes.capacity)
        self.experts = RoutedExpertStore(block_size)
        self.experts.ensure_capacity(self.nodes.capacity)
        self.kv = KVLifecycle(self.nodes, pool, None if eviction is None else eviction.kv_score)
        self.stats = PrefixCacheStats()
        self.state_pool = state_pool
        self.lookup = PathLookup(self.nodes, self.tokens, self.keyer, block_size, self.track_pending)
        self.pressure = Pressure(self.nodes, self.kv, self.experts, self.keyer, self.stats,
                                 eviction is not None and bool(eviction.states_with_leaves),
                                 getattr(eviction, "shortfall_costs", None))
        self._compose_checkpoints(max_checkpoints_per_anchor, None if eviction is None else eviction.checkpoint_score)
        self.attacher = Attacher(self.lookup, pool, self.kv, self.experts, self.checkpoints, self.enabled)
        if eviction is not None:
            eviction.bind(EvictionView(self.nodes, (pool, state_pool), self.checkpoints, self.kv, self.keyer))

    def _compose_checkpoints(self, max_per_anchor: int, score: Callable | None = None) -> None:
        """The one place that decides the trie's kind: the checkpoint side and the matcher."""
        if self.state_pool is None:
            self.index: CheckpointIndex | None = None
            self.checkpoints: CheckpointLifecycle | NoCheckpoints = NoCheckpoints()
        else:
            self.index = CheckpointIndex(self.nodes, self.experts, self.block_size)
            self.checkpoints = CheckpointLifecycle(
                self.nodes,
                self.index,
                self.pool,
                self.state_pool,
                self.block_size,
                max_per_anchor,
                owner=self.trie_id,
                score=score,
                free_kv_blocks=self.pressure.free_for_frozen_copy,
            )
        self.pressure.bind(self.checkpoints)
        self.book = MatchBook(self.pool, self.kv, self.stats, self.checkpoints, self.borrow_paths)
        if self.index is None:
            self.matcher: BlockMatcher | CheckpointMatcher = BlockMatcher(self.lookup, self.book, self.experts)
        else:
            self.matcher = CheckpointMatcher(self.lookup, self.book, self.experts, self.checkpoints)

    @property
    def states_with_leaves(self) -> bool:
        """Under KV pressure a mid-block state goes with its anchor leaf (the eviction policy's
        choice), instead of ahead of every leaf."""
        return self.pressure.states_with_leaves

    @property
    def is_hybrid(self) -> bool:
        """A hybrid trie needs a published state checkpoint for every hit."""
        return self.index is not None

    # --- sequences -----------------------------------------------------------------------------

    def _claim(self, seq: Sequence) -> None:
        """Validate ``seq`` and make this trie the one its cached facts (verified node, search,
        cursor) refer to: a sequence holding no blocks forgets another trie's facts; one
        holding blocks there is refused."""
        if not isinstance(seq, Sequence):  # _require_sequence, inline: this runs on every match
            raise InvalidTypeError(f"expected a Sequence, got {type(seq).__name__}")
        state = seq.prefix_state
        position = state.trie
        if position.owner == self.trie_id:
            return
        if position.owner >= 0:
            self._refuse_foreign_holder(seq)
            position.verified, position.verified_generation, position.verified_path, position.last_search = NO_NODE, -1, None, None
            state.clear_tracking()
        position.owner = self.trie_id

    def _refuse_foreign_holder(self, seq: Sequence) -> None:
        owner = seq.prefix_state.trie.owner
        if owner >= 0 and owner != self.trie_id and (seq.num_blocks or seq.prefix_state.borrow.depth):
            raise ForeignSequenceError("the sequence holds blocks of another trie; free it there first")

    def check_matchable(self, seq: Sequence) -> None:
        """Raise what ``match`` would refuse ``seq`` for, changing nothing: not a sequence,
        one holding another trie's blocks, a pinned restore. A caller that matches a batch
        checks every sequence before the first match."""
        _require_sequence(seq)
        self._refuse_foreign_holder(seq)
        if seq.prefix_state.checkpoints.restore_pinned:
            raise PinnedError(_PINNED_MATCH)

    def _require_own(self, seq: Sequence) -> None:
        """Refuse a sequence whose cached facts (and blocks) belong to another trie."""
        _require_sequence(seq)
        owner = seq.prefix_state.trie.owner
        if owner >= 0 and owner != self.trie_id:
            raise ForeignSequenceError("the sequence belongs to another trie")

    # --- ingest and match ----------------------------------------------------------------------

    def prepare(self, seq: Sequence) -> NodePath:
        """Ingest: verify the request's deepest reusable prefix exactly, once.

        Attention-only trie: compute the request's block keys and verify its deepest cached
        path. Hybrid trie: find its deepest exactly matching published checkpoint, hashing only
        the anchor block of each candidate step. Safe to run when a request arrives, outside the
        scheduler loop. What was verified is remembered on the sequence
        (``prefix_state.trie.verified``), so a later ``prepare``, ``match`` or ``allocate`` only
        compares tokens beyond it. Returns the verified path.
        """
        self._claim(seq)
        return self.matcher.prepare(seq)

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` the trie holds as exactly verified KV blocks
        (whole blocks, hit or not; a hybrid hit also needs a checkpoint). Where a new prompt
        diverges from everything cached: the branch point an admission policy may checkpoint."""
        self._claim(seq)
        if not self.enabled:
            return 0
        _, depth = self.lookup.extend_verified(seq, seq.num_valid // self.block_size)
        return depth * self.block_size

    def match(self, seq: Sequence) -> MatchTxn:
        """Tentatively reuse the longest exactly cached prefix beyond ``seq.num_computed``.

        Attention-only trie: the deepest cached block path, after the policy cuts. Hybrid trie:
        the deepest exactly verified published checkpoint; a KV path without one is a miss.
        """
        self._claim(seq)
        state = seq.prefix_state
        position = state.trie
        refs = state.checkpoints
        if refs.restore_pinned:
            raise PinnedError(_PINNED_MATCH)
        txn = MatchTxn(seq)
        state.overlap.fresh_range = NO_FRESH_RANGE
        refs.restore = None
        if not self.enabled:
            return txn
        base, base_depth = self.lookup.resume_point(seq)
        cursor, reason = self.matcher.match(seq, txn, base, base_depth)
        position.cursor, position.cursor_generation = txn.cursor_after = cursor
        if not state.suppress_stats:
            txn.recorded = (seq.num_tokens - txn.step_before, txn.hit_tokens, reason)
            self.stats.record_match(*txn.recorded)
        return txn

    def remembered_hits(self, seqs: list[Sequence]) -> list[CheckpointSearch]:
        """The searches of the leading ``seqs`` whose ``match`` is exactly their remembered
        checkpoint hit taken from the root as one borrowed path
        (``CheckpointMatcher.remembered_hits``). Empty for an attention-only or disabled trie,
        or without borrowed paths. Changes nothing."""
        if not (self.enabled and self.is_hybrid and self.borrow_paths):
            return []
        return self.matcher.remembered_hits(seqs, self.trie_id)

    def attaching_nothing(self, seqs: list[Sequence], hits: list[CheckpointSearch], ends: np.ndarray) -> int:
        """How many of the leading ``seqs``, matched to their remembered ``hits``, would
        attach nothing for a first chunk to ``ends[k]`` (``allocate_if_trivial`` holds: the
        anchor attached, as deep as the chunk's complete blocks, no private block to settle)."""
        count = len(hits)
        if count == 0:
            return 0
        anchors = np.fromiter((found.record.anchor for found in hits), np.int64, count)
        generations = np.fromiter((found.record.anchor_generation for found in hits), np.int64, count)
        valid = np.fromiter((seq.num_valid for seq in seqs[:count]), np.int64, count)
        nodes = self.nodes
        trivial = nodes.attached[anchors] & (nodes.generation[anchors] == generations)
        trivial &= nodes.depth[anchors] >= np.minimum(valid, ends[:count]) // self.block_size
        trivial &= np.fromiter((not seq.prefix_state.overlap.trie_block_map for seq in seqs[:count]), bool, count)
        return count if trivial.all() else int(np.argmin(trivial))

    def take_remembered_hits(self, seqs: list[Sequence], hits: list[CheckpointSearch], pin_stamps: list[int]) -> None:
        """For each of ``seqs`` and its remembered hit (``remembered_hits``, nothing changed
        since): what ``match``, ``pin_restore`` (its recency stamped ``pin_stamps[k]``) and
        ``allocate_if_trivial`` do, without a transaction (the caller admits them all)."""
        records = [found.record for found in hits]
        nodes = self.nodes
        self.book.borrow_paths_of(seqs, [record.anchor for record in records], [nodes.path_blocks(found.path) for found in hits])
        counted, query, hit = self.matcher.apply_remembered_hits(seqs, records)
        self.checkpoints.pin_selected_restores(seqs, records, pin_stamps)
        if counted:
            self.stats.record_hits(counted, query, hit)

    def commit(self, txn: MatchTxn) -> None:
        """Make a match final: drop the references on blocks it displaced."""
        require_txn(txn)
        self._require_own(txn.seq)
        self.book.commit(txn)

    def commit_undisplacing(self, txns: list[MatchTxn]) -> None:
        """``commit`` of several matches that displaced no block, in one call (a batch of
        admissions); raises before closing any when one displaced blocks or is closed."""
        trie_id = self.trie_id
        for txn in txns:
            if not isinstance(txn, MatchTxn):
                raise InvalidTypeError(f"expected a MatchTxn, got {type(txn).__name__}")
            owner = txn.seq.prefix_state.trie.owner
            if owner >= 0 and owner != trie_id:
                raise ForeignSequenceError("the sequence belongs to another trie")
        self.book.commit_undisplacing(txns)

    def rollback(self, txn: MatchTxn) -> None:
        """Undo a match exactly: table, references, step, cursor, fresh range and statistics."""
        require_txn(txn)
        self._require_own(txn.seq)
        self.book.rollback(txn)

    # --- attach and forward boundaries ---------------------------------------------------------

    def allocate(self, seq: Sequence, upto: int | None = None) -> None:
        """Attach the sequence's complete blocks beyond its cursor to the trie.

        ``upto`` caps the tokens considered (a chunked prefill attaches only the blocks its
        next forward completes). With ``track_pending`` the new nodes whose tokens are not
        computed yet stay unmatchable until ``mark_computed``.
        """
        self._claim(seq)
        self.attacher.allocate(seq, upto)

    def allocate_if_trivial(self, seq: Sequence, upto: int) -> bool:
        """``allocate(seq, upto)`` when it would attach nothing (the first chunk completes no
        block beyond the cursor), once the table covers ``upto`` tokens: True, done; False,
        nothing changed (call ``allocate`` after growing the table)."""
        self._claim(seq)
        return self.attacher.allocate_if_trivial(seq, upto)

    def attach_table(self, seq: Sequence, block_ids: object, upto: int | None = None) -> None:
        """Append blocks the engine allocated itself to the sequence's table, then ``allocate``.

        The caller hands over one reference per id that it already holds (the sequence's own),
        as ``pool.grow_table`` would have taken; every id must be in use and not already in
        the table. Refused ids change nothing."""
        self._claim(seq)
        ids = self.attacher.validated_new_blocks(seq, block_ids)
        seq.write_blocks(seq.num_blocks, ids)
        self.attacher.allocate(seq, upto)

    def exclusive_blocks(self, seq: Sequence, start: int, end: int) -> frozenset[int]:
        """Blocks the sequence may write for positions ``[start, end)``: held by it alone, or
        co-owned only by a pending trie node it attached itself (its own uncomputed block).
        A borrowed block is never writable."""
        self._require_own(seq)
        return self.attacher.exclusive_blocks(seq, start, end)

    def mark_computed(self, seq: Sequence, start: int) -> None:
        """A forward computed the sequence's tokens from ``start`` to ``num_computed``: its own
        pending nodes in that range become matchable."""
        self._require_own(seq)
        self.attacher.mark_computed(seq, start)

    def discard_pending(self, seq: Sequence) -> int:
        """A forward of ``seq`` failed: detach the pending leaves it attached for blocks it did
        not write (and their checkpoints), so nothing it would have produced stays matchable.
        Returns how many nodes were detached."""
        self._require_own(seq)
        return self.attacher.discard_pending(seq)

    def cache_routed_experts(self, seq: Sequence) -> None:
        """Give cached blocks on the sequence's path the expert rows it has recorded (only
        blocks completed since the last call: a watermark on the sequence)."""
        self._require_own(seq)
        self.attacher.cache_routed_experts(seq)

    # --- eviction and release ------------------------------------------------------------------

    def free_kv_blocks(self, count: int) -> int:
        """Free at least ``count`` KV blocks where the cache allows, in the eviction order
        (``Pressure``); returns the blocks freed."""
        count = as_int("count", count, 0)
        if not self.enabled or count == 0:
            return 0
        return self.pressure.free_kv_blocks(count)

    def reclaimable_kv_blocks(self) -> int:
        """At most how many blocks eviction could ever free: one per attached node and one per
        live record's frozen block, and no more than are in use. A need beyond it and the free
        blocks is refused without evicting anything."""
        if not self.enabled:
            return 0
        return min(self.nodes.num_attached + self.checkpoints.num_live, self.pool.num_blocks - self.pool.num_free)

    def free_state_slots(self, count: int) -> int:
        """Free up to ``count`` state slots by releasing least recently used unpinned
        checkpoints (state-slot pressure). Returns how many were released."""
        return self.pressure.free_state_slots(count) if self.enabled else 0

    def clear(self) -> int:
        """Evict every unpinned checkpoint and every block only the trie holds, and the roots
        of namespaces left with nothing cached."""
        freed = self.free_state_slots(self.checkpoints.num_live) + self.free_kv_blocks(self.nodes.num_attached)
        self.pressure.release_empty_namespaces()
        return freed

    def free_sequence(self, seq: Sequence) -> None:
        """Release a finished or cancelled sequence: its block references and its tracking.
        A sequence of another trie is refused before anything changes."""
        self._require_own(seq)
        self.checkpoints.release_sequence(seq)
        state = seq.prefix_state
        borrowing = state.borrow
        self.pool.unref(seq.block_table[borrowing.depth :])
        if borrowing.depth:
            self.book.return_borrow(seq)
        seq.truncate_blocks(0)
        state.clear_tracking()
        seq.set_computed(0)
        self.pressure.release_empty_namespaces()

    # --- observers -----------------------------------------------------------------------------

    def record_changes(self) -> None:
        """From now on, log blocks made matchable or detached and checkpoints published or
        released, for ``take_changes`` (an event publisher's source). Idempotent."""
        if self.nodes.changes is None:
            self.nodes.changes = ChangeLog()

    def take_changes(self) -> CacheChanges:
        """What changed since the last call (nothing when ``record_changes`` was never called)."""
        if self.nodes.changes is None:
            return CacheChanges([], [], [], [])
        return self.nodes.changes.take(self.nodes, self.tokens)

    # --- diagnostics ---------------------------------------------------------------------------

    def check_invariants(
        self,
        sequences: tuple[Sequence, ...] | list[Sequence] = (),
        transactions: tuple[MatchTxn, ...] | list[MatchTxn] = (),
    ) -> None:
        """Refcounts equal trie plus sequence owners (and the blocks open ``transactions``
        displaced, held until commit); cursors lie on exact paths; leaves are candidates; the
        token store covers every node."""
        check_trie(self, sequences, transactions)
