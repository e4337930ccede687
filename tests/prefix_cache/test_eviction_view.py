"""The eviction policy's side of the trie: what the trie reads from it when it is built, and the
narrow view it is bound to instead of the trie itself."""

from __future__ import annotations

import pytest

from hybridcache.errors import InvalidTypeError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.prefix_cache import BlockTrie
from hybridcache.prefix_cache.eviction_view import EvictionView

from ._helpers import B, leaves, tokens
from ._hybrid import make_hybrid, produce


class RecencyPolicy:
    """The library's own order, through the view: a policy that keeps states with leaves."""

    states_with_leaves = True

    def __init__(self) -> None:
        self.view: EvictionView | None = None
        self.kv_calls = 0

    def bind(self, view: EvictionView) -> None:
        self.view = view

    def kv_score(self, slot: int) -> int:
        self.kv_calls += 1
        return self.view.stamp(slot)

    def checkpoint_score(self, record) -> int:
        return record.stamp


def test_the_trie_binds_the_policy_to_a_view_and_reads_its_order_once():
    policy = RecencyPolicy()
    pool, states, trie = make_hybrid(eviction=policy)
    view = policy.view
    assert isinstance(view, EvictionView) and trie.states_with_leaves
    assert (view.block_size, view.num_kv_blocks, view.num_state_slots, view.checkpoint_budget) == (B, 64, 8, 4)
    _, record = produce(trie, tokens(2 * B + 5), 2 * B + 5)
    (leaf,) = leaves(trie)
    assert view.depth(leaf) == 2 and view.stamp(leaf) == pool.stamp_of(int(trie.nodes.block[leaf]))
    assert view.key(leaf) == int(trie.nodes.key[leaf]) and view.records_at(leaf) == (record,)
    assert view.published_records() == [record] and view.clock == pool.clock
    assert view.prefix_keys(tokens(2 * B + 5))[-1] == view.key(leaf)  # the keys the cache files under
    assert policy.kv_calls > 0  # the leaf heap scores through the policy
    assert trie.free_kv_blocks(1) == 2  # states go with their leaves: the leaf and its frozen block
    assert not record.is_published
    trie.check_invariants([])


def test_rescore_leaf_files_a_cached_leaf_again_and_says_when_none_is_cached():
    policy = RecencyPolicy()
    _, _, trie = make_hybrid(eviction=policy)
    produce(trie, tokens(2 * B), 2 * B)
    view = policy.view
    keys = view.prefix_keys(tokens(2 * B))
    calls = policy.kv_calls
    assert view.rescore_leaf(int(keys[1]), 2) and policy.kv_calls == calls + 1  # the leaf, re-scored
    assert view.rescore_leaf(int(keys[0]), 1) and policy.kv_calls == calls + 1  # cached, not a leaf
    assert not view.rescore_leaf(int(keys[1]), 1)  # no node with that key at that depth
    trie.check_invariants([])


def test_an_attention_only_view_has_no_states_and_a_bad_policy_is_refused():
    policy = RecencyPolicy()
    trie = BlockTrie(BlockPool(16), B, eviction=policy)
    assert policy.view.num_state_slots == 0 and policy.view.checkpoint_budget == 0
    assert policy.view.records_at(0) == () and policy.view.published_records() == []
    with pytest.raises(InvalidTypeError):
        BlockTrie(BlockPool(16), B, eviction=object())
    trie.check_invariants([])
