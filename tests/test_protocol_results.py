"""What the protocol's calls report (``protocol_values``): the record a save reserved, the save a
landed forward made usable, what an adoption gained, and every checkpoint released on the way,
by cause, so that no caller infers it from counters or reads the trie."""

from __future__ import annotations

import pytest

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import InvalidTypeError
from hybridcache.prefix_cache.checkpoint_store import CheckpointReleases
from hybridcache.protocol import CacheProtocol

from tests.test_protocol import B, serve


def protocol(budget: int = 4, per_anchor: int = 4, slots: int | None = None) -> CacheProtocol:
    config = CacheConfig(
        block_size=B, num_kv_blocks=32, num_state_slots=slots or budget + 2, checkpoint_budget=budget,
        max_checkpoints_per_anchor=per_anchor, hybrid=True,
    )
    return CacheProtocol(build_cache(config, track_pending=True))


def tokens(count: int, start: int = 1) -> list[int]:
    return list(range(start, start + count))


def forward(cache: CacheProtocol, seq: Sequence, start: int, end: int):
    """Queue and land one forward of ``seq`` computing ``[start, end)``."""
    cache.forward_queued(seq)
    seq.set_computed(end)
    landed = cache.forward_done(seq, start)
    cache.check_invariants([seq])
    return landed


def test_a_save_that_needs_a_slot_reports_the_checkpoint_it_evicted():
    cache = protocol(budget=1)
    serve(cache, tokens(2 * B + 3))  # its checkpoint holds the only slot
    seq = Sequence(tokens(2 * B + 3, start=500))
    cache.prepare(seq)
    admission = cache.admit(seq, seq.num_tokens)
    reservation = cache.reserve_save(seq, seq.num_tokens)
    assert reservation.reserved and reservation.record.step == seq.num_tokens
    assert reservation.released == CheckpointReleases(save_slots=1)
    landed = forward(cache, seq, admission.start, admission.end)
    assert landed.published and landed.save is reservation.record and landed.released.total == 0
    assert cache.released_checkpoints() == CheckpointReleases(save_slots=1)
    assert cache.stats()["evicted_checkpoints"] == 0  # the trie's counter never saw it
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants()


def test_a_landed_save_reports_the_checkpoint_its_anchor_had_to_drop():
    cache = protocol(per_anchor=1)
    seq = Sequence(tokens(2 * B + 9))
    cache.prepare(seq)
    admission = cache.admit(seq, 2 * B + 4)
    first = cache.reserve_save(seq, 2 * B + 4).record
    assert forward(cache, seq, 0, 2 * B + 4).save is first
    assert cache.extend(seq, 2 * B + 8)
    second = cache.reserve_save(seq, 2 * B + 8).record  # the same anchor, one record allowed
    landed = forward(cache, seq, 2 * B + 4, 2 * B + 8)
    assert landed.save is second and landed.released == CheckpointReleases(anchor_cap=1)
    assert not first.is_published and second.is_published
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants()


def test_a_decode_checkpoint_reports_the_one_it_replaced():
    cache = protocol()
    seq = Sequence(tokens(2 * B))
    cache.prepare(seq)
    admission = cache.admit(seq, 2 * B)
    previous = cache.reserve_decode_save(seq, B).record
    assert forward(cache, seq, 0, 2 * B).save is previous
    seq.append_tokens(tokens(B, start=900))
    cache.swap_computed_duplicates(seq)
    assert cache.extend(seq, 3 * B)
    reservation = cache.reserve_decode_save(seq, B)
    landed = forward(cache, seq, 2 * B, 3 * B)
    assert landed.save is reservation.record and landed.released == CheckpointReleases(replaced=1)
    assert not previous.is_published
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants()


def test_a_refused_save_reports_no_record_and_a_forward_without_one_no_save():
    cache = protocol()
    seq = Sequence(tokens(B + 3))
    cache.prepare(seq)
    admission = cache.admit(seq, seq.num_tokens)
    assert cache.reserve_decode_save(seq, B).record is None  # B + 3 is no multiple of B
    landed = forward(cache, seq, admission.start, admission.end)
    assert not landed.published and landed.save is None and landed.released.total == 0
    with pytest.raises(InvalidTypeError):
        cache.forward_done("seq", 0)
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants()


def test_an_adoption_reports_its_checkpoint_and_what_it_evicted_for_it():
    cache = protocol(budget=1)
    serve(cache, tokens(2 * B + 3))
    adopted = cache.adopt(Sequence(tokens(3 * B, start=500)), 3 * B, lambda adoption: True)
    assert adopted.gained == 3 * B and adopted.published and adopted.checkpoint.step == 3 * B
    assert adopted.released == CheckpointReleases(save_slots=1)
    assert cache.cached_prefix(Sequence(tokens(3 * B + 5, start=500)))[0] == 3 * B
    cache.check_invariants()
