"""CheckpointLifecycle: reserve, publish, discard, pins, release, eviction, decode checkpoints
and stale cleanup, with several records per anchor, no in-place replacement, tail copies
instead of prefix copies, and a transactional publish."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import (
    AlreadyPublishedError,
    InvalidArgumentError,
    InvalidStepError,
    InvalidTypeError,
    LifecycleError,
    PinnedError,
    PinUnderflowError,
)
from hybridcache.memory.state_pool import SlotRole
from hybridcache.policies.eviction import LeafLRUState
from hybridcache.prefix_cache.checkpoint_index import Verdict, VerifyStatus
from hybridcache.prefix_cache.checkpoint_lifecycle import NO_SAVE
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from hybridcache.sequence import MultimodalSpan, Namespace, Sequence

from ._helpers import (
    B,
    admit,
    admit_leaving_restore_unpinned,
    cursor_depth,
    forward,
    grow_attach_commit,
    leaves,
    tokens,
)
from ._hybrid import indexed, make_hybrid, produce, request_key, world

NS = Namespace()


def extend(trie, seq, new_tokens) -> None:
    """A decode step's bookkeeping before its forward: append, grow the table, attach."""
    seq.append_tokens(new_tokens)
    trie.pool.grow_table(seq, seq.num_tokens, trie.block_size)
    trie.allocate(seq)


def hits(trie, prompt, **kwargs):
    """Match a request of ``prompt`` (rolled back at once); return (hit step, restore)."""
    request = Sequence(prompt, **kwargs)
    txn = trie.match(request)
    result = (request.num_computed, request.prefix_state.checkpoints.restore)
    trie.rollback(txn)
    return result


# --- reserve, publish, discard ---------------------------------------------------------------


def test_reserve_then_publish():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(48))
    admit(trie, seq)
    slot = cp.reserve_save(seq, 32)
    assert slot > 0 and states.role_of(slot) is SlotRole.CHECKPOINT
    record = seq.prefix_state.checkpoints.pending_save
    assert record.state is CheckpointState.RESERVED and record.slot == slot
    # keyed by its step and the value of its anchor's own block: what a request probes
    assert record.key == (32, trie.nodes.last_block_value(record.anchor))
    assert record.key == request_key(trie, Sequence(tokens(49)), 32)
    assert cp.live_records() == [record] and cp.records_at(record.anchor) == (record,)
    assert len(trie.index) == 0 and not indexed(trie, record)
    assert hits(trie, tokens(49)) == (0, None)  # a reservation is not matchable
    forward(trie, seq)
    assert cp.publish_save(seq) is True
    assert record.state is CheckpointState.PUBLISHED and seq.prefix_state.checkpoints.pending_save is None
    assert indexed(trie, record) and trie.index.candidate_steps(NS, 0, 100) == [32]
    assert record.producer_pins == 0 and seq.prefix_state.checkpoints.producer_pin is None
    assert hits(trie, tokens(49)) == (32, record)
    trie.check_invariants([seq])
    trie.free_sequence(seq)
    assert hits(trie, tokens(49)) == (32, record)  # the checkpoint outlives its producer


def test_publish_without_pending_save_is_false():
    pool, states, trie = make_hybrid()
    seq = Sequence(tokens(20))
    admit(trie, seq)
    assert trie.checkpoints.publish_save(seq) is False
    assert trie.checkpoints.release_reservation(seq) is False


def test_partial_reserve_consumes_one_block_and_one_slot_and_discard_returns_both():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(33))
    admit(trie, seq)
    free_blocks, free_slots = pool.num_free, states.num_free
    slot = cp.reserve_save(seq)
    record = seq.prefix_state.checkpoints.pending_save
    assert slot > 0 and record.step == 33 and record.is_partial
    assert pool.num_free == free_blocks - 1 and states.num_free == free_slots - 1
    assert record.frozen_block not in seq.block_table.tolist()
    assert pool.refcount_of(record.frozen_block) == 1
    trie.check_invariants([seq])
    assert cp.release_reservation(seq) is True
    assert seq.prefix_state.checkpoints.pending_save is None and record.state is CheckpointState.RELEASED
    assert cp.live_records() == [] and cp.records_at(record.anchor) == ()
    assert pool.num_free == free_blocks and states.num_free == free_slots
    assert cp.release_reservation(seq) is False
    trie.check_invariants([seq])


def test_partial_checkpoint_publish_then_release_returns_block_and_slot():
    pool, states, trie = make_hybrid()
    free_blocks, free_slots = pool.num_free, states.num_free
    seq, record = produce(trie, tokens(48), 33, free=False)
    assert record.frozen_block not in seq.block_table.tolist()
    trie.free_sequence(seq)
    held = pool.num_blocks - pool.num_free  # the trie's 3 blocks + the frozen block
    assert held == 4 and states.num_free == free_slots - 1
    trie.checkpoints.release(record)
    assert record.state is CheckpointState.RELEASED and not indexed(trie, record)
    assert pool.num_free == free_blocks - 3 and states.num_free == free_slots
    trie.check_invariants([])


