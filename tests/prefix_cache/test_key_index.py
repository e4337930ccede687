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
