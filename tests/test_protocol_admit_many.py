"""``CacheProtocol.admit_many``: one call for a scheduler step's admissions makes the same
decisions as ``admit`` called for each sequence in turn, and bad input changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import ForeignSequenceError, InvalidArgumentError, InvalidTypeError, PinnedError, StaleHandleError
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
    """What a later decision can depend on: counters, tables, and the pools' clock, stamps,
    references and slot roles (eviction order and the ids handed out next follow them)."""
    every_block = np.arange(cache.pool.num_blocks)
    roles = [cache.states.role_of(slot) for slot in range(cache.states.num_slots)]
    return (cache.stats(), [(s.num_computed, s.block_table.tolist()) for s in live], cache.pool.clock,
            cache.pool.stamps(every_block).tolist(), cache.pool.refcounts(every_block).tolist(), roles)


def next_ids(cache: CacheProtocol) -> tuple:
    """The order the pools hand out what is free (taken, then given back)."""
    blocks = cache.pool.allocate(cache.pool.num_free)
    cache.pool.unref(blocks[::-1].copy(), unique=True)
    slots = [cache.states.allocate_runtime() for _ in range(cache.states.num_free_runtime)]
    for slot in reversed(slots):
        cache.states.free_runtime(slot)
    return blocks.tolist(), slots


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

# first chunks mostly inside one block (nothing to attach: the deferred batch path)
short_step = st.tuples(
    st.lists(st.tuples(request, st.sampled_from([1, 2, 3, 3, 8])), min_size=1, max_size=6),
    st.booleans(),
    st.lists(likely, min_size=6, max_size=6),
    st.lists(likely, min_size=6, max_size=6),
)


def run(cache: CacheProtocol, steps: list, batched: bool, after_admissions=lambda: None, before_admissions=None) -> list:
    """Drive the same schedule through admit_many (batched) or admit one by one; return every
    decision and what the cache looks like after each step. ``before_admissions(step)`` runs
    between the requests' ``prepare`` and their admission."""
    trace, live = [], []
    for number, (requests, shared, runs, frees) in enumerate(steps):
        seqs = [Sequence(BASES[base][:cut] + suffix) for (base, cut, suffix), _ in requests]
        budgets = requests[0][1] if shared else [budget for _, budget in requests]
        for seq in seqs:
            cache.prepare(seq)
        if before_admissions is not None:
            trace.append(before_admissions(cache, number))
        if batched:
            admitted = cache.admit_many(seqs, budgets)
        else:
            each = [budgets] * len(seqs) if shared else budgets
            admitted = [cache.admit(seq, budget) for seq, budget in zip(seqs, each)]
        after_admissions()
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
    trace.append(next_ids(cache))
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


class FreeingMatches:
    """Wraps a cache's ``trie.match`` so that the matches numbered in ``at`` free a block and
    a state slot held outside the cache (as a match that releases a stale checkpoint frees
    its slot and frozen block): the batch path must then leave those on top of the free
    lists for the admissions after it, as one-by-one admission does. What a step's matches
    did not free is freed after its admissions (so every step ends with the cache's owners
    only, as the invariants require)."""

    def __init__(self, cache: CacheProtocol, at: set[int]) -> None:
        self.cache, self.at, self.calls = cache, at, 0
        # a remembered hit frees nothing, so every match here takes the path that can
        cache.trie.remembered_hits = lambda seqs: []
        self.blocks = list(cache.pool.allocate(len(at)).tolist())
        self.slots = [cache.states.allocate_checkpoint() for _ in at]
        self.match = cache.trie.match
        cache.trie.match = self

    def __call__(self, seq: Sequence):
        txn = self.match(seq)
        self.calls += 1
        if self.calls in self.at and self.blocks:
            self.free_one()
        return txn

    def free_one(self) -> None:
        self.cache.pool.unref(self.blocks.pop())
        self.cache.states.free_checkpoint(self.slots.pop())

    def free_rest(self) -> None:
        while self.blocks:
            self.free_one()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hybrid=st.booleans(),
    blocks=st.integers(60, 120),
    slots=st.integers(14, 20),
    steps=st.lists(st.one_of(short_step, step), min_size=1, max_size=6),
    frees=st.sets(st.integers(1, 5), max_size=3),  # match numbers of the first step
)
def test_the_batch_path_decides_as_one_by_one_when_matches_free_blocks_and_slots(hybrid, blocks, slots, steps, frees):
    """Roomy pools, so most steps take the deferred batch path; some matches free a block and
    a slot in the middle of a batch."""
    traces = []
    for batched in (False, True):
        cache = protocol(hybrid, blocks, slots)
        freeing = FreeingMatches(cache, frees)
        traces.append(run(cache, steps, batched, freeing.free_rest))
    assert traces[0] == traces[1]