def test_a_new_reserve_discards_the_previous_one():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(48))
    admit(trie, seq)
    free_slots = states.num_free
    cp.reserve_save(seq, 33)
    first = seq.prefix_state.checkpoints.pending_save
    cp.reserve_save(seq, 40)
    second = seq.prefix_state.checkpoints.pending_save
    assert first.state is CheckpointState.RELEASED and second.state is CheckpointState.RESERVED
    assert states.num_free == free_slots - 1 and cp.live_records() == [second]
    with pytest.raises(InvalidStepError):  # bad input changes nothing: the reservation stays
        cp.reserve_save(seq, 0)
    assert seq.prefix_state.checkpoints.pending_save is second and second.state is CheckpointState.RESERVED
    assert cp.reserve_save(seq, 41, is_decode=True) == NO_SAVE  # a refused reserve drops the previous one
    assert second.state is CheckpointState.RELEASED and states.num_free == free_slots
    trie.check_invariants([seq])


def test_a_step_inside_a_span_is_refused_without_a_save():
    pool, states, trie = make_hybrid()
    seq = Sequence(tokens(48), multimodal=[MultimodalSpan(17, 20, "image", "a")])
    admit(trie, seq)
    before = (pool.num_free, states.num_free)
    assert trie.checkpoints.reserve_save(seq, 18) == NO_SAVE
    assert seq.prefix_state.checkpoints.pending_save is None and trie.checkpoints.live_records() == []
    assert (pool.num_free, states.num_free) == before


@pytest.mark.parametrize("step", [0, -3, 49, 10**12])
def test_an_out_of_range_step_raises_and_keeps_the_reservation(step):
    pool, states, trie = make_hybrid()
    seq = Sequence(tokens(48))
    admit(trie, seq)
    trie.checkpoints.reserve_save(seq, 33)
    held = seq.prefix_state.checkpoints.pending_save
    before = (pool.num_free, states.num_free)
    with pytest.raises(InvalidStepError):
        trie.checkpoints.reserve_save(seq, step)
    assert seq.prefix_state.checkpoints.pending_save is held and held.state is CheckpointState.RESERVED
    assert (pool.num_free, states.num_free) == before
    trie.check_invariants([seq])


def test_reserve_needs_the_cursor_at_the_anchor():
    """Before ``allocate`` the cursor has not reached the anchor: -1 (a root anchor needs none)."""
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(48))
    txn = trie.match(seq)
    pool.grow_table(seq, seq.num_tokens, B)
    assert cp.reserve_save(seq, 32) == NO_SAVE
    assert cp.reserve_save(seq, 5) > 0  # anchored on the root
    trie.allocate(seq)
    trie.commit(txn)
    assert cp.reserve_save(seq, 32) > 0
    trie.check_invariants([seq])


def test_decode_save_must_be_aligned():
    pool, states, trie = make_hybrid()
    seq = Sequence(tokens(40))
    admit(trie, seq)
    assert trie.checkpoints.reserve_save(seq, 40, is_decode=True) == NO_SAVE
    assert trie.checkpoints.reserve_save(seq, 32, is_decode=True) > 0
    assert seq.prefix_state.checkpoints.pending_save.is_decode


def test_explicit_chunk_step():
    """A chunked prefill saves at its chunk end: an 80-token prompt, first chunk to 32."""
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(80))
    admit(trie, seq)
    assert cp.reserve_save(seq, 32) > 0
    seq.set_computed(32)
    assert cp.publish_save(seq)
    step, record = hits(trie, tokens(33))
    assert step == 32 and record.step == 32 and record.producer_id == seq.seq_id


def test_two_identical_prompts_share_the_anchor():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    first, second = Sequence(tokens(40)), Sequence(tokens(40))
    admit(trie, first)
    admit(trie, second)
    slot = cp.reserve_save(first)
    assert slot > 0
    free = (pool.num_free, states.num_free)
    assert cp.reserve_save(second) == NO_SAVE  # an equal save is pending at the anchor
    assert second.prefix_state.checkpoints.pending_save is None and (pool.num_free, states.num_free) == free
    forward(trie, first)
    forward(trie, second)
    assert cp.publish_save(first) and cp.publish_save(second) is False
    assert cp.reserve_save(second) == NO_SAVE  # an equal save is published there
    third = Sequence(tokens(41))
    txn = trie.match(third)
    assert third.num_computed == 40 and third.prefix_state.checkpoints.restore.slot == slot
    trie.rollback(txn)
    # a different step on the same anchor is not equal
    assert cp.reserve_save(second, 39) > 0
    trie.check_invariants([first, second, third])


def test_equal_step_with_a_different_tail_is_not_equal():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    first, second = Sequence(tokens(40)), Sequence(tokens(38) + [0, 0])
    admit(trie, first)
    admit(trie, second)
    assert cp.reserve_save(first) > 0 and cp.reserve_save(second) > 0
    assert first.prefix_state.checkpoints.pending_save.anchor == second.prefix_state.checkpoints.pending_save.anchor
    trie.check_invariants([first, second])


# --- pins -----------------------------------------------------------------------------------


def test_restore_pin_survives_tail_allocation():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    _, record = produce(trie, tokens(32), 32)
    seq = Sequence(tokens(50))
    txn = trie.match(seq)
    assert seq.prefix_state.checkpoints.restore is record and not seq.prefix_state.checkpoints.restore_pinned
    assert record.restore_pins == 0  # selected, not pinned
    assert cp.pin_restore(seq) and record.restore_pins == 1 and record.hits == 1
    assert cp.pin_restore(seq) is False  # already pinned
    grow_attach_commit(trie, seq, txn)
    assert cursor_depth(trie, seq) == 3 and int(trie.nodes.depth[record.anchor]) == 2
    assert seq.prefix_state.checkpoints.restore is record and record.restore_pins == 1
    trie.check_invariants([seq])
    assert cp.unpin_restore(seq) is True
    assert record.restore_pins == 0 and seq.prefix_state.checkpoints.restore is None
    assert not seq.prefix_state.checkpoints.restore_pinned
    assert cp.unpin_restore(seq) is False
    trie.check_invariants([seq])


