"""Attach: a sequence's newly complete blocks join the trie, once and exactly.

Owns: the node lifecycle from attach to a pending node's readiness or detachment, and the
sequence's private-block map (``prefix_state.overlap.trie_block_map``): a block the sequence's next
forward still writes (not yet computed, or in the fresh range) is never replaced by a shared
trie block; ``allocate`` maps it to its canonical block instead, and swaps it once it is
computed. With ``track_pending`` (the engine's mode) a node attached before its forward ran
stays unmatchable until ``mark_computed``, and ``discard_pending`` detaches it when that
forward fails. Also enriches cached blocks with the routed-expert rows a sequence recorded.
"""

from __future__ import annotations

import numpy as np

from hybridcache.errors import InvalidBlockIdError, InvalidStepError, LifecycleError
from hybridcache.memory.protocols import KVBlockAllocator
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.lookup import PathLookup
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_state import NO_FRESH_RANGE
from hybridcache.sequence import Sequence, as_block_ids
from hybridcache.types import as_int



def forward_start(seq: Sequence, start: object) -> int:
    """The first position of the forward that computed ``seq`` up to its computed tokens: an
    int in ``[0, num_computed]``."""
    if type(start) is not int:
        start = as_int("start", start)
    if not 0 <= start <= seq.num_computed:
        raise InvalidStepError(f"forward start {start} outside [0, {seq.num_computed}]")
    return start


def position_range(start: object, end: object) -> tuple[int, int]:
    """Positions ``[start, end)``: ints with ``0 <= start <= end`` (the end may lie beyond the
    tokens: a save's block one past its step)."""
    if type(start) is not int or type(end) is not int:
        start, end = as_int("start", start), as_int("end", end)
    if not 0 <= start <= end:
        raise InvalidStepError(f"positions [{start}, {end}) are not 0 <= start <= end")
    return start, end


