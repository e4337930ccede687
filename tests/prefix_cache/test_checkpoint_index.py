"""CheckpointIndex: buckets ``(step, anchor prefix key) -> records``, the sorted steps per
namespace, and exact verification (every status and reason), plus the cleanup ``match`` does
for each verdict (reference sections 1.8 and 2.5, adapted)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.prefix_cache.checkpoint_index import CheckpointIndex, VerifyStatus
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_cache.stats import MissReason
from hybridcache.sequence import MultimodalSpan, Namespace, Sequence

from ._helpers import B, tokens
from ._hybrid import admit, forward, indexed, make_hybrid, produce, store_kv

NS = Namespace()
LORA = Namespace(adapter="lora")


def fake_record(step: int, anchor_key: int, namespace: Namespace = NS) -> CheckpointRecord:
    return CheckpointRecord(
        namespace=namespace,
        step=step,
        anchor=0,
        anchor_generation=0,
        key=(step, anchor_key),
        slot=1,
        frozen_block=-1,
        tail_tokens=np.empty(0, dtype=np.int32),
        tail_identity=(),
        producer_id=0,
        is_decode=False,
    )


@pytest.fixture
def index() -> CheckpointIndex:
    return CheckpointIndex(NodeTable(), RoutedExpertStore(B), B)


# --- buckets and steps -----------------------------------------------------------------------


def test_add_remove_and_idempotent_add(index):
    record = fake_record(32, 11)
    index.add(record)
    index.add(record)  # a second add is a no-op
    assert index.bucket(record.key) == (record,)
    assert len(index) == 1
    assert index.candidate_steps(NS, 0, 100) == [32]
    assert index.num_steps(NS) == 1
    assert list(index.entries()) == [(record.key, record)]
    assert index.remove(record) is True
    assert index.bucket(record.key) == ()
    assert len(index) == 0 and index.num_steps(NS) == 0
    assert index.candidate_steps(NS, 0, 100) == []
    assert index.remove(record) is False  # already gone
    assert index.remove(fake_record(48, 1)) is False  # never indexed


def test_remove_under_a_key_the_record_is_not_in(index):
    record = fake_record(32, 11)
    index.add(record)
    assert index.remove(record, (32, 12)) is False
    assert index.remove(record, (48, 11)) is False
    assert index.bucket(record.key) == (record,) and index.candidate_steps(NS, 0, 64) == [32]


def test_bucket_shared_by_two_records(index):
    first, second = fake_record(32, 11), fake_record(32, 11)
    index.add(first)
    index.add(second)
    assert index.bucket((32, 11)) == (first, second)
    assert index.num_steps(NS) == 1
    assert index.remove(first)
    assert index.bucket((32, 11)) == (second,)
    assert index.candidate_steps(NS, 0, 64) == [32]  # the step stays while a bucket has it
    assert index.remove(second)
    assert index.candidate_steps(NS, 0, 64) == [] and index.num_steps(NS) == 0


def test_step_count_drops_only_when_the_last_bucket_of_the_step_goes(index):
    a, b, c = fake_record(32, 1), fake_record(32, 2), fake_record(48, 1)
    for record in (a, b, c):
        index.add(record)
    assert index.candidate_steps(NS, 0, 64) == [48, 32]
    assert index.num_steps(NS) == 2
    index.remove(a)
    assert index.candidate_steps(NS, 0, 64) == [48, 32]
    index.remove(b)
    assert index.candidate_steps(NS, 0, 64) == [48]
    index.remove(c)
    assert index.num_steps(NS) == 0 and index.candidate_steps(NS, 0, 64) == []
    assert NS not in index._steps  # the namespace entry goes with its last step


def test_candidate_steps_order_and_bounds(index):
    for step in (5, 17, 48, 16, 32, 64, 1):
        index.add(fake_record(step, step * 7))
    assert index.candidate_steps(NS, 0, 1000) == [64, 48, 32, 17, 16, 5, 1]  # deepest first
    assert index.candidate_steps(NS, 16, 48) == [48, 32, 17]  # after exclusive, up_to inclusive
    assert index.candidate_steps(NS, 15, 16) == [16]
    assert index.candidate_steps(NS, 16, 16) == []
    assert index.candidate_steps(NS, 64, 1000) == []
    assert index.candidate_steps(NS, 0, 0) == []
    assert index.candidate_steps(NS, 48, 17) == []  # an empty window
    assert index.candidate_steps(LORA, 0, 1000) == []  # namespaces are separate


def test_namespaces_are_counted_separately(index):
    base, lora = fake_record(32, 5, NS), fake_record(32, 5, LORA)
    index.add(base)
    index.add(lora, (32, 6))
    assert index.candidate_steps(NS, 0, 64) == [32] and index.candidate_steps(LORA, 0, 64) == [32]
    index.remove(base)
    assert index.candidate_steps(NS, 0, 64) == [] and index.candidate_steps(LORA, 0, 64) == [32]


def test_add_under_an_explicit_foreign_key(index):
    record = fake_record(32, 11)
    index.add(record)
    index.add(record, (48, 99))
    assert sorted(key for key, _ in index.entries()) == [(32, 11), (48, 99)]
    assert index.candidate_steps(NS, 0, 64) == [48, 32]
    assert index.remove(record)  # its own key only
    assert list(index.entries()) == [((48, 99), record)]
    assert index.remove(record, (48, 99))
    assert len(index) == 0 and index.num_steps(NS) == 0


# --- exact verification ----------------------------------------------------------------------


PROMPT = tokens(48)


@pytest.fixture
def hybrid():
    pool, states, trie = make_hybrid()
    return pool, states, trie


def verify(trie, record, seq, key=None):
    return trie.index.verify(record, record.key if key is None else key, trie.prepare(seq))


def test_verify_hit_for_aligned_and_partial(hybrid):
    pool, states, trie = hybrid
    _, aligned = produce(trie, PROMPT, 32)
    _, partial = produce(trie, PROMPT, 37)
    request = Sequence(PROMPT + [1])
    assert verify(trie, aligned, request).status is VerifyStatus.HIT
    assert verify(trie, partial, request).status is VerifyStatus.HIT


def test_verify_root_anchored(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, tokens(5), 5)
    assert verify(trie, record, Sequence(tokens(6))).status is VerifyStatus.HIT
    verdict = verify(trie, record, Sequence([9] + tokens(5)[1:] + [6]))
    assert verdict.status is VerifyStatus.REQUEST_MISMATCH and verdict.reason == "tail tokens differ"


def test_verify_stale_checkpoint_reserved_and_released(hybrid):
    pool, states, trie = hybrid
    producer = Sequence(PROMPT)
    admit(trie, producer)
    assert trie.checkpoints.reserve_save(producer, 32) > 0
    reserved = producer.prefix_state.pending_save
    request = Sequence(PROMPT + [1])
    verdict = verify(trie, reserved, request)
    assert verdict.status is VerifyStatus.STALE_CHECKPOINT and "reserved" in verdict.reason
    trie.checkpoints.discard_save(producer)
    verdict = verify(trie, reserved, request)
    assert verdict.status is VerifyStatus.STALE_CHECKPOINT and "released" in verdict.reason


def test_verify_stale_checkpoint_frozen_block_disagrees_with_the_step(hybrid):
    pool, states, trie = hybrid
    _, partial = produce(trie, PROMPT, 37)
    _, aligned = produce(trie, PROMPT, 32)
    request = Sequence(PROMPT + [1])
    frozen = partial.frozen_block
    partial.frozen_block = -1
    assert verify(trie, partial, request).status is VerifyStatus.STALE_CHECKPOINT
    partial.frozen_block = frozen
    aligned.frozen_block = frozen
    verdict = verify(trie, aligned, request)
    assert verdict.status is VerifyStatus.STALE_CHECKPOINT and "frozen" in verdict.reason
    aligned.frozen_block = -1
    assert verify(trie, aligned, request).status is VerifyStatus.HIT


def test_verify_stale_checkpoint_without_a_slot_or_with_a_wrong_tail_length(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 37)
    request = Sequence(PROMPT + [1])
    slot, tail = record.slot, record.tail_tokens
    record.slot = -1
    assert verify(trie, record, request).status is VerifyStatus.STALE_CHECKPOINT
    record.slot = slot
    record.tail_tokens = tail[:-1]
    verdict = verify(trie, record, request)
    assert verdict.status is VerifyStatus.STALE_CHECKPOINT and "tail length" in verdict.reason
    record.tail_tokens = tail
    assert verify(trie, record, request).status is VerifyStatus.HIT


def test_verify_stale_checkpoint_detached_anchor(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, tokens(40), 40)  # anchor = the leaf at depth 2
    assert trie.kv.evict(1) == [record.anchor]  # bypass the lifecycle: the record stays
    verdict = verify(trie, record, Sequence(tokens(41)))
    assert verdict.status is VerifyStatus.STALE_CHECKPOINT and verdict.reason == "anchor detached"


def test_verify_stale_checkpoint_anchor_depth_disagrees(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 32)
    record.step = 48  # the anchor is at depth 2, not 3
    verdict = verify(trie, record, Sequence(PROMPT + [1]))
    assert verdict.status is VerifyStatus.STALE_CHECKPOINT and "depth" in verdict.reason


def test_verify_stale_index_key(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 32)
    request = Sequence(PROMPT + [1])
    verdict = verify(trie, record, request, key=(32, record.key[1] ^ 1))
    assert verdict.status is VerifyStatus.STALE_INDEX_ENTRY and "key" in verdict.reason
    verdict = verify(trie, record, request, key=(48, record.key[1]))
    assert verdict.status is VerifyStatus.STALE_INDEX_ENTRY


def test_verify_namespace_differs(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, tokens(8), 8)
    verdict = verify(trie, record, Sequence(tokens(9), adapter="lora"))
    assert verdict.status is VerifyStatus.STALE_INDEX_ENTRY and verdict.reason == "namespace differs"


def test_verify_request_mismatch_reasons(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 37)
    cases = {
        "step not before the request's last token": Sequence(PROMPT[:37]),
        "step inside a multimodal span of the request": Sequence(
            PROMPT + [1], multimodal=[MultimodalSpan(36, 40, "image", "x")]
        ),
        "prefix before the anchor differs": Sequence([0] + PROMPT[1:] + [1]),
        "tail tokens differ": Sequence(PROMPT[:36] + [0] + PROMPT[37:] + [1]),
        "tail multimodal identity differs": Sequence(
            PROMPT + [1], multimodal=[MultimodalSpan(33, 35, "image", "x")]
        ),
        "tail has no routed experts": Sequence(PROMPT + [1], want_routed_experts=True),
    }
    for reason, request in cases.items():
        verdict = verify(trie, record, request)
        assert (verdict.status, verdict.reason) == (VerifyStatus.REQUEST_MISMATCH, reason)


def test_verify_request_mismatch_prefix_lacks_routed_experts(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 32)
    verdict = verify(trie, record, Sequence(PROMPT + [1], want_routed_experts=True))
    assert verdict.status is VerifyStatus.REQUEST_MISMATCH
    assert verdict.reason == "prefix blocks lack routed experts"


def test_verify_prefix_beyond_the_requests_cached_path(hybrid):
    """A request whose cached path is shallower than the anchor cannot use the record."""
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 32)
    verdict = verify(trie, record, Sequence(PROMPT[:16] + [0] * 32))
    assert verdict.status is VerifyStatus.REQUEST_MISMATCH


def test_verify_simulated_key_collision(hybrid):
    """A foreign record under the request's key (as if the anchor keys collided) is rejected by
    the anchor's identity, not trusted by its key."""
    pool, states, trie = hybrid
    _, foreign = produce(trie, [0] + PROMPT[1:], 32)
    request = Sequence(PROMPT + [1])
    store_kv(trie, PROMPT)
    request_key = (32, int(trie.keyer.extend(request)[1]))
    assert request_key != foreign.key
    trie.index.remove(foreign)
    foreign.key = request_key  # the collision
    trie.index.add(foreign)
    verdict = verify(trie, foreign, request)
    assert (verdict.status, verdict.reason) == (VerifyStatus.REQUEST_MISMATCH, "prefix before the anchor differs")
    trie.stats.reset()
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.restore is None
    assert trie.stats.match.misses == {MissReason.NO_CHECKPOINT.value: 1}
    assert foreign.is_published and indexed(trie, foreign)  # a mismatch changes nothing
    trie.rollback(txn)
    trie.check_invariants([request])


