"""Ingest of a request arriving with nothing verified (``PathLookup.verify_from_root``, the
descent from the root as one chain) decides exactly as the general ``extend_verified`` and
``path_of``: on random schedules of ingests, matches, rollbacks, admissions, forwards, frees
and evictions (text and multimodal requests, two namespaces), a trie with the one chain and
one without it end every step with the same transactions, tables, cursors, verified nodes and
paths, cached keys, statistics, references and stamps, and both pass their invariants."""

from __future__ import annotations

import pytest

from hybridcache.prefix_cache import BlockTrie
from hybridcache.sequence import Sequence

from ._helpers import make_trie
from .test_remembered_match import BASES, B, Pair, run_schedule


def general_ingest(trie: BlockTrie) -> BlockTrie:
    """The same trie with the one-chain ingest switched off: every ingest starts at
    ``extend_verified``."""
    trie.lookup.fresh_from_root = lambda seq: False
    return trie


def counting_fresh(trie: BlockTrie, taken: list[int]) -> BlockTrie:
    """Count the ingests that took the one chain (``taken[0]``)."""
    chain = trie.lookup.verify_from_root

    def counted(seq, limit):
        taken[0] += 1
        return chain(seq, limit)

    trie.lookup.verify_from_root = counted
    return trie


def verified_facts(trie: BlockTrie, seq: Sequence) -> tuple:
    """What ingest leaves on the sequence besides ``seq_facts``: the verified path's runs and
    root, and where the cached keys resume and end. Each trie keys with its own secret, so
    the keys themselves are checked against keys computed anew, not across the tries."""
    state = seq.prefix_state
    path, keys = state.trie.verified_path, state.keys
    runs = None if path is None else (list(path.runs), path.root)
    if keys.keyer_id == trie.keyer.keyer_id:
        values = trie.keyer.block_values(seq, range(keys.num_keys)).tolist()
        expected_sum = (trie.keyer.namespace_seed(seq.namespace) + sum(values)) % 2**64
        assert keys.key_sum == expected_sum, "the keys resume from another running sum"
        cached = keys.block_keys[keys.keys_from : keys.num_keys]
        assert cached.tolist() == trie.keyer.keys_anew(seq, keys.num_keys)[keys.keys_from :].tolist()
    return runs, keys.keyer_id == trie.keyer.keyer_id, keys.keys_from, keys.num_keys, sorted(keys.mm_blocks)


class FreshPair(Pair):
    """The same schedule on a trie with the one-chain ingest and one without it."""

    def __init__(self, **trie_kwargs) -> None:
        super().__init__(**trie_kwargs)
        self.tries = (counting_fresh(make_trie(48, B, **trie_kwargs)[1], self.taken),
                      general_ingest(make_trie(48, B, **trie_kwargs)[1]))

    def check(self) -> None:
        super().check()
        facts = [[verified_facts(trie, pair[k]) for pair in self.live + self.waiting] for k, trie in enumerate(self.tries)]
        assert facts[0] == facts[1]


@pytest.mark.parametrize("trie_kwargs", [{}, {"borrow_paths": False}])
def test_one_chain_ingest_decides_as_the_general_ingest(trie_kwargs):
    taken = sum(run_schedule(seed, FreshPair, **trie_kwargs) for seed in range(60))
    assert taken >= 50  # the schedules reach the one chain, not only the general path


def test_track_pending_keeps_the_general_ingest():
    taken = sum(run_schedule(seed, FreshPair, track_pending=True) for seed in range(10))
    assert taken == 0  # a pending node may clip the path: the general path_of decides


def test_a_fully_cached_prompt_is_verified_as_one_run_from_the_root():
    _, trie = make_trie(32, B)
    first = Sequence(BASES[1][:17])
    assert Pair.admit(trie, first, trie.match(first))
    first.set_computed(first.num_tokens)
    cached_blocks = first.block_table[:4].tolist()
    trie.free_sequence(first)
    again = Sequence(BASES[1][:17])
    path = trie.prepare(again)
    child = path.node - 3
    assert (path.depth, path.runs, path.root) == (4, [(child, path.node)], trie.nodes.parent[child])
    assert again.prefix_state.trie.verified == path.node
    assert trie.nodes.block[child : path.node + 1].tolist() == cached_blocks
    trie.check_invariants([again])
