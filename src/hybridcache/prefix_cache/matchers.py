"""Matching: the deepest prefix a request may reuse, one matcher per kind of trie.

Owns: the remembered checkpoint search on each sequence (``prefix_state.trie.last_search``, a
``CheckpointSearch``) and the match fields it sets on a hit (step, restore selection, fresh
range, replayed routed experts). The kind is chosen once, when the trie is built:

* ``BlockMatcher`` (attention-only): the deepest cached block path, after the policy cuts
  (recompute overlap, routed experts, multimodal boundary).
* ``CheckpointMatcher`` (hybrid): the deepest exactly verified published checkpoint; a KV path
  without one is a miss. Candidate steps come from the namespace's sorted steps; each probe
  hashes one block (the anchor's last) and looks up one bucket; the winner's prefix is compared
  only beyond what was verified before.

Both take their blocks through ``MatchBook.take_path_blocks`` and compare through
``PathLookup``; neither holds a reference to a sequence beyond one call.

The token ranges of a hybrid hit (``B`` = block size)::

    0        base_depth*B        anchor*B   step                 cached_depth*B
    |--computed--|---- taken from the trie ---|tail|--fresh range (recomputed)--|
                 ^ resume point                ^ checkpoint state restored here
    borrowed depth = anchor (a match from the root borrows the path with one pin);
    blocks from ``step // B`` on stay private to the sequence until its forward computes them.
"""

from __future__ import annotations

import numpy as np

from hybridcache.prefix_cache.checkpoint_index import HIT, CheckpointIndex, VerifyStatus
from hybridcache.prefix_cache.checkpoint_lifecycle import CheckpointLifecycle
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointSearch
from hybridcache.prefix_cache.lookup import PathLookup
from hybridcache.prefix_cache.match_txn import MatchBook, MatchTxn
from hybridcache.prefix_cache.node import NodePath, Runs
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_cache.stats import MissReason
from hybridcache.prefix_state import NO_FRESH_RANGE
from hybridcache.sequence import Sequence

# A miss probing more candidate steps than this first checks the request's first block.
_PROBES_BEFORE_FIRST_BLOCK_TEST = 4
# Up to this many probes, hashing each probe block when it is probed beats one vectorized call.
_SCALAR_PROBES = 8


