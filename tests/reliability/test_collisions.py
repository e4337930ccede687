"""Collision flooding: with a degenerate key function (every block gets the same key) results
stay exact, colliding prefixes all still cache and hit (KV trie and hybrid checkpoints), and the
work per match grows at most linearly in the number of colliding entries. Keys differ between
processes unless deterministic keys are requested."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache import BlockKeyer, BlockTrie
from hybridcache.prefix_cache.checkpoint_index import CheckpointIndex
from hybridcache.prefix_cache.token_store import TokenStore
from hybridcache.sequence import MultimodalSpan, Sequence

from tests.keyers import CONSTANT, ConstantKeyer
from tests.prefix_cache._helpers import admit, forward, grow_attach_commit

B = 4
DEPTH = 4  # blocks per cached prompt
SIZES = (1, 2, 4, 8, 16)


def make(num_blocks: int, hybrid: bool, slots: int = 16) -> BlockTrie:
    pool = BlockPool(num_blocks)
    states = StatePool(slots + 2, checkpoint_budget=slots) if hybrid else None
    return BlockTrie(pool, B, keyer=ConstantKeyer(B), state_pool=states, max_checkpoints_per_anchor=32)


def produce(trie: BlockTrie, tokens, save: int | None = None, **kwargs) -> Sequence:
    """Run a request to completion (saving its state after ``save`` tokens) and free it."""
    seq = Sequence(tokens, **kwargs)
    admit(trie, seq)
    if save is not None:
        assert trie.checkpoints.reserve_save(seq, save) > 0
    forward(trie, seq)
    if save is not None:
        assert trie.checkpoints.publish_save(seq)
    trie.free_sequence(seq)
    return seq


def assert_exact_hit(trie: BlockTrie, seq: Sequence, start: int = 0) -> None:
    """Every block the hit handed out is a trie node holding exactly the request's tokens (and
    its multimodal identity), on a path from the request's own namespace root."""
    nodes = trie.nodes
    by_block = {int(nodes.block[s]): s for s in nodes.attached_slots().tolist()}
    for index in range(start // B, seq.num_computed // B):
        slot = by_block[int(seq.block_table[index])]
        assert int(nodes.depth[slot]) == index + 1
        assert trie.tokens.run(slot, slot).tolist() == seq.tokens[index * B : (index + 1) * B].tolist()
        assert nodes.extra_identity.get(slot) == (seq.spans_overlapping(index * B, (index + 1) * B) or None)
    top = by_block[int(seq.block_table[0])] if seq.num_computed >= B else None
    while top is not None and not nodes.is_root[top]:
        top = int(nodes.parent[top])
    if top is not None:
        assert top == nodes.find_root(seq.namespace)
    record = seq.prefix_state.checkpoints.restore
    if record is not None:
        step = record.step
        assert step == seq.num_computed and record.namespace == seq.namespace
        assert record.tail_tokens.tolist() == seq.tokens[step - step % B : step].tolist()


def test_every_lookup_collides_with_the_constant_keyer():
    trie = make(64, hybrid=False)
    prompts = [[100 + i] * (DEPTH * B) + [1] for i in range(3)]
    for tokens in prompts:
        produce(trie, tokens)
    assert trie.nodes.num_attached == 3 * DEPTH
    assert len(trie.nodes.candidates(CONSTANT)) == 3 * DEPTH  # one key for every node
    trie.check_invariants()


@pytest.mark.parametrize("hybrid", [False, True], ids=["kv", "hybrid"])
def test_colliding_prefixes_all_cache_and_hit_exactly(hybrid):
    trie = make(96, hybrid=hybrid)
    span = [MultimodalSpan(B, 2 * B, "image", "img-a")]
    requests = [
        ([1] * (DEPTH * B) + [9], {}),
        ([2] * (DEPTH * B) + [9], {}),
        ([1] * (2 * B) + [3] * (2 * B) + [9], {}),  # shares two blocks with the first
        ([1] * (DEPTH * B) + [9], {"adapter": "lora"}),  # same tokens, other namespace
        ([1] * (DEPTH * B) + [9], {"cache_salt": "tenant"}),
        ([1] * (DEPTH * B) + [9], {"multimodal": span}),  # same tokens, an image
        ([1] * (DEPTH * B) + [9], {"multimodal": [MultimodalSpan(B, 2 * B, "image", "img-b")]}),
    ]
    step = DEPTH * B - 1  # a mid-block checkpoint: the anchor's tail is compared too
    for tokens, kwargs in requests:
        produce(trie, tokens, save=step if hybrid else None, **kwargs)
    trie.check_invariants()
    if hybrid:
        assert len(trie.checkpoints.live_records()) == len(requests)
    for tokens, kwargs in requests:
        seq = Sequence(tokens + [5], **kwargs)
        txn = trie.match(seq)
        assert txn.hit_tokens == (step if hybrid else DEPTH * B), (tokens, kwargs)
        assert_exact_hit(trie, seq)
        trie.rollback(txn)
    for tokens in ([4] * (DEPTH * B) + [9], [1] * (DEPTH * B - 2) + [2, 2, 9]):  # never cached
        seq = Sequence(tokens)
        txn = trie.match(seq)
        expected = 0 if hybrid or tokens[0] == 4 else (DEPTH - 1) * B
        assert txn.hit_tokens == expected
        assert_exact_hit(trie, seq)
        trie.rollback(txn)
    trie.check_invariants()
    trie.clear()
    assert trie.pool.num_free == trie.pool.num_blocks and trie.nodes.num_attached == 0


def test_a_colliding_key_never_blocks_a_deeper_exact_hit():
    """A request extending one of many colliding prefixes hits that prefix and caches beyond it."""
    trie = make(64, hybrid=False)
    for i in range(6):
        produce(trie, [10 + i] * (2 * B) + [1])
    seq = Sequence([13] * (2 * B) + [7] * (2 * B) + [1])
    txn = trie.match(seq)
    assert txn.hit_tokens == 2 * B
    assert_exact_hit(trie, seq)
    grow_attach_commit(trie, seq, txn)
    seq.set_computed(seq.num_tokens)
    trie.free_sequence(seq)
    again = Sequence([13] * (2 * B) + [7] * (2 * B) + [2])
    assert trie.match(again).hit_tokens == 4 * B
    assert_exact_hit(trie, again)


# --- cost grows at most linearly in the colliding entries -------------------------------------------


class WorkCounter:
    """Counts the exact comparisons a match does while active: token-run reads, token-run
    comparisons (``TokenStore.equals``: every path comparison, a run followed by
    ``PathLookup.descend`` and the collision walk alike), checkpoint verifications and every
    ``np.array_equal``."""

    TARGETS = (
        (np, "array_equal"),
        (TokenStore, "run"),
        (TokenStore, "equals"),
        (CheckpointIndex, "verify"),
    )

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> "WorkCounter":
        for owner, name in self.TARGETS:
            original = owner.__dict__[name]
            self._saved.append((owner, name, original))
            setattr(owner, name, self._counted(name, getattr(owner, name)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return original(*args, **kwargs)

        return counted

    def total(self) -> int:
        return sum(self.counts.values())


def _prompts(shape: str, count: int) -> list[list[int]]:
    if shape == "diverge-first":  # every node of every depth collides
        return [[1000 + i] * (DEPTH * B) + [1] for i in range(count)]
    return [[1] * ((DEPTH - 1) * B) + [1000 + i] * B + [1] for i in range(count)]  # only the last depth


def _work_per_match(hybrid: bool, shape: str, step: int | None) -> dict[str, list[int]]:
    """For each number of colliding prefixes: the work of matching the oldest cached prefix,
    the newest one, and a prompt that is not cached."""
    work = {"oldest": [], "newest": [], "uncached": []}
    for n in SIZES:
        trie = make(n * (DEPTH + 2) + 8, hybrid, slots=n + 2)
        prompts = _prompts(shape, n)
        for tokens in prompts:
            produce(trie, tokens, save=step)
        for name, tokens in (("oldest", prompts[0]), ("newest", prompts[-1]), ("uncached", [5] * (DEPTH * B + 1))):
            seq = Sequence(tokens)
            with WorkCounter() as counter:
                txn = trie.match(seq)
            work[name].append(counter.total())
            expected = 0 if name == "uncached" else (step if hybrid else DEPTH * B)
            assert txn.hit_tokens == expected, (n, name)
            trie.rollback(txn)
    return work


@pytest.mark.parametrize(
    "hybrid, shape, step",
    [
        (False, "diverge-first", None),
        (False, "diverge-last", None),
        (True, "diverge-first", DEPTH * B - 1),
        (True, "diverge-first", DEPTH * B),
        (True, "diverge-last", DEPTH * B - 1),
        (True, "diverge-last", DEPTH * B),
    ],
    ids=["kv-first", "kv-last", "hybrid-first-midblock", "hybrid-first-aligned", "hybrid-last-midblock", "hybrid-last-aligned"],
)
def test_work_per_match_grows_at_most_linearly(hybrid, shape, step):
    work = _work_per_match(hybrid, shape, step)
    # at most two counted comparisons per colliding entry and cached block, plus a constant
    a, b = 2 * (DEPTH + 1), 16
    for name, counts in work.items():
        assert counts[0] > 0 or name == "uncached"
        for n, count in zip(SIZES, counts):
            assert count <= a * n + b, f"{name}: {count} operations for {n} colliding entries ({counts})"
        # scale-free linearity: doubling 8 -> 16 adds at most about twice what doubling 4 -> 8 added
        growth_small = counts[SIZES.index(8)] - counts[SIZES.index(4)]
        growth_large = counts[SIZES.index(16)] - counts[SIZES.index(8)]
        assert growth_large <= 2.5 * growth_small + 4, f"{name}: super-linear growth {counts}"
    # the work really depends on the collisions (the counter sees the comparisons)
    assert max(max(counts) for counts in work.values()) >= 16


# --- keys are secret per process unless deterministic ---------------------------------------------

_KEYS_SCRIPT = textwrap.dedent(
    """
    import sys
    from hybridcache.prefix_cache import BlockKeyer
    from hybridcache.sequence import Sequence
    keyer = BlockKeyer.deterministic(16) if sys.argv[1] == "deterministic" else BlockKeyer(16)
    print(keyer.extend(Sequence(list(range(1, 70)), adapter="lora")).tolist())
    """
)


def _keys_in_subprocess(kind: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", _KEYS_SCRIPT, kind], capture_output=True, text=True, check=True, timeout=60
    )
    keys = eval(out.stdout)  # a list of ints printed by the child
    assert len(keys) == 4 and all(isinstance(k, int) for k in keys)
    return keys


def test_default_keys_differ_between_processes():
    first, second = _keys_in_subprocess("default"), _keys_in_subprocess("default")
    assert all(a != b for a, b in zip(first, second))
    local = BlockKeyer(16).extend(Sequence(list(range(1, 70)), adapter="lora")).tolist()
    assert not set(local) & (set(first) | set(second))


def test_deterministic_keys_are_equal_between_processes():
    first, second = _keys_in_subprocess("deterministic"), _keys_in_subprocess("deterministic")
    assert first == second
    local = BlockKeyer.deterministic(16).extend(Sequence(list(range(1, 70)), adapter="lora")).tolist()
    assert local == first
    assert first != _keys_in_subprocess("default")
