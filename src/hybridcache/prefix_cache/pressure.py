"""What cache pressure takes, and in which order.

Owns: the order between the two sources of KV blocks under pressure (the frozen blocks of
mid-block checkpoints, and trie leaves with their checkpoints), chosen once from the eviction
policy (``states_with_leaves``, or its ``ShortfallCosts``: then weighed block by block), and the
release of namespaces left with nothing cached. What it frees belongs to the KV and checkpoint
lifecycles; the evictions are counted in the trie's statistics.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hybridcache.errors import InvalidTypeError
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_cache.stats import PrefixCacheStats


@runtime_checkable
class ShortfallCosts(Protocol):
    """An eviction policy's price of each source of KV blocks, in the tokens later hits are
    expected to lose per block freed (lower goes first; the policy learns what they are)."""

    def leaf_cost(self, slot: int) -> float:
        """Evicting leaf ``slot`` with the checkpoints it anchors."""

    def frozen_cost(self) -> float | None:
        """Dropping the mid-block checkpoint ``evict_frozen`` takes next (None: none)."""


class Pressure:
    """Frees KV blocks and state slots for the trie, in its eviction order.

    By default frozen blocks go first: a policy that writes mid-block states beside aligned
    ones (a prompt end next to its last block boundary, chunk ends) loses the least per freed
    block that way. With ``states_with_leaves`` (the eviction policy's) leaves go first and a
    mid-block checkpoint goes with its anchor leaf, frozen blocks only when no leaf can go:
    where every state is one a hit needs (Marconi's branch points and turn ends), dropping it
    to keep its leaf would keep KV that no hybrid hit can resume from (Marconi, too, evicts a
    state with its leaf edge). With ``costs`` (``ShortfallCosts``, ``auto``'s) neither order is
    fixed: each block comes from whichever of the next leaf and the next mid-block state the
    policy prices lower (at equal prices the mid-block state, the default order).
    """

    def __init__(self, nodes: NodeTable, kv: KVLifecycle, experts: RoutedExpertStore, keyer: BlockKeyer,
                 stats: PrefixCacheStats, states_with_leaves: bool, costs: ShortfallCosts | None = None) -> None:
        self.nodes, self.kv, self.experts, self.keyer, self.stats = nodes, kv, experts, keyer, stats
        self.states_with_leaves = states_with_leaves
        if costs is not None and not isinstance(costs, ShortfallCosts):
            raise InvalidTypeError("shortfall_costs must price leaves and frozen blocks (leaf_cost, frozen_cost)")
        self.costs = None if states_with_leaves else costs
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
        protected = self._protector(keep)
        if self.costs is not None:
            freed = self._free_weighed(count, protected)
        else:
            freed = 0 if self.states_with_leaves else self._evict_frozen(count)
            if freed < count:
                freed += self._evict_leaves(count - freed, protected)
            if freed < count and self.states_with_leaves:
                freed += self._evict_frozen(count - freed)
        self.release_empty_namespaces()
        return freed

    def _protector(self, keep: int | None):
        checkpoints = self.checkpoints

        def protected(slot: int) -> bool:
            return slot == keep or checkpoints.is_anchor_protected(slot)

        return protected

    def _free_weighed(self, count: int, protected) -> int:
        """Leaves while the next one is priced below the next mid-block state, then that state,
        and again: O(log n) a block."""
        costs, freed = self.costs, 0
        while freed < count:
            frozen = costs.frozen_cost()
            dearer = None if frozen is None else (lambda slot: costs.leaf_cost(slot) >= frozen)
            step = self._evict_leaves(count - freed, protected, dearer)
            if not step:
                step = self._evict_frozen(1) or self._evict_leaves(count - freed, protected)
            if not step:
                break
            freed += step
        return freed

    def _evict_frozen(self, count: int) -> int:
        released = self.checkpoints.evict_frozen(count)
        self.stats.evicted_checkpoints += released
        return released

    def _evict_leaves(self, count: int, protected, stop=None) -> int:
        """Up to ``count`` leaves with their checkpoints (``KVLifecycle.evict``); the blocks
        freed (frozen ones too)."""
        checkpoints, stats = self.checkpoints, self.stats
        evicted = self.kv.evict(count, protected, stop)
        freed = len(evicted)
        for slot in evicted:
            self.experts.forget(slot)
            released = checkpoints.release_anchored(slot)
            freed += released.frozen_blocks
            stats.evicted_checkpoints += released.records
        stats.evicted_blocks += len(evicted)
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
