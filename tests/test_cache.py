"""Building the cache components from a CacheConfig."""

import pytest

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import InvalidConfigError, InvalidTypeError


def test_one_state_slot_builds_an_attention_only_trie():
    parts = build_cache(CacheConfig(block_size=16, num_kv_blocks=32))
    assert parts.pool.num_blocks == 32 and not parts.trie.is_hybrid and parts.trie.block_size == 16


def test_a_hybrid_config_builds_a_hybrid_trie_with_the_budget():
    parts = build_cache(CacheConfig(block_size=16, num_kv_blocks=32, num_state_slots=6, checkpoint_budget=2, hybrid=True))
    assert parts.trie.is_hybrid and parts.states.runtime_cap == 3


def test_state_slots_alone_do_not_make_a_trie_hybrid():
    """One rule decides "hybrid" (the model has recurrent layers), for the engine and the library."""
    parts = build_cache(CacheConfig(block_size=16, num_kv_blocks=32, num_state_slots=6))
    assert not parts.trie.is_hybrid and parts.states.num_slots == 6


def test_a_hybrid_config_needs_a_state_slot_beside_the_reserved_row():
    with pytest.raises(InvalidConfigError):
        CacheConfig(hybrid=True, num_state_slots=1)


def test_deterministic_keys_and_disabled_caching_are_honoured():
    on = build_cache(CacheConfig(block_size=16, deterministic_keys=True)).trie
    other = build_cache(CacheConfig(block_size=16, deterministic_keys=True)).trie
    seq_a, seq_b = Sequence(list(range(32))), Sequence(list(range(32)))
    assert on.keyer.extend(seq_a).tolist() == other.keyer.extend(seq_b).tolist()
    off = build_cache(CacheConfig(block_size=16, prefix_caching=False)).trie
    assert not off.enabled


def test_a_non_config_is_rejected():
    with pytest.raises(InvalidTypeError):
        build_cache({"block_size": 16})


def test_an_object_that_is_not_an_eviction_policy_is_refused():
    with pytest.raises(InvalidTypeError):
        build_cache(CacheConfig(block_size=16), eviction=object())