class Attacher:
    def __init__(
        self, lookup: PathLookup, pool: KVBlockAllocator, kv: KVLifecycle, experts: RoutedExpertStore, checkpoints, enabled: bool
    ) -> None:
        """``checkpoints``: the trie's CheckpointLifecycle or its null object."""
        self._lookup = lookup
        self.nodes = lookup.nodes
        self.tokens = lookup.tokens
        self.keyer = lookup.keyer
        self.block_size = lookup.block_size
        self.track_pending = lookup.track_pending
        self.kv = kv
        self.pool = pool
        self.experts = experts
        self.checkpoints = checkpoints
        self.enabled = enabled

    def allocate(self, seq: Sequence, upto: int | None = None) -> None:
        """Attach the sequence's complete blocks beyond its cursor to the trie.

        ``upto`` caps the tokens considered (a chunked prefill attaches only the blocks its
        next forward completes). With ``track_pending`` the new nodes whose tokens are not
        computed yet stay unmatchable until ``mark_computed``.
        """
        state = seq.prefix_state
        position = state.trie
        recompute = state.overlap
        if not self.enabled:
            recompute.fresh_range = NO_FRESH_RANGE
            return
        if not self.nodes.is_valid(position.cursor, position.cursor_generation):
            position.cursor = self._lookup.root(seq.namespace)
            position.cursor_generation = int(self.nodes.generation[position.cursor])
            position.experts_cached_blocks = 0
        node = position.cursor
        depth = int(self.nodes.depth[node])
        tokens = seq.num_valid if upto is None else min(seq.num_valid, int(upto))
        end = min(tokens // self.block_size, seq.num_blocks)
        if recompute.trie_block_map:
            self._settle_private_blocks(seq)
        if depth >= end:
            recompute.fresh_range = NO_FRESH_RANGE
            return
        self.keyer.resume_at(seq, depth, int(self.nodes.key_sums[node]))
        found_node, found_depth = self._lookup.extend_verified(seq, end)
        keys = self.keyer.extend(seq)
        if found_depth > depth:
            runs, ancestor = self.nodes.path_runs(found_node, depth)
            if ancestor != node:  # unreachable while exact paths are unique; stay exact anyway
                found_depth, found_node, runs = self._lookup.deepest_cached(seq, keys, node, depth, end)
            self._adopt_existing(
                seq, depth, self._lookup.path_blocks(runs, found_depth), self._lookup.path_pending(runs, found_depth)
            )
            node = found_node
        else:
            found_depth = depth
        if found_depth < end:
            node = self._attach_new(seq, keys, node, found_depth, end)
        position.verified, position.verified_generation = node, int(self.nodes.generation[node])
        cursor = self._undetachable(seq, node)
        position.cursor, position.cursor_generation = cursor, int(self.nodes.generation[cursor])
        recompute.fresh_range = NO_FRESH_RANGE

    def _undetachable(self, seq: Sequence, node: int) -> int:
        """The deepest node at or above ``node`` that no other sequence's failed forward can
        detach: ready, or pending on this sequence's own block. A pending leaf another sequence
        attached is adopted (its block mapped) but not held as the cursor: its producer's
        ``discard_pending`` would take it, and with it this sequence's own pending nodes above."""
        nodes = self.nodes
        table = seq.block_table
        while not nodes.is_root[node] and nodes.pending[node] and nodes.block[node] != table[int(nodes.depth[node]) - 1]:
            node = int(nodes.parent[node])
        return node

    def allocate_if_trivial(self, seq: Sequence, upto: int) -> bool:
        """``allocate(seq, upto)`` when the table will cover ``upto`` tokens and it would only
        clear the fresh range (no complete block beyond a valid cursor, no private block to
        settle): do that and return True. Otherwise change nothing and return False. Lets a
        batch of admissions skip the attach walk of a hit whose first chunk completes no block."""
        state = seq.prefix_state
        position = state.trie
        if self.enabled:
            if state.overlap.trie_block_map or not self.nodes.is_valid(position.cursor, position.cursor_generation):
                return False
            if int(self.nodes.depth[position.cursor]) < min(seq.num_valid, upto) // self.block_size:
                return False
        state.overlap.fresh_range = NO_FRESH_RANGE
        return True

    def validated_new_blocks(self, seq: Sequence, block_ids: object) -> np.ndarray:
        """``block_ids`` as a flat int32 array of in-use blocks, distinct and absent from the
        sequence's table (blocks an engine grew the table with itself)."""
        ids = as_block_ids(block_ids, self.pool.num_blocks)
        table = seq.block_table
        if ids.size == 1:  # the common step: one block a decode or a short prefill appended
            repeated = bool((table == ids[0]).any())
        else:
            repeated = np.unique(ids).size != ids.size or bool(np.isin(ids, table).any())
        if repeated:
            raise InvalidBlockIdError("a block appears twice in the sequence's table")
        if any(self.pool.refcount_of(int(block)) <= 0 for block in ids.tolist()):
            raise LifecycleError("a handed-over block is free: allocate it before attaching")
        return ids

    def _adopt_existing(self, seq: Sequence, first_index: int, canonical: np.ndarray, pending: np.ndarray) -> None:
        """Point the table at existing trie blocks where safe; keep private blocks the next
        forward writes (not yet computed, or in the fresh range), and private blocks whose
        canonical node is still pending, and map them instead."""
        state = seq.prefix_state
        recompute = state.overlap
        indices = np.arange(first_index, first_index + canonical.size)
        current = seq.block_table[first_index : first_index + canonical.size].copy()
        differs = current != canonical
        fresh_start, fresh_end = recompute.fresh_range
        writes_next = (
            (indices >= seq.num_computed // self.block_size) | ((indices >= fresh_start) & (indices < fresh_end)) | pending
        )
        swap = differs & ~writes_next
        if swap.any():
            self.pool.ref(canonical[swap], unique=True)
            seq.write_blocks(first_index, np.where(swap, canonical, current))
            self.pool.unref(current[swap])
        for index, block in zip(indices[differs & writes_next].tolist(), canonical[differs & writes_next].tolist()):
            recompute.trie_block_map[index] = block
        for index in indices[~differs | swap].tolist():
            recompute.trie_block_map.pop(index, None)

    def _settle_private_blocks(self, seq: Sequence) -> None:
        """Replace private duplicates the sequence has finished computing by their canonical
        trie blocks, so duplicates live only while a forward still writes them."""
        state = seq.prefix_state
        position = state.trie
        recompute = state.overlap
        computed_blocks = seq.num_computed // self.block_size
        done = [i for i in recompute.trie_block_map if i < computed_blocks and not recompute.in_fresh_range(i)]
        if not done or not self.nodes.is_valid(position.cursor, position.cursor_generation):
            return
        first = min(done)
        runs, _ = self.nodes.path_runs(position.cursor, first)
        if not runs:
            return
        depth = int(self.nodes.depth[position.cursor])
        canonical = self._lookup.path_blocks(runs, depth)
        pending = self._lookup.path_pending(runs, depth)
        settled = {i: int(canonical[i - first]) for i in done if i - first < canonical.size and not pending[i - first]}
        for index, block in settled.items():
            self.pool.ref([block])
            replaced = seq.write_blocks(index, [block])
            self.pool.unref(replaced)
            del recompute.trie_block_map[index]

    def _attach_new(self, seq: Sequence, keys: np.ndarray, parent: int, first: int, end: int) -> int:
        size = self.block_size
        identities = {i - first: spans for i, spans in seq.prefix_state.keys.mm_blocks.items() if first <= i < end}
        pending = False
        if self.track_pending:
            pending = np.arange(first, end) >= seq.num_computed // size
        sums = seq.prefix_state.keys.block_sums[first:end]
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
            seq.prefix_state.overlap.trie_block_map.pop(index, None)
        return int(slots[-1])

    def exclusive_blocks(self, seq: Sequence, start: int, end: int) -> frozenset[int]:
        """Blocks the sequence may write for positions ``[start, end)``: held by it alone, or
        co-owned only by a pending trie node it attached itself (its own uncomputed block).
        A borrowed block is never writable."""
        start, end = position_range(start, end)
        size = self.block_size
        indices = range(max(start // size, seq.prefix_state.borrow.depth), -(-end // size))
        table = seq.block_table
        own_pending = set()
        state = seq.prefix_state
        position = state.trie
        if self.track_pending and self.nodes.is_valid(position.cursor, position.cursor_generation):
            runs, _ = self.nodes.path_runs(position.cursor, start // size)
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
        start = forward_start(seq, start)
        state = seq.prefix_state
        position = state.trie
        if not self.track_pending or not self.nodes.is_valid(position.cursor, position.cursor_generation):
            return
        nodes = self.nodes
        high = min(int(nodes.depth[position.cursor]), seq.num_computed // self.block_size)
        low = start // self.block_size
        if high <= low:
            return
        runs, _ = nodes.path_runs(position.cursor, low)
        table = seq.block_table
        for first, last in nodes.clip_runs(runs, high, low):
            slots = np.arange(first, last + 1)
            own = nodes.block[slots] == table[nodes.depth[slots] - 1]
            nodes.mark_ready(slots[own])
        self.checkpoints.invalidate_searches()

    def discard_pending(self, seq: Sequence) -> int:
        """A forward of ``seq`` failed: detach the pending leaves it attached for blocks it did
        not write (and their checkpoints), so nothing it would have produced stays matchable.
        Returns how many nodes were detached."""
        state = seq.prefix_state
        position = state.trie
        nodes = self.nodes
        detached = 0
        node = position.cursor
        while (
            nodes.is_valid(node, position.cursor_generation if node == position.cursor else int(nodes.generation[node]))
            and not nodes.is_root[node]
            and nodes.pending[node]
            and nodes.num_children[node] == 0
            and nodes.block[node] == seq.block_table[int(nodes.depth[node]) - 1]
        ):
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
            position.cursor, position.cursor_generation = node, int(nodes.generation[node])
            position.verified, position.verified_generation = node, int(nodes.generation[node])
            if not nodes.is_root[node] and nodes.num_children[node] == 0:
                self.kv.offer_leaf(node)
        return detached

    def cache_routed_experts(self, seq: Sequence) -> None:
        """Give cached blocks on the sequence's path the expert rows it has recorded.

        Only blocks completed since the last call are visited (a watermark on the sequence).
        """
        state = seq.prefix_state
        position = state.trie
        if not self.enabled or not seq.want_routed_experts:
            return
        self.checkpoints.attach_pending_tail_experts(seq)
        if not self.nodes.is_valid(position.cursor, position.cursor_generation):
            return
        size = self.block_size
        covered = min(seq.num_routed_experts // size, int(self.nodes.depth[position.cursor]))
        first = position.experts_cached_blocks
        if covered <= first:
            return
        runs, _ = self.nodes.path_runs(position.cursor, first)
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
        position.experts_cached_blocks = covered
        if stored:
            self.checkpoints.invalidate_searches()  # a checkpoint miss for want of these rows may now hit
