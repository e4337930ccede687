"""``CacheProtocol.admit_many``: one call for a scheduler step's admissions makes the same
decisions as ``admit`` called for each sequence in turn, and bad input changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import ForeignSequenceError, InvalidArgumentError, InvalidTypeError, PinnedError
from hybridcache.protocol import CacheProtocol

B = 4
BASES = ([1] * 40, list(range(100, 140)), list(range(200, 230)))


def protocol(hybrid: bool, blocks: int, slots: int) -> CacheProtocol:
    config = CacheConfig(
        block_size=B, num_kv_blocks=blocks, num_state_slots=slots, checkpoint_budget=2, hybrid=hybrid,
        deterministic_keys=True,
    )
    return CacheProtocol(build_cache(config, track_pending=True))


def admission_facts(admitted) -> tuple:
    restore = None if admitted.restore is None else admitted.restore.step
    return (admitted.start, admitted.end, admitted.runtime_slot, restore, admitted.hit_tokens, admitted.refused,
            admitted.miss_reason)


def cache_facts(cache: CacheProtocol, live: list[Sequence]) -> tuple:
    return (cache.stats(), [(s.num_computed, s.block_table.tolist()) for s in live])


# prompts cut from a few bases at block-aligned and unaligned lengths: later ones hit earlier ones
request = st.tuples(
    st.integers(0, len(BASES) - 1), st.sampled_from([3, 8, 13, 16, 24, 40]), st.lists(st.integers(0, 3), max_size=6)
)
likely = st.sampled_from([True, True, True, False])
step = st.tuples(
    st.lists(st.tuples(request, st.integers(0, 48)), min_size=1, max_size=5),  # (prompt, budget) per sequence
    st.booleans(),  # one shared budget (the first) instead of one each
    st.lists(likely, min_size=5, max_size=5),  # which admitted sequences run their chunk and a save
    st.lists(likely, min_size=5, max_size=5),  # which admitted sequences are freed afterwards
)


def run(cache: CacheProtocol, steps: list, batched: bool) -> list:
    """Drive the same schedule through admit_many (batched) or admit one by one; return every
    decision and what the cache looks like after each step."""
    trace, live = [], []
    for requests, shared, runs, frees in steps:
        seqs = [Sequence(BASES[base][:cut] + suffix) for (base, cut, suffix), _ in requests]
        budgets = requests[0][1] if shared else [budget for _, budget in requests]
        for seq in seqs:
            cache.prepare(seq)
        if batched:
            admitted = cache.admit_many(seqs, budgets)
        else:
            each = [budgets] * len(seqs) if shared else budgets
            admitted = [cache.admit(seq, budget) for seq, budget in zip(seqs, each)]
        trace.append([admission_facts(a) for a in admitted])
        for index, (seq, admission) in enumerate(zip(seqs, admitted)):
            if not admission.admitted:
                continue
            if runs[index]:
                cache.reserve_save(seq, admission.end)
                cache.forward_queued(seq)
                seq.set_computed(admission.end)
                cache.forward_done(seq, admission.start)
            if frees[index]:
                cache.free(seq, admission.runtime_slot)
            else:
                live.append((seq, admission.runtime_slot))
        cache.check_invariants([seq for seq, _ in live])
        trace.append(cache_facts(cache, [seq for seq, _ in live]))
    for seq, slot in live:
        cache.free(seq, slot)
    cache.check_invariants([])
    trace.append(cache.stats())
    return trace


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hybrid=st.booleans(),
    blocks=st.integers(6, 40),
    slots=st.integers(4, 12),
    steps=st.lists(step, min_size=1, max_size=6),
)
def test_admit_many_decides_as_admitting_one_by_one(hybrid, blocks, slots, steps):
    one_by_one = run(protocol(hybrid, blocks, slots), steps, batched=False)
    batched = run(protocol(hybrid, blocks, slots), steps, batched=True)
    assert batched == one_by_one


def test_admit_many_admits_each_in_order_and_refusals_change_nothing():
    cache = protocol(hybrid=False, blocks=4, slots=8)
    first, second, third = Sequence(list(range(1, 11))), Sequence(list(range(50, 60))), Sequence([9, 9])
    admitted = cache.admit_many([first, second, third], [10, 10, 0])
    assert [a.admitted for a in admitted] == [True, False, False]
    assert (admitted[0].start, admitted[0].end) == (0, 10)
    assert admitted[1].refused.value == "no_kv_blocks" and admitted[2].refused.value == "nothing_to_run"
    assert second.num_blocks == third.num_blocks == 0 and cache.pool.num_free == 1
    cache.check_invariants([first, second, third])


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        (lambda fine: ("abc", 4), InvalidTypeError, "seqs must be a sequence"),
        (lambda fine: ([fine, object()], 4), InvalidTypeError, "expected a Sequence"),
        (lambda fine: ([fine, fine], [4, 4]), InvalidArgumentError, "appears twice"),
        (lambda fine: ([fine], "4"), InvalidTypeError, "budgets must be an int or a sequence"),
        (lambda fine: ([fine], [4, 4]), InvalidArgumentError, "2 budgets for 1 sequences"),
        (lambda fine: ([fine, Sequence([1, 2])], [4, -1]), InvalidArgumentError, "budget must be >= 0"),
        (lambda fine: ([fine], [True]), InvalidTypeError, "budget must be an int"),
    ],
    ids=["seqs-a-string", "not-a-sequence", "twice", "budgets-a-string", "budget-count", "negative", "bool"],
)
def test_bad_batches_raise_before_any_admission(batch, error, message):
    cache = protocol(hybrid=True, blocks=16, slots=6)
    fine = Sequence(list(range(1, 9)))
    free_before = cache.pool.num_free
    with pytest.raises(error, match=message):
        cache.admit_many(*batch(fine))
    assert fine.num_computed == 0 and fine.num_blocks == 0 and cache.pool.num_free == free_before
    assert cache.states.num_runtime == 0
    cache.check_invariants([fine])


def test_a_sequence_the_trie_refuses_stops_the_batch_before_it_starts():
    cache, other = protocol(hybrid=True, blocks=16, slots=6), protocol(hybrid=True, blocks=16, slots=6)
    foreign = Sequence(list(range(1, 9)))
    assert other.admit(foreign, 8).admitted
    fine = Sequence(list(range(20, 28)))
    with pytest.raises(ForeignSequenceError):
        cache.admit_many([fine, foreign], 8)
    assert fine.num_blocks == 0 and cache.pool.num_free == 16
    pinned = Sequence(list(range(1, 9)))
    pinned.prefix_state.checkpoints.restore_pinned = True
    with pytest.raises(PinnedError):
        cache.admit_many([fine, pinned], 8)
    assert fine.num_blocks == 0 and cache.states.num_runtime == 0
    cache.check_invariants([fine])
