"""An attention-only ``match`` that takes the whole path ingest verified in one chain
(``BlockMatcher._remembered_whole``) decides exactly as the general match: on random
schedules of ingests, matches, rollbacks, admissions, matches of admitted sequences, forwards, frees and evictions, a trie
with the one-chain path and one without it end every step with the same transactions, tables,
cursors, verified nodes, statistics, references and stamps, and both pass their invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridcache.errors import OutOfBlocksError
from hybridcache.prefix_cache import BlockTrie
from hybridcache.sequence import MultimodalSpan, Sequence

from ._helpers import make_trie

B = 4
BASES = ([1] * 40, list(range(100, 140)), list(range(200, 230)))


def general_only(trie: BlockTrie) -> BlockTrie:
    """The same trie with the one-chain path switched off: every match takes the general path."""
    trie.matcher._remembered_whole = lambda seq, base_depth: None
    return trie


def counting(trie: BlockTrie, taken: list[int]) -> BlockTrie:
    """Count the matches that took the one-chain path (``taken[0]``)."""
    remembered = trie.matcher._remembered_whole

    def counted(seq, base_depth):
        path = remembered(seq, base_depth)
        taken[0] += path is not None
        return path

    trie.matcher._remembered_whole = counted
    return trie


def txn_facts(txn) -> tuple:
    return (txn.step_before, txn.step_after, txn.hit_tokens, txn.cursor_after, txn.recorded, txn.table_start,
            txn.taken.tolist(), txn.displaced.tolist(), txn.borrowed, txn.materialized, txn.open)


def seq_facts(seq: Sequence) -> tuple:
    state = seq.prefix_state
    position, path = state.trie, state.trie.verified_path
    return (seq.num_computed, seq.block_table.tolist(), state.borrow.node, state.borrow.depth,
            position.cursor, position.cursor_generation, position.verified, position.verified_generation,
            None if path is None else (path.node, path.depth, path.generation), state.overlap.fresh_range)


def trie_facts(trie: BlockTrie, seqs: list[Sequence]) -> tuple:
    every = np.arange(trie.pool.num_blocks)
    return (trie.stats.as_dict(), trie.pool.clock, trie.pool.refcounts(every).tolist(),
            trie.pool.stamps(every).tolist(), trie.nodes.version, [seq_facts(seq) for seq in seqs])


def new_request(rng: random.Random, spans_allowed: bool) -> tuple[list[int], dict]:
    base = BASES[rng.randrange(len(BASES))]
    tokens = base[: rng.choice([3, 8, 13, 16, 17, 24, 40])] + rng.choice([[], [], [0], [1, 2], [3, 1, 0]])
    kwargs: dict = {}
    if rng.random() < 0.15:
        kwargs["adapter"] = "lora-a"
    if spans_allowed and len(tokens) > 10 and rng.random() < 0.3:  # the same span for the same tokens
        kwargs["multimodal"] = [MultimodalSpan(len(tokens) - 7, len(tokens) - 1, "image", "x")]
    return tokens, kwargs


class Pair:
    """The same schedule on a trie with the one-chain path and one without it."""

    def __init__(self, **trie_kwargs) -> None:
        self.taken = [0]
        self.tries = (counting(make_trie(48, B, **trie_kwargs)[1], self.taken),
                      general_only(make_trie(48, B, **trie_kwargs)[1]))
        self.live: list[tuple[Sequence, Sequence]] = []  # admitted, not freed
        self.waiting: list[tuple[Sequence, Sequence]] = []  # created, maybe ingested, not admitted

    def both(self, call) -> list:
        return [call(trie, k) for k, trie in enumerate(self.tries)]

    def check(self) -> None:
        facts = []
        for k, trie in enumerate(self.tries):
            seqs = [pair[k] for pair in self.live + self.waiting]
            trie.check_invariants(seqs)
            facts.append(trie_facts(trie, seqs))
        assert facts[0] == facts[1]

    def create(self, rng: random.Random) -> None:
        tokens, kwargs = new_request(rng, spans_allowed=True)
        pair = (Sequence(tokens, **kwargs), Sequence(tokens, **kwargs))
        if rng.random() < 0.1:
            for seq in pair:
                seq.prefix_state.overlap.recompute_blocks = 1
        self.waiting.append(pair)

    def ingest(self, index: int) -> None:
        pair = self.waiting[index]
        depths = [trie.prepare(pair[k]).depth for k, trie in enumerate(self.tries)]
        assert depths[0] == depths[1]

    def match(self, index: int, rng: random.Random) -> None:
        pair = self.waiting[index]
        txns = [trie.match(pair[k]) for k, trie in enumerate(self.tries)]
        assert txn_facts(txns[0]) == txn_facts(txns[1])
        self.check_open(pair, txns)
        if rng.random() < 0.5:
            for k, trie in enumerate(self.tries):
                trie.rollback(txns[k])
            return
        outcomes = [self.admit(trie, pair[k], txns[k]) for k, trie in enumerate(self.tries)]
        assert outcomes[0] == outcomes[1]
        if outcomes[0]:
            self.waiting.remove(pair)
            self.live.append(pair)

    def rematch(self, index: int, rng: random.Random) -> None:
        """Match an admitted sequence again (a later chunk's match), then commit or roll back."""
        pair = self.live[index]
        txns = [trie.match(pair[k]) for k, trie in enumerate(self.tries)]
        assert txn_facts(txns[0]) == txn_facts(txns[1])
        self.check_open(pair, txns)
        finish = "commit" if rng.random() < 0.5 else "rollback"
        for k, trie in enumerate(self.tries):
            getattr(trie, finish)(txns[k])

    def check_open(self, pair, txns) -> None:
        for k, trie in enumerate(self.tries):
            seqs = [p[k] for p in self.live + self.waiting]
            trie.check_invariants(seqs, [txns[k]])

    @staticmethod
    def admit(trie: BlockTrie, seq: Sequence, txn) -> bool:
        try:
            trie.pool.grow_table(seq, seq.num_tokens, B)
        except OutOfBlocksError:
            trie.rollback(txn)
            return False
        trie.allocate(seq)
        trie.commit(txn)
        return True

    def forward(self, index: int) -> None:
        for k, trie in enumerate(self.tries):
            seq = self.live[index][k]
            start = seq.num_computed
            seq.set_computed(seq.num_tokens)
            trie.mark_computed(seq, start)

    def free(self, index: int) -> None:
        pair = self.live.pop(index)
        for k, trie in enumerate(self.tries):
            trie.free_sequence(pair[k])

    def evict(self, count: int) -> None:
        assert len(set(self.both(lambda trie, k: trie.free_kv_blocks(count)))) == 1


def run_schedule(seed: int, pair_class: type = Pair, **trie_kwargs) -> int:
    """A random schedule on a pair of tries (``pair_class``); how often the fast path was taken."""
    rng = random.Random(seed)
    pair = pair_class(**trie_kwargs)
    for _ in range(80):
        roll = rng.random()
        if roll < 0.2 or not (pair.waiting or pair.live):
            pair.create(rng)
        elif roll < 0.4 and pair.waiting:
            pair.ingest(rng.randrange(len(pair.waiting)))
        elif roll < 0.7 and pair.waiting:
            pair.match(rng.randrange(len(pair.waiting)), rng)
        elif roll < 0.75 and pair.live:
            pair.rematch(rng.randrange(len(pair.live)), rng)
        elif roll < 0.85 and pair.live:
            pair.forward(rng.randrange(len(pair.live)))
        elif roll < 0.94 and pair.live:
            pair.free(rng.randrange(len(pair.live)))
        else:
            pair.evict(rng.randrange(1, 8))
        pair.check()
    return pair.taken[0]


@pytest.mark.parametrize("trie_kwargs", [{}, {"track_pending": True}, {"borrow_paths": False}])
def test_one_chain_match_decides_as_the_general_match(trie_kwargs):
    taken = sum(run_schedule(seed, **trie_kwargs) for seed in range(40))
    if trie_kwargs.get("borrow_paths", True):
        assert taken >= 5  # the schedules reach the one-chain path, not only the general one
    else:
        assert taken == 0  # without borrowed paths every match references its blocks


def test_a_fully_cached_prompt_matched_after_ingest_takes_the_one_chain_path():
    taken = [0]
    _, trie = make_trie(32, B)
    counting(trie, taken)
    first = Sequence(BASES[1][:17])
    assert Pair.admit(trie, first, trie.match(first))
    first.set_computed(first.num_tokens)
    trie.free_sequence(first)
    again = Sequence(BASES[1][:17])
    trie.prepare(again)
    txn = trie.match(again)
    assert taken == [1]
    node = again.prefix_state.borrow.node
    assert (txn.hit_tokens, txn.borrowed, again.prefix_state.borrow.depth) == (16, True, 4)
    assert again.block_table.tolist() == trie.nodes.block[node - 3 : node + 1].tolist()
    trie.check_invariants([again], [txn])
    trie.rollback(txn)
    trie.check_invariants([again])