@pytest.fixture
def checked_deferrals(monkeypatch):
    """Check the deferred admissions' invariants before every ``defer`` and ``take``."""
    from hybridcache.batch_admission import DeferredAdmissions as deferred
    for name in ("defer", "take"):
        method = getattr(deferred, name)

        def checked(self, *args, _method=method):
            self.check_invariants()
            return _method(self, *args)

        monkeypatch.setattr(deferred, name, checked)


@pytest.mark.parametrize("hybrid", [True, False])
def test_deferred_admissions_keep_their_invariants_on_a_mixed_schedule(hybrid, checked_deferrals):
    steps = [
        ([((0, 8, []), 3), ((1, 8, []), 2), ((2, 24, []), 8), ((0, 16, [1]), 3), ((1, 40, []), 1)], False, [True] * 6, [False] * 6),
        ([((0, 16, [2]), 3), ((1, 13, []), 3), ((2, 30, []), 3)], True, [True] * 6, [True] * 6),
    ]
    traces = [run(protocol(hybrid, blocks=60, slots=16), steps, batched) for batched in (False, True)]
    assert traces[0] == traces[1]


class Spy:
    def __init__(self, target: object, name: str) -> None:
        self.calls, self.method = 0, getattr(target, name)
        setattr(target, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.method(*args, **kwargs)


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_batch_that_fits_takes_its_blocks_and_slots_in_one_call_each(hybrid):
    cache = protocol(hybrid, blocks=64, slots=12)
    seqs = [Sequence(list(range(100 * k, 100 * k + 10))) for k in range(4)]
    grow, stamped, runtimes = Spy(cache.pool, "grow_table"), Spy(cache.pool, "allocate_stamped"), Spy(cache.states, "allocate_runtimes")
    admitted = cache.admit_many(seqs, 3)  # first chunks of 3 tokens complete no block: nothing to attach
    assert [(a.start, a.end) for a in admitted] == [(0, 3)] * 4
    assert (grow.calls, stamped.calls, runtimes.calls) == (0, 1, 1)
    assert sorted(a.runtime_slot for a in admitted) == sorted(set(a.runtime_slot for a in admitted))
    cache.check_invariants(seqs)


def test_a_batch_under_pressure_falls_back_to_one_by_one_after_the_deferred_ones():
    cache = protocol(hybrid=False, blocks=4, slots=12)
    seqs = [Sequence(list(range(100 * k, 100 * k + 10))) for k in range(4)]
    grow, stamped = Spy(cache.pool, "grow_table"), Spy(cache.pool, "allocate_stamped")
    admitted = cache.admit_many(seqs, [3, 3, 8, 3])  # the third needs 2 blocks and completes one: one by one
    assert [a.admitted for a in admitted] == [True, True, True, False]
    assert admitted[3].refused.value == "no_kv_blocks"
    assert grow.calls == 1 and stamped.calls == 1  # the first two deferred, taken before the third
    assert [s.num_blocks for s in seqs] == [1, 1, 2, 0]
    cache.check_invariants(seqs)


@pytest.mark.parametrize("hybrid", [True, False])
def test_what_a_match_frees_mid_batch_goes_to_its_own_admission_and_those_after(hybrid):
    steps = [([((0, 8, []), 3), ((1, 8, []), 3), ((2, 8, []), 3)], False, [True] * 6, [False] * 6)]
    traces, freed = [], []
    for batched in (False, True):
        cache = protocol(hybrid, blocks=80, slots=16)
        freeing = FreeingMatches(cache, {2})
        block, slot = freeing.blocks[0], freeing.slots[0]
        traces.append(run(cache, steps, batched, freeing.free_rest))
        freed.append((block, slot))
    assert traces[0] == traces[1]
    first_admissions = traces[1][0]
    assert first_admissions[1][2] == freed[1][1]  # the second took the slot its own match freed
    assert traces[1][1][1][1][1] == [freed[1][0]]  # and the block


# --- remembered hits: ingested requests whose checkpoint search still holds at admission ---------

prompt = st.tuples(st.integers(0, len(BASES) - 1), st.sampled_from([4, 8, 11, 13, 16, 24, 33]))


@st.composite
def conversations(draw):
    """A first step publishes a checkpoint at the end of each prompt (aligned and mid-block,
    prompts sharing prefixes); later steps ask for the same prompts plus a few tokens, so
    most of their requests' matches are the hits their ingest remembered, with budgets that
    fit, complete a block, run nothing or need eviction."""
    prompts = draw(st.lists(prompt, min_size=1, max_size=6))
    first = ([((base, cut, []), 48) for base, cut in prompts], False, [True] * 6, [True] * 6)
    later = st.tuples(
        st.lists(st.tuples(st.tuples(st.sampled_from(prompts), st.lists(st.integers(0, 3), min_size=1, max_size=6)),
                           st.sampled_from([0, 1, 2, 3, 3, 8, 48])), min_size=1, max_size=8),
        st.booleans(), st.lists(likely, min_size=8, max_size=8), st.lists(likely, min_size=8, max_size=8),
    )
    steps = draw(st.lists(later, min_size=1, max_size=4))
    return [first] + [([((base, cut, suffix), budget) for ((base, cut), suffix), budget in requests], shared, runs, frees)
                      for requests, shared, runs, frees in steps]


def release_checkpoints(which: set[int]):
    """Between ingest and admission of the steps in ``which``, release one checkpoint under
    state-slot pressure (a remembered search then no longer holds for requests that hit it)."""
    def release(cache: CacheProtocol, number: int) -> int:
        return cache.trie.free_state_slots(1) if number in which else 0
    return release


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.integers(24, 140),
    slots=st.integers(5, 20),
    steps=conversations(),
    released=st.sets(st.integers(1, 4), max_size=2),
)
def test_remembered_hits_decide_as_one_by_one(blocks, slots, steps, released):
    """Ids, stamps, refcounts, slots, counters, tables and decisions end as one by one, with
    roomy and tight pools (the fast run stops at the first that does not fit, the rest go on
    one by one) and checkpoints released between ingest and admission."""
    traces = [run(protocol(True, blocks, slots), steps, batched, before_admissions=release_checkpoints(released))
              for batched in (False, True)]
    assert traces[0] == traces[1]


