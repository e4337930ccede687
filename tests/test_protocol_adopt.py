"""``CacheProtocol.adopt`` and ``cached_prefix``: a prefix computed elsewhere becomes cached here
through the same steps as a forward, or nothing it touched stays matchable."""

from __future__ import annotations

import pytest

from hybridcache import Sequence
from hybridcache.errors import AdoptionWriteError, InvalidArgumentError, InvalidStepError, InvalidTypeError, LifecycleError

from tests.test_protocol import B, protocol, serve

PROMPT = list(range(1, 4 * B + 6))


def free_counts(cache) -> tuple[int, int]:
    return cache.pool.num_free, cache.states.num_free


def test_an_adopted_prefix_is_hit_by_the_next_request():
    cache = protocol()
    written = []
    adopted = cache.adopt(Sequence(PROMPT[: 3 * B]), 3 * B, lambda adoption: written.append(adoption) or True)
    (adoption,) = written
    assert adopted.gained == 3 * B and (adoption.start, adoption.end) == (0, 3 * B)
    assert adopted.published and adopted.checkpoint.step == 3 * B and adopted.checkpoint.slot == adoption.slot
    assert set(adoption.block_table) == adoption.writable and len(adoption.block_table) == 3
    follow = Sequence(PROMPT)
    assert cache.cached_prefix(follow) == (3 * B, 3 * B)
    admitted = cache.admit(follow, 64)
    assert admitted.hit_tokens == 3 * B and admitted.restore.slot == adoption.slot
    cache.check_invariants([follow])
    cache.free(follow, admitted.runtime_slot)
    cache.check_invariants()


def test_adoption_beyond_a_local_hit_writes_only_what_the_cache_lacks():
    cache = protocol()
    serve(cache, PROMPT[: 2 * B])  # a checkpoint at 2B and its KV
    written = []
    adopted = cache.adopt(Sequence(PROMPT[: 4 * B]), 4 * B, lambda adoption: written.append(adoption) or True)
    (adoption,) = written
    assert adopted.gained == 2 * B and adoption.start == 2 * B
    shared = [block for block in adoption.block_table[:2] if block not in adoption.writable]
    assert len(shared) == 2  # the cached blocks of [0, 2B) are borrowed, never written
    assert cache.cached_prefix(Sequence(PROMPT))[0] == 4 * B
    cache.check_invariants()


def test_nothing_is_adopted_when_the_cache_already_reaches_the_step():
    cache = protocol()
    serve(cache, PROMPT[: 3 * B])
    calls = []
    assert cache.adopt(Sequence(PROMPT[: 3 * B]), 3 * B, lambda adoption: calls.append(adoption) or True).gained == 0
    assert not calls
    cache.check_invariants()


def test_a_failed_write_leaves_nothing_matchable_and_nothing_held():
    cache = protocol()
    before = free_counts(cache)
    adopted = cache.adopt(Sequence(PROMPT[: 3 * B]), 3 * B, lambda adoption: False)
    assert adopted.gained == 0 and not adopted.published
    assert adopted.released.abandoned == 1  # the save published for the write, released with it
    assert cache.cached_prefix(Sequence(PROMPT)) == (0, 0)
    assert free_counts(cache) == before
    cache.check_invariants()


def _raise(error: Exception):
    def write(adoption):
        raise error

    return write


@pytest.mark.parametrize(
    "error,expected",
    [(IndexError("index 3 is out of bounds"), AdoptionWriteError), (ValueError("x"), AdoptionWriteError),
     (InvalidArgumentError("misfit"), InvalidArgumentError)],
    ids=["IndexError", "ValueError", "hybridcache error"],
)
def test_a_raising_write_fails_frees_everything_then_raises_typed(error, expected):
    cache = protocol()
    serve(cache, PROMPT[: B])  # a local hit: the adoption borrows it and must give it back
    before = free_counts(cache)
    for _ in range(cache.states.num_slots):  # more raising writes than there are slots: none leaks
        with pytest.raises(expected) as raised:
            cache.adopt(Sequence(PROMPT[: 3 * B]), 3 * B, _raise(error))
        assert raised.value is error or raised.value.__cause__ is error
        cache.check_invariants()
    assert free_counts(cache) == before
    assert cache.cached_prefix(Sequence(PROMPT))[0] == B  # nothing of the failed adoptions is matchable


def test_free_while_the_forward_is_in_flight_is_refused_and_changes_nothing():
    cache = protocol()
    seq = Sequence(PROMPT)
    cache.prepare(seq)
    admission = cache.admit(seq, len(PROMPT))
    cache.reserve_save(seq, seq.num_tokens)
    cache.forward_queued(seq)
    held = (seq.block_table.tolist(), free_counts(cache))
    with pytest.raises(LifecycleError):
        cache.free(seq, admission.runtime_slot)
    assert (seq.block_table.tolist(), free_counts(cache)) == held
    cache.check_invariants([seq])
    seq.set_computed(admission.end)
    cache.forward_done(seq, admission.start)
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants()


def test_check_invariants_catches_a_pinned_save_whose_sequence_is_gone():
    cache = protocol()
    seq = Sequence(PROMPT)
    cache.prepare(seq)
    admission = cache.admit(seq, len(PROMPT))
    cache.reserve_save(seq, seq.num_tokens)
    cache.forward_queued(seq)
    cache.trie.free_sequence(seq)  # behind the protocol's back: the save stays pinned
    cache.states.free_runtime(admission.runtime_slot)
    with pytest.raises(AssertionError, match="producer pins without owners"):
        cache.check_invariants([])


def test_attention_only_caches_adopt_nothing():
    cache = protocol(hybrid=False)
    assert cache.adopt(Sequence(PROMPT[: 2 * B]), 2 * B, lambda adoption: True).gained == 0
    cache.check_invariants()


def test_pools_too_small_refuse_the_adoption_without_change():
    cache = protocol(blocks=2)
    before = free_counts(cache)
    assert cache.adopt(Sequence(PROMPT[: 3 * B]), 3 * B, lambda adoption: True).gained == 0
    assert free_counts(cache) == before
    cache.check_invariants()


def test_bad_adoptions_are_refused():
    cache = protocol()
    with pytest.raises(InvalidStepError):
        cache.adopt(Sequence(PROMPT[: 3 * B]), 2 * B, lambda adoption: True)  # not the sequence's length
    with pytest.raises(InvalidTypeError):
        cache.adopt(Sequence(PROMPT[: 2 * B]), 2 * B, "write")
    cache.check_invariants()