def test_hold_restore_pins_before_admission_without_counting_a_hit():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    _, record = produce(trie, tokens(32), 32)
    seq = Sequence(tokens(50))
    assert cp.hold_restore(seq, record) and record.restore_pins == 1 and record.hits == 0
    assert cp.hold_restore(seq, record) is False and record.restore_pins == 1  # already held
    trie.check_invariants([seq])
    assert trie.free_state_slots(1) == 0  # a held checkpoint is not given up for room
    assert cp.unpin_restore(seq) and record.restore_pins == 0
    assert seq.prefix_state.checkpoints.restore is None
    txn = trie.match(seq)
    assert cp.pin_restore(seq) and record.hits == 1  # the admission's hit, once
    grow_attach_commit(trie, seq, txn)
    trie.check_invariants([seq])


def test_hold_restore_refuses_a_released_checkpoint_and_a_foreign_record():
    pool, states, trie = make_hybrid()
    other_trie = make_hybrid()[2]
    _, foreign = produce(other_trie, tokens(32), 32)
    _, record = produce(trie, tokens(32), 32)
    seq = Sequence(tokens(50))
    with pytest.raises(InvalidArgumentError):
        trie.checkpoints.hold_restore(seq, foreign)
    with pytest.raises(InvalidArgumentError):
        trie.checkpoints.hold_restore(seq, "a record")
    assert trie.free_state_slots(1) == 1  # released
    assert trie.checkpoints.hold_restore(seq, record) is False
    assert seq.prefix_state.checkpoints.restore is None  # nothing selected
    trie.check_invariants([seq])


def test_pin_restore_refuses_a_released_checkpoint():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    _, record = produce(trie, tokens(32), 32)
    seq = Sequence(tokens(33))
    txn = trie.match(seq)
    assert seq.prefix_state.checkpoints.restore is record
    assert trie.free_state_slots(1) == 1  # gone between match and admission
    assert cp.pin_restore(seq) is False and not seq.prefix_state.checkpoints.restore_pinned
    trie.rollback(txn)
    assert seq.prefix_state.checkpoints.restore is None and seq.num_computed == 0
    trie.check_invariants([seq])


def test_free_sequence_discards_the_pending_save():
    pool, states, trie = make_hybrid()
    seq = Sequence(tokens(40))
    admit(trie, seq)
    free_blocks, free_slots = pool.num_free, states.num_free
    assert trie.checkpoints.reserve_save(seq) > 0
    record = seq.prefix_state.checkpoints.pending_save
    trie.free_sequence(seq)
    assert record.state is CheckpointState.RELEASED and seq.prefix_state.checkpoints.pending_save is None
    assert states.num_free == free_slots and pool.num_free == free_blocks + 1  # + the unattached block 2
    assert trie.checkpoints.live_records() == []
    trie.check_invariants([seq])


def test_disabled_hybrid_trie_never_reserves():
    pool, states, trie = make_hybrid(enabled=False)
    seq = Sequence(tokens(40))
    admit(trie, seq)
    assert trie.checkpoints.reserve_save(seq, 5) == NO_SAVE
    assert trie.checkpoints.reserve_save(seq) == NO_SAVE
    assert trie.checkpoints.live_records() == [] and states.num_free == states.num_slots - 1


def test_free_sequence_clears_an_unpinned_selected_restore():
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(32), 32)
    seq = Sequence(tokens(40))
    admit_leaving_restore_unpinned(trie, seq)
    assert seq.prefix_state.checkpoints.restore is record and record.restore_pins == 0
    trie.free_sequence(seq)
    assert seq.prefix_state.checkpoints.restore is None and record.restore_pins == 0 and record.is_published
    trie.check_invariants([seq])


def test_free_sequence_unpins_the_restore_but_keeps_the_producer_pin():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    _, restored = produce(trie, tokens(32), 32)
    seq = Sequence(tokens(40))
    admit(trie, seq)
    assert restored.restore_pins == 1
    assert cp.reserve_save(seq) > 0
    seq.set_computed(seq.num_tokens)  # the restore copy is not unpinned yet
    assert cp.publish_save(seq, pin=True)
    saved = seq.prefix_state.checkpoints.producer_pin
    trie.free_sequence(seq)
    assert restored.restore_pins == 0 and seq.prefix_state.checkpoints.restore is None
    assert saved.producer_pins == 1 and seq.prefix_state.checkpoints.producer_pin is saved
    trie.check_invariants([seq])
    assert cp.unpin_save(seq) and saved.producer_pins == 0 and seq.prefix_state.checkpoints.producer_pin is None
    assert cp.unpin_save(seq) is False
    trie.check_invariants([seq])


def test_release_pinned_raises_then_works_after_unpin():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq, record = produce(trie, tokens(40), 40, pin=True)
    before = world(pool, states, trie, seq)
    with pytest.raises(PinnedError, match="pinned"):
        cp.release(record)
    assert world(pool, states, trie, seq) == before
    assert cp.unpin_save(seq)
    free_blocks, free_slots = pool.num_free, states.num_free
    cp.release(record)
    assert record.state is CheckpointState.RELEASED and not indexed(trie, record)
    assert pool.num_free == free_blocks + 1 and states.num_free == free_slots + 1
    before = world(pool, states, trie, seq)
    with pytest.raises(LifecycleError, match="released"):
        cp.release(record)
    assert world(pool, states, trie, seq) == before
    trie.check_invariants([seq])


