"""The eviction heap both lifecycles share: lazy invalidation, re-filing of grown scores, and a
score function as the place an eviction policy plugs in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.prefix_cache.lru import EvictionHeap


class Items:
    """Candidates with a score and a generation; an entry is live while its generation holds."""

    def __init__(self) -> None:
        self.score: dict[int, float] = {}
        self.generation: dict[int, int] = {}

    def heap(self, slack: int = 4) -> EvictionHeap[int]:
        return EvictionHeap(self.score.__getitem__, int, lambda item, gen: self.generation.get(item) == gen, slack)


def test_pops_in_score_order_and_drops_stale_entries():
    items = Items()
    heap = items.heap()
    for item, score in [(1, 5.0), (2, 1.0), (3, 3.0)]:
        items.score[item], items.generation[item] = score, 0
        heap.push(item, 0, live=3)
    items.generation[2] = 1  # item 2 left: its entry is stale
    assert [heap.pop()[3], heap.pop()[3], heap.pop()] == [3, 1, None]


def test_a_grown_score_is_refiled_and_a_kept_entry_restored():
    items = Items()
    heap = items.heap()
    for item in (1, 2):
        items.score[item], items.generation[item] = float(item), 0
        heap.push(item, 0, live=2)
    items.score[1] = 10.0  # touched after it was filed
    first = heap.pop()
    assert first[3] == 2
    heap.restore([first])  # the caller kept it (pinned)
    assert [heap.pop()[3], heap.pop()[3]] == [2, 1]


def test_a_policy_score_orders_by_value_per_byte_instead_of_recency():
    saved_per_byte = {1: 0.5, 2: 9.0, 3: 2.0}
    heap = EvictionHeap(saved_per_byte.__getitem__, int, lambda item, token: True, 8)
    for item in (1, 2, 3):
        heap.push(item, 0, live=3)
    assert [heap.pop()[3] for _ in range(3)] == [1, 3, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 50), st.booleans()), max_size=80))
def test_pop_always_returns_the_live_item_with_the_lowest_current_score(operations):
    items = Items()
    heap = items.heap(slack=3)
    present: set[int] = set()
    for item, score, leave in operations:
        if leave:
            if item in present:
                items.generation[item] += 1
                present.discard(item)
            continue
        if item not in present:
            items.generation[item] = items.generation.get(item, -1) + 1
            present.add(item)
        items.score[item] = max(items.score.get(item, 0), score)  # scores only grow between pushes
        heap.push(item, items.generation[item], live=len(present))
        assert len(heap) <= 2 * len(present) + 3
    expected = sorted((items.score[item], item) for item in present)
    popped = []
    while (entry := heap.pop()) is not None:
        popped.append((entry[0], entry[3]))
        items.generation[entry[3]] += 1  # evicted: its other entries are stale now
    assert popped == expected


def test_push_many_files_as_pushing_each_in_turn():
    """The same entries in the same order, compacted at the same points."""
    one, many = (EvictionHeap(lambda item: item[0], lambda item: item[1], lambda item, token: token % 3 != 0, 2) for _ in range(2))
    items = [(stamp % 7, stamp) for stamp in range(1, 30)]
    for item in items:
        one.push(item, item[1], 4)
    many.push_many(items, [item[1] for item in items], 4)
    assert one.entries() == many.entries() and len(one) == len(many)
