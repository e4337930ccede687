"""PrefixState: per-sequence protocol state as grouped records, and its reset helpers."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.prefix_state import PrefixState, RecomputeOverlap
from hybridcache.types import NO_NODE


def populated() -> PrefixState:
    """A state with every field moved away from its default."""
    state = PrefixState()
    state.keys.block_keys = np.array([11, 22, 33], dtype=np.uint64)
    state.keys.num_keys = 3
    state.keys.key_sum = 66
    state.keys.keyer_id = 5
    state.trie.cursor = 17
    state.trie.cursor_generation = 4
    state.overlap.fresh_range = (1, 3)
    state.overlap.trie_block_map = {2: 40}
    state.overlap.recompute_blocks = 2
    state.trie.experts_cached_blocks = 2
    state.suppress_stats = True
    return state


def test_defaults():
    state = PrefixState()
    assert state.keys.block_keys.dtype == np.uint64
    assert state.keys.block_keys.shape == (0,)
    assert state.keys.num_keys == 0
    assert state.keys.key_sum == 0
    assert state.keys.keyer_id == -1
    assert state.trie.cursor == NO_NODE == -1
    assert state.trie.cursor_generation == -1
    assert state.overlap.fresh_range == (0, 0)
    assert state.overlap.trie_block_map == {}
    assert state.overlap.recompute_blocks == 0
    assert state.trie.experts_cached_blocks == 0
    assert state.suppress_stats is False


def test_mutable_defaults_are_not_shared():
    a, b = PrefixState(), PrefixState()
    a.overlap.trie_block_map[1] = 2
    assert b.overlap.trie_block_map == {}
    assert a.keys.block_keys is not b.keys.block_keys
    assert a.checkpoints.records_missing_experts is not b.checkpoints.records_missing_experts


@pytest.mark.parametrize(("index", "inside"), [(0, False), (1, True), (2, True), (3, False), (-1, False), (10, False)])
def test_in_fresh_range_is_half_open(index, inside):
    state = PrefixState(overlap=RecomputeOverlap(fresh_range=(1, 3)))
    assert state.overlap.in_fresh_range(index) is inside


def test_empty_fresh_range_contains_nothing():
    state = PrefixState()
    assert not any(state.overlap.in_fresh_range(i) for i in range(-2, 5))


def test_clear_cursor_resets_only_the_cursor():
    state = populated()
    state.trie.clear_cursor()
    assert state.trie.cursor == NO_NODE
    assert state.trie.cursor_generation == -1
    assert state.overlap.fresh_range == (1, 3)
    assert state.overlap.trie_block_map == {2: 40}


def test_clear_tracking_forgets_block_tied_state_and_keeps_keys_and_policy():
    state = populated()
    state.clear_tracking()
    # forgotten
    assert state.trie.cursor == NO_NODE
    assert state.trie.cursor_generation == -1
    assert state.overlap.fresh_range == (0, 0)
    assert state.overlap.trie_block_map == {}
    assert state.trie.experts_cached_blocks == 0
    # kept
    np.testing.assert_array_equal(state.keys.block_keys, [11, 22, 33])
    assert state.keys.num_keys == 3
    assert state.keys.key_sum == 66
    assert state.keys.keyer_id == 5
    assert state.overlap.recompute_blocks == 2
    assert state.suppress_stats is True


def test_clear_tracking_replaces_the_map_instead_of_clearing_a_shared_one():
    state = populated()
    old_map = state.overlap.trie_block_map
    state.clear_tracking()
    assert old_map == {2: 40}
    assert state.overlap.trie_block_map is not old_map


def test_clear_tracking_is_idempotent():
    state = populated()
    state.clear_tracking()
    once = (state.trie.cursor, state.trie.cursor_generation, state.overlap.fresh_range, dict(state.overlap.trie_block_map))
    state.clear_tracking()
    assert (state.trie.cursor, state.trie.cursor_generation, state.overlap.fresh_range, state.overlap.trie_block_map) == once