def test_unpin_below_zero_raises_and_changes_nothing():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    producer, record = produce(trie, tokens(32), 32, pin=True)
    consumer = Sequence(tokens(33))
    admit(trie, consumer)
    assert record.restore_pins == 1 and record.producer_pins == 1
    record.restore_pins = 0  # a lost pin
    before = world(pool, states, trie, consumer, producer)
    with pytest.raises(PinUnderflowError):
        cp.unpin_restore(consumer)
    assert world(pool, states, trie, consumer, producer) == before
    record.restore_pins = 1
    assert cp.unpin_restore(consumer) and record.restore_pins == 0
    record.producer_pins = 0
    before = world(pool, states, trie, consumer, producer)
    with pytest.raises(PinUnderflowError):
        cp.unpin_save(producer)
    assert world(pool, states, trie, consumer, producer) == before
    record.producer_pins = 1
    assert cp.unpin_save(producer) and record.pin_count == 0
    trie.check_invariants([consumer, producer])


def test_publish_twice_raises():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq, record = produce(trie, tokens(32), 32)
    before = world(pool, states, trie, seq)
    with pytest.raises(AlreadyPublishedError):
        cp.publish(record)
    assert world(pool, states, trie, seq) == before
    assert trie.index.bucket(NS, record.key) == (record,)
    assert trie.index.candidate_steps(NS, 0, 100) == [32]
    cp.release(record)
    before = world(pool, states, trie, seq)
    with pytest.raises(LifecycleError):
        cp.publish(record)
    assert world(pool, states, trie, seq) == before


def test_publish_with_a_producer_pin_already_held_raises_before_publishing():
    """The sequence still holds the producer pin of its previous save: the second pinned
    publish raises and leaves its reservation pending (nothing published, nothing released)."""
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq, first = produce(trie, tokens(32), 32, pin=True, free=False)
    extend(trie, seq, tokens(16, start=500))
    assert cp.reserve_save(seq) > 0
    pending = seq.prefix_state.checkpoints.pending_save
    forward(trie, seq)
    before = world(pool, states, trie, seq)
    with pytest.raises(LifecycleError, match="producer pin"):
        cp.publish_save(seq, pin=True)
    assert world(pool, states, trie, seq) == before
    assert pending.state is CheckpointState.RESERVED and seq.prefix_state.checkpoints.pending_save is pending
    assert cp.unpin_save(seq)
    assert cp.publish_save(seq, pin=True) and seq.prefix_state.checkpoints.producer_pin is pending
    assert first.is_published and first.producer_pins == 0
    trie.check_invariants([seq])


def test_reserve_with_a_bad_step_type_changes_nothing():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(40))
    admit(trie, seq)
    assert cp.reserve_save(seq, 33) > 0
    before = world(pool, states, trie, seq)
    for bad in (33.0, "33", True, None.__class__):
        with pytest.raises(InvalidTypeError):
            cp.reserve_save(seq, bad)
        assert world(pool, states, trie, seq) == before
    assert seq.prefix_state.checkpoints.pending_save.state is CheckpointState.RESERVED
    assert cp.reserve_save(seq, np.int64(34)) > 0  # numpy ints are ints
    assert seq.prefix_state.checkpoints.pending_save.step == 34


def test_bad_counts_and_intervals_change_nothing():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq, _ = produce(trie, tokens(40), 40, free=False)
    before = world(pool, states, trie, seq)
    for call in (
        lambda: cp.evict(-1),
        lambda: cp.evict_frozen(1.5),
        lambda: trie.free_kv_blocks(-1),
        lambda: trie.free_state_slots(True),
        lambda: cp.reserve_decode_save(seq, -16),
        lambda: cp.reserve_decode_save(seq, 16.0),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
        assert world(pool, states, trie, seq) == before


def test_match_while_the_restore_is_pinned_raises_and_changes_nothing():
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(32), 32)
    seq = Sequence(tokens(40))
    admit(trie, seq)
    before = world(pool, states, trie, seq)
    with pytest.raises(PinnedError):
        trie.match(seq)
    assert world(pool, states, trie, seq) == before
    assert record.restore_pins == 1


def test_checkpoint_cap_per_anchor_must_be_positive():
    with pytest.raises(InvalidArgumentError):
        make_hybrid(max_checkpoints_per_anchor=0)
    with pytest.raises(InvalidArgumentError):
        make_hybrid(max_checkpoints_per_anchor=True)


# --- decode checkpoints ---------------------------------------------------------------------


def test_decode_save_published_after_the_sequence_advanced():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(31))
    admit(trie, seq)
    forward(trie, seq)
    extend(trie, seq, [500])  # 32 tokens: block 1 completes and is attached
    assert cp.reserve_decode_save(seq, B) > 0
    record = seq.prefix_state.checkpoints.pending_save
    assert record.is_decode and record.step == 32
    seq.set_computed(32)
    seq.append_tokens([501])  # the next decode token arrives before the output boundary
    assert cp.publish_save(seq)
    assert seq.prefix_state.checkpoints.decode_checkpoint is record and record.is_published
    trie.check_invariants([seq])