# --- what match does with each verdict ------------------------------------------------------


def test_request_mismatch_leaves_the_record_intact(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 40)
    free_slots, free_blocks = states.num_free, pool.num_free
    for request in (Sequence(PROMPT[:39] + [0, 1]), Sequence([0] + PROMPT[1:] + [1])):
        txn = trie.match(request)
        assert txn.hit_tokens == 0 and request.num_computed == 0
        assert request.prefix_state.restore is None
        trie.commit(txn)
        trie.free_sequence(request)
    assert record.is_published and indexed(trie, record)
    assert trie.index.candidate_steps(NS, 0, 100) == [40]
    assert states.num_free == free_slots and pool.num_free == free_blocks
    assert trie.checkpoints.live_records() == [record]
    trie.check_invariants([])


def test_stale_index_key_is_dropped_and_the_match_goes_on(hybrid):
    """An entry under a foreign key is removed (only that entry); the record's own entry, its
    step and its slot survive, and the shallower step still hits."""
    pool, states, trie = hybrid
    _, record = produce(trie, tokens(64), 32)
    request = Sequence(tokens(65))
    stale_key = (48, int(trie.keyer.extend(request)[2]))
    trie.index.add(record, stale_key)
    assert trie.index.candidate_steps(NS, 0, 64) == [48, 32]
    free_slots = states.num_free
    txn = trie.match(request)
    assert request.prefix_state.restore is record and request.num_computed == 32
    assert trie.index.bucket(stale_key) == ()
    assert trie.index.bucket(record.key) == (record,)
    assert trie.index.candidate_steps(NS, 0, 64) == [32]
    assert states.num_free == free_slots and record.is_published
    trie.rollback(txn)
    trie.check_invariants([request])


