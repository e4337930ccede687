"""The engine-facing protocol: prepare, admit (or change nothing and say why), the forward
boundaries, free."""

from __future__ import annotations

import pytest

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import ForeignSequenceError
from hybridcache.protocol import CacheProtocol, Refusal

B = 16


def protocol(hybrid: bool = True, blocks: int = 32, slots: int = 8, budget: int = 4) -> CacheProtocol:
    config = CacheConfig(block_size=B, num_kv_blocks=blocks, num_state_slots=slots, checkpoint_budget=budget, hybrid=hybrid)
    return CacheProtocol(build_cache(config, track_pending=True))


def holdings(cache: CacheProtocol, seq: Sequence) -> tuple:
    """What the sequence holds and what is pinned. Recency stamps aside (a tentative match may
    touch what it looked at), and cached entries aside: eviction under pressure is never undone."""
    state = seq.prefix_state
    pins = sorted((r.record_id, r.pin_count) for r in cache.checkpoints.live_records() if r.pin_count)
    return (
        cache.states.num_runtime, pins, seq.block_table.tolist(), seq.num_computed,
        state.checkpoints.restore, state.checkpoints.restore_pinned, state.borrow.depth, state.trie.cursor, state.checkpoints.pending_save,
    )


def serve(cache: CacheProtocol, tokens: list[int]) -> Sequence:
    """One request through every step, its prompt in one forward, then freed."""
    seq = Sequence(tokens)
    cache.prepare(seq)
    admission = cache.admit(seq, len(tokens))
    assert admission.admitted
    save = cache.reserve_save(seq, seq.num_tokens).record
    cache.forward_queued(seq)
    seq.set_computed(admission.end)
    landed = cache.forward_done(seq, admission.start)
    assert landed.save is save and (save is None or save.is_published)
    cache.free(seq, admission.runtime_slot)
    return seq


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_repeated_prompt_hits_through_the_protocol_and_nothing_leaks(hybrid):
    cache = protocol(hybrid)
    prompt = list(range(1, 3 * B + 6))
    serve(cache, prompt)
    again = Sequence(prompt + [7, 8])
    cache.prepare(again)
    admission = cache.admit(again, 64)
    assert admission.admitted and admission.hit_tokens == (3 * B + 5 if hybrid else 3 * B)
    assert (admission.restore is not None) == hybrid
    cache.forward_queued(again)
    cache.trie.check_invariants([again])
    cache.free(again, admission.runtime_slot)
    cache.trie.clear()
    assert cache.pool.num_free == 32 and cache.states.num_free == 7
    cache.trie.check_invariants()


@pytest.mark.parametrize(
    ("setup", "tokens", "reason"),
    [
        ("none", 0, Refusal.NOTHING_TO_RUN),
        ("slots", 64, Refusal.NO_STATE_SLOT),
        ("blocks", 64, Refusal.NO_KV_BLOCKS),
    ],
)
def test_a_refused_admission_changes_nothing_and_says_why(setup, tokens, reason):
    cache = protocol(blocks=6, slots=4, budget=1)
    serve(cache, list(range(1, 2 * B + 3)))  # cached blocks and a checkpoint worth reusing
    holders = []
    if setup == "slots":
        holders = [cache.states.allocate_runtime() for _ in range(cache.states.num_free_runtime)]
    if setup == "blocks":
        hog = Sequence(list(range(500, 500 + 4 * B)))
        assert cache.admit(hog, 4 * B).admitted
        holders = [hog]
    seq = Sequence(list(range(1, 2 * B + 3)) + list(range(900, 900 + 3 * B)))
    cache.prepare(seq)
    before = holdings(cache, seq)
    admission = cache.admit(seq, tokens)
    assert admission.refused is reason and not admission.admitted
    assert holdings(cache, seq) == before
    cache.trie.check_invariants([seq, *[h for h in holders if isinstance(h, Sequence)]])


def test_a_failed_forward_leaves_nothing_matchable():
    cache = protocol()
    prompt = list(range(1, 2 * B + 5))
    seq = Sequence(prompt)
    cache.prepare(seq)
    admission = cache.admit(seq, len(prompt))
    save = cache.reserve_save(seq, seq.num_tokens).record
    cache.forward_queued(seq)
    cache.forward_failed(seq)
    cache.free(seq, admission.runtime_slot)
    assert not save.is_published
    again = Sequence(prompt + [3])
    cache.prepare(again)
    assert cache.admit(again, 8).hit_tokens == 0
    cache.trie.check_invariants([again])


def test_extend_gives_a_running_sequence_its_next_chunk_or_nothing():
    cache = protocol(blocks=4)
    seq = Sequence(list(range(1, 4 * B + 1)))
    cache.prepare(seq)
    admission = cache.admit(seq, B)
    assert admission.admitted and seq.num_blocks == 1
    seq.set_computed(B)
    assert cache.extend(seq, 4 * B) and seq.num_blocks == 4
    seq.append_tokens([1])
    before = holdings(cache, seq)
    assert not cache.extend(seq, 4 * B + 1)  # the pool has no fifth block
    assert holdings(cache, seq) == before
    cache.free(seq, admission.runtime_slot)
    cache.trie.check_invariants()


def test_another_caches_sequence_is_refused():
    first, second = protocol(), protocol()
    seq = Sequence(list(range(1, 40)))
    first.prepare(seq)
    first.admit(seq, 39)
    with pytest.raises(ForeignSequenceError):
        second.free(seq)
    with pytest.raises(ForeignSequenceError):
        second.admit(seq, 8)
