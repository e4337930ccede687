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

from dataclasses import dataclass

import numpy as np

from hybridcache.errors import InvalidArgumentError, StaleHandleError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_cache.stats import MatchCounters, MissReason, PrefixCacheStats
from hybridcache.prefix_cache.token_store import TokenStore
from hybridcache.prefix_state import NO_NODE
from hybridcache.sequence import Sequence

_EMPTY_RANGE = (0, 0)
Runs = list[tuple[int, int]]


@dataclass
class MatchTxn:
    """Undo record of one tentative match; the caller commits or rolls it back exactly once.

    Blocks the match displaced from the sequence's table stay referenced by the transaction
    until commit, so a rollback can put them back even if pools were used in between.
    """

    seq: Sequence
    step_before: int
    cursor_before: tuple[int, int]
    fresh_before: tuple[int, int]
    match_start_before: int
    stats_before: MatchCounters
    num_blocks_before: int
    table_start: int = 0
    taken: np.ndarray = None  # type: ignore[assignment]
    displaced: np.ndarray = None  # type: ignore[assignment]
    step_after: int = 0
    hit_tokens: int = 0
    open: bool = True


def _empty_ids() -> np.ndarray:
    return np.empty(0, dtype=np.int32)


class BlockTrie:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        enabled: bool = True,
        keyer: BlockKeyer | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
            raise InvalidArgumentError(f"block_size must be an even int >= 2, got {block_size!r}")
        if keyer is not None and keyer.block_size != block_size:
            raise InvalidArgumentError("keyer block size differs from the trie's")
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

    # --- match ---------------------------------------------------------------------------------

    def match(self, seq: Sequence) -> MatchTxn:
        """Tentatively reuse the longest exactly cached prefix beyond ``seq.num_computed``."""
        state = seq.prefix_state
        txn = MatchTxn(
            seq=seq,
            step_before=seq.num_computed,
            cursor_before=(state.cursor, state.cursor_generation),
            fresh_before=state.fresh_range,
            match_start_before=state.match_start_step,
            stats_before=self.stats.snapshot(),
            num_blocks_before=seq.num_blocks,
            taken=_empty_ids(),
            displaced=_empty_ids(),
            step_after=seq.num_computed,
        )
        state.fresh_range = _EMPTY_RANGE
        state.match_start_step = seq.num_computed
        if not self.enabled:
            return txn
        size = self.block_size
        keys = self.keyer.extend(seq)
        start = seq.num_computed
        base, base_depth = self._resume_point(seq)
        limit = (seq.num_valid - 1) // size
        raw_depth, raw_node, runs = self._deepest_cached(seq, keys, base, base_depth, limit)
        accepted, reason = self._accepted_depth(seq, raw_depth, base_depth, runs, limit)
        node = raw_node if accepted == raw_depth else (
            base if accepted == base_depth else NodeTable.slot_at_depth(runs, self.nodes.depth, accepted)
        )
        if accepted * size > start:
            self._apply_hit(seq, txn, runs, base_depth, accepted)
        elif limit <= start // size:
            reason = MissReason.NOTHING_TO_MATCH
        elif raw_depth * size <= start:
            reason = MissReason.NO_CACHED_PREFIX
        state.cursor, state.cursor_generation = node, int(self.nodes.generation[node])
        if raw_depth > accepted:
            state.fresh_range = (accepted, raw_depth)
        if not state.suppress_stats:
            self.stats.record_match(seq.num_tokens - start, txn.hit_tokens, reason)
        return txn

    def commit(self, txn: MatchTxn) -> None:
        """Make a match final: drop the references on blocks it displaced."""
        self._close(txn)
        if txn.displaced.size:
            self.pool.unref(txn.displaced)

    def rollback(self, txn: MatchTxn) -> None:
        """Undo a match exactly: table, references, step, cursor, fresh range and statistics."""
        seq = txn.seq
        expected_blocks = max(txn.num_blocks_before, txn.table_start + txn.taken.size)
        if seq.num_computed != txn.step_after or seq.num_blocks != expected_blocks:
            raise StaleHandleError("the sequence changed after the match; roll back before allocating")
        self._close(txn)
        if txn.taken.size:
            seq.write_blocks(txn.table_start, txn.displaced)
            seq.truncate_blocks(txn.num_blocks_before)
            self.pool.unref(txn.taken, unique=True)
        seq.set_computed(txn.step_before)
        state = seq.prefix_state
        state.cursor, state.cursor_generation = txn.cursor_before
        state.fresh_range = txn.fresh_before
        state.match_start_step = txn.match_start_before
        self.stats.restore(txn.stats_before)

    @staticmethod
    def _close(txn: MatchTxn) -> None:
        if not txn.open:
            raise StaleHandleError("this match was already committed or rolled back")
        txn.open = False

    def _resume_point(self, seq: Sequence) -> tuple[int, int]:
        """The deepest node known to match ``seq`` at or below its computed blocks."""
        state = seq.prefix_state
        if self.nodes.is_valid(state.cursor, state.cursor_generation):
            node = state.cursor
            depth = int(self.nodes.depth[node])
            computed_blocks = seq.num_computed // self.block_size
            if depth > computed_blocks:
                _, node = self.nodes.path_runs(node, computed_blocks)
                depth = computed_blocks
            return node, depth
        return self.nodes.root(seq.namespace), 0

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

    def _apply_hit(self, seq: Sequence, txn: MatchTxn, runs: Runs, base_depth: int, accepted: int) -> None:
        start = seq.num_computed
        ids = self._path_blocks(runs, accepted)
        self.pool.ref(ids, unique=True)
        txn.table_start = base_depth
        txn.taken = ids
        txn.displaced = seq.write_blocks(base_depth, ids)
        seq.set_computed(accepted * self.block_size)
        txn.step_after = seq.num_computed
        txn.hit_tokens = seq.num_computed - start
        if seq.want_routed_experts and seq.num_routed_experts == start:
            rows = self.experts.gather(self._clip_runs(runs, accepted))
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
            block_tokens = seq.token_view(depth * size, (depth + 1) * size)
            expected_identity = identities.get(depth)
            for candidate in nodes.candidates(int(keys[depth])):
                if (
                    nodes.parent[candidate] == node
                    and nodes.extra_identity.get(candidate) == expected_identity
                    and np.array_equal(self.tokens.run(candidate, candidate), block_tokens)
                ):
                    node, depth = candidate, depth + 1
                    break
            else:
                break
        runs, _ = nodes.path_runs(node, base_depth)
        return depth, node, runs

    def _same_tokens(self, seq: Sequence, runs: Runs) -> bool:
        depth, size = self.nodes.depth, self.block_size
        return all(
            np.array_equal(self.tokens.run(first, last), seq.token_view((depth[first] - 1) * size, depth[last] * size))
            for first, last in runs
        )

    def _same_identity(self, seq: Sequence, runs: Runs, base: int, node: int, base_depth: int, depth: int) -> bool:
        nodes = self.nodes
        expected = {i: spans for i, spans in seq.prefix_state.mm_blocks.items() if base_depth <= i < depth}
        if int(nodes.mm_count[node] - nodes.mm_count[base]) != len(expected):
            return False
        return all(
            nodes.extra_identity.get(NodeTable.slot_at_depth(runs, nodes.depth, index + 1)) == spans
            for index, spans in expected.items()
        )

    def _clip_runs(self, runs: Runs, max_depth: int) -> Runs:
        """The part of a path (runs, deepest first) at depths <= ``max_depth``."""
        depth = self.nodes.depth
        clipped = []
        for first, last in runs:
            if depth[first] > max_depth:
                continue
            clipped.append((first, last - max(0, int(depth[last]) - max_depth)))
        return clipped

    def _path_blocks(self, runs: Runs, max_depth: int) -> np.ndarray:
        """Block ids of a path in table order, up to ``max_depth``."""
        block = self.nodes.block
        parts = [block[first : last + 1] for first, last in reversed(self._clip_runs(runs, max_depth))]
        return np.concatenate(parts).astype(np.int32) if parts else _empty_ids()

    # --- allocate ------------------------------------------------------------------------------

    def allocate(self, seq: Sequence) -> None:
        """Attach the sequence's complete blocks beyond its cursor to the trie."""
        state = seq.prefix_state
        if not self.enabled:
            state.fresh_range = _EMPTY_RANGE
            return
        keys = self.keyer.extend(seq)
        if not self.nodes.is_valid(state.cursor, state.cursor_generation):
            state.cursor = self.nodes.root(seq.namespace)
            state.cursor_generation = int(self.nodes.generation[state.cursor])
        node = state.cursor
        depth = int(self.nodes.depth[node])
        end = min(seq.num_valid // self.block_size, seq.num_blocks)
        if state.trie_block_map:
            self._settle_private_blocks(seq)
        if depth >= end:
            state.fresh_range = _EMPTY_RANGE
            return
        found_depth, found_node, runs = self._deepest_cached(seq, keys, node, depth, end)
        if found_depth > depth:
            self._adopt_existing(seq, depth, self._path_blocks(runs, found_depth))
            node = found_node
        if found_depth < end:
            node = self._attach_new(seq, keys, node, found_depth, end)
        state.cursor, state.cursor_generation = node, int(self.nodes.generation[node])
        state.fresh_range = _EMPTY_RANGE

    def _adopt_existing(self, seq: Sequence, first_index: int, canonical: np.ndarray) -> None:
        """Point the table at existing trie blocks where safe; keep private blocks the next
        forward writes (not yet computed, or in the fresh range) and map them instead."""
        state = seq.prefix_state
        indices = np.arange(first_index, first_index + canonical.size)
        current = seq.block_table[first_index : first_index + canonical.size].copy()
        differs = current != canonical
        fresh_start, fresh_end = state.fresh_range
        writes_next = (indices >= seq.num_computed // self.block_size) | ((indices >= fresh_start) & (indices < fresh_end))
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
        canonical = self._path_blocks(runs, int(self.nodes.depth[state.cursor]))
        settled = {i: int(canonical[i - first]) for i in done if i - first < canonical.size}
        for index, block in settled.items():
            self.pool.ref([block])
            replaced = seq.write_blocks(index, [block])
            self.pool.unref(replaced)
            del state.trie_block_map[index]

    def _attach_new(self, seq: Sequence, keys: np.ndarray, parent: int, first: int, end: int) -> int:
        size = self.block_size
        identities = {i - first: spans for i, spans in seq.prefix_state.mm_blocks.items() if first <= i < end}
        slots = self.nodes.attach_run(parent, keys[first:end].copy(), seq.block_table[first:end], identities)
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

    # --- routed experts ------------------------------------------------------------------------

    def cache_routed_experts(self, seq: Sequence) -> None:
        """Give cached blocks on the sequence's path the expert rows it has recorded.

        Only blocks completed since the last call are visited (a watermark on the sequence).
        """
        state = seq.prefix_state
        if not self.enabled or not seq.want_routed_experts:
            return
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
        for run_first, run_last in self._clip_runs(runs, covered):
            slots = np.arange(run_first, run_last + 1)
            missing = slots[~self.experts.has_rows[slots]]
            if missing.size:
                token_starts = (depth[missing] - 1) * size
                gathered = rows[(token_starts[:, None] + np.arange(size)).reshape(-1)]
                self.experts.store(missing, gathered)
        state.experts_cached_blocks = covered

    # --- eviction and release ------------------------------------------------------------------

    def evict(self, count: int) -> int:
        """Free up to ``count`` KV blocks by evicting least recently used trie leaves."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise InvalidArgumentError(f"count must be a non-negative int, got {count!r}")
        if not self.enabled or count == 0:
            return 0
        evicted = self.kv.evict(int(count))
        for slot in evicted:
            self.experts.forget(slot)
        self.stats.evicted_blocks += len(evicted)
        return len(evicted)

    def clear(self) -> int:
        """Evict every block only the trie holds."""
        return self.evict(self.nodes.num_attached)

    def free_sequence(self, seq: Sequence) -> None:
        """Release a finished or cancelled sequence: its block references and its tracking."""
        self.pool.release_table(seq)
        seq.prefix_state.clear_tracking()
        seq.set_computed(0)

    # --- diagnostics ---------------------------------------------------------------------------

    def check_invariants(self, sequences: tuple[Sequence, ...] | list[Sequence] = ()) -> None:
        """Refcounts equal trie plus sequence owners; cursors lie on exact paths; leaves are
        candidates; the token store covers every node."""
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
        for seq in sequences:
            np.add.at(expected, seq.block_table.astype(np.int64), 1)
            self._check_sequence(seq)
        self.pool.check_invariants(expected)

    def _check_sequence(self, seq: Sequence) -> None:
        state = seq.prefix_state
        if not self.nodes.is_valid(state.cursor, state.cursor_generation) or self.nodes.is_root[state.cursor]:
            return
        depth = int(self.nodes.depth[state.cursor])
        runs, root = self.nodes.path_runs(state.cursor, 0)
        assert root == self.nodes.root(seq.namespace), "cursor path leads to another namespace"
        assert depth * self.block_size <= seq.num_valid and depth <= seq.num_blocks
        assert self._same_tokens(seq, runs), "cursor path differs from the sequence's tokens"
        canonical = self._path_blocks(runs, depth)
        table = seq.block_table[:depth]
        for index in np.flatnonzero(table != canonical).tolist():
            assert state.trie_block_map.get(index) == int(canonical[index]), (
                f"block {index} is neither canonical nor a mapped private block"
            )