def test_stale_index_key_alone_is_a_miss(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, tokens(32), 32)
    store_kv(trie, tokens(16) + [0] * 32)
    request = Sequence(tokens(16) + [0] * 32 + [1])
    stale_key = (32, int(trie.keyer.extend(request)[1]))
    trie.index.add(record, stale_key)
    trie.stats.reset()
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.restore is None
    assert trie.stats.match.misses == {MissReason.NO_CHECKPOINT.value: 1}
    assert trie.index.bucket(stale_key) == () and indexed(trie, record)
    assert trie.index.candidate_steps(NS, 0, 64) == [32]
    trie.rollback(txn)
    trie.check_invariants([request])


def test_detached_anchor_is_released_by_the_match(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, tokens(40), 40)
    trie.kv.evict(1)  # detach the anchor behind the lifecycle's back
    store_kv(trie, tokens(40))  # the same blocks are cached again, on a new node
    free_slots, free_blocks = states.num_free, pool.num_free
    request = Sequence(tokens(41))
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.restore is None
    assert record.state is CheckpointState.RELEASED
    assert trie.index.num_steps(NS) == 0 and len(trie.index) == 0
    assert states.num_free == free_slots + 1 and pool.num_free == free_blocks + 1  # slot and frozen block
    assert trie.checkpoints.live_records() == []
    trie.rollback(txn)
    trie.check_invariants([request])