def published(prompts: list[list[int]]) -> CacheProtocol:
    cache = protocol(hybrid=True, blocks=64, slots=16)
    for tokens in prompts:
        seq = Sequence(tokens)
        admitted = cache.admit(seq, len(tokens))
        cache.reserve_save(seq, len(tokens))
        cache.forward_queued(seq)
        seq.set_computed(len(tokens))
        cache.forward_done(seq, 0)
        cache.free(seq, admitted.runtime_slot)
    return cache


def test_remembered_hits_are_admitted_in_one_pass():
    """Requests ingested against published checkpoints (two sharing a prefix, one mid-block)
    are admitted without a match transaction each, one call per pool; a first chunk that
    completes a block (attaches it) ends the run, and the rest go on as before. Everything
    ends as one by one."""
    prompts = [list(range(1, 13)), list(range(1, 9)) + [50], list(range(100, 116)), list(range(1, 9)) + [60, 61]]
    results = []
    for batched in (False, True):
        cache = published(prompts)
        seqs = [Sequence(tokens + [7, 7, 7]) for tokens in prompts]
        for seq in seqs:
            cache.prepare(seq)
        seqs[1].prefix_state.suppress_stats = True  # its hit is not counted either way
        match, stamped, runtimes = Spy(cache.trie, "match"), Spy(cache.pool, "allocate_stamped"), Spy(cache.states, "allocate_runtimes")
        admitted = cache.admit_many(seqs, 2) if batched else [cache.admit(seq, 2) for seq in seqs]
        assert all(seq.prefix_state.checkpoints.restore_pinned for seq in seqs)
        cache.check_invariants(seqs)
        results.append(([admission_facts(a) for a in admitted], cache_facts(cache, seqs), next_ids(cache)))
    assert (match.calls, stamped.calls, runtimes.calls) == (1, 1, 1)  # the last one's chunk [10, 12) completes a block
    starts = [(start, end, restore, hit) for start, end, _, restore, hit, _, _ in results[1][0]]
    assert starts == [(12, 14, 12, 12), (9, 11, 9, 9), (16, 18, 16, 16), (10, 12, 10, 10)]
    assert results[0] == results[1]



def test_commit_undisplacing_refuses_one_match_twice_and_closes_none():
    cache = protocol(True, 16, 4)
    seq = Sequence(list(range(8)))
    txn = cache.trie.match(seq)
    with pytest.raises(StaleHandleError):
        cache.trie.commit_undisplacing([txn, txn])
    assert txn.open
    cache.trie.rollback(txn)
    cache.check_invariants([seq])
