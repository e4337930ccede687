"""One lazy-invalidation priority heap: the order in which eviction candidates go.

Owns: its heap entries, nothing else. Both eviction lifecycles use it: KV leaves (scored by
their block's recency stamp) and checkpoint records (scored by theirs). It is also where an
eviction policy plugs in: a policy is a ``score`` function (lower goes first), so one that
weighs what a candidate saves per byte, or how often it was reused, replaces recency without
touching the lifecycles.

An entry is ``(score, tie, token, item)``: ``token`` is what the item looked like when it was
pushed (a node generation, a record stamp). Nothing is ever searched or removed in place:
``pop`` drops entries whose item ``is_live`` no longer holds for their token, and re-files an
entry whose item's score has grown since it was pushed. So each eviction costs O(log n)
amortized, provided a score only grows between two pushes of its item (recency does; a
policy whose score can drop pushes the item again when it drops). The heap is compacted when
stale entries outnumber live candidates by more than ``slack``.
"""

from __future__ import annotations

import heapq
from typing import Callable, Generic, TypeVar

Item = TypeVar("Item")
Entry = tuple


class EvictionHeap(Generic[Item]):
    def __init__(
        self,
        score: Callable[[Item], object],
        tie: Callable[[Item], object],
        is_live: Callable[[Item, object], bool],
        slack: int,
    ) -> None:
        self._score = score
        self._tie = tie
        self._is_live = is_live
        self._slack = slack
        self._heap: list[Entry] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: Item, token: object, live: int) -> None:
        """File ``item`` under its current score; ``live`` is how many candidates are live now
        (compaction keeps the heap within ``2 * live + slack`` entries)."""
        heapq.heappush(self._heap, (self._score(item), self._tie(item), token, item))
        if len(self._heap) > 2 * live + self._slack:
            self.compact()

    def push_many(self, items: list[Item], tokens: list[object], live: int) -> None:
        """``push`` of each of ``items`` under ``tokens[k]``, in order (a batch's, in one call)."""
        score, tie, limit = self._score, self._tie, 2 * live + self._slack
        for item, token in zip(items, tokens):
            heapq.heappush(self._heap, (score(item), tie(item), token, item))
            if len(self._heap) > limit:
                self.compact()

    def pop(self) -> Entry | None:
        """The live entry with the lowest current score, removed; None when none is left.
        Hand it back with ``restore`` when the caller decides to keep the item."""
        heap, score = self._heap, self._score
        while heap:
            entry = heapq.heappop(heap)
            item, token = entry[3], entry[2]
            if not self._is_live(item, token):
                continue
            current = score(item)
            if current != entry[0]:
                heapq.heappush(heap, (current, entry[1], token, item))
                continue
            return entry
        return None

    def restore(self, entries: list[Entry]) -> None:
        """Put back entries that ``pop`` returned and the caller kept (pinned items)."""
        for entry in entries:
            heapq.heappush(self._heap, entry)

    def compact(self) -> None:
        """Drop every stale entry and re-score the rest."""
        live = {}
        for _, tie, token, item in self._heap:
            if self._is_live(item, token):
                live[(tie, token)] = item
        self._heap = [(self._score(item), tie, token, item) for (tie, token), item in live.items()]
        heapq.heapify(self._heap)

    def entries(self) -> list[tuple[object, Item]]:
        """``(token, item)`` of every entry, live or stale (for invariant checks)."""
        return [(token, item) for _, _, token, item in self._heap]
