"""Eviction policies: score functions of the library's heaps, and what they keep."""

from types import SimpleNamespace

import numpy as np
import pytest

from hybridcache import CacheConfig
from hybridcache.cache import build_cache
from hybridcache.errors import InvalidArgumentError, InvalidTypeError, LifecycleError
from hybridcache.policies import BRANCH, SPECULATIVE, TURN_END, AutoEviction, MarconiEviction, resolve_policy
from hybridcache.policies.reuse import save_class
from hybridcache.policies.eviction import PROVEN_GRACE
from hybridcache.policies.tuning import AlphaTuner
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from tests.replay._helpers import PROFILE, budget, request, run


def record(step, stamp, record_id, hits=0):
    return SimpleNamespace(
        step=step, stamp=stamp, record_id=record_id, hits=hits, state=CheckpointState.PUBLISHED, is_published=True,
        anchor=0, producer_id=0, tail_tokens=np.zeros(0, np.int32), is_partial=False, pin_count=0,
    )


class _View:
    """An ``EvictionView`` stand-in: the narrow reads a policy scores with."""

    block_size = 32
    clock = 100
    num_state_slots = 10

    def key(self, slot):
        return slot + 1


@pytest.mark.parametrize("eviction", [MarconiEviction(alpha=1.0), AutoEviction()])
def test_keeps_the_checkpoint_saving_more_flops_per_byte_at_equal_recency(eviction):
    state = eviction.new_state(PROFILE)
    state.bind(_View())
    short, long = record(4096, 50, 1), record(4096, 50, 2)
    state.note_save(short, 4064, SPECULATIVE)  # 32 tokens beyond its parent state
    state.note_save(long, 0, SPECULATIVE)  # 4,096 tokens beyond it
    # lower goes first: the short edge (fewer FLOPs saved per byte held) is evicted
    assert state.checkpoint_score(short) < state.checkpoint_score(long)


def test_marconi_alpha_zero_is_recency():
    state = MarconiEviction(alpha=0.0).new_state(PROFILE)
    state.bind(_View())
    old, new = record(4096, 10, 1), record(64, 11, 2)
    state.note_save(old, 0, SPECULATIVE)
    state.note_save(new, 32, SPECULATIVE)
    assert state.checkpoint_score(old) < state.checkpoint_score(new)
    state.set_alpha(2.0)
    with pytest.raises(InvalidArgumentError):
        state.set_alpha(-1)


def test_auto_scores_a_checkpoint_by_the_reuse_its_class_has_shown():
    # a kind reused soon and often is expected back sooner than one never reused: at equal
    # recency the first stays (higher score), whatever the kind is called
    state = AutoEviction().new_state(PROFILE)
    state.bind(_View())
    paying, idle = record(64, 1, 1), record(64, 2, 2)
    state.note_save(paying, 0, TURN_END)
    state.note_save(idle, 0, BRANCH)
    learner = state.learner
    learner.reused[save_class(TURN_END, 0), 0, 0] = 9  # as if nine turn ends had been reused ...
    learner.reuse_ages[save_class(TURN_END, 0), 0, 0] = 9 * 4  # ... four saves after their last touch
    learner.unused[save_class(BRANCH, 0), 0, 0] = 9  # and nine branch points left the window unused
    assert learner.expected_interval(paying) < learner.expected_interval(idle) <= learner.window
    assert state.checkpoint_score(paying) > state.checkpoint_score(idle)


def test_a_state_serves_one_cache_and_kinds_are_checked():
    state = AutoEviction().new_state(None)
    state.bind(_View())
    with pytest.raises(LifecycleError):
        state.bind(_View())
    with pytest.raises(InvalidArgumentError):
        state.note_save(record(8, 1, 1), 0, "whim")