def test_reserve_decode_save_refusals():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(40))
    admit(trie, seq)
    forward(trie, seq)
    with pytest.raises(InvalidArgumentError):
        cp.reserve_decode_save(seq, 8)  # the interval must be a multiple of the block size
    assert seq.prefix_state.checkpoints.pending_save is None
    extend(trie, seq, tokens(8, start=300))
    assert cp.reserve_decode_save(seq, 0) == NO_SAVE  # no decode saves
    assert cp.reserve_decode_save(seq, 32) == NO_SAVE  # 48 is not a multiple of 32
    assert cp.reserve_decode_save(seq, B) > 0
    assert cp.publish_save(seq)
    assert cp.reserve_decode_save(seq, B) == NO_SAVE  # the same step is already published
    extend(trie, seq, [1])
    assert cp.reserve_decode_save(seq, B) == NO_SAVE  # 49: not a multiple
    assert seq.prefix_state.checkpoints.pending_save is None and len(cp.live_records()) == 1


def _decode_checkpoint_at_32(trie):
    cp = trie.checkpoints
    seq = Sequence(tokens(32))
    admit(trie, seq)
    forward(trie, seq)
    assert cp.reserve_decode_save(seq, B) > 0 and cp.publish_save(seq)
    old = seq.prefix_state.checkpoints.decode_checkpoint
    extend(trie, seq, tokens(16, start=900))
    return seq, old


def test_decode_checkpoint_is_replaced_only_after_the_new_one_publishes():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq, old = _decode_checkpoint_at_32(trie)
    assert cp.reserve_decode_save(seq, B) > 0
    new = seq.prefix_state.checkpoints.pending_save
    assert new.step == 48 and new is not old
    # while the new save is in flight the old one is still published and matchable
    assert old.is_published and seq.prefix_state.checkpoints.decode_checkpoint is old
    assert hits(trie, tokens(33)) == (32, old)
    forward(trie, seq)
    assert cp.publish_save(seq)
    assert old.state is CheckpointState.RELEASED and seq.prefix_state.checkpoints.decode_checkpoint is new
    assert hits(trie, tokens(32) + tokens(16, start=900) + [1]) == (48, new)
    trie.check_invariants([seq])


def test_abandoned_decode_save_keeps_the_old_checkpoint():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq, old = _decode_checkpoint_at_32(trie)
    free_slots = states.num_free
    assert cp.reserve_decode_save(seq, B) > 0
    assert cp.release_reservation(seq)
    assert old.is_published and seq.prefix_state.checkpoints.decode_checkpoint is old
    assert states.num_free == free_slots and hits(trie, tokens(33)) == (32, old)
    trie.check_invariants([seq])


def test_pinned_old_decode_checkpoint_is_kept():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq, old = _decode_checkpoint_at_32(trie)
    reader = Sequence(tokens(33))
    admit(trie, reader)
    assert old.restore_pins == 1
    assert cp.reserve_decode_save(seq, B) > 0
    forward(trie, seq)
    assert cp.publish_save(seq)
    new = seq.prefix_state.checkpoints.decode_checkpoint
    assert new.step == 48 and old.is_published and old.restore_pins == 1
    assert cp.unpin_restore(reader) and old.is_published  # now an ordinary LRU checkpoint
    trie.check_invariants([seq, reader])


def test_decode_save_refused_when_the_anchor_has_an_equal_pending_save():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq, old = _decode_checkpoint_at_32(trie)
    other = Sequence(seq.tokens.tolist())
    admit(trie, other)
    assert cp.reserve_save(other, 48) > 0
    assert cp.reserve_decode_save(seq, B) == NO_SAVE
    assert old.is_published and seq.prefix_state.checkpoints.decode_checkpoint is old
    assert seq.prefix_state.checkpoints.pending_save is None
    trie.check_invariants([seq, other])


def test_decode_save_refused_before_the_block_is_attached():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(32))
    admit(trie, seq)
    forward(trie, seq)
    assert cp.reserve_decode_save(seq, B) > 0 and cp.publish_save(seq)
    old = seq.prefix_state.checkpoints.decode_checkpoint
    seq.append_tokens(tokens(16, start=900))
    pool.grow_table(seq, seq.num_tokens, B)  # no trie.allocate
    assert cp.reserve_decode_save(seq, B) == NO_SAVE
    assert old.is_published and seq.prefix_state.checkpoints.decode_checkpoint is old


# --- eviction and pressure ------------------------------------------------------------------


def test_reservation_whose_anchor_is_evicted_before_publish():
    """The consumer keeps private blocks for the cached continuation (fresh range), so the
    canonical leaf it reserves on is held by the trie alone and can be evicted mid-flight."""
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    prompt = tokens(48)
    _, shallow = produce(trie, prompt, 16)
    seq = Sequence(prompt + [7])
    admit(trie, seq)
    assert seq.num_computed == 16 and seq.prefix_state.overlap.trie_block_map  # private blocks 1, 2
    free_blocks, free_slots = pool.num_free, states.num_free
    assert cp.reserve_save(seq, 49) > 0  # mid-block, anchored on the leaf at depth 3
    record = seq.prefix_state.checkpoints.pending_save
    assert leaves(trie) == [record.anchor] and pool.refcount_of(int(trie.nodes.block[record.anchor])) == 1
    assert trie.free_kv_blocks(1) == 2  # the leaf and the reservation's frozen block
    assert record.state is CheckpointState.RELEASED
    forward(trie, seq)
    assert cp.publish_save(seq) is False
    assert seq.prefix_state.checkpoints.pending_save is None
    # the evicted leaf's block is freed; the frozen block and the slot are back
    assert pool.num_free == free_blocks + 1 and states.num_free == free_slots
    assert cp.live_records() == [shallow] and shallow.restore_pins == 0
    trie.check_invariants([seq])


