"""Bad input and misuse at the protocol's boundary: each call raises its specific error before
anything changes (the cache's counters and pools, the sequence's table, step and pins), never
loops, and a need no eviction could meet evicts nothing."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidStepError,
    InvalidTypeError,
    LifecycleError,
    WrongRoleError,
)
from hybridcache.protocol import CacheProtocol, Refusal

B = 4
PROMPT = list(range(1, 25))


def protocol(hybrid: bool = True, blocks: int = 32) -> CacheProtocol:
    config = CacheConfig(block_size=B, num_kv_blocks=blocks, num_state_slots=8, checkpoint_budget=4, hybrid=hybrid)
    return CacheProtocol(build_cache(config, track_pending=True))


def image(cache: CacheProtocol, *seqs: Sequence) -> tuple:
    """What a refused call must leave as it was: counters, pools, live records and their pins,
    and each sequence's table, step, experts and checkpoint references."""
    records = sorted((r.record_id, r.state.value, r.restore_pins, r.producer_pins) for r in cache.checkpoints.live_records())
    held = [
        (
            seq.block_table.tolist(), seq.num_computed, seq.num_routed_experts, seq.prefix_state.borrow.depth,
            seq.prefix_state.checkpoints.restore, seq.prefix_state.checkpoints.restore_pinned,
            seq.prefix_state.checkpoints.producer_pin, seq.prefix_state.checkpoints.pending_save,
        )
        for seq in seqs
    ]
    return cache.stats(), cache.states.num_runtime, cache.trie.nodes.num_attached, records, held


def serve(cache: CacheProtocol, tokens: list[int]) -> None:
    seq = Sequence(tokens)
    cache.prepare(seq)
    admission = cache.admit(seq, len(tokens))
    cache.reserve_save(seq, admission.end)
    cache.forward_queued(seq)
    seq.set_computed(admission.end)
    cache.forward_done(seq, admission.start)
    cache.free(seq, admission.runtime_slot)


def in_flight(cache: CacheProtocol, tokens: list[int] = PROMPT, **kwargs) -> tuple[Sequence, int]:
    """A sequence admitted, its save reserved and its forward queued and computed, not landed."""
    seq = Sequence(tokens, **kwargs)
    cache.prepare(seq)
    admission = cache.admit(seq, len(tokens))
    cache.reserve_save(seq, admission.end)
    cache.forward_queued(seq)
    seq.set_computed(admission.end)
    return seq, admission.runtime_slot


@pytest.fixture
def deadline():
    """Fail a call that does not return within a few seconds instead of hanging the run."""

    def expired(*_):
        raise AssertionError("the call did not return")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# --- positions of the forward boundaries -----------------------------------------------------


@pytest.mark.parametrize("start, error", [(-1, InvalidStepError), (25, InvalidStepError), ("x", InvalidTypeError),
                                          (None, InvalidTypeError), (1.5, InvalidTypeError), (True, InvalidTypeError)])
def test_forward_done_refuses_a_bad_start_before_landing_anything(deadline, start, error):
    cache = protocol()
    seq, slot = in_flight(cache)
    before = image(cache, seq)
    with pytest.raises(error):
        cache.forward_done(seq, start)
    assert image(cache, seq) == before
    cache.check_invariants([seq])
    assert cache.forward_done(seq, 0).save is not None  # still in flight: it lands now
    cache.free(seq, slot)


@pytest.mark.parametrize("rows", [np.ones((24, 2)), [[1], [2, 3]], np.ones(24, dtype=np.int64), np.ones((30, 2), np.int64)])
def test_forward_done_refuses_bad_expert_rows_before_landing_anything(rows):
    cache = protocol()
    seq, slot = in_flight(cache, want_routed_experts=True)
    before = image(cache, seq)
    with pytest.raises((InvalidTypeError, InvalidStepError)):
        cache.forward_done(seq, 0, rows)
    assert image(cache, seq) == before
    cache.check_invariants([seq])
    landed = cache.forward_done(seq, 0, np.ones((24, 2), dtype=np.int64))
    assert landed.save is not None and seq.num_routed_experts == 24
    cache.free(seq, slot)


