"""KeyIndex: entries in the recent dict, in the sorted arrays (tombstoned on removal) and on
collision lists; removing an entry that is not there is refused."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import TopologyError
from hybridcache.prefix_cache.key_index import KeyIndex


def filled(count: int) -> KeyIndex:
    """An index whose first ``count`` keys were merged into the arrays, then one recent key."""
    index = KeyIndex()
    keys = np.arange(10, 10 + 2 * count, 2, dtype=np.uint64)
    index.insert_many(keys, np.arange(count, dtype=np.int64))
    index.insert_many(np.array([7], dtype=np.uint64), np.array([count], dtype=np.int64))  # forces the merge
    return index


def test_remove_from_the_arrays_and_from_the_recent_dict():
    index = filled(1100)
    assert index._keys.size == 1100 and index._recent == {7: 1100}
    index.remove(10 + 2 * 500, 500)
    assert index.first(10 + 2 * 500) is None and index.first(10 + 2 * 501) == 501
    index.remove(7, 1100)
    assert index.first(7) is None and len(index) == 1099
    index.check_invariants()


def test_remove_of_an_absent_or_mismatched_entry_is_refused():
    index = filled(1100)
    with pytest.raises(TopologyError):
        index.remove(10, 3)  # key 10 maps to slot 0
    with pytest.raises(TopologyError):
        index.remove(11, 0)  # no such key
    with pytest.raises(TopologyError):
        index.remove(7, 0)  # a recent key, another slot
    with pytest.raises(TopologyError):
        KeyIndex().remove(1, 1)
    assert len(index) == 1101
    index.check_invariants()


def test_remove_on_a_collision_promotes_the_next_slot():
    index = filled(1100)
    index.insert_many(np.array([10], dtype=np.uint64), np.array([2000], dtype=np.int64))
    assert index.all(10) == [0, 2000]
    with pytest.raises(TopologyError):
        index.remove(10, 2001)
    index.remove(10, 0)
    assert index.all(10) == [2000]
    index.remove(10, 2000)
    assert index.all(10) == [] and index.first(12) == 1
    index.check_invariants()


def test_root_children_stay_in_their_dict_through_merges_collisions_and_removal():
    index = filled(1100)
    index.insert_many(np.array([5, 9], dtype=np.uint64), np.array([3000, 3001], dtype=np.int64), root_child=True)
    assert index._root_children == {5: 3000} and index._recent[9] == 3001
    index.insert_many(np.arange(20000, 22000, dtype=np.uint64), np.arange(4000, 6000, dtype=np.int64))  # a merge
    assert index._root_children == {5: 3000} and index.first(5) == 3000 and index.first(9) == 3001
    index.insert_many(np.array([5], dtype=np.uint64), np.array([3002], dtype=np.int64), root_child=True)  # collision
    assert index.all(5) == [3000, 3002] and index._root_children == {5: 3000}
    index.check_invariants()
    index.remove(5, 3000)  # the next slot is promoted
    assert index.all(5) == [3002]
    index.remove(5, 3002)
    assert index.all(5) == [] and len(index) == 1101 + 1 + 2000
    index.check_invariants()


def test_random_inserts_and_removals_find_what_a_dict_of_lists_finds():
    rng = np.random.default_rng(7)
    index, model = KeyIndex(), {}
    next_slot = 0
    for _ in range(400):
        if model and rng.random() < 0.35:
            key = int(rng.choice(sorted(model)))
            slot = model[key][int(rng.integers(len(model[key])))]
            index.remove(key, slot)
            model[key].remove(slot)
            if not model[key]:
                del model[key]
        else:
            keys = rng.integers(0, 60, size=int(rng.integers(1, 40)), dtype=np.uint64)  # collisions are common
            slots = np.arange(next_slot, next_slot + keys.size, dtype=np.int64)
            next_slot += keys.size
            index.insert_many(keys, slots, root_child=bool(rng.random() < 0.5))
            for key, slot in zip(keys.tolist(), slots.tolist()):
                model.setdefault(key, []).append(slot)
        index.check_invariants()
        assert all(sorted(index.all(key)) == sorted(slots) for key, slots in model.items())
        assert all(index.first(key) is None for key in range(60) if key not in model)
        assert len(index) == sum(len(slots) for slots in model.values())
