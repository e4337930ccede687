"""A sequence that adopts another sequence's pending leaf keeps its own pending nodes when that
other sequence's forward fails and its leaf is detached (found by the soak's admit_many rule)."""

from __future__ import annotations

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache import BlockTrie
from hybridcache.cache import CacheComponents
from hybridcache.protocol import CacheProtocol
from hybridcache.sequence import Sequence

B = 4


def cache() -> tuple[CacheProtocol, BlockTrie]:
    pool, states = BlockPool(30), StatePool(8, checkpoint_budget=3)
    trie = BlockTrie(pool, B, state_pool=states, track_pending=True)
    return CacheProtocol(CacheComponents(pool, states, trie)), trie


def test_a_failed_forward_detaches_its_leaf_but_not_the_adopters_own_nodes():
    protocol, trie = cache()
    first_block, second_block = [1, 2, 3, 0], [0, 0, 0, 0]
    adopter = Sequence(first_block + second_block + [0])
    producer = Sequence(first_block + second_block)
    assert protocol.admit(adopter, B).end == B  # attaches the first block, pending
    assert protocol.admit(producer, 2 * B).end == 2 * B  # a private first block; attaches the second under it
    assert protocol.extend(adopter, adopter.num_tokens)  # its second block is the producer's pending leaf
    assert trie.exclusive_blocks(adopter, 0, adopter.num_tokens) == frozenset(adopter.block_table.tolist())
    trie.check_invariants([adopter, producer])
    trie.discard_pending(producer)  # the producer's forward failed
    protocol.free(producer)
    assert trie.exclusive_blocks(adopter, 0, adopter.num_tokens) == frozenset(adopter.block_table.tolist())
    trie.check_invariants([adopter])
    adopter.set_computed(adopter.num_tokens)
    trie.mark_computed(adopter, 0)
    cursor = adopter.prefix_state.trie.cursor
    assert int(trie.nodes.depth[cursor]) == 1 and not trie.nodes.pending[cursor]  # its own block became matchable
    trie.check_invariants([adopter])