@pytest.mark.parametrize("start, end, error", [(-4, 4, InvalidStepError), (8, 4, InvalidStepError),
                                               (0.5, 4, InvalidTypeError), ("a", 4, InvalidTypeError),
                                               (None, None, InvalidTypeError)])
def test_writable_blocks_refuses_bad_positions(deadline, start, end, error):
    cache = protocol()
    seq, slot = in_flight(cache)
    with pytest.raises(error):
        cache.writable_blocks(seq, start, end)
    assert cache.writable_blocks(seq, 0, 24) == frozenset(seq.block_table.tolist())
    assert cache.writable_blocks(seq, 24, 25) == frozenset()  # a save's block past the tokens
    cache.forward_done(seq, 0)
    cache.free(seq, slot)


def test_the_trie_refuses_a_negative_start_without_looping(deadline):
    cache = protocol()
    seq, slot = in_flight(cache)
    before = image(cache, seq)
    with pytest.raises(InvalidStepError):
        cache.trie.mark_computed(seq, -1)
    with pytest.raises(InvalidStepError):
        cache.trie.exclusive_blocks(seq, -4, 4)
    assert image(cache, seq) == before
    cache.forward_done(seq, 0)
    cache.free(seq, slot)


# --- admission ----------------------------------------------------------------------------


@pytest.mark.parametrize("stop_at, error", [(lambda start: "x", InvalidTypeError), (lambda start: 26.5, InvalidTypeError),
                                            (lambda start: 1 / 0, InvalidArgumentError),
                                            (lambda start: (_ for _ in ()).throw(InvalidStepError("mine")), InvalidStepError)])
def test_a_bad_stop_at_rolls_the_match_back_entirely(stop_at, error):
    cache = protocol()
    serve(cache, PROMPT)  # a checkpoint at 24: the next admission's match pins it and counts a hit
    seq = Sequence(PROMPT + [99, 98, 97, 96, 95])
    cache.prepare(seq)
    before = image(cache, seq)
    with pytest.raises(error) as raised:
        cache.admit(seq, 100, stop_at=stop_at)
    if error is InvalidArgumentError:
        assert isinstance(raised.value.__cause__, ZeroDivisionError)
    assert image(cache, seq) == before
    cache.check_invariants([seq])
    admission = cache.admit(seq, 100, stop_at=lambda start: np.int64(start + 2))
    assert admission.admitted and admission.hit_tokens == 24 and admission.end == 26
    cache.forward_queued(seq)
    seq.set_computed(admission.end)
    cache.forward_done(seq, admission.start)
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants([])


@pytest.mark.parametrize("admit", [lambda cache, seq: cache.admit(seq, 8), lambda cache, seq: cache.admit_many([seq], 8)])
def test_a_sequence_in_flight_is_not_admitted_again(admit):
    cache = protocol()
    seq, slot = in_flight(cache)
    before = image(cache, seq)
    with pytest.raises(LifecycleError):
        admit(cache, seq)
    assert image(cache, seq) == before
    cache.check_invariants([seq])
    cache.forward_done(seq, 0)
    cache.free(seq, slot)
    later = Sequence(PROMPT + [7, 7, 7, 7])
    cache.prepare(later)
    assert cache.admit(later, 100).hit_tokens == 24  # its save stayed usable


def test_admit_many_refuses_the_whole_batch_when_one_is_in_flight():
    cache = protocol()
    seq, slot = in_flight(cache)
    fresh = Sequence(list(range(100, 120)))
    before = image(cache, seq, fresh)
    with pytest.raises(LifecycleError):
        cache.admit_many([fresh, seq], 8)
    assert image(cache, seq, fresh) == before
    cache.forward_done(seq, 0)
    cache.free(seq, slot)


