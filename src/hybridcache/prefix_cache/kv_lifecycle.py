"""Trie KV references, path pins and LRU leaf eviction.

Owns: the trie's single reference on each node's KV block, the path pins of sequences that
borrow a cached path, and the eviction heap of leaf candidates (``lru.EvictionHeap``).

A sequence whose match starts at the root borrows the matched path with one pin on its
deepest node instead of one block reference per block: eviction only takes leaves, so a
pinned node keeps its whole ancestry attached, and a hit costs O(1) whatever its length.
Recency follows the same rule: returning a pin stamps the pinned node's block (while pinned
the path cannot be evicted, so a stamp at pin time would never decide an eviction), and an
evicted leaf hands its stamp to its parent, so a path's blocks age as if each had been stamped.

The heap is never rebuilt from all candidates: entries carry the score and the node generation
they were pushed with and are re-validated when popped (lazy invalidation). A popped entry
whose block was touched since is filed again under the new stamp; one whose block a sequence
still holds or borrows is set aside for this call. Each evicted block costs O(log n)
amortized. The score is the block's recency stamp unless a policy gives another.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hybridcache.errors import RefcountUnderflowError
from hybridcache.memory.protocols import KVBlockAllocator
from hybridcache.prefix_cache.lru import EvictionHeap
from hybridcache.prefix_cache.node import NodeTable

_HEAP_SLACK = 1024  # stale entries tolerated beyond twice the attached nodes before compaction


class KVLifecycle:
    def __init__(self, nodes: NodeTable, pool: KVBlockAllocator, score: Callable[[int], object] | None = None) -> None:
        """``score(slot)`` orders leaf candidates (lowest first); by default the recency stamp
        of the leaf's block (LRU)."""
        self._nodes = nodes
        self._pool = pool
        self._heap: EvictionHeap[int] = EvictionHeap(score or self._stamp_of, int, self._is_candidate, _HEAP_SLACK)
        self._pins: dict[int, int] = {}

    def _stamp_of(self, slot: int) -> int:
        return self._pool.stamp_of(int(self._nodes.block[slot]))

    def pin_path(self, slot: int) -> None:
        """A sequence borrows the path root..``slot`` (keeps it attached until unpinned)."""
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def pin_paths(self, slots: list[int]) -> None:
        """``pin_path`` of each of ``slots``, in order."""
        pins = self._pins
        for slot in slots:
            pins[slot] = pins.get(slot, 0) + 1

    def unpin_path(self, slot: int) -> None:
        count = self._pins.get(slot, 0)
        if count == 0:
            raise RefcountUnderflowError(f"node {slot} is not pinned")
        if count == 1:
            del self._pins[slot]
        else:
            self._pins[slot] = count - 1
        self._pool.stamp_now(int(self._nodes.block[slot]))

    def pins(self) -> dict[int, int]:
        """Pinned slots and their pin counts (a copy)."""
        return dict(self._pins)

    def take_references(self, slots: np.ndarray) -> None:
        """The trie takes its reference on newly attached nodes' blocks."""
        self._pool.ref(self._nodes.block[slots], unique=True)

    def offer_leaf(self, slot: int) -> None:
        """Make a node that just became a leaf an eviction candidate."""
        self._heap.push(slot, int(self._nodes.generation[slot]), self._nodes.num_attached)

    def _is_candidate(self, slot: int, generation: int) -> bool:
        nodes = self._nodes
        return (
            int(nodes.generation[slot]) == generation
            and bool(nodes.attached[slot])
            and not nodes.is_root[slot]
            and nodes.num_children[slot] == 0
        )

    def evict(
        self, count: int, is_protected: Callable[[int], bool] | None = None, stop: Callable[[int], bool] | None = None
    ) -> list[int]:
        """Evict up to ``count`` least recently used leaves only the trie holds.

        ``is_protected(slot)`` lets the owner of checkpoints keep pinned nodes; ``stop(slot)``
        ends the call at the first leaf that could go for which it holds (left in place: the
        owner weighs it against another source of blocks). Evicting a leaf
        may make its parent a leaf, which then competes with its own stamp (cascade). Returns
        the evicted slots (already detached; their blocks freed).
        """
        nodes, pool, heap = self._nodes, self._pool, self._heap
        evicted: list[int] = []
        freed_blocks: list[int] = []
        set_aside = []
        while len(evicted) < count:
            entry = heap.pop()
            if entry is None:
                break
            slot = entry[3]
            block = int(nodes.block[slot])
            if (
                slot in self._pins
                or pool.refcount_of(block) > 1
                or (is_protected is not None and is_protected(slot))
            ):
                set_aside.append(entry)
                continue
            if stop is not None and stop(slot):
                set_aside.append(entry)
                break
            parent = nodes.detach_leaf(slot)
            evicted.append(slot)
            freed_blocks.append(block)
            if not nodes.is_root[parent]:
                pool.raise_stamp(int(nodes.block[parent]), pool.stamp_of(block))
                if nodes.num_children[parent] == 0:
                    self.offer_leaf(parent)
        heap.restore(set_aside)
        if freed_blocks:
            pool.unref(np.asarray(freed_blocks, dtype=np.int64), unique=True)
        return evicted

    def check_invariants(self) -> None:
        nodes = self._nodes
        for slot, count in self._pins.items():
            assert count > 0 and nodes.attached[slot] and not nodes.is_root[slot], f"pin on node {slot} is not live"
        offered = {(slot, gen) for gen, slot in self._heap.entries()}
        for slot in nodes.attached_slots().tolist():
            if nodes.num_children[slot] == 0:
                assert (slot, int(nodes.generation[slot])) in offered, f"leaf {slot} is not an eviction candidate"
