"""What cache pressure takes, and in which order.

Owns: the order between the two sources of KV blocks under pressure (the frozen blocks of
mid-block checkpoints, and trie leaves with their checkpoints), chosen once from the eviction
policy (``states_with_leaves``), and the release of namespaces left with nothing cached. What
it frees belongs to the KV and checkpoint lifecycles; the evictions are counted in the trie's
statistics.
"""

from __future__ import annotations

from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_cache.stats import PrefixCacheStats


class Pressure:
    """Frees KV blocks and state slots for the trie, in its eviction order.

    By default frozen blocks go first: a policy that writes mid-block states beside aligned
    ones (a prompt end next to its last block boundary, chunk ends) loses the least per freed
    block that way. With ``states_with_leaves`` (the eviction policy's) leaves go first and a
    mid-block checkpoint goes with its anchor leaf, frozen blocks only when no leaf can go:
    where every state is one a hit needs (Marconi's branch points and turn ends), dropping it
    to keep its leaf would keep KV that no hybrid hit can resume from (Marconi, too, evicts a
    state with its leaf edge).
    """

    def __init__(self, nodes: NodeTable, kv: KVLifecycle, experts: RoutedExpertStore, keyer: BlockKeyer,
                 stats: PrefixCacheStats, states_with_leaves: bool) -> None:
        self.nodes, self.kv, self.experts, self.keyer, self.stats = nodes, kv, experts, keyer, stats
        self.states_with_leaves = states_with_leaves
        self.checkpoints = None

    def bind(self, checkpoints) -> None:
        """The trie's CheckpointLifecycle or its null object: built after this, since a
        mid-block save frees through ``free_for_frozen_copy``."""
        self.checkpoints = checkpoints

    def free_kv_blocks(self, count: int, keep: int | None = None) -> int:
        """Free at least ``count`` KV blocks (frozen blocks of least recently used unpinned
        mid-block checkpoints, least recently used leaves only the trie holds, each with its
        checkpoints, so possibly more than ``count``), keeping node ``keep`` attached and so
        its whole path. A leaf anchoring a pinned checkpoint is never evicted. Returns the
        blocks freed."""
        checkpoints, stats = self.checkpoints, self.stats

        def protected(slot: int) -> bool:
            return slot == keep or checkpoints.is_anchor_protected(slot)

        freed = 0
        if not self.states_with_leaves:
            freed = checkpoints.evict_frozen(count)
            stats.evicted_checkpoints += freed
        if freed < count:
            evicted = self.kv.evict(count - freed, protected)
            freed += len(evicted)
            for slot in evicted:
                self.experts.forget(slot)
                released = checkpoints.release_anchored(slot)
                freed += released.frozen_blocks
                stats.evicted_checkpoints += released.records
            stats.evicted_blocks += len(evicted)
        if freed < count and self.states_with_leaves:
            frozen = checkpoints.evict_frozen(count - freed)
            stats.evicted_checkpoints += frozen
            freed += frozen
        self.release_empty_namespaces()
        return freed

    def free_for_frozen_copy(self, count: int, keep: int) -> int:
        """What a mid-block save with no free block may evict for its frozen copy, keeping the
        saving sequence's cursor ``keep``: only where states go with their leaves (the LRU leaf
        gives it, as Marconi makes room for a state it inserts). Otherwise the block would come
        from another mid-block checkpoint, one such state traded for another, so the save is
        refused (measured: more state churn and a lower hit rate with scarce state slots)."""
        return self.free_kv_blocks(count, keep) if self.states_with_leaves else 0

    def free_state_slots(self, count: int) -> int:
        """Release up to ``count`` least recently used unpinned checkpoints; how many went."""
        released = self.checkpoints.evict(count)
        self.stats.evicted_checkpoints += released
        self.release_empty_namespaces()
        return released

    def release_empty_namespaces(self) -> None:
        """Free the root (and key memo) of every namespace that caches nothing: no node below
        its root and no checkpoint on it, so per-namespace memory is bounded by what is cached."""
        for namespace, slot in self.nodes.childless_roots():
            if not self.checkpoints.records_at(slot):
                self.nodes.release_root(namespace)
                self.keyer.forget_namespace(namespace)
