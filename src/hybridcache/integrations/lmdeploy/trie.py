"""``LmdeployBlockTrie``: hybridcache's BlockTrie behind lmdeploy's ``BlockTrie`` surface.

Owns: the composition (a hybridcache ``BlockTrie`` over lmdeploy's allocator and state
manager, one reference per block per holder, one checkpoint per anchor as lmdeploy keeps)
and lmdeploy's match statistics (``stats``: query and hit tokens counted lmdeploy's way,
snapshot and restored by lmdeploy's scheduler around a tentative admission). Matching,
attaching, eviction and the checkpoint lifecycle are hybridcache's; this class syncs the
shadow of each lmdeploy sequence in, calls the trie, and writes the outcome back onto
lmdeploy's sequence (``logical_blocks``, step, ``prefix_cache`` fields).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridcache.errors import HybridCacheError, InvalidTypeError
from hybridcache.integrations.lmdeploy.checkpoints import StateCheckpoints
from hybridcache.integrations.lmdeploy.pools import AllocatorBlocks, StateManagerSlots
from hybridcache.integrations.lmdeploy.shadows import Shadow, ShadowBook
from hybridcache.integrations.lmdeploy.views import NodeView, ViewBook
from hybridcache.prefix_cache.trie import BlockTrie


@dataclass
class LmdeployStats:
    """lmdeploy's ``PrefixCacheStats`` surface."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    def reset(self) -> None:
        self.num_query_tokens = self.num_hit_tokens = 0

    def snapshot(self) -> "LmdeployStats":
        return LmdeployStats(self.num_query_tokens, self.num_hit_tokens)

    def restore(self, snapshot: "LmdeployStats | None") -> None:
        if snapshot is not None:
            self.num_query_tokens, self.num_hit_tokens = snapshot.num_query_tokens, snapshot.num_hit_tokens

    def hit_rate(self) -> float:
        return 0.0 if self.num_query_tokens <= 0 else self.num_hit_tokens / self.num_query_tokens


class Leaves:
    """``BlockTrie.leaves``: the attached non-root nodes without children, as views."""

    def __init__(self, trie: BlockTrie, views: ViewBook) -> None:
        self._trie, self._views = trie, views

    def _slots(self) -> list[int]:
        nodes = self._trie.nodes
        return [s for s in nodes.attached_slots().tolist() if not nodes.is_root[s] and nodes.num_children[s] == 0]

    def __len__(self) -> int:
        return len(self._slots())

    def __contains__(self, node: object) -> bool:
        return isinstance(node, NodeView) and node.is_live and node.slot in self._slots()

    def __iter__(self):
        return iter([self._views.node(slot, None) for slot in self._slots()])