def test_a_hopeless_admission_or_extension_evicts_nothing():
    cache = protocol(blocks=16)
    for first in (100, 200, 300):
        serve(cache, list(range(first, first + 16)))
    big = Sequence(list(range(5000, 5160)))  # 40 blocks of a 16-block pool
    cache.prepare(big)
    before = image(cache, big)
    assert cache.admit(big, 10**6).refused is Refusal.NO_KV_BLOCKS
    assert image(cache, big)[1:] == before[1:]  # a miss counted, nothing evicted or held
    assert cache.stats()["evicted_blocks"] == 0 and cache.stats()["evicted_checkpoints"] == 0
    cache.check_invariants([big])
    assert not cache.extend(big, 160) and not cache.make_block_room(17)
    assert image(cache, big)[1:] == before[1:]
    again = Sequence(list(range(100, 116)) + [9, 9])
    cache.prepare(again)
    assert cache.admit(again, 100).hit_tokens == 16  # the cache survived


@pytest.mark.parametrize("call, error", [
    (lambda cache, seq: cache.extend(seq, 1.5), InvalidTypeError),
    (lambda cache, seq: cache.extend(seq, "x"), InvalidTypeError),
    (lambda cache, seq: cache.extend(seq, None), InvalidTypeError),
    (lambda cache, seq: cache.extend(seq, -5), InvalidStepError),
    (lambda cache, seq: cache.extend(None, 4), InvalidTypeError),
    (lambda cache, seq: cache.blocks_needed(None, 4), InvalidTypeError),
    (lambda cache, seq: cache.blocks_needed(seq, "x"), InvalidTypeError),
    (lambda cache, seq: cache.blocks_needed(seq, -5), InvalidStepError),
    (lambda cache, seq: cache.make_block_room("x"), InvalidTypeError),
    (lambda cache, seq: cache.make_block_room(None), InvalidTypeError),
    (lambda cache, seq: cache.make_block_room(1.5), InvalidTypeError),
    (lambda cache, seq: cache.make_block_room(-5), InvalidArgumentError),
    (lambda cache, seq: cache.swap_computed_duplicates(None), InvalidTypeError),
    (lambda cache, seq: cache.adopt(None, 4, lambda adoption: True), InvalidTypeError),
])
def test_bad_arguments_raise_hybridcache_errors_and_change_nothing(call, error):
    cache = protocol()
    serve(cache, PROMPT)
    seq = Sequence(PROMPT + [5, 6, 7, 8])
    cache.prepare(seq)
    admission = cache.admit(seq, 4)
    before = image(cache, seq)
    with pytest.raises(error):
        call(cache, seq)
    assert image(cache, seq) == before
    cache.check_invariants([seq])
    cache.forward_queued(seq)
    cache.free(seq, admission.runtime_slot)


# --- free ---------------------------------------------------------------------------------


@pytest.mark.parametrize("slot, error", [(999, InvalidBlockIdError), (-5, InvalidBlockIdError), ("x", InvalidTypeError),
                                         (np.array([1, 2]), InvalidTypeError), (1.0, InvalidTypeError),
                                         (0, WrongRoleError), ("free", DoubleFreeError), ("checkpoint", WrongRoleError)])
def test_free_refuses_a_bad_runtime_slot_before_freeing_anything(slot, error):
    cache = protocol()
    serve(cache, PROMPT)
    seq = Sequence(PROMPT + [5, 6, 7, 8])
    cache.prepare(seq)
    admission = cache.admit(seq, 100)
    if isinstance(slot, str) and slot == "free":
        slot = next(s for s in range(1, cache.states.num_slots) if cache.states.role_of(s).name == "FREE")
    elif isinstance(slot, str) and slot == "checkpoint":
        slot = admission.restore.slot
    before = image(cache, seq)
    with pytest.raises(error):
        cache.free(seq, slot)
    assert image(cache, seq) == before
    cache.check_invariants([seq])
    cache.free(seq, np.int64(admission.runtime_slot))
    assert cache.states.num_runtime == 0 and seq.num_blocks == 0