class BlockMatcher:
    """Matching for an attention-only trie."""

    def __init__(self, lookup: PathLookup, book: MatchBook, experts: RoutedExpertStore) -> None:
        self._lookup = lookup
        self._book = book
        self.nodes = lookup.nodes
        self.experts = experts
        self.block_size = lookup.block_size

    def prepare(self, seq: Sequence) -> NodePath:
        """The request's deepest exactly verified cached path (keys only beyond the run it follows)."""
        lookup = self._lookup
        limit = (seq.num_valid - 1) // self.block_size
        if limit > 0 and lookup.fresh_from_root(seq):
            return lookup.verify_from_root(seq, limit)
        node, depth = lookup.extend_verified(seq, limit)
        return lookup.path_of(seq, node, depth)

    def match(self, seq: Sequence, txn: MatchTxn, base: int, base_depth: int) -> tuple[tuple[int, int], MissReason | None]:
        """Attention-only match: the new cursor handle and why the hit fell short, if it did."""
        path = self._remembered_whole(seq, base_depth)
        if path is not None:
            return self._take_whole(seq, txn, path), None
        path = self.prepare(seq)
        size, start = self.block_size, seq.num_computed
        limit = (seq.num_valid - 1) // size
        raw_depth = path.depth
        if raw_depth <= base_depth:
            reason = MissReason.NOTHING_TO_MATCH if limit <= start // size else MissReason.NO_CACHED_PREFIX
            return self._lookup.handle(base), reason
        window = self.nodes.clip_runs(path.runs, raw_depth, base_depth)
        accepted, reason = self._accepted_depth(seq, raw_depth, base_depth, window, limit)
        if raw_depth > accepted:
            seq.prefix_state.overlap.fresh_range = (accepted, raw_depth)
        if accepted * size <= start:
            return self._lookup.handle(base), reason or MissReason.NO_CACHED_PREFIX
        node = path.slot_at(self.nodes, accepted)
        self._apply_hit(seq, txn, window, base_depth, accepted, node)
        return self._lookup.handle(node), reason

    def _remembered_whole(self, seq: Sequence, base_depth: int) -> NodePath | None:
        """The path ingest verified when ``match`` would take exactly all of it, else None.

        It is the path of the verified node, which still holds its generation (an attached
        node's path never changes) and lies as deep as the request can match, so ``prepare``
        would return it unchanged (no lookup, nothing to descend; none of it is pending: a
        path verified with a pending node is kept clipped above it, not as the verified
        node's, and a node never becomes pending again); nothing is computed or held
        (taken from the root with one borrow); and no policy cut applies (no recompute
        overlap, routed experts or multimodal span). ``match`` then is one chain: borrow the
        path, write its blocks, set the step."""
        state = seq.prefix_state
        position = state.trie
        path = position.verified_path
        if (
            path is None
            or base_depth
            or path.node != position.verified
            or path.generation != position.verified_generation
            or path.depth != (seq.num_valid - 1) // self.block_size
            or path.depth == 0
            or seq.num_computed
            or state.borrow.depth
            or state.overlap.recompute_blocks
            or seq.want_routed_experts
            or seq.spans
            or not self._book.borrow_paths
            or not self.nodes.is_valid(path.node, path.generation)
        ):
            return None
        return path

    def _take_whole(self, seq: Sequence, txn: MatchTxn, path: NodePath) -> tuple[int, int]:
        """``_apply_hit`` of a ``_remembered_whole`` path: the same borrow, table, step and
        transaction fields; returns the cursor handle (the path's node)."""
        self._book.take_path_blocks(seq, txn, self.nodes.path_blocks(path), 0, path.node)  # the borrowing branch
        seq.set_computed(path.depth * self.block_size)
        txn.step_after = txn.hit_tokens = seq.num_computed
        return path.node, path.generation

    def _accepted_depth(
        self, seq: Sequence, raw_depth: int, base_depth: int, runs: Runs, limit: int
    ) -> tuple[int, MissReason | None]:
        """Apply the policy cuts to the deepest cached depth; return the depth and why it shrank."""
        accepted, reason = raw_depth, None
        overlap_limit = limit - seq.prefix_state.overlap.recompute_blocks
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

    def _apply_hit(
        self, seq: Sequence, txn: MatchTxn, runs: Runs, base_depth: int, accepted: int, node: int
    ) -> None:
        start = seq.num_computed
        runs = self.nodes.clip_runs(runs, accepted)
        self._book.take_path_blocks(seq, txn, self.nodes.run_blocks(runs), base_depth, node)
        seq.set_computed(accepted * self.block_size)
        txn.step_after = seq.num_computed
        txn.hit_tokens = seq.num_computed - start
        if seq.want_routed_experts and seq.num_routed_experts == start:
            rows = self.experts.gather(runs)
            seq.append_routed_experts(rows[start - base_depth * self.block_size :])


