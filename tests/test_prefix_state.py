"""PrefixState: per-sequence protocol state and its reset helpers."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.prefix_state import NO_NODE, PrefixState


def populated() -> PrefixState:
    """A state with every field moved away from its default."""
    state = PrefixState()
    state.block_keys = np.array([11, 22, 33], dtype=np.uint64)
    state.num_keys = 3
    state.key_sum = 66
    state.keyer_id = 5
    state.cursor = 17
    state.cursor_generation = 4
    state.fresh_range = (1, 3)
    state.trie_block_map = {2: 40}
    state.recompute_blocks = 2
    state.experts_cached_blocks = 2
    state.suppress_stats = True
    return state


def test_defaults():
    state = PrefixState()
    assert state.block_keys.dtype == np.uint64
    assert state.block_keys.shape == (0,)
    assert state.num_keys == 0
    assert state.key_sum == 0
    assert state.keyer_id == -1
    assert state.cursor == NO_NODE == -1
    assert state.cursor_generation == -1
    assert state.fresh_range == (0, 0)
    assert state.trie_block_map == {}
    assert state.recompute_blocks == 0
    assert state.experts_cached_blocks == 0
    assert state.suppress_stats is False


def test_mutable_defaults_are_not_shared():
    a, b = PrefixState(), PrefixState()
    a.trie_block_map[1] = 2
    assert b.trie_block_map == {}
    assert a.block_keys is not b.block_keys


@pytest.mark.parametrize(("index", "inside"), [(0, False), (1, True), (2, True), (3, False), (-1, False), (10, False)])
def test_in_fresh_range_is_half_open(index, inside):
    state = PrefixState(fresh_range=(1, 3))
    assert state.in_fresh_range(index) is inside


def test_empty_fresh_range_contains_nothing():
    state = PrefixState()
    assert not any(state.in_fresh_range(i) for i in range(-2, 5))


def test_clear_cursor_resets_only_the_cursor():
    state = populated()
    state.clear_cursor()
    assert state.cursor == NO_NODE
    assert state.cursor_generation == -1
    assert state.fresh_range == (1, 3)
    assert state.trie_block_map == {2: 40}


def test_clear_tracking_forgets_block_tied_state_and_keeps_keys_and_policy():
    state = populated()
    state.clear_tracking()
    # forgotten
    assert state.cursor == NO_NODE
    assert state.cursor_generation == -1
    assert state.fresh_range == (0, 0)
    assert state.trie_block_map == {}
    assert state.experts_cached_blocks == 0
    # kept
    np.testing.assert_array_equal(state.block_keys, [11, 22, 33])
    assert state.num_keys == 3
    assert state.key_sum == 66
    assert state.keyer_id == 5
    assert state.recompute_blocks == 2
    assert state.suppress_stats is True


def test_clear_tracking_replaces_the_map_instead_of_clearing_a_shared_one():
    state = populated()
    old_map = state.trie_block_map
    state.clear_tracking()
    assert old_map == {2: 40}
    assert state.trie_block_map is not old_map


def test_clear_tracking_is_idempotent():
    state = populated()
    state.clear_tracking()
    once = (state.cursor, state.cursor_generation, state.fresh_range, dict(state.trie_block_map))
    state.clear_tracking()
    assert (state.cursor, state.cursor_generation, state.fresh_range, state.trie_block_map) == once
