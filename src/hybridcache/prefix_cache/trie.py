"""BlockTrie: the prefix-cache facade for KV blocks.

Owns: the composition of the prefix-cache components (node table, token store, expert store,
KV lifecycle, statistics) and the match / allocate policy. It writes each sequence's
``prefix_state``; it never holds a reference to a sequence beyond one call, except inside a
``MatchTxn`` the caller holds.

Match (tentative, see ``MatchTxn``):
  resume point -> deepest exactly verified cached block (binary search on prefix keys, then
  one vectorized token comparison along the path's runs) -> policy cuts (recompute overlap,
  routed experts, multimodal boundary) -> take references, write the block table by index,
  advance the step, replay routed experts.
Allocate:
  attach the sequence's newly complete blocks below its cursor, reusing exact existing nodes;
  a block the next forward still writes (not yet computed, or in the fresh range) stays
  private and is mapped to its canonical trie block instead of being deduplicated.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from hybridcache.errors import (
    ForeignSequenceError,
    InvalidArgumentError,
    InvalidTypeError,
    PinnedError,
    StaleHandleError,
)
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.checkpoint_index import HIT, CheckpointIndex, VerifyStatus
from hybridcache.prefix_cache.checkpoint_lifecycle import CheckpointLifecycle
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.node import NodePath, NodeTable, Runs
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_cache.stats import MissReason, PrefixCacheStats
from hybridcache.prefix_cache.token_store import TokenStore
from hybridcache.types import NO_NODE
from hybridcache.sequence import Sequence

_EMPTY_RANGE = (0, 0)
# A miss probing more candidate steps than this first checks the request's first block.
_PROBES_BEFORE_FIRST_BLOCK_TEST = 4
# Up to this many probes, hashing each probe block when it is probed beats one vectorized call.
_SCALAR_PROBES = 8
_TRIE_IDS = itertools.count()
_NO_IDS = np.empty(0, dtype=np.int32)  # shared: read-only
_NO_IDS.flags.writeable = False


class MatchTxn:
    """Undo record of one tentative match; the caller commits or rolls it back exactly once.

    Blocks the match displaced from the sequence's table stay referenced by the transaction
    until commit, so a rollback can put them back even if pools were used in between.
    (A plain slotted class: one is built per match on the scheduler's hot path.)
    """

    __slots__ = (
        "seq", "step_before", "cursor_before", "fresh_before", "match_start_before", "num_blocks_before",
        "restore_before", "table_start", "taken", "displaced", "step_after", "cursor_after", "hit_tokens",
        "recorded", "borrowed", "materialized", "open",
    )

    def __init__(self, seq: Sequence) -> None:
        state = seq.prefix_state
        self.seq = seq
        self.step_before = self.step_after = seq.num_computed
        self.cursor_before = self.cursor_after = (state.cursor, state.cursor_generation)
        self.fresh_before = state.fresh_range
        self.match_start_before = state.match_start_step
        self.num_blocks_before = seq.num_blocks
        self.restore_before: CheckpointRecord | None = state.restore
        self.table_start = 0
        self.taken = self.displaced = _NO_IDS
        self.hit_tokens = 0
        self.recorded: tuple[int, int, MissReason | None] | None = None  # the stats delta, undone on rollback
        self.borrowed = False  # the taken blocks are borrowed with one path pin
        self.materialized: tuple[int, int] | None = None  # (node, depth) of a borrow it turned into references
        self.open = True


class _Found(NamedTuple):
    """Outcome of a checkpoint search: the record (None on a miss), the verified path (to the
    anchor on a hit), how deep the KV trie holds the prefix beyond it, and the miss reason."""

    record: CheckpointRecord | None
    path: NodePath
    cached_depth: int
    reason: MissReason | None
    window: tuple[int, int, int] = (0, 0, 0)  # what the search was for: see ``_find_checkpoint``
    epoch: int = -1  # the index's epoch when searched
    version: int = -1  # the node table's version when searched


def _require_sequence(seq: object) -> None:
    if not isinstance(seq, Sequence):
        raise InvalidTypeError(f"expected a Sequence, got {type(seq).__name__}")


def _require_txn(txn: object) -> None:
    if not isinstance(txn, MatchTxn):
        raise InvalidTypeError(f"expected a MatchTxn, got {type(txn).__name__}")


class BlockTrie:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        enabled: bool = True,
        keyer: BlockKeyer | None = None,
        state_pool: StatePool | None = None,
        max_checkpoints_per_anchor: int = 4,
        track_pending: bool = False,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
            raise InvalidArgumentError(f"block_size must be an even int >= 2, got {block_size!r}")
        if not isinstance(pool, BlockPool):
            raise InvalidTypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if keyer is not None and not isinstance(keyer, BlockKeyer):
            raise InvalidTypeError(f"keyer must be a BlockKeyer, got {type(keyer).__name__}")
        if keyer is not None and keyer.block_size != block_size:
            raise InvalidArgumentError("keyer block size differs from the trie's")
        self.trie_id = next(_TRIE_IDS)
        self.pool = pool
        self.block_size = block_size
        self.enabled = bool(enabled)
        self.keyer = keyer or BlockKeyer(block_size)
        self.nodes = NodeTable()
        self.tokens = TokenStore(block_size, self.nodes.capacity)
        self.experts = RoutedExpertStore(block_size)
        self.experts.ensure_capacity(self.nodes.capacity)
        self.kv = KVLifecycle(self.nodes, pool)
        self.stats = PrefixCacheStats()
        self.track_pending = bool(track_pending)
        self.state_pool = state_pool
        self.index: CheckpointIndex | None = None
        self.checkpoints: CheckpointLifecycle | None = None
        if state_pool is not None:
            if not isinstance(state_pool, StatePool):
                raise InvalidTypeError(f"state_pool must be a StatePool, got {type(state_pool).__name__}")
            self.index = CheckpointIndex(self.nodes, self.experts, block_size)
            self.checkpoints = CheckpointLifecycle(
                self.nodes, self.index, pool, state_pool, block_size, max_checkpoints_per_anchor, owner=self.trie_id
            )

    @property
    def is_hybrid(self) -> bool:
        """A hybrid trie needs a published state checkpoint for every hit."""
        return self.checkpoints is not None

    def _track(self, seq: Sequence) -> None:
        """Validate ``seq`` and make this trie the one its cached facts (verified node, search,
        cursor) refer to: a sequence holding no blocks forgets another trie's facts; one
        holding blocks there is refused."""
        _require_sequence(seq)
        state = seq.prefix_state
        if state.owner == self.trie_id:
            return
        if state.owner >= 0:
            if seq.num_blocks or state.borrowed_depth:
                raise ForeignSequenceError("the sequence holds blocks of another trie; free it there first")
            state.verified, state.verified_generation, state.path, state.found = NO_NODE, -1, None, None
            state.clear_tracking()
        state.owner = self.trie_id

    def _require_own(self, seq: Sequence) -> None:
        """Refuse a sequence whose cached facts (and blocks) belong to another trie."""
        _require_sequence(seq)
        owner = seq.prefix_state.owner
        if owner >= 0 and owner != self.trie_id:
            raise ForeignSequenceError("the sequence belongs to another trie")

    def _release_empty_namespaces(self) -> None:
        """Free the root (and key memo) of every namespace that caches nothing: no node below
        its root and no checkpoint on it, so per-namespace memory is bounded by what is cached."""
        for namespace, slot in self.nodes.childless_roots():
            if self.checkpoints is None or not self.checkpoints.records_at(slot):
                self.nodes.release_root(namespace)
                self.keyer.forget_namespace(namespace)

    def _root(self, namespace) -> int:
        slot = self.nodes.find_root(namespace)
        return self.nodes.root(namespace, self.keyer.namespace_seed(namespace)) if slot is None else slot

    # --- match ---------------------------------------------------------------------------------

    def prepare(self, seq: Sequence) -> NodePath:
        """Ingest: verify the request's deepest reusable prefix exactly, once.

        Attention-only trie: compute the request's block keys and verify its deepest cached
        path. Hybrid trie: find its deepest exactly matching published checkpoint, hashing only
        the anchor block of each candidate step. Safe to run when a request arrives, outside the
        scheduler loop. What was verified is remembered on the sequence
        (``prefix_state.verified``), so a later ``prepare``, ``match`` or ``allocate`` only
        compares tokens beyond it. Returns the verified path.
        """
        self._track(seq)
        if self.checkpoints is not None:
            return self._find_checkpoint(seq).path
        node, depth = self._extend_verified(seq, (seq.num_valid - 1) // self.block_size)
        return self._path_of(seq, node, depth)

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` the trie holds as exactly verified KV blocks
        (whole blocks, hit or not; a hybrid hit also needs a checkpoint). Where a new prompt
        diverges from everything cached: the branch point an admission policy may checkpoint."""
        self._track(seq)
        if not self.enabled:
            return 0
        _, depth = self._extend_verified(seq, seq.num_valid // self.block_size)
        return depth * self.block_size

    def _path_of(self, seq: Sequence, node: int, depth: int, known: NodePath | None = None) -> NodePath:
        """The path of a verified node, reused while the node is unchanged; ``known`` is that
        path when the caller holds it (a checkpoint record's anchor path)."""
        state = seq.prefix_state
        if known is None:
            generation = int(self.nodes.generation[node])
            cached = state.path
            if cached is not None and (cached.node, cached.generation, cached.depth) == (node, generation, depth):
                return cached  # the path of an attached node never changes (monotonic topology)
            runs, root = self.nodes.path_runs(node, 0)
            known = NodePath(node, depth, runs, root, generation)
        waiting = self.nodes.first_pending_depth(known.runs) if self.track_pending else None
        if waiting is not None:
            # Verified only up to the first node still pending; that node's readiness changes
            # without the topology changing, so the clipped path is recomputed next time
            # (generation -1). A node that is not pending never becomes pending again.
            runs, root = known.runs, known.root
            depth = waiting - 1
            node = root if depth == 0 else NodeTable.slot_at_depth(runs, self.nodes.depth, depth)
            known = NodePath(node, depth, self.nodes.clip_runs(runs, depth), root)
        state.path = known
        return known

    def match(self, seq: Sequence) -> MatchTxn:
        """Tentatively reuse the longest exactly cached prefix beyond ``seq.num_computed``.

        Attention-only trie: the deepest cached block path, after the policy cuts. Hybrid trie:
        the deepest exactly verified published checkpoint; a KV path without one is a miss.
        """
        self._track(seq)
        state = seq.prefix_state
        if state.restore_pinned:
            raise PinnedError("match while the sequence's restore is pinned; unpin or roll back first")
        txn = MatchTxn(seq)
        state.fresh_range = _EMPTY_RANGE
        state.match_start_step = txn.step_before
        state.restore = None
        if not self.enabled:
            return txn
        base, base_depth = self._resume_point(seq)
        if self.checkpoints is None:
            cursor, reason = self._match_blocks(seq, txn, self.prepare(seq), base, base_depth)
        else:
            cursor, reason = self._match_checkpoint(seq, txn, base, base_depth)
        state.cursor, state.cursor_generation = txn.cursor_after = cursor
        if not state.suppress_stats:
            txn.recorded = (seq.num_tokens - txn.step_before, txn.hit_tokens, reason)
            self.stats.record_match(*txn.recorded)
        return txn

    def _match_blocks(
        self, seq: Sequence, txn: MatchTxn, path: NodePath, base: int, base_depth: int
    ) -> tuple[tuple[int, int], MissReason | None]:
        """Attention-only match: the new cursor handle and why the hit fell short, if it did."""
        size, start = self.block_size, seq.num_computed
        limit = (seq.num_valid - 1) // size
        raw_depth = path.depth
        if raw_depth <= base_depth:
            reason = MissReason.NOTHING_TO_MATCH if limit <= start // size else MissReason.NO_CACHED_PREFIX
            return self._handle(base), reason
        window = self.nodes.clip_runs(path.runs, raw_depth, base_depth)
        accepted, reason = self._accepted_depth(seq, raw_depth, base_depth, window, limit)
        if raw_depth > accepted:
            seq.prefix_state.fresh_range = (accepted, raw_depth)
        if accepted * size <= start:
            return self._handle(base), reason or MissReason.NO_CACHED_PREFIX
        node = path.slot_at(self.nodes, accepted)
        self._apply_hit(seq, txn, window, base_depth, accepted, node)
        return self._handle(node), reason

    def _match_checkpoint(
        self, seq: Sequence, txn: MatchTxn, base: int, base_depth: int
    ) -> tuple[tuple[int, int], MissReason | None]:
        """Hybrid match: the new cursor handle (the checkpoint's anchor on a hit) and the miss
        reason."""
        found = self._find_checkpoint(seq)
        record = found.record
        if record is None:
            return self._handle(base), found.reason
        self._apply_restore(seq, txn, found, base_depth)
        return (record.anchor, record.anchor_generation), None

    def _handle(self, node: int) -> tuple[int, int]:
        """``(slot, generation)`` of an attached node: what a cursor remembers."""
        return node, int(self.nodes.generation[node])

    def _find_checkpoint(self, seq: Sequence) -> "_Found":
        """The deepest published checkpoint in ``(num_computed, num_valid - 1]`` whose whole
        prefix equals the request's, deepest step first. Candidate steps come from the
        namespace's sorted steps; each probe hashes one block (the anchor's last) and looks up
        one bucket; the winner's prefix is compared only beyond what was verified before."""
        start = seq.num_computed
        state = seq.prefix_state
        highest = seq.num_valid - 1
        # What a search depends on besides the cache: where it starts, the last valid token
        # and the recompute overlap.
        window = (start, highest, state.recompute_blocks)
        earlier = state.found
        if (
            earlier is not None
            and earlier.window == window
            and earlier.epoch == self.index.epoch
            and earlier.version == self.nodes.version
            and (earlier.record is None or earlier.record.is_published)
        ):
            return earlier  # nothing that could change the outcome happened since it was found
        self.keyer.identity(seq)
        if highest <= start:
            return _Found(None, self._base_path(seq), 0, MissReason.NOTHING_TO_MATCH)
        found = None
        if earlier is not None and earlier.record is None:
            if (
                earlier.window == window
                and earlier.epoch == self.index.epoch
                and earlier.reason is not MissReason.RECOMPUTE_OVERLAP  # newly attached KV could end it
            ):
                # Nothing that could turn it into a hit happened since ingest; evictions may
                # have moved the verified node, so the path is taken afresh.
                found = earlier._replace(path=self._base_path(seq), version=self.nodes.version)
        elif earlier is not None and earlier.window == window and self._still_usable(earlier.record):
            # Ingest already verified this checkpoint: only deeper steps published since count,
            # and the KV after it (recompute overlap) is looked at again.
            found = self._search(seq, self.index.candidate_steps(seq.namespace, earlier.record.step, highest), window)
            if found.record is None:
                cached_depth = self._cached_depth(seq, earlier.path)
                overlap = seq.prefix_state.recompute_blocks * self.block_size
                found = None
                if cached_depth * self.block_size >= earlier.record.step + overlap:
                    found = earlier._replace(
                        cached_depth=cached_depth, epoch=self.index.epoch, version=self.nodes.version
                    )
        if found is None:
            found = self._search(seq, self.index.candidate_steps(seq.namespace, start, highest), window)
        state.found = found
        return found

    def _still_usable(self, record: CheckpointRecord | None) -> bool:
        return (
            record is not None
            and record.is_published
            and record.ready
            and self.nodes.is_valid(record.anchor, record.anchor_generation)
        )

    def _base_path(self, seq: Sequence) -> NodePath:
        return self._path_of(seq, *self._verified_or_root(seq))

    def _search(self, seq: Sequence, steps: list[int], window: tuple[int, int, int]) -> "_Found":
        """The deepest of ``steps`` (deepest first) whose checkpoint fits the request exactly;
        on a miss, the verified path and the reason. ``window`` is what the search is for (see
        ``_find_checkpoint``)."""
        size = self.block_size
        epoch, version = self.index.epoch, self.nodes.version
        first_cached = None
        if len(steps) > _PROBES_BEFORE_FIRST_BLOCK_TEST:
            first_cached = self._first_block_cached(seq, self._base_path(seq))
            if not first_cached:  # every checkpoint beyond the first block lies on a cached first block
                steps = [step for step in steps if step < size]
        # A hit usually comes at the first probe: hash lazily unless many probes are certain.
        values = self._anchor_values(seq, steps) if len(steps) > _SCALAR_PROBES else None
        overlap = seq.prefix_state.recompute_blocks * size
        reason = None
        for step in steps:
            anchor_depth = step // size
            key = (step, self._probe_value(seq, anchor_depth, values))
            for record in self.index.bucket(seq.namespace, key):
                verdict = self.index.verify(record, key, seq)
                if verdict is not HIT:
                    if verdict.status is not VerifyStatus.REQUEST_MISMATCH:
                        self.checkpoints.clean_stale(record, key, verdict)
                    continue
                path = self._path_to_anchor(seq, record, anchor_depth)
                if path is None:
                    continue
                cached_depth = self._cached_depth(seq, path) if overlap else path.depth
                if overlap and cached_depth * size < step + overlap:
                    reason = MissReason.RECOMPUTE_OVERLAP
                    continue
                return _Found(record, path, cached_depth, None, window, epoch, version)
        base_path = self._base_path(seq)
        if reason is None:
            if first_cached is None:
                first_cached = self._first_block_cached(seq, base_path)
            reason = MissReason.NO_CHECKPOINT if first_cached else MissReason.NO_CACHED_PREFIX
        return _Found(None, base_path, 0, reason, window, epoch, version)

    def _probe_value(self, seq: Sequence, anchor_depth: int, values: dict[int, int] | None) -> int:
        """What a checkpoint anchored at ``anchor_depth`` is indexed under besides its step: the
        keyed value of the request's block ending at the anchor (taken from ``values`` when
        they were hashed together), or the namespace root's key for an anchor at the root."""
        if anchor_depth == 0:
            return int(self.nodes.key[self._root(seq.namespace)])
        if values is not None:
            return values[anchor_depth]
        return self.keyer.value_of(seq, anchor_depth - 1)

    def _anchor_values(self, seq: Sequence, steps: list[int]) -> dict[int, int]:
        """Anchor depth -> keyed value of the request's block ending there, for every step
        anchored below the root, hashed in one vectorized call."""
        size = self.block_size
        ordered = sorted({step // size for step in steps if step >= size})
        if not ordered:
            return {}
        return dict(zip(ordered, self.keyer.values_of(seq, np.asarray(ordered) - 1).tolist()))

    def _verified_or_root(self, seq: Sequence) -> tuple[int, int]:
        state = seq.prefix_state
        if self.nodes.is_valid(state.verified, state.verified_generation):
            return state.verified, int(self.nodes.depth[state.verified])
        return self._root(seq.namespace), 0

    def _path_to_anchor(self, seq: Sequence, record: CheckpointRecord, depth: int) -> NodePath | None:
        """The record's anchor path when it equals the request's prefix (and its blocks carry
        routed experts when the request wants them), else None. Only tokens beyond the verified
        node are compared; a deeper match becomes the new verified node."""
        nodes, state = self.nodes, seq.prefix_state
        anchor, path = record.anchor, record.anchor_path
        base, base_depth = self._verified_or_root(seq)
        if depth <= base_depth:
            base_path = self._path_of(seq, base, base_depth)
            if base_path.depth < depth or base_path.slot_at(nodes, depth) != anchor:
                return None
        else:
            runs, ancestor = (path.runs, path.root) if base_depth == 0 else nodes.path_runs(anchor, base_depth)
            if ancestor != base or not self._same_tokens(seq, runs):
                return None
            if not self._same_identity(seq, runs, base, anchor, base_depth, depth):
                return None
            if self.track_pending and nodes.first_pending_depth(runs) is not None:
                return None
            state.verified, state.verified_generation = anchor, record.anchor_generation
            path = self._path_of(seq, anchor, depth, path)
            if path.depth < depth:  # a node at or above the verified one is still pending
                return None
        if seq.want_routed_experts and self.experts.first_missing_depth(path.runs, nodes.depth) is not None:
            return None
        return path

    def _cached_depth(self, seq: Sequence, path: NodePath) -> int:
        """How deep the KV trie holds the request's prefix beyond a verified anchor (hashing
        only the blocks after it). Only a request that recomputes an overlap (MTP) needs KV
        beyond the anchor; for any other the anchor's depth is the answer, without a lookup."""
        limit = (seq.num_valid - 1) // self.block_size
        if limit <= path.depth or not seq.prefix_state.recompute_blocks:
            return path.depth
        self.keyer.resume_at(seq, path.depth, int(self.nodes.sums[path.node]))
        keys = self.keyer.extend(seq)
        depth, _, runs = self._deepest_cached(seq, keys, path.node, path.depth, limit)
        if self.track_pending:
            waiting = self.nodes.first_pending_depth(runs)
            if waiting is not None:
                depth = waiting - 1  # blocks nobody has computed yet are not cached KV
        return depth

    def _first_block_cached(self, seq: Sequence, base_path: NodePath) -> bool:
        """Whether the request's first block is cached at all (tells "no checkpoint" from
        "nothing cached" in the miss statistics)."""
        if base_path.depth > 0 or seq.num_valid < self.block_size:
            return base_path.depth > 0
        nodes = self.nodes
        first_key = self.keyer.key_after(seq, 0, int(nodes.sums[base_path.root]))
        return any(
            nodes.parent[slot] == base_path.root and not (self.track_pending and nodes.pending[slot])
            for slot in nodes.candidates(first_key)
        )

    def _apply_restore(self, seq: Sequence, txn: MatchTxn, found: "_Found", base_depth: int) -> None:
        record, path = found.record, found.path
        size, start, step = self.block_size, txn.step_before, record.step
        anchor_depth = step // size
        if base_depth == 0 and path.depth == anchor_depth:  # the verified path is exactly the part to take
            window, ids = path.runs, self.nodes.path_blocks(path)
        else:
            window = self.nodes.clip_runs(path.runs, anchor_depth, base_depth)
            ids = self.nodes.run_blocks(window)
        self._take_path_blocks(seq, txn, ids, base_depth, record.anchor)
        seq.set_computed(step)
        txn.step_after = step
        txn.hit_tokens = step - start
        self.checkpoints.select_restore(seq, record)
        if seq.want_routed_experts and seq.num_routed_experts == start:
            rows = self.experts.gather(window)
            if record.tail_experts is not None:
                rows = np.concatenate([rows, record.tail_experts]) if rows.size else record.tail_experts
            seq.append_routed_experts(rows[start - base_depth * size :])
        seq.prefix_state.fresh_range = (anchor_depth, max(found.cached_depth, -(-step // size)))

    def _extend_verified(self, seq: Sequence, limit: int) -> tuple[int, int]:
        """The deepest node at or above ``limit`` whose path equals the sequence's tokens,
        hashing and comparing only blocks beyond the node verified before."""
        nodes, state = self.nodes, seq.prefix_state
        if nodes.is_valid(state.verified, state.verified_generation):
            node = state.verified
        elif nodes.is_valid(state.cursor, state.cursor_generation):
            node = state.cursor
        else:
            node = self._root(seq.namespace)
        depth = int(nodes.depth[node])
        if depth > limit:
            _, node = nodes.path_runs(node, limit)
            return node, limit
        self.keyer.resume_at(seq, depth, int(nodes.sums[node]))
        keys = self.keyer.extend(seq)
        depth, node, _ = self._deepest_cached(seq, keys, node, depth, limit)
        state.verified, state.verified_generation = node, int(nodes.generation[node])
        return node, depth

    def commit(self, txn: MatchTxn) -> None:
        """Make a match final: drop the references on blocks it displaced."""
        _require_txn(txn)
        self._require_own(txn.seq)
        self._close(txn)
        if txn.displaced.size:
            self.pool.unref(txn.displaced)

    def rollback(self, txn: MatchTxn) -> None:
        """Undo a match exactly: table, references, step, cursor, fresh range and statistics."""
        _require_txn(txn)
        self._require_own(txn.seq)
        seq = txn.seq
        expected_blocks = max(txn.num_blocks_before, txn.table_start + txn.taken.size)
        state = seq.prefix_state
        if (
            seq.num_computed != txn.step_after
            or seq.num_blocks != expected_blocks
            or (state.cursor, state.cursor_generation) != txn.cursor_after
        ):
            raise StaleHandleError("the sequence changed after the match; roll back before allocating")
        self._close(txn)
        if txn.taken.size:
            seq.place_blocks(txn.table_start, txn.displaced)
            seq.truncate_blocks(txn.num_blocks_before)
            if txn.borrowed:
                self._return_borrow(seq)
            else:
                self.pool.unref(txn.taken, unique=True)
        if txn.materialized is not None:  # borrow the path again instead of referencing its blocks
            node, depth = txn.materialized
            self.pool.unref(seq.block_table[:depth], unique=True)
            self._borrow(seq, node, depth)
        seq.set_computed(txn.step_before)
        state = seq.prefix_state
        if state.restore_pinned:
            self.checkpoints.unpin_restore(seq)
        state.restore = txn.restore_before
        state.cursor, state.cursor_generation = txn.cursor_before
        state.fresh_range = txn.fresh_before
        state.match_start_step = txn.match_start_before
        if txn.recorded is not None:
            self.stats.unrecord_match(*txn.recorded)

    @staticmethod
    def _close(txn: MatchTxn) -> None:
        if not txn.open:
            raise StaleHandleError("this match was already committed or rolled back")
        txn.open = False

    def _resume_point(self, seq: Sequence) -> tuple[int, int]:
        """The deepest node known to match ``seq`` at or below its computed blocks."""
        state = seq.prefix_state
        if state.cursor != NO_NODE and self.nodes.is_valid(state.cursor, state.cursor_generation):
            node = state.cursor
            depth = int(self.nodes.depth[node])
            computed_blocks = seq.num_computed // self.block_size
            if depth > computed_blocks:
                _, node = self.nodes.path_runs(node, computed_blocks)
                depth = computed_blocks
            return node, depth
        return self._root(seq.namespace), 0

    def _accepted_depth(
        self, seq: Sequence, raw_depth: int, base_depth: int, runs: Runs, limit: int
    ) -> tuple[int, MissReason | None]:
        """Apply the policy cuts to the deepest cached depth; return the depth and why it shrank."""
        accepted, reason = raw_depth, None
        overlap_limit = limit - seq.prefix_state.recompute_blocks
        if accepted > overlap_limit:
            accepted, reason = max(overlap_limit, base_depth), MissReason.RECOMPUTE_OVERLAP
        if seq.want_routed_experts and accepted > base_depth:
            missing = self.experts.first_missing_depth(runs, self.nodes.depth)
            if missing is not None and missing <= accepted:
                accepted, reason = missing - 1, MissReason.ROUTED_EXPERTS
        clamped = seq.clamp_to_safe_block_boundary(accepted * self.block_size, self.block_size) // self.block_size
        if clamped < accepted:
            accepted, reason = max(clamped, base_depth), MissReason.MULTIMODAL_BOUNDARY
        return accepted, reason

    def _take_path_blocks(self, seq: Sequence, txn: MatchTxn, ids: np.ndarray, base_depth: int, node: int) -> None:
        """Hold the blocks ``ids`` (of the path from ``base_depth`` down to ``node``; possibly
        a shared view, never written) and write them at their table positions: a path from the
        root is borrowed with one pin on ``node``, anything else referenced per block."""
        if ids.size == 0:
            return
        state = seq.prefix_state
        if base_depth == 0 and state.borrowed_depth == 0:
            self._borrow(seq, node, ids.size)
            txn.borrowed = True
        else:
            if state.borrowed_depth > base_depth:
                txn.materialized = (state.borrowed, state.borrowed_depth)
                self._materialize_borrow(seq)
            ids = ids.copy()  # the transaction drops exactly these references on rollback
            self.pool.ref(ids, unique=True)
        txn.table_start = base_depth
        txn.taken = ids
        txn.displaced = seq.place_blocks(base_depth, ids)

    def _materialize_borrow(self, seq: Sequence) -> None:
        """Turn the sequence's path pin into one reference per borrowed block (before a match
        rewrites part of the borrowed range)."""
        state = seq.prefix_state
        self.pool.ref(seq.block_table[: state.borrowed_depth], unique=True)
        self._return_borrow(seq)

    def _borrow(self, seq: Sequence, node: int, depth: int) -> None:
        self.kv.pin_path(node)
        seq.prefix_state.borrowed, seq.prefix_state.borrowed_depth = node, depth

    def _return_borrow(self, seq: Sequence) -> None:
        state = seq.prefix_state
        self.kv.unpin_path(state.borrowed)
        state.borrowed, state.borrowed_depth = NO_NODE, 0

    def _apply_hit(
        self, seq: Sequence, txn: MatchTxn, runs: Runs, base_depth: int, accepted: int, node: int
    ) -> None:
        start = seq.num_computed
        runs = self.nodes.clip_runs(runs, accepted)
        self._take_path_blocks(seq, txn, self.nodes.run_blocks(runs), base_depth, node)
        seq.set_computed(accepted * self.block_size)
        txn.step_after = seq.num_computed
        txn.hit_tokens = seq.num_computed - start
        if seq.want_routed_experts and seq.num_routed_experts == start:
            rows = self.experts.gather(runs)
            seq.append_routed_experts(rows[start - base_depth * self.block_size :])

    # --- exact lookup --------------------------------------------------------------------------

    def _deepest_cached(
        self, seq: Sequence, keys: np.ndarray, base: int, base_depth: int, limit: int
    ) -> tuple[int, int, Runs]:
        """Deepest depth in (base_depth, limit] whose node is an exact match of ``seq`` below
        ``base``; returns (depth, node, runs of the path from that node up to base_depth)."""
        nodes = self.nodes
        if limit <= base_depth or not nodes.has_key(int(keys[base_depth])):
            return base_depth, base, []
        low, high = base_depth + 1, limit
        if nodes.has_key(int(keys[high - 1])):
            low = high
        while low < high:  # invariant: depth `low` is present, everything above `high` absent
            middle = (low + high + 1) // 2
            if nodes.has_key(int(keys[middle - 1])):
                low = middle
            else:
                high = middle - 1
        for candidate in nodes.candidates(int(keys[low - 1])):
            if nodes.depth[candidate] != low:
                continue
            runs, ancestor = nodes.path_runs(candidate, base_depth)
            if ancestor == base and self._same_tokens(seq, runs) and self._same_identity(seq, runs, base, candidate, base_depth, low):
                return low, candidate, runs
        return self._walk(seq, keys, base, base_depth, limit)

    def _walk(self, seq: Sequence, keys: np.ndarray, base: int, base_depth: int, limit: int) -> tuple[int, int, Runs]:
        """Block-by-block exact walk; only taken when a key collision defeated the fast path."""
        nodes, size = self.nodes, self.block_size
        identities = seq.prefix_state.mm_blocks
        node, depth = base, base_depth
        while depth < limit:
            expected_identity = identities.get(depth)
            for candidate in nodes.candidates(int(keys[depth])):
                if (
                    nodes.parent[candidate] == node
                    and nodes.extra_identity.get(candidate) == expected_identity
                    and self.tokens.equals(candidate, candidate, seq, depth * size)
                ):
                    node, depth = candidate, depth + 1
                    break
            else:
                break
        runs, _ = nodes.path_runs(node, base_depth)
        return depth, node, runs

    def _same_tokens(self, seq: Sequence, runs: Runs) -> bool:
        depth, size, equals = self.nodes.depth, self.block_size, self.tokens.equals
        for first, last in runs:
            if not equals(first, last, seq, (int(depth[first]) - 1) * size):
                return False
        return True

    def _same_identity(self, seq: Sequence, runs: Runs, base: int, node: int, base_depth: int, depth: int) -> bool:
        nodes = self.nodes
        if not nodes.extra_identity and not seq.prefix_state.mm_blocks:
            return True  # text only on both sides
        expected = {i: spans for i, spans in seq.prefix_state.mm_blocks.items() if base_depth <= i < depth}
        if int(nodes.mm_count[node] - nodes.mm_count[base]) != len(expected):
            return False
        return all(
            nodes.extra_identity.get(NodeTable.slot_at_depth(runs, nodes.depth, index + 1)) == spans
            for index, spans in expected.items()
        )

    def _path_blocks(self, runs: Runs, max_depth: int) -> np.ndarray:
        """Block ids of a path in table order, up to ``max_depth``."""
        return self.nodes.run_blocks(self.nodes.clip_runs(runs, max_depth))

    def _path_pending(self, runs: Runs, max_depth: int) -> np.ndarray:
        """Which nodes of a path (table order, up to ``max_depth``) are still pending."""
        return self.nodes.run_pending(self.nodes.clip_runs(runs, max_depth))

    # --- allocate ------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, upto: int | None = None) -> None:
        """Attach the sequence's complete blocks beyond its cursor to the trie.

        ``upto`` caps the tokens considered (a chunked prefill attaches only the blocks its
        next forward completes). With ``track_pending`` the new nodes whose tokens are not
        computed yet stay unmatchable until ``mark_computed``.
        """
        self._track(seq)
        state = seq.prefix_state
        if not self.enabled:
            state.fresh_range = _EMPTY_RANGE
            return
        if not self.nodes.is_valid(state.cursor, state.cursor_generation):
            state.cursor = self._root(seq.namespace)
            state.cursor_generation = int(self.nodes.generation[state.cursor])
            state.experts_cached_blocks = 0
        node = state.cursor
        depth = int(self.nodes.depth[node])
        tokens = seq.num_valid if upto is None else min(seq.num_valid, int(upto))
        end = min(tokens // self.block_size, seq.num_blocks)
        if state.trie_block_map:
            self._settle_private_blocks(seq)
        if depth >= end:
            state.fresh_range = _EMPTY_RANGE
            return
        self.keyer.resume_at(seq, depth, int(self.nodes.sums[node]))
        found_node, found_depth = self._extend_verified(seq, end)
        keys = self.keyer.extend(seq)
        if found_depth > depth:
            runs, ancestor = self.nodes.path_runs(found_node, depth)
            if ancestor != node:  # unreachable while exact paths are unique; stay exact anyway
                found_depth, found_node, runs = self._deepest_cached(seq, keys, node, depth, end)
            self._adopt_existing(
                seq, depth, self._path_blocks(runs, found_depth), self._path_pending(runs, found_depth)
            )
            node = found_node
        else:
            found_depth = depth
        if found_depth < end:
            node = self._attach_new(seq, keys, node, found_depth, end)
        generation = int(self.nodes.generation[node])
        state.cursor, state.cursor_generation = node, generation
        state.verified, state.verified_generation = node, generation
        state.fresh_range = _EMPTY_RANGE

    def _adopt_existing(self, seq: Sequence, first_index: int, canonical: np.ndarray, pending: np.ndarray) -> None:
        """Point the table at existing trie blocks where safe; keep private blocks the next
        forward writes (not yet computed, or in the fresh range), and private blocks whose
        canonical node is still pending, and map them instead."""
        state = seq.prefix_state
        indices = np.arange(first_index, first_index + canonical.size)
        current = seq.block_table[first_index : first_index + canonical.size].copy()
        differs = current != canonical
        fresh_start, fresh_end = state.fresh_range
        writes_next = (
            (indices >= seq.num_computed // self.block_size) | ((indices >= fresh_start) & (indices < fresh_end)) | pending
        )
        swap = differs & ~writes_next
        if swap.any():
            self.pool.ref(canonical[swap], unique=True)
            seq.write_blocks(first_index, np.where(swap, canonical, current))
            self.pool.unref(current[swap])
        for index, block in zip(indices[differs & writes_next].tolist(), canonical[differs & writes_next].tolist()):
            state.trie_block_map[index] = block
        for index in indices[~differs | swap].tolist():
            state.trie_block_map.pop(index, None)

    def _settle_private_blocks(self, seq: Sequence) -> None:
        """Replace private duplicates the sequence has finished computing by their canonical
        trie blocks, so duplicates live only while a forward still writes them."""
        state = seq.prefix_state
        computed_blocks = seq.num_computed // self.block_size
        done = [i for i in state.trie_block_map if i < computed_blocks and not state.in_fresh_range(i)]
        if not done or not self.nodes.is_valid(state.cursor, state.cursor_generation):
            return
        first = min(done)
        runs, _ = self.nodes.path_runs(state.cursor, first)
        if not runs:
            return
        depth = int(self.nodes.depth[state.cursor])
        canonical = self._path_blocks(runs, depth)
        pending = self._path_pending(runs, depth)
        settled = {i: int(canonical[i - first]) for i in done if i - first < canonical.size and not pending[i - first]}
        for index, block in settled.items():
            self.pool.ref([block])
            replaced = seq.write_blocks(index, [block])
            self.pool.unref(replaced)
            del state.trie_block_map[index]

    def _attach_new(self, seq: Sequence, keys: np.ndarray, parent: int, first: int, end: int) -> int:
        size = self.block_size
        identities = {i - first: spans for i, spans in seq.prefix_state.mm_blocks.items() if first <= i < end}
        pending = False
        if self.track_pending:
            pending = np.arange(first, end) >= seq.num_computed // size
        sums = seq.prefix_state.block_sums[first:end]
        slots = self.nodes.attach_run(
            parent, keys[first:end].copy(), seq.block_table[first:end], identities, pending, sums
        )
        self.tokens.ensure_capacity(self.nodes.capacity)
        self.experts.ensure_capacity(self.nodes.capacity)
        self.tokens.write(slots, seq.token_view(first * size, end * size))
        covered = min(end, seq.num_routed_experts // size)
        if seq.want_routed_experts and covered > first:
            self.experts.store(slots[: covered - first], seq.routed_experts[first * size : covered * size])
        self.kv.take_references(slots)
        self.kv.offer_leaf(int(slots[-1]))
        for index in range(first, end):
            seq.prefix_state.trie_block_map.pop(index, None)
        return int(slots[-1])

    def exclusive_blocks(self, seq: Sequence, start: int, end: int) -> frozenset[int]:
        """Blocks the sequence may write for positions ``[start, end)``: held by it alone, or
        co-owned only by a pending trie node it attached itself (its own uncomputed block).
        A borrowed block is never writable."""
        self._require_own(seq)
        size = self.block_size
        indices = range(max(start // size, seq.prefix_state.borrowed_depth), -(-end // size))
        table = seq.block_table
        own_pending = set()
        state = seq.prefix_state
        if self.track_pending and self.nodes.is_valid(state.cursor, state.cursor_generation):
            runs, _ = self.nodes.path_runs(state.cursor, start // size)
            for first, last in runs:
                slots = np.arange(first, last + 1)
                own_pending.update(self.nodes.block[slots[self.nodes.pending[slots]]].tolist())
        allowed = set()
        for index in indices:
            if index >= table.size:
                break
            block = int(table[index])
            references = self.pool.refcount_of(block)
            if references == 1 or (references == 2 and block in own_pending):
                allowed.add(block)
        return frozenset(allowed)

    def mark_computed(self, seq: Sequence, start: int) -> None:
        """A forward computed the sequence's tokens from ``start`` to ``num_computed``: its own
        pending nodes in that range become matchable."""
        self._require_own(seq)
        state = seq.prefix_state
        if not self.track_pending or not self.nodes.is_valid(state.cursor, state.cursor_generation):
            return
        nodes = self.nodes
        high = min(int(nodes.depth[state.cursor]), seq.num_computed // self.block_size)
        low = start // self.block_size
        if high <= low:
            return
        runs, _ = nodes.path_runs(state.cursor, low)
        table = seq.block_table
        for first, last in nodes.clip_runs(runs, high, low):
            slots = np.arange(first, last + 1)
            own = nodes.block[slots] == table[nodes.depth[slots] - 1]
            nodes.settle(slots[own])
        if self.index is not None:
            self.index.note_change()

    def discard_pending(self, seq: Sequence) -> int:
        """A forward of ``seq`` failed: detach the pending leaves it attached for blocks it did
        not write (and their checkpoints), so nothing it would have produced stays matchable.
        Returns how many nodes were detached."""
        self._require_own(seq)
        state = seq.prefix_state
        nodes = self.nodes
        detached = 0
        node = state.cursor
        while (
            nodes.is_valid(node, state.cursor_generation if node == state.cursor else int(nodes.generation[node]))
            and not nodes.is_root[node]
            and nodes.pending[node]
            and nodes.num_children[node] == 0
            and nodes.block[node] == seq.block_table[int(nodes.depth[node]) - 1]
        ):
            if self.checkpoints is not None:
                if self.checkpoints.is_anchor_protected(node):
                    break
                self.checkpoints.release_anchored(node)
            block = int(nodes.block[node])
            parent = nodes.detach_leaf(node)
            self.experts.forget(node)
            self.pool.unref([block])
            detached += 1
            node = parent
        if detached:
            state.cursor, state.cursor_generation = node, int(nodes.generation[node])
            state.verified, state.verified_generation = node, int(nodes.generation[node])
            if not nodes.is_root[node] and nodes.num_children[node] == 0:
                self.kv.offer_leaf(node)
        return detached

    # --- routed experts ------------------------------------------------------------------------

    def cache_routed_experts(self, seq: Sequence) -> None:
        """Give cached blocks on the sequence's path the expert rows it has recorded.

        Only blocks completed since the last call are visited (a watermark on the sequence).
        """
        self._require_own(seq)
        state = seq.prefix_state
        if not self.enabled or not seq.want_routed_experts:
            return
        if self.checkpoints is not None:
            self.checkpoints.attach_pending_tail_experts(seq)
        if not self.nodes.is_valid(state.cursor, state.cursor_generation):
            return
        size = self.block_size
        covered = min(seq.num_routed_experts // size, int(self.nodes.depth[state.cursor]))
        first = state.experts_cached_blocks
        if covered <= first:
            return
        runs, _ = self.nodes.path_runs(state.cursor, first)
        rows = seq.routed_experts
        depth = self.nodes.depth
        stored = False
        for run_first, run_last in self.nodes.clip_runs(runs, covered):
            slots = np.arange(run_first, run_last + 1)
            missing = slots[~self.experts.has_rows[slots]]
            if missing.size:
                token_starts = (depth[missing] - 1) * size
                gathered = rows[(token_starts[:, None] + np.arange(size)).reshape(-1)]
                self.experts.store(missing, gathered)
                stored = True
        state.experts_cached_blocks = covered
        if stored and self.index is not None:
            self.index.note_change()  # a checkpoint miss for want of these rows may now hit

    # --- eviction and release ------------------------------------------------------------------

    def evict(self, count: int) -> int:
        """Free up to ``count`` KV blocks: frozen blocks of least recently used mid-block
        checkpoints first, then least recently used trie leaves (with their checkpoints).
        A leaf anchoring a pinned checkpoint is never evicted. Returns the blocks freed."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise InvalidTypeError(f"count must be an int, got {count!r}")
        if count < 0:
            raise InvalidArgumentError(f"count must be non-negative, got {count}")
        if not self.enabled or count == 0:
            return 0
        checkpoints = self.checkpoints
        freed = 0
        if checkpoints is not None:
            freed = checkpoints.evict_frozen(int(count))
            self.stats.evicted_checkpoints += freed
        if freed < count:
            protected = None if checkpoints is None else checkpoints.is_anchor_protected
            evicted = self.kv.evict(int(count) - freed, protected)
            for slot in evicted:
                self.experts.forget(slot)
                if checkpoints is not None:
                    released = checkpoints.release_anchored(slot)
                    freed += released.frozen_blocks
                    self.stats.evicted_checkpoints += released.records
            self.stats.evicted_blocks += len(evicted)
            freed += len(evicted)
        self._release_empty_namespaces()
        return freed

    def evict_checkpoints(self, count: int) -> int:
        """Free up to ``count`` state slots by releasing least recently used unpinned
        checkpoints (state-slot pressure). Returns how many were released."""
        if self.checkpoints is None or not self.enabled:
            return 0
        released = self.checkpoints.evict(count)
        self.stats.evicted_checkpoints += released
        self._release_empty_namespaces()
        return released

    def clear(self) -> int:
        """Evict every unpinned checkpoint and every block only the trie holds, and the roots
        of namespaces left with nothing cached."""
        released = self.evict_checkpoints(self.state_pool.num_slots) if self.checkpoints is not None else 0
        freed = released + self.evict(self.nodes.num_attached)
        self._release_empty_namespaces()
        return freed

    def free_sequence(self, seq: Sequence) -> None:
        """Release a finished or cancelled sequence: its block references and its tracking.
        A sequence of another trie is refused before anything changes."""
        self._require_own(seq)
        if self.checkpoints is not None:
            self.checkpoints.forget_sequence(seq)
        state = seq.prefix_state
        self.pool.unref(seq.block_table[state.borrowed_depth :])
        if state.borrowed_depth:
            self._return_borrow(seq)
        seq.truncate_blocks(0)
        state.clear_tracking()
        seq.set_computed(0)
        self._release_empty_namespaces()

    # --- diagnostics ---------------------------------------------------------------------------

    def check_invariants(
        self,
        sequences: tuple[Sequence, ...] | list[Sequence] = (),
        transactions: tuple[MatchTxn, ...] | list[MatchTxn] = (),
    ) -> None:
        """Refcounts equal trie plus sequence owners (and the blocks open ``transactions``
        displaced, held until commit); cursors lie on exact paths; leaves are candidates; the
        token store covers every node."""
        nodes = self.nodes
        nodes.check_invariants()
        self.kv.check_invariants()
        attached = nodes.attached_slots()
        if attached.size:
            assert self.tokens.capacity > attached.max(), "a node has no token row"
        blocks = nodes.block[attached]
        assert np.unique(blocks).size == blocks.size, "two trie nodes own one block"
        expected = np.zeros(self.pool.num_blocks, dtype=np.int64)
        np.add.at(expected, blocks, 1)
        borrowers: dict[int, int] = {}
        for seq in sequences:
            state = seq.prefix_state
            np.add.at(expected, seq.block_table[state.borrowed_depth :].astype(np.int64), 1)
            if state.borrowed_depth:
                borrowers[state.borrowed] = borrowers.get(state.borrowed, 0) + 1
            self._check_sequence(seq)
        assert borrowers == self.kv.pins(), "path pins differ from the sequences that borrow"
        for txn in transactions:
            if txn.open:
                np.add.at(expected, txn.displaced.astype(np.int64), 1)
        if self.checkpoints is not None:
            np.add.at(expected, np.asarray(self.checkpoints.frozen_blocks(), dtype=np.int64), 1)
            self.checkpoints.check_invariants(sequences)
            self.state_pool.check_invariants()
        self.pool.check_invariants(expected)

    def _check_sequence(self, seq: Sequence) -> None:
        state = seq.prefix_state
        for path in (state.path, state.found.path if state.found is not None else None):
            if path is not None and state.owner == self.trie_id:
                self.nodes.check_path(path)
        if state.borrowed_depth:
            borrowed = state.borrowed
            assert self.nodes.attached[borrowed] and self.nodes.depth[borrowed] == state.borrowed_depth
            runs, _ = self.nodes.path_runs(borrowed, 0)
            borrowed_blocks = self._path_blocks(runs, state.borrowed_depth)
            assert np.array_equal(seq.block_table[: state.borrowed_depth], borrowed_blocks), "borrowed table differs"
        if not self.nodes.is_valid(state.cursor, state.cursor_generation) or self.nodes.is_root[state.cursor]:
            return
        depth = int(self.nodes.depth[state.cursor])
        runs, root = self.nodes.path_runs(state.cursor, 0)
        assert root == self.nodes.find_root(seq.namespace), "cursor path leads to another namespace"
        assert depth * self.block_size <= seq.num_valid and depth <= seq.num_blocks
        assert self._same_tokens(seq, runs), "cursor path differs from the sequence's tokens"
        canonical = self._path_blocks(runs, depth)
        table = seq.block_table[:depth]
        for index in np.flatnonzero(table != canonical).tolist():
            assert state.trie_block_map.get(index) == int(canonical[index]), (
                f"block {index} is neither canonical nor a mapped private block"
            )