class CheckpointMatcher:
    """Matching for a hybrid trie: every hit restores a published checkpoint."""

    def __init__(
        self, lookup: PathLookup, book: MatchBook, experts: RoutedExpertStore, checkpoints: CheckpointLifecycle
    ) -> None:
        self._lookup = lookup
        self._book = book
        self.nodes = lookup.nodes
        self.keyer = lookup.keyer
        self.block_size = lookup.block_size
        self.track_pending = lookup.track_pending
        self.experts = experts
        self.checkpoints = checkpoints
        self.index: CheckpointIndex = checkpoints.index

    def prepare(self, seq: Sequence) -> NodePath:
        """Search the request's deepest exact checkpoint (remembered on the sequence) and
        return the path verified on the way."""
        return self.find(seq).path

    def match(self, seq: Sequence, txn: MatchTxn, base: int, base_depth: int) -> tuple[tuple[int, int], MissReason | None]:
        """Hybrid match: the new cursor handle (the checkpoint's anchor on a hit) and the miss
        reason."""
        found = self.find(seq)
        record = found.record
        if record is None:
            return self._lookup.handle(base), found.reason
        self._apply_restore(seq, txn, found, base_depth)
        return (record.anchor, record.anchor_generation), None

    def find(self, seq: Sequence) -> CheckpointSearch:
        """The deepest published checkpoint in ``(num_computed, num_valid - 1]`` whose whole
        prefix equals the request's, deepest step first. Candidate steps come from the
        namespace's sorted steps; each probe hashes one block (the anchor's last) and looks up
        one bucket; the winner's prefix is compared only beyond what was verified before."""
        start = seq.num_computed
        state = seq.prefix_state
        position = state.trie
        highest = seq.num_valid - 1
        # What a search depends on besides the cache: where it starts, the last valid token
        # and the recompute overlap.
        window = (start, highest, state.overlap.recompute_blocks)
        earlier = position.last_search
        if self._reusable(earlier, window):
            return earlier  # nothing that could change the outcome happened since it was found
        self.keyer.identity(seq)
        if highest <= start:
            return CheckpointSearch(None, self._lookup.base_path(seq), 0, MissReason.NOTHING_TO_MATCH)
        found = None
        if earlier is not None and earlier.record is None:
            if (
                earlier.window == window
                and earlier.epoch == self.index.epoch
                and earlier.reason is not MissReason.RECOMPUTE_OVERLAP  # newly attached KV could end it
            ):
                # Nothing that could turn it into a hit happened since ingest; evictions may
                # have moved the verified node, so the path is taken afresh.
                found = earlier._replace(path=self._lookup.base_path(seq), version=self.nodes.version)
        elif earlier is not None and earlier.window == window and self._still_usable(earlier.record):
            # Ingest already verified this checkpoint: only deeper steps published since count,
            # and the KV after it (recompute overlap) is looked at again.
            found = self._search(seq, self.index.candidate_steps(seq.namespace, earlier.record.step, highest), window)
            if found.record is None:
                cached_depth = self._lookup.cached_depth(seq, earlier.path)
                overlap = seq.prefix_state.overlap.recompute_blocks * self.block_size
                found = None
                if cached_depth * self.block_size >= earlier.record.step + overlap:
                    found = earlier._replace(
                        cached_depth=cached_depth, epoch=self.index.epoch, version=self.nodes.version
                    )
        if found is None:
            found = self._search(seq, self.index.candidate_steps(seq.namespace, start, highest), window)
        position.last_search = found
        return found

    def _reusable(self, earlier: CheckpointSearch | None, window: tuple[int, int, int]) -> bool:
        return (
            earlier is not None
            and earlier.window == window
            and earlier.epoch == self.index.epoch
            and earlier.version == self.nodes.version
            and (earlier.record is None or earlier.record.is_published)
        )

    def remembered_hits(self, seqs: list[Sequence], owner: int) -> list[CheckpointSearch]:
        """The remembered searches of the leading ``seqs`` (up to the first that is not one)
        whose ``match`` would take exactly that hit, from the root, as the record's whole
        anchor path below the first block and nothing else: owned by ``owner``, nothing
        computed or held, no routed experts wanted, the search reusable as ``find`` reuses
        it. Changes nothing."""
        size = self.block_size
        hits = []
        for seq in seqs:
            state = seq.prefix_state
            found = state.trie.last_search
            record = None if found is None else found.record
            if (
                record is None
                or state.trie.owner != owner
                or seq.num_computed
                or seq.num_blocks
                or state.borrow.depth
                or seq.want_routed_experts
                or record.step < size
                or found.path.depth != record.step // size
                or not self._reusable(found, (0, seq.num_valid - 1, state.overlap.recompute_blocks))
            ):
                break
            hits.append(found)
        return hits

    def apply_remembered_hits(self, seqs: list[Sequence], records: list[CheckpointRecord]) -> tuple[int, int, int]:
        """What ``match`` sets for each of ``seqs`` hitting ``records[k]`` as its remembered
        hit (its path already borrowed): the step, the cursor at the anchor, the fresh range
        (empty: the chunk attaches nothing). Returns what the match counters take: the hits
        counted (a sequence may suppress its statistics), tokens asked and tokens hit."""
        empty = NO_FRESH_RANGE
        counted = query = hit = 0
        for seq, record in zip(seqs, records):
            state = seq.prefix_state
            position = state.trie
            step = record.step
            seq.set_computed(step)
            position.cursor, position.cursor_generation = record.anchor, record.anchor_generation
            state.overlap.fresh_range = empty
            if not state.suppress_stats:
                counted, query, hit = counted + 1, query + seq.num_tokens, hit + step
        return counted, query, hit

    def _still_usable(self, record: CheckpointRecord | None) -> bool:
        return (
            record is not None
            and record.is_published
            and record.ready
            and self.nodes.is_valid(record.anchor, record.anchor_generation)
        )

    def _search(self, seq: Sequence, steps: list[int], window: tuple[int, int, int]) -> CheckpointSearch:
        """The deepest of ``steps`` (deepest first) whose checkpoint fits the request exactly;
        on a miss, the verified path and the reason. ``window`` is what the search is for (see
        ``_find_checkpoint``)."""
        size, index = self.block_size, self.index
        epoch, version = index.epoch, self.nodes.version
        first_cached = None
        if len(steps) > _PROBES_BEFORE_FIRST_BLOCK_TEST:
            first_cached = self._lookup.first_block_cached(seq, self._lookup.base_path(seq))
            if not first_cached:  # every checkpoint beyond the first block lies on a cached first block
                steps = [step for step in steps if step < size]
        # A hit usually comes at the first probe: hash lazily unless many probes are certain.
        values = self._anchor_values(seq, steps) if len(steps) > _SCALAR_PROBES else None
        overlap = seq.prefix_state.overlap.recompute_blocks * size
        namespace = seq.namespace
        reason = None
        for step in steps:
            anchor_depth = step // size
            key = (step, self._probe_value(seq, anchor_depth, values))
            for record in index.bucket(namespace, key):
                verdict = index.verify(record, key, seq)
                if verdict is not HIT:
                    if verdict.status is not VerifyStatus.REQUEST_MISMATCH:
                        self.checkpoints.clean_stale(record, key, verdict)
                    continue
                path = self._path_to_anchor(seq, record, anchor_depth)
                if path is None:
                    continue
                cached_depth = self._lookup.cached_depth(seq, path) if overlap else path.depth
                if overlap and cached_depth * size < step + overlap:
                    reason = MissReason.RECOMPUTE_OVERLAP
                    continue
                return CheckpointSearch(record, path, cached_depth, None, window, epoch, version)
        base_path = self._lookup.base_path(seq)
        if reason is None:
            if first_cached is None:
                first_cached = self._lookup.first_block_cached(seq, base_path)
            reason = MissReason.NO_CHECKPOINT if first_cached else MissReason.NO_CACHED_PREFIX
        return CheckpointSearch(None, base_path, 0, reason, window, epoch, version)

    def _probe_value(self, seq: Sequence, anchor_depth: int, values: dict[int, int] | None) -> int:
        """What a checkpoint anchored at ``anchor_depth`` is indexed under besides its step: the
        keyed value of the request's block ending at the anchor (taken from ``values`` when
        they were hashed together), or the namespace root's key for an anchor at the root."""
        if anchor_depth == 0:
            return int(self.nodes.key[self._lookup.root(seq.namespace)])
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
        return dict(zip(ordered, self.keyer.block_values(seq, np.asarray(ordered) - 1).tolist()))

    def _path_to_anchor(self, seq: Sequence, record: CheckpointRecord, depth: int) -> NodePath | None:
        """The record's anchor path when it equals the request's prefix (and its blocks carry
        routed experts when the request wants them), else None. Only tokens beyond the verified
        node are compared; a deeper match becomes the new verified node."""
        nodes, state = self.nodes, seq.prefix_state
        position = state.trie
        anchor, path = record.anchor, record.anchor_path
        base, base_depth = self._lookup.verified_or_root(seq)
        if depth <= base_depth:
            base_path = self._lookup.path_of(seq, base, base_depth)
            if base_path.depth < depth or base_path.slot_at(nodes, depth) != anchor:
                return None
        else:
            runs, ancestor = (path.runs, path.root) if base_depth == 0 else nodes.path_runs(anchor, base_depth)
            if ancestor != base or not self._lookup.same_tokens(seq, runs):
                return None
            if not self._lookup.same_identity(seq, runs, base, anchor, base_depth, depth):
                return None
            if self.track_pending and nodes.first_pending_depth(runs) is not None:
                return None
            position.verified, position.verified_generation = anchor, record.anchor_generation
            path = self._lookup.path_of(seq, anchor, depth, path)
            if path.depth < depth:  # a node at or above the verified one is still pending
                return None
        if seq.want_routed_experts and self.experts.first_missing_depth(path.runs, nodes.depth) is not None:
            return None
        return path

    def _apply_restore(self, seq: Sequence, txn: MatchTxn, found: CheckpointSearch, base_depth: int) -> None:
        record, path = found.record, found.path
        size, start, step = self.block_size, txn.step_before, record.step
        anchor_depth = step // size
        if base_depth == 0 and path.depth == anchor_depth:  # the verified path is exactly the part to take
            window, ids = path.runs, self.nodes.path_blocks(path)
        else:
            window = self.nodes.clip_runs(path.runs, anchor_depth, base_depth)
            ids = self.nodes.run_blocks(window)
        self._book.take_path_blocks(seq, txn, ids, base_depth, record.anchor)
        seq.set_computed(step)
        txn.step_after = step
        txn.hit_tokens = step - start
        self.checkpoints.select_restore(seq, record)
        if seq.want_routed_experts and seq.num_routed_experts == start:
            rows = self.experts.gather(window)
            if record.tail_experts is not None:
                rows = np.concatenate([rows, record.tail_experts]) if rows.size else record.tail_experts
            seq.append_routed_experts(rows[start - base_depth * size :])
        seq.prefix_state.overlap.fresh_range = (anchor_depth, max(found.cached_depth, -(-step // size)))