def test_one_usable_row_reserve_evicts_the_lru_checkpoint():
    pool, states, trie = make_hybrid(num_slots=2, budget=0)
    _, a = produce(trie, tokens(32), 32)
    _, b = produce(trie, tokens(32, start=100), 32)
    assert b.slot == a.slot  # B took A's slot
    assert a.state is CheckpointState.RELEASED and b.is_published
    assert hits(trie, tokens(33)) == (0, None)
    assert hits(trie, tokens(33, start=100)) == (32, b)
    trie.check_invariants([])


def test_one_usable_row_producer_pinned_checkpoint_survives():
    pool, states, trie = make_hybrid(num_slots=2, budget=0)
    cp = trie.checkpoints
    producer, a = produce(trie, tokens(32), 32, pin=True)
    seq = Sequence(tokens(32, start=100))
    admit(trie, seq)
    assert cp.reserve_save(seq) == NO_SAVE
    assert a.is_published and a.producer_pins == 1 and seq.prefix_state.checkpoints.pending_save is None
    assert cp.unpin_save(producer)
    slot = cp.reserve_save(seq)
    assert slot == a.slot and a.state is CheckpointState.RELEASED
    trie.check_invariants([seq, producer])


def test_two_usable_rows_restore_pinned_checkpoint_survives():
    pool, states, trie = make_hybrid(num_slots=3, budget=0)
    cp = trie.checkpoints
    _, a = produce(trie, tokens(32), 32)
    reader = Sequence(tokens(40))
    admit(trie, reader)  # pins A's restore
    _, b = produce(trie, tokens(32, start=100), 32)
    assert a.stamp < b.stamp  # A is the least recently used, but pinned
    seq = Sequence(tokens(32, start=200))
    admit(trie, seq)
    slot = cp.reserve_save(seq)
    assert slot == b.slot and b.state is CheckpointState.RELEASED
    assert a.is_published and a.restore_pins == 1
    assert cp.unpin_restore(reader) and reader.prefix_state.checkpoints.restore is None and a.restore_pins == 0
    trie.check_invariants([reader, seq])


def test_no_usable_state_slot():
    pool, states, trie = make_hybrid(num_slots=1, budget=0)
    seq = Sequence(tokens(40))
    admit(trie, seq)
    assert trie.checkpoints.reserve_save(seq) == NO_SAVE
    assert trie.checkpoints.reserve_save(seq, 32) == NO_SAVE
    assert trie.checkpoints.live_records() == [] and pool.num_free == pool.num_blocks - 3


def test_partial_reserve_with_no_free_block_rolls_back():
    pool, states, trie = make_hybrid(num_blocks=3)
    seq = Sequence(tokens(40))
    admit(trie, seq)
    assert pool.num_free == 0
    free_slots = states.num_free
    assert trie.checkpoints.reserve_save(seq) == NO_SAVE
    assert trie.checkpoints.live_records() == [] and states.num_free == free_slots
    assert trie.checkpoints.reserve_save(seq, 32) > 0  # an aligned save needs no block
    trie.check_invariants([seq])


def test_root_anchored_partial_checkpoint():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    producer, record = produce(trie, [42], 1, pin=True)
    assert bool(trie.nodes.is_root[record.anchor]) and record.is_partial
    assert record.tail_tokens.tolist() == [42]
    assert hits(trie, [42, 43]) == (1, record)
    free_blocks = pool.num_free
    assert cp.evict(1) == 0 and cp.evict_frozen(1) == 0 and trie.free_kv_blocks(1) == 0
    assert record.is_published and pool.num_free == free_blocks
    assert cp.unpin_save(producer)
    assert cp.evict(1) == 1
    assert record.state is CheckpointState.RELEASED and pool.num_free == free_blocks + 1
    assert hits(trie, [42, 43]) == (0, None)
    trie.check_invariants([producer])


def test_evict_is_lru_and_evict_frozen_takes_only_partial_records():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    _, aligned = produce(trie, tokens(32), 32)
    _, partial1 = produce(trie, tokens(40, start=100), 40)
    _, partial2 = produce(trie, tokens(40, start=200), 40)
    stamp = partial1.stamp
    assert hits(trie, tokens(41, start=100)) == (40, partial1)
    assert partial1.stamp == stamp  # a tentative match does not touch; a pin does
    reader = Sequence(tokens(41, start=100))
    admit(trie, reader)
    cp.unpin_restore(reader)  # partial1 is now the most recently used
    assert cp.evict_frozen(1) == 1 and partial2.state is CheckpointState.RELEASED
    assert cp.evict(1) == 1 and aligned.state is CheckpointState.RELEASED
    assert cp.evict(5) == 1 and partial1.state is CheckpointState.RELEASED
    assert cp.evict(1) == 0 and cp.evict(0) == 0
    trie.check_invariants([reader])


def test_kv_eviction_of_an_anchor_releases_its_records():
    pool, states, trie = make_hybrid()
    _, aligned = produce(trie, tokens(32), 32)
    free_slots = states.num_free
    assert trie.free_kv_blocks(1) == 1
    assert aligned.state is CheckpointState.RELEASED and states.num_free == free_slots + 1
    assert trie.stats.evicted_checkpoints == 1 and trie.stats.evicted_blocks == 1
    assert trie.checkpoints.live_records() == [] and len(trie.index) == 0
    trie.check_invariants([])