class LmdeployBlockTrie:
    def __init__(self, *, allocator: object, block_size: int, enabled: bool, checkpoint_state_manager: object = None) -> None:
        """lmdeploy's constructor: its ``LogicalAllocator``, block size, whether prefix caching
        is on, and its ``StateManager`` for a model with recurrent state (else None)."""
        if not all(hasattr(allocator, name) for name in ("allocate", "free", "add_ref_count", "get_ref_count")):
            raise InvalidTypeError(f"allocator must be lmdeploy's LogicalAllocator, got {type(allocator).__name__}")
        needed = ("allocate_checkpoint_state", "free_checkpoint_state", "get_num_free_checkpoint")
        if checkpoint_state_manager is not None and not all(hasattr(checkpoint_state_manager, n) for n in needed):
            raise InvalidTypeError(f"checkpoint_state_manager must be lmdeploy's StateManager, got {type(checkpoint_state_manager).__name__}")
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = bool(enabled)
        states = None if checkpoint_state_manager is None else StateManagerSlots(checkpoint_state_manager)
        self._uses_checkpoints = states is not None
        self.trie = BlockTrie(
            AllocatorBlocks(allocator),
            block_size,
            enabled=self.enabled,
            state_pool=states,
            max_checkpoints_per_anchor=1,
            borrow_paths=False,
        )
        self.stats = LmdeployStats()
        self._shadows = ShadowBook(self.trie)
        self._views = ViewBook(self.trie, lambda: (self._shadows.expert_shape, self._shadows.expert_dtype))
        self.state_checkpoints = StateCheckpoints(self.trie, self._shadows, self._views)
        self.leaves = Leaves(self.trie, self._views)

    # --- arrival -------------------------------------------------------------------------------

    def sequence_waiting(self, seq: object) -> None:
        """``seq`` starts waiting for admission (``arrivals``): build or extend its shadow now,
        outside the scheduler step, as lmdeploy materializes the prompt itself at arrival.
        Changes no trie state; tokens the cache refuses are left for the match to refuse."""
        if self.enabled:
            try:
                self._shadows.prepare(seq)
            except HybridCacheError:
                pass

    def sequence_removed(self, seq: object) -> None:
        """lmdeploy removed ``seq`` (its blocks and state already freed): its shadow goes now,
        so its token buffer serves the next arrival instead of waiting for a garbage collection."""
        self._shadows.release(seq)

    # --- match ---------------------------------------------------------------------------------

    def match(self, seq: object) -> None:
        """Tentatively reuse the longest cached prefix; lmdeploy's scheduler admits or frees."""
        if not self.enabled:
            return
        prefix_cache = seq.prefix_cache
        overlap = prefix_cache.recompute_overlap
        overlap.clear_fresh_block_range()
        prefix_cache.match_start_step = seq.num_history_ids
        selected = prefix_cache.restore
        selected.clear()
        cursor = prefix_cache.trie_cursor
        initial_step = cursor.prefix_len if isinstance(cursor, NodeView) else 0
        shadow = self._shadows.synced(seq)
        if shadow.txn is not None:
            self._close_match(shadow)
        hc_seq = shadow.seq
        before = hc_seq.num_blocks
        resumed_at = hc_seq.num_computed
        if self._uses_checkpoints and initial_step < resumed_at:
            # A continued turn (lmdeploy grows the same sequence) searches checkpoints from its
            # cursor's block boundary, as lmdeploy's match does, not from its computed step: the
            # turn resumes from the checkpoint its previous turn published and restores that state.
            hc_seq.set_computed(initial_step)
        shadow.txn = txn = self.trie.match(hc_seq)
        hit = txn.hit_tokens
        if not hit and hc_seq.num_computed != resumed_at:
            hc_seq.set_computed(resumed_at)  # a miss leaves a continued turn where it was
        self._mirror_table(shadow, seq, min(before, txn.table_start))
        if hit:
            seq.set_step(hc_seq.num_computed)
            if hc_seq.want_routed_experts:
                self._shadows.replay_experts(shadow, seq)
        state = hc_seq.prefix_state
        position = state.trie
        prefix_cache.trie_cursor = cursor = self._views.live_node(position.cursor, position.cursor_generation, seq.adapter_name)
        restore = state.checkpoints.restore
        if restore is not None:  # an aligned hit restores at its cursor: the same view
            anchor = cursor if restore.anchor == cursor.slot else self._views.node(restore.anchor, seq.adapter_name)
            selected.select(int(restore.slot), anchor)
        overlap.set_fresh_block_range(*state.overlap.fresh_range)
        if not prefix_cache.suppress_match_stats:
            stats = self.stats
            stats.num_query_tokens += int(seq.num_all_ids) - initial_step
            if hit:
                stats.num_hit_tokens += max(0, int(seq.num_history_ids) - initial_step)

    def _close_match(self, shadow: Shadow) -> None:
        if shadow.txn is not None:
            if shadow.txn.open:
                self.trie.commit(shadow.txn)
            shadow.txn = None

    # --- attach --------------------------------------------------------------------------------

    def allocate(self, seq: object) -> None:
        """Attach the blocks lmdeploy's block manager gave ``seq`` (complete ones join the trie)."""
        if not self.enabled:
            return
        settled = self._settled_before_sync(seq)  # a decode step inside a block, or a hit's suffix
        if settled is not None:
            self._close_match(settled)  # the match stands: nothing to attach
            seq.prefix_cache.recompute_overlap.clear_fresh_block_range()
            return
        shadow = self._shadows.synced(seq, with_table=False)
        self._close_match(shadow)
        hc_seq = shadow.seq
        limit = hc_seq.num_valid if seq.kv_token_limit is None else min(hc_seq.num_valid, int(seq.kv_token_limit))
        limit = self._before_lost_overlap_block(hc_seq, limit)
        if self._nothing_to_attach(hc_seq, limit):  # as lmdeploy: no complete block beyond the cursor
            self._shadows.sync_table(shadow, seq)
            seq.prefix_cache.recompute_overlap.clear_fresh_block_range()
            seq.prefix_cache.trie_cursor = self._cursor_view(shadow, seq)
            return
        first_changed = min([self._cursor_depth(hc_seq), *hc_seq.prefix_state.overlap.trie_block_map])
        computed = hc_seq.num_computed
        # lmdeploy attaches blocks before their forward and shares an already cached block at
        # once (its KV is recomputed identically); only the recompute overlap stays private.
        hc_seq.set_computed(max(computed, limit))
        try:
            self.trie.attach_table(hc_seq, self._shadows.new_blocks(shadow, seq), upto=limit)
            if hc_seq.want_routed_experts:  # lmdeploy enriches cached blocks as it attaches
                self.trie.cache_routed_experts(hc_seq)
        finally:
            hc_seq.set_computed(computed)
        self._mirror_table(shadow, seq, first_changed)
        overlap = seq.prefix_cache.recompute_overlap
        overlap.trie_block_map.clear()
        overlap.trie_block_map.update(hc_seq.prefix_state.overlap.trie_block_map)
        overlap.clear_fresh_block_range()
        seq.prefix_cache.trie_cursor = self._cursor_view(shadow, seq)

    def _settled_before_sync(self, seq: object) -> Shadow | None:
        """The shadow when nothing is to attach, known without syncing it: no private block or
        experts to settle, lmdeploy has not released the sequence, and no block beyond the
        cursor completes (an open match, as a hit whose suffix fits its last block leaves it,
        only needs its commit). The shadow's tokens and table catch up at the next sync."""
        shadow = self._shadows.existing(seq)
        if shadow is None or seq.return_routed_experts:
            return None
        cursor, position = seq.prefix_cache.trie_cursor, shadow.seq.prefix_state.trie
        # lmdeploy holds the view of the shadow's cursor node, still live (a root's view has no
        # slot, and depth 0 leaves nothing settled)
        if not isinstance(cursor, NodeView) or cursor.slot < 0 or cursor.slot != position.cursor:
            return None
        if cursor.generation != position.cursor_generation or not self.trie.nodes.is_valid(cursor.slot, cursor.generation):
            return None
        if shadow.seq.prefix_state.overlap.trie_block_map or self._shadows.lmdeploy_released(shadow, seq):
            return None
        limit = int(seq.num_valid_ids) if seq.kv_token_limit is None else min(int(seq.num_valid_ids), int(seq.kv_token_limit))
        return shadow if cursor.depth >= limit // self.block_size else None

    def _before_lost_overlap_block(self, hc_seq: object, limit: int) -> int:
        """``limit`` cut at the first block of the recompute overlap that the trie lost since
        the match (evicted while lmdeploy made room for this batch), as lmdeploy's allocate
        stops there: the sequence's fresh block at that position is still to be written by the
        forward and must not become a trie node, nor may any block after it. The overlap here
        is the fresh range the match found cached; a hybrid model's range without recompute
        blocks is only its partial restore block, which hybridcache attaches on purpose (the
        documented partial-checkpoint difference), so it is not cut."""
        overlap = hc_seq.prefix_state.overlap
        fresh_start, fresh_end = overlap.fresh_range
        size = self.block_size
        if fresh_start >= fresh_end or fresh_start >= limit // size:
            return limit
        if self._uses_checkpoints and overlap.recompute_blocks <= 0:
            return limit
        cached_blocks = self.trie.cached_prefix_tokens(hc_seq) // size
        if cached_blocks >= fresh_end:
            return limit
        return min(limit, max(cached_blocks, fresh_start) * size)

    def _nothing_to_attach(self, hc_seq: object, limit: int) -> bool:
        """No block beyond the cursor completes, and no private block waits to be settled or
        enriched: attaching would change nothing but the table's new ids."""
        overlap = hc_seq.prefix_state.overlap
        if overlap.trie_block_map or hc_seq.want_routed_experts:
            return False
        position = hc_seq.prefix_state.trie
        if not self.trie.nodes.is_valid(position.cursor, position.cursor_generation):
            return False
        return int(self.trie.nodes.depth[position.cursor]) >= limit // self.block_size

    def _cursor_depth(self, hc_seq: object) -> int:
        position = hc_seq.prefix_state.trie
        if not self.trie.nodes.is_valid(position.cursor, position.cursor_generation):
            return 0
        return int(self.trie.nodes.depth[position.cursor])

    def _cursor_view(self, shadow: Shadow, seq: object) -> NodeView:
        position = shadow.seq.prefix_state.trie
        return self._views.live_node(position.cursor, position.cursor_generation, seq.adapter_name)

    @staticmethod
    def _mirror_table(shadow: Shadow, seq: object, first: int) -> None:
        """Write the shadow's table onto ``seq.logical_blocks`` from index ``first`` on: one
        slice assignment, into a buffer of lmdeploy's own growth unit when the table grows
        (lmdeploy's ``append`` regrows by ``np.pad``, a copy twice the cost of the write)."""
        table = shadow.seq.block_table
        size = table.size
        blocks = seq.logical_blocks
        have = len(blocks)
        if size <= have:
            if size > first:
                blocks[first:size] = table[first:]
            return
        unit = type(blocks).ALLOC_SIZE
        grown = np.empty(-(-(size + 1) // unit) * unit, dtype=np.int64)  # room for the suffix block
        keep = min(first, have)
        if keep:  # a fresh sequence's table (a hit from the root) keeps nothing
            grown[:keep] = blocks.get_real_blocks()[:keep]
        grown[keep:size] = table[keep:]
        mirrored = type(blocks)(grown)  # lmdeploy's public constructor, then its length
        mirrored.resize(size)
        seq.logical_blocks = mirrored

    # --- eviction and routed experts -----------------------------------------------------------

    def evict(self, max_num_blocks: int) -> int:
        """KV pressure: frozen blocks of unpinned mid-block checkpoints, then LRU leaves."""
        if not self.enabled:
            return 0
        return self.trie.free_kv_blocks(int(max_num_blocks))

    def cache_routed_experts_for_seq(self, seq: object) -> None:
        if not self.enabled or not seq.return_routed_experts:
            return
        shadow = self._shadows.synced(seq, with_table=False)
        self.trie.cache_routed_experts(shadow.seq)

    def cache_routed_experts(self, seqs: list) -> None:
        if self.enabled:
            for seq in seqs:
                self.cache_routed_experts_for_seq(seq)

    # --- diagnostics ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """hybridcache's trie invariants, with every live lmdeploy sequence's shadow brought up
        to date first: lmdeploy's reference counts equal trie nodes + sequence tables + open
        matches' displaced blocks + frozen blocks."""
        pairs = [(seq, self._shadows.synced(seq)) for seq, _ in self._shadows.live()]
        shadows = [shadow.seq for _, shadow in pairs]
        txns = [shadow.txn for _, shadow in pairs if shadow.txn is not None]
        external = self._views.external_pins()
        for record, pins in external:  # the engine's own pins: no sequence owns them
            record.restore_pins -= pins
        try:
            self.trie.check_invariants(shadows, txns)
        finally:
            for record, pins in external:
                record.restore_pins += pins