def test_auto_evicts_kv_that_no_checkpoint_uses_first():
    # 16 KV blocks: the second request needs room; auto drops the first request's dead tail
    # (KV beyond its deepest checkpoint) before the prefix under its checkpoint
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 50_000, 4 * 32)
    first = request(0, np.concatenate([shared, rng.integers(0, 50_000, 5 * 32 + 3)]))
    second = request(1, rng.integers(0, 50_000, 6 * 32))
    third = request(2, np.concatenate([shared, rng.integers(0, 50_000, 40)]))
    _, hits = run([first, second, third], "auto:128", budget(16, 8))
    assert hits[2] == 128


class _LeafView(_View):
    """Three leaves (slots 0, 1, 2), stamps and records as given."""

    num_kv_blocks = 100

    def __init__(self, stamps, records):
        self.clock = max(stamps)
        self.stamp = lambda slot: stamps[slot]
        self.records_at = lambda slot: records[slot]


def test_auto_grace_for_proven_leaves_is_bounded():
    proven = record(64, 1, 1, hits=1)
    unproven = record(64, 1, 2)
    grace = PROVEN_GRACE * 100
    stamps = [500, 100, 100 + grace + 1]  # dead and recent, proven and old, unproven and newer
    state = AutoEviction().new_state(PROFILE)
    state.bind(_LeafView(stamps, [(), (proven,), (unproven,)]))
    for item in (proven, unproven):
        state.note_save(item, 0, SPECULATIVE)
    dead, old_proven, newer = (state.kv_score(slot) for slot in range(3))
    assert dead < old_proven  # KV no checkpoint uses goes first, however recent
    assert old_proven < newer  # a proven leaf's grace runs out: it does not stay forever
    assert state.kv_score(1) > (1, 100)  # but it is counted younger than its stamp


def test_tuner_schedule():
    tuner = AlphaTuner(window_factor=2, grid=(0.0, 1.0))
    tuner.record("r0")
    assert not tuner.wants_snapshot(False)
    assert tuner.wants_snapshot(True)
    tuner.took_snapshot()
    for name in ("r1", "r2"):
        assert not tuner.due()
        tuner.record(name)
    assert tuner.due() and tuner.window == ["r1", "r2"]
    assert tuner.choose({0.0: 5, 1.0: 7}) == 1.0 and tuner.tuned and not tuner.due()


def test_marconi_autotunes_during_a_replay():
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 50_000, 4 * 32)
    requests = [request(i, np.concatenate([shared, rng.integers(0, 50_000, 100)])) for i in range(12)]
    record_, _ = run(requests, "marconi", budget(24, 4))
    assert record_.alpha in AlphaTuner().grid


@pytest.mark.parametrize("eviction, turn_end_kept", [
    ("lru", False), ("leaf-lru", True), ("auto:fixed", False), ("auto:weighed", True)])
def test_leaf_lru_keeps_a_turn_end_state_with_its_leaf_under_kv_pressure(eviction, turn_end_kept):
    # an old one-off request, then a turn, then a large one-off that needs blocks: lru (and
    # auto's fixed order) drops the mid-block turn-end states first (one frozen block each),
    # leaf-lru the oldest leaves with their states, auto:weighed whichever its learner prices
    # lower (the old leaf here), so the follow-up of the turn still resumes after its last
    # decoded token
    rng = np.random.default_rng(11)
    old = request(0, rng.integers(0, 50_000, 4 * 32 + 5), output_length=3)
    turn = request(1, rng.integers(0, 50_000, 4 * 32 + 5), output_length=3)
    large = request(2, rng.integers(0, 50_000, 6 * 32))
    follow_up = request(3, np.concatenate([turn.tokens, rng.integers(0, 50_000, 20)]))
    _, hits = run([old, turn, large, follow_up], "marconi", budget(13, 8), eviction=eviction)
    assert hits[3] == (4 * 32 + 5 + 3 - 1 if turn_end_kept else 0)