def test_kv_eviction_takes_frozen_blocks_first():
    pool, states, trie = make_hybrid()
    _, partial = produce(trie, tokens(40), 40)  # anchor = depth 2, the leaf
    leaf = leaves(trie)
    assert trie.free_kv_blocks(1) == 1
    assert partial.state is CheckpointState.RELEASED and leaves(trie) == leaf  # the leaf stays
    assert trie.stats.evicted_checkpoints == 1 and trie.stats.evicted_blocks == 0
    trie.check_invariants([])


def test_kv_eviction_with_states_kept_by_their_leaves_takes_the_lru_leaf_and_its_frozen_block():
    """Where the eviction policy keeps states with their leaves a mid-block checkpoint goes
    with its anchor leaf, not ahead of it."""
    pool, states, trie = make_hybrid(eviction=LeafLRUState())
    assert trie.states_with_leaves
    _, partial = produce(trie, tokens(40), 40)
    _, newer = produce(trie, tokens(40, start=100), 40)
    free_blocks = pool.num_free
    assert trie.free_kv_blocks(1) == 2  # the older leaf's block and its record's frozen block
    assert partial.state is CheckpointState.RELEASED and newer.is_published
    assert pool.num_free == free_blocks + 2
    assert trie.stats.evicted_checkpoints == 1 and trie.stats.evicted_blocks == 1
    trie.check_invariants([])


def test_kv_eviction_with_states_kept_by_their_leaves_takes_frozen_blocks_when_no_leaf_can_go():
    pool, states, trie = make_hybrid(eviction=LeafLRUState())
    producer, partial = produce(trie, tokens(40), 40, free=False)  # the producer holds every block
    leaf = leaves(trie)
    assert trie.free_kv_blocks(1) == 1
    assert partial.state is CheckpointState.RELEASED and leaves(trie) == leaf
    assert trie.stats.evicted_checkpoints == 1 and trie.stats.evicted_blocks == 0
    trie.check_invariants([producer])


@pytest.mark.parametrize("mid_block_first", [True, False])
def test_mid_block_save_with_no_free_block_evicts_a_leaf_only_where_states_go_with_leaves(mid_block_first):
    """With no free block, a mid-block save is refused by default (its block would come from
    another mid-block state); where states go with their leaves it evicts the LRU leaf, never
    the saving sequence's own path."""
    pool, states, trie = make_hybrid(num_blocks=5, eviction=None if mid_block_first else LeafLRUState())
    _, other = produce(trie, tokens(20, start=500), 20)  # one block and one frozen block, trie only
    seq = Sequence(tokens(40))
    admit(trie, seq)
    assert pool.num_free == 0
    slot = trie.checkpoints.reserve_save(seq)
    if mid_block_first:
        assert slot == NO_SAVE and other.is_published and trie.stats.evicted_checkpoints == 0
        trie.check_invariants([seq])
        return
    assert slot > 0
    record = seq.prefix_state.checkpoints.pending_save
    assert record.is_partial and record.frozen_block >= 0
    assert other.state is CheckpointState.RELEASED and trie.stats.evicted_checkpoints == 1
    assert (trie.stats.evicted_blocks, pool.num_free) == (1, 1)  # the leaf, and its frozen block with it
    assert [pool.refcount_of(int(b)) for b in seq.block_table] == [2, 2, 1]  # the saving path stays
    trie.check_invariants([seq])


def test_kv_eviction_skips_a_leaf_anchoring_a_pinned_checkpoint():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    producer, record = produce(trie, tokens(32), 32, pin=True)
    leaf = leaves(trie)
    assert trie.free_kv_blocks(1) == 0
    assert leaves(trie) == leaf and record.is_published
    trie.check_invariants([producer])  # the leaf is still an eviction candidate
    assert cp.unpin_save(producer)
    free_slots = states.num_free
    assert trie.free_kv_blocks(1) == 1
    assert record.state is CheckpointState.RELEASED and states.num_free == free_slots + 1
    trie.check_invariants([producer])


def test_clear_releases_everything_unpinned():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    producer, pinned = produce(trie, tokens(40), 40, pin=True)
    produce(trie, tokens(33, start=100), 33)
    produce(trie, tokens(16, start=200), 16)
    trie.clear()
    assert cp.live_records() == [pinned]
    assert trie.nodes.num_attached == 2  # the pinned record's anchor and its parent
    cp.unpin_save(producer)
    trie.clear()
    assert cp.live_records() == [] and trie.nodes.num_attached == 0
    assert pool.num_free == pool.num_blocks and states.num_free == states.num_slots - 1
    trie.check_invariants([producer])


# --- stale cleanup --------------------------------------------------------------------------


def test_clean_stale_by_verdict():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    producer, record = produce(trie, tokens(32), 32, pin=True)
    foreign = (48, 12345)
    trie.index.add(record, foreign)
    before = world(pool, states, trie, producer)
    cp.clean_stale(record, record.key, Verdict(VerifyStatus.REQUEST_MISMATCH, "x"))
    assert world(pool, states, trie, producer) == before
    cp.clean_stale(record, foreign, Verdict(VerifyStatus.STALE_INDEX_ENTRY, "x"))
    assert trie.index.bucket(NS, foreign) == () and indexed(trie, record)
    cp.clean_stale(record, record.key, Verdict(VerifyStatus.STALE_CHECKPOINT, "x"))  # pinned: kept
    assert record.is_published and indexed(trie, record)
    cp.unpin_save(producer)
    cp.clean_stale(record, record.key, Verdict(VerifyStatus.STALE_CHECKPOINT, "x"))
    assert record.state is CheckpointState.RELEASED and len(trie.index) == 0
    trie.check_invariants([producer])