def test_detached_pinned_anchor_is_kept(hybrid):
    pool, states, trie = hybrid
    producer, record = produce(trie, tokens(40), 40, pin=True)
    trie.kv.evict(1)  # bypasses the pin protection: simulates a detached anchor
    store_kv(trie, tokens(40))
    request = Sequence(tokens(41))
    txn = trie.match(request)
    assert txn.hit_tokens == 0
    assert record.is_published and record.producer_pins == 1 and indexed(trie, record)
    trie.rollback(txn)
    assert trie.checkpoints.unpin_save(producer)
    # once unpinned, the next match cleans it up
    txn = trie.match(request)
    assert record.state is CheckpointState.RELEASED and len(trie.index) == 0
    trie.rollback(txn)
    trie.check_invariants([request])


def test_unpublished_reservation_indexed_by_hand_is_released(hybrid):
    pool, states, trie = hybrid
    producer = Sequence(tokens(48))
    admit(trie, producer)
    slot = trie.checkpoints.reserve_save(producer, 32)
    reserved = producer.prefix_state.pending_save
    trie.index.add(reserved)
    free_slots = states.num_free
    request = Sequence(tokens(49))
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.restore is None
    assert reserved.state is CheckpointState.RELEASED and len(trie.index) == 0
    assert states.num_free == free_slots + 1
    # the producer's publish now fails cleanly
    forward(trie, producer)
    assert trie.checkpoints.publish_save(producer) is False
    assert producer.prefix_state.pending_save is None and states.num_free == free_slots + 1
    assert slot not in [r.slot for r in trie.checkpoints.live_records()]
    trie.rollback(txn)
    trie.check_invariants([request, producer])


def test_bucket_is_a_snapshot(index):
    """Callers iterate a bucket while cleanup removes entries from it."""
    record = fake_record(16, 3)
    index.add(record)
    snapshot = index.bucket(record.key)
    index.remove(record)
    assert snapshot == (record,) and index.bucket(record.key) == ()
