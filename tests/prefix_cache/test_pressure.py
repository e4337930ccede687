"""KV pressure weighed by the eviction policy's prices (``ShortfallCosts``): each block comes
from whichever of the next leaf and the next mid-block state costs less."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import InvalidTypeError
from hybridcache.prefix_cache import BlockTrie
from hybridcache.prefix_cache.checkpoint_store import ReleaseCause
from hybridcache.memory.block_pool import BlockPool

from hybridcache.sequence import Sequence

from ._helpers import B, admit, forward, leaves, tokens
from ._hybrid import make_hybrid, produce, store_kv


class PricedPolicy:
    """Recency order, mid-block states first by default, with fixed prices: ``leaf`` for a leaf
    anchoring a checkpoint, 0 for one anchoring none, ``frozen`` for the next mid-block state."""

    states_with_leaves = False

    def __init__(self, leaf: float, frozen: float) -> None:
        self.prices = (leaf, frozen)
        self.view = None
        self.shortfall_costs = self

    def bind(self, view) -> None:
        self.view = view

    def kv_score(self, slot: int) -> int:
        return self.view.stamp(slot)

    def checkpoint_score(self, record) -> int:
        return record.stamp

    def leaf_cost(self, slot: int) -> float:
        return self.prices[0] if self.view.records_at(slot) else 0.0

    def frozen_cost(self) -> float | None:
        return self.prices[1] if any(r.is_partial for r in self.view.published_records()) else None


def _aligned_old_then_mid_block_new(policy):
    _, _, trie = make_hybrid(num_blocks=8, eviction=policy)
    _, aligned = produce(trie, tokens(2 * B, start=1), 2 * B)  # 2 blocks, an aligned state
    _, mid = produce(trie, tokens(2 * B + 5, start=500), 2 * B + 5)  # 2 blocks + a frozen one
    return trie, aligned, mid


@pytest.mark.parametrize("leaf, frozen, leaf_goes", [(1.0, 2.0, True), (2.0, 1.0, False), (1.0, 1.0, False)])
def test_each_block_comes_from_the_cheaper_source(leaf, frozen, leaf_goes):
    trie, aligned, mid = _aligned_old_then_mid_block_new(PricedPolicy(leaf, frozen))
    assert trie.free_kv_blocks(1) >= 1
    # the older leaf (with its aligned state) goes when cheaper; at equal prices the mid-block
    # state, the library's default order
    assert aligned.is_published is not leaf_goes and mid.is_published is leaf_goes
    trie.check_invariants([])


def test_a_leaf_anchoring_no_state_is_free_and_pressure_falls_back_when_one_source_is_empty():
    policy = PricedPolicy(5.0, 1.0)
    _, _, trie = make_hybrid(num_blocks=8, eviction=policy)
    store_kv(trie, tokens(2 * B, start=900))  # anchors nothing: priced 0
    _, mid = produce(trie, tokens(2 * B + 5, start=500), 2 * B + 5)
    assert trie.free_kv_blocks(1) == 1 and mid.is_published  # the free leaf, not the state
    assert trie.free_kv_blocks(2) >= 2 and not mid.is_published  # then the state (1.0 < 5.0)
    assert trie.free_kv_blocks(100) == 2 and leaves(trie) == []  # only leaves are left: they go
    trie.check_invariants([])


def test_states_with_leaves_ignores_prices_and_bad_prices_are_refused():
    policy = PricedPolicy(1.0, 2.0)
    policy.states_with_leaves = True
    trie, aligned, mid = _aligned_old_then_mid_block_new(policy)
    assert trie.pressure.costs is None
    bad = PricedPolicy(1.0, 2.0)
    bad.shortfall_costs = object()
    with pytest.raises(InvalidTypeError):
        BlockTrie(BlockPool(8), B, eviction=bad)


class RandomPrices(PricedPolicy):
    """Prices drawn afresh at every question: the order may flip block by block."""

    def __init__(self, rng) -> None:
        super().__init__(0.0, 0.0)
        self.rng = rng

    def leaf_cost(self, slot: int) -> float:
        return float(self.rng.integers(0, 3))

    def frozen_cost(self) -> float | None:
        return None if self.rng.random() < 0.1 else float(self.rng.integers(0, 3))


@pytest.mark.parametrize("seed", range(4))
def test_weighed_pressure_keeps_the_invariants_whatever_the_prices(seed):
    rng = np.random.default_rng(seed)
    _, _, trie = make_hybrid(num_blocks=24, num_slots=8, budget=6, eviction=RandomPrices(rng))
    for step in range(60):
        start = int(rng.integers(1, 13)) * 1000  # twelve prefixes, each asked again: shared paths
        length = int(rng.integers(B, 4 * B))
        if trie.pool.num_free < 6:
            assert trie.free_kv_blocks(int(rng.integers(1, 6))) >= 0
        elif rng.random() < 0.3:
            store_kv(trie, tokens(length, start=start))
        else:
            seq = Sequence(tokens(length, start=start))
            admit(trie, seq)
            saving = trie.checkpoints.reserve_save(seq, int(rng.integers(1, length + 1))) > 0  # may be refused
            forward(trie, seq)
            if saving:
                trie.checkpoints.publish_save(seq)
            trie.free_sequence(seq)
        trie.check_invariants([])
    released = trie.checkpoints.release_counts()
    assert trie.stats.evicted_blocks > 0 and released[ReleaseCause.KV_BLOCKS] > 0  # both sources gave
