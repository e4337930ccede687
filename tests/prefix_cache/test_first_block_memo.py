"""A text-only request finds its root's child through the memo of first blocks
(``PathLookup._root_child``) exactly as through its first block's key: on random schedules of
ingests, matches, rollbacks, admissions, forwards, frees and evictions, a trie with the memo and
one without it end every step with the same transactions, tables, cursors, verified nodes and
paths, sequence keys, statistics, references and stamps, and both pass their invariants."""

from __future__ import annotations

import pytest

from hybridcache.prefix_cache import BlockTrie
from hybridcache.sequence import Sequence

from ._helpers import make_trie
from .test_remembered_match import BASES, B, Pair, run_schedule


def without_memo(trie: BlockTrie) -> BlockTrie:
    """The same trie finding a root's child by the next slot or the first block's key only."""
    trie.lookup._run_child = trie.lookup._next_or_keyed_child
    return trie


class CountingMemo(dict):
    """The memo, counting the entries looked up and found (valid or not)."""

    def __init__(self, taken: list[int]) -> None:
        super().__init__()
        self.taken = taken

    def get(self, key, default=None):
        found = super().get(key, default)
        self.taken[0] += found is not None
        return found


class MemoPair(Pair):
    """The same schedule on a trie with the memo (entries found counted) and one without it;
    ``capacity`` bounds the memo's entries (2: old entries keep leaving)."""

    capacity: int | None = None

    def __init__(self, **trie_kwargs) -> None:
        super().__init__(**trie_kwargs)
        with_memo = make_trie(48, B, **trie_kwargs)[1]
        with_memo.lookup._root_children = CountingMemo(self.taken)
        if self.capacity is not None:
            with_memo.lookup._memo_entries = self.capacity
        self.tries = (with_memo, without_memo(make_trie(48, B, **trie_kwargs)[1]))

    def check(self) -> None:
        super().check()
        facts = [[seq_keys(pair[k]) for pair in self.live + self.waiting] for k in range(2)]
        assert facts[0] == facts[1]


class SmallMemoPair(MemoPair):
    capacity = 2


def seq_keys(seq: Sequence) -> tuple:
    """Where the sequence's cached keys resume and end, and the verified path's runs and root."""
    state = seq.prefix_state
    path, keys = state.trie.verified_path, state.keys
    return keys.keys_from, keys.num_keys, None if path is None else (list(path.runs), path.root)


@pytest.mark.parametrize(
    "pair_class, trie_kwargs",
    [(MemoPair, {}), (MemoPair, {"track_pending": True}), (MemoPair, {"borrow_paths": False}), (SmallMemoPair, {})],
)
def test_the_memo_finds_the_child_the_key_finds(pair_class, trie_kwargs):
    taken = sum(run_schedule(seed, pair_class, **trie_kwargs) for seed in range(40))
    assert taken >= 20  # the schedules reach the memo, not only the general probe


def cache(trie: BlockTrie, tokens: list[int]) -> None:
    """Admit, compute and free a request: its blocks stay cached."""
    seq = Sequence(tokens)
    assert Pair.admit(trie, seq, trie.match(seq))
    seq.set_computed(seq.num_tokens)
    trie.free_sequence(seq)


def test_an_entry_is_taken_only_while_its_child_is_attached_unchanged():
    _, trie = make_trie(32, B)
    cache(trie, BASES[1][:17])
    again = Sequence(BASES[1][:17])
    assert trie.prepare(again).depth == 4  # found by key, then remembered
    ((root, _), (child, generation)), = trie.lookup._root_children.items()
    assert trie.nodes.parent[child] == root
    assert trie.clear() == 4  # the child is detached: the entry stays, stale
    cache(trie, BASES[2][:17])  # a new path, maybe in the child's old slots
    assert not trie.nodes.is_valid(child, generation)
    third = Sequence(BASES[1][:17])
    assert trie.prepare(third).depth == 0  # the stale entry is not taken
    trie.check_invariants([third])


def test_the_memo_keeps_its_newest_entries():
    _, trie = make_trie(64, B)
    trie.lookup._memo_entries = 2
    for base in BASES:
        cache(trie, base[:17])
    for base in BASES:
        assert trie.prepare(Sequence(base[:17])).depth == 4
    assert [first for (_, first) in trie.lookup._root_children] == [
        Sequence(base[:B]).token_words(0, B).tobytes() for base in BASES[1:]]