@pytest.mark.parametrize("eviction, with_leaves", [("leaf-lru", True), ("marconi", True), ("auto", False)])
def test_the_trie_reads_whether_states_go_with_their_leaves_when_it_is_built(eviction, with_leaves):
    state = resolve_policy("marconi", eviction=eviction).eviction.new_state(None)
    config = CacheConfig(block_size=8, num_kv_blocks=16, num_state_slots=6, checkpoint_budget=4, hybrid=True)
    components = build_cache(config, eviction=state)
    assert components.trie.states_with_leaves is with_leaves and components.eviction is state
    with pytest.raises(LifecycleError):  # the trie bound it: a state serves one cache
        build_cache(config, eviction=state)
    assert build_cache(config).trie.states_with_leaves is False  # the library's order
    assert resolve_policy("reference").eviction.new_state(None) is None
    with pytest.raises(InvalidArgumentError):
        resolve_policy("marconi", eviction="leaf-lru:2")
    with pytest.raises(InvalidArgumentError, match="the eviction name must be a non-empty string"):
        resolve_policy("marconi", eviction="")
    with pytest.raises(InvalidArgumentError, match="the admission name must be a non-empty string"):
        resolve_policy("marconi", admission="")
    for name in ("interval:\u0663\u0662", "interval:\u00b2", "auto:\u0661\u0660\u0662\u0664"):  # digits, not ASCII ones
        with pytest.raises(InvalidArgumentError, match="needs a positive int argument"):
            resolve_policy(name)
    with pytest.raises(InvalidArgumentError, match="takes a weight alpha"):
        resolve_policy("marconi", eviction="marconi:\u0661")
    with pytest.raises(InvalidTypeError):
        build_cache(config, eviction=SimpleNamespace(kv_score=None, checkpoint_score=None, bind=None))
    components.trie.check_invariants([])


def _partial(step, stamp, record_id):
    item = record(step, stamp, record_id)
    item.tail_tokens, item.is_partial, item.pin_count = np.ones(step % 32, np.int32), True, 0
    return item


def test_auto_prices_kv_shortfalls_by_the_reuse_its_learner_has_seen():
    # a leaf's price is that of the states it anchors (a leaf anchoring none: one block unseen
    # in the learner's horizon); the next mid-block state's price is its class's odds times
    # the tokens a hit falls back per block freed; a class reused often costs more to drop
    paying, idle, aligned = _partial(70, 5, 1), _partial(75, 1, 2), record(64, 2, 3)
    state = AutoEviction(weigh_shortfalls=True).new_state(PROFILE)
    state.bind(_LeafView([1, 2, 3], [(), (aligned,), (paying,)]))
    state.note_save(paying, 0, TURN_END)
    state.note_save(idle, 0, BRANCH)
    state.note_save(aligned, 0, SPECULATIVE)
    learner = state.learner
    learner.reused[save_class(TURN_END, 70), 0, 0] = 9
    learner.unused[save_class(BRANCH, 75), 0, 0] = 9
    for item in (paying, idle, aligned):
        state.checkpoint_score(item)  # the library files each record: mid-block ones join the heap
    assert state.lost_per_block(idle) < state.lost_per_block(paying)
    expected = learner.odds(paying) * 70 * 32 / (70 + 32)
    assert state.leaf_cost(2) == pytest.approx(expected) and state.leaf_cost(1) == state.lost_per_block(aligned)
    assert state.leaf_cost(0) == 32 / learner.window
    next_state = min((paying, idle), key=state.checkpoint_score)  # the library's frozen order
    assert state.frozen_cost() == state.lost_per_block(next_state)
    next_state.is_published = False  # released: the next one is priced
    other = idle if next_state is paying else paying
    assert state.frozen_cost() == state.lost_per_block(other)
    other.pin_count = 1  # a pinned state cannot go
    assert state.frozen_cost() is None
    assert AutoEviction().new_state(PROFILE).shortfall_costs is None  # off by default
    assert resolve_policy("auto", eviction="auto:weighed").eviction.weigh_shortfalls is True
    assert resolve_policy("auto", eviction="auto:fixed").eviction.weigh_shortfalls is False
    with pytest.raises(InvalidArgumentError):
        resolve_policy("auto", eviction="auto:sometimes")