def test_release_leaves_a_foreign_entry_for_match_to_clean():
    """The index is auxiliary: a record also filed under a foreign key keeps that entry after
    release; the next match that reaches it drops it as a stale checkpoint."""
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(64), 32)
    request = Sequence(tokens(65))
    foreign = request_key(trie, request, 48)  # a bucket the match probes
    trie.index.add(record, foreign)
    trie.checkpoints.release(record)
    assert list(trie.index.entries()) == [(foreign, record)]
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and len(trie.index) == 0 and trie.index.num_steps(NS) == 0
    trie.rollback(txn)
    trie.check_invariants([request])


def test_many_published_records_keep_heaps_bounded():
    """Touching records repeatedly compacts the LRU heaps instead of growing them forever."""
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    _, record = produce(trie, tokens(40), 40)
    reader = Sequence(tokens(41))
    for _ in range(200):
        txn = trie.match(reader)
        assert cp.pin_restore(reader)
        trie.rollback(txn)
    assert record.hits == 200 and record.restore_pins == 0
    assert len(cp._lru) <= 2 * 1 + 64 + 1 and len(cp._frozen_lru) <= 2 * 1 + 64 + 1
    assert cp.evict_frozen(1) == 1
    trie.check_invariants([reader])


# --- in-flight saves and abandoned forwards (engines with asynchronous copies) -----------------


def test_in_flight_save_is_unusable_until_its_producer_pin_is_released():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    _, shallow = produce(trie, tokens(48), 16)
    seq = Sequence(tokens(48))
    admit(trie, seq)
    assert cp.reserve_save(seq, 40) > 0
    record = seq.prefix_state.checkpoints.pending_save
    forward(trie, seq)
    assert cp.publish_save(seq, pin=True, in_flight=True)
    assert record.is_published and indexed(trie, record) and not record.ready
    assert hits(trie, tokens(41)) == (16, shallow)  # the shallower ready checkpoint is used
    assert record.is_published and record.restore_pins == 0  # a mismatch, not stale: kept
    assert cp.unpin_save(seq)
    assert record.ready and hits(trie, tokens(41)) == (40, record)
    trie.check_invariants([seq])


def test_abandon_save_drops_the_pending_reservation():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(40))
    admit(trie, seq)
    free_blocks, free_slots = pool.num_free, states.num_free
    assert cp.reserve_save(seq) > 0
    record = seq.prefix_state.checkpoints.pending_save
    cp.release_failed_save(seq)
    assert record.state is CheckpointState.RELEASED and seq.prefix_state.checkpoints.pending_save is None
    assert (pool.num_free, states.num_free) == (free_blocks, free_slots)
    trie.check_invariants([seq])


def test_abandon_save_releases_the_in_flight_record():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(40))
    admit(trie, seq)
    free_blocks, free_slots = pool.num_free, states.num_free
    assert cp.reserve_save(seq) > 0
    record = seq.prefix_state.checkpoints.pending_save
    forward(trie, seq)
    assert cp.publish_save(seq, pin=True, in_flight=True)
    cp.release_failed_save(seq)
    assert record.state is CheckpointState.RELEASED and not indexed(trie, record)
    assert seq.prefix_state.checkpoints.producer_pin is None and len(trie.index) == 0
    assert (pool.num_free, states.num_free) == (free_blocks, free_slots)
    assert hits(trie, tokens(41)) == (0, None)
    trie.check_invariants([seq])


def test_abandoned_in_flight_decode_save_keeps_the_previous_decode_checkpoint():
    """The previous decode checkpoint is released only when the in-flight replacement lands."""
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(32))
    admit(trie, seq)
    forward(trie, seq)
    assert cp.reserve_decode_save(seq, B) > 0 and cp.publish_save(seq)
    old = seq.prefix_state.checkpoints.decode_checkpoint
    extend(trie, seq, tokens(16, start=900))
    assert cp.reserve_decode_save(seq, B) > 0
    forward(trie, seq)
    assert cp.publish_save(seq, pin=True, in_flight=True)
    cp.release_failed_save(seq)  # the forward carrying the save copy failed
    assert old.is_published and hits(trie, tokens(33)) == (32, old)
    assert seq.prefix_state.checkpoints.decode_checkpoint is old


def test_completed_in_flight_decode_save_retires_the_previous_one():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    seq = Sequence(tokens(32))
    admit(trie, seq)
    forward(trie, seq)
    assert cp.reserve_decode_save(seq, B) > 0 and cp.publish_save(seq)
    old = seq.prefix_state.checkpoints.decode_checkpoint
    extend(trie, seq, tokens(16, start=900))
    assert cp.reserve_decode_save(seq, B) > 0
    forward(trie, seq)
    assert cp.publish_save(seq, pin=True, in_flight=True)
    assert old.is_published  # still serving while the new save is in flight
    assert cp.unpin_save(seq)
    assert not old.is_published and seq.prefix_state.checkpoints.decode_checkpoint is not old
    trie.check_invariants([seq])
