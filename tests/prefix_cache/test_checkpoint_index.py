"""CheckpointIndex: buckets ``(namespace, step, anchor block value) -> records``, the sorted
steps per namespace, and exact verification (every status and reason), plus the trie's exact
check of the prefix before the anchor (``BlockTrie._path_to_anchor``) and the cleanup ``match``
does for each verdict."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.prefix_cache.checkpoint_index import CheckpointIndex, VerifyStatus
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.prefix_cache.node import NodePath, NodeTable
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.prefix_cache.stats import MissReason
from hybridcache.types import NO_NODE
from hybridcache.sequence import MultimodalSpan, Namespace, Sequence

from ._helpers import B, admit, forward, tokens
from ._hybrid import indexed, make_hybrid, path_to, produce, request_key, store_kv

NS = Namespace()
LORA = Namespace(adapter="lora")


def fake_record(step: int, anchor_key: int, namespace: Namespace = NS) -> CheckpointRecord:
    return CheckpointRecord(
        namespace=namespace,
        step=step,
        anchor=0,
        anchor_generation=0,
        anchor_path=NodePath(0, 0, [], 0, 0),
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
    assert index.bucket(NS, record.key) == (record,)
    assert index.bucket(LORA, record.key) == ()  # buckets are per namespace
    assert len(index) == 1
    assert index.candidate_steps(NS, 0, 100) == [32]
    assert index.num_steps(NS) == 1
    assert list(index.entries()) == [(record.key, record)]
    assert index.remove(record) is True
    assert index.bucket(NS, record.key) == ()
    assert len(index) == 0 and index.num_steps(NS) == 0
    assert index.candidate_steps(NS, 0, 100) == []
    assert index.remove(record) is False  # already gone
    assert index.remove(fake_record(48, 1)) is False  # never indexed


def test_remove_under_a_key_the_record_is_not_in(index):
    record = fake_record(32, 11)
    index.add(record)
    assert index.remove(record, (32, 12)) is False
    assert index.remove(record, (48, 11)) is False
    assert index.bucket(NS, record.key) == (record,) and index.candidate_steps(NS, 0, 64) == [32]


def test_bucket_shared_by_two_records(index):
    first, second = fake_record(32, 11), fake_record(32, 11)
    index.add(first)
    index.add(second)
    assert index.bucket(NS, (32, 11)) == (first, second)
    assert index.num_steps(NS) == 1
    assert index.remove(first)
    assert index.bucket(NS, (32, 11)) == (second,)
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


def test_the_same_key_in_two_namespaces_is_two_buckets(index):
    """A key holds no namespace (the anchor block's value is seeded by nothing but the block):
    a bucket is keyed by the record's namespace too, so equal keys in two namespaces never
    share one."""
    base, lora = fake_record(32, 5, NS), fake_record(32, 5, LORA)
    index.add(base)
    index.add(lora)
    assert index.bucket(NS, (32, 5)) == (base,) and index.bucket(LORA, (32, 5)) == (lora,)
    assert sorted(((key, record.namespace == LORA) for key, record in index.entries())) == [
        ((32, 5), False),
        ((32, 5), True),
    ]
    assert index.remove(lora, (32, 5))  # files under the record's own namespace
    assert index.bucket(NS, (32, 5)) == (base,) and index.bucket(LORA, (32, 5)) == ()
    assert index.candidate_steps(LORA, 0, 64) == [] and index.candidate_steps(NS, 0, 64) == [32]
    assert index.remove(lora) is False


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
    return trie.index.verify(record, record.key if key is None else key, seq)


def assert_usable(trie, record, request):
    """``record`` is a usable checkpoint for ``request``: the index's verdict is a hit, the
    request probes its bucket at the record's step, and the prefix before the anchor equals the
    anchor's trie path."""
    depth = record.step // B
    assert verify(trie, record, request).status is VerifyStatus.HIT
    assert request_key(trie, request, record.step) == record.key
    path = path_to(trie, record, request)
    assert path is not None and (path.node, path.depth) == (record.anchor, depth)
    assert path.slot_at(trie.nodes, depth) == record.anchor
    assert path.root == trie.nodes.find_root(request.namespace)


def test_verify_hit_for_aligned_and_partial(hybrid):
    pool, states, trie = hybrid
    _, aligned = produce(trie, PROMPT, 32)
    _, partial = produce(trie, PROMPT, 37)
    request = Sequence(PROMPT + [1])
    assert_usable(trie, aligned, request)
    assert_usable(trie, partial, request)
    assert aligned.key[1] == partial.key[1]  # one anchor, one anchor block value


def test_verify_root_anchored(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, tokens(5), 5)
    assert record.key == (5, trie.keyer.namespace_seed(NS))
    assert_usable(trie, record, Sequence(tokens(6)))
    verdict = verify(trie, record, Sequence([9] + tokens(5)[1:] + [6]))
    assert verdict.status is VerifyStatus.REQUEST_MISMATCH and verdict.reason == "tail tokens differ"


def test_verify_stale_checkpoint_reserved_and_released(hybrid):
    pool, states, trie = hybrid
    producer = Sequence(PROMPT)
    admit(trie, producer)
    assert trie.checkpoints.reserve_save(producer, 32) > 0
    reserved = producer.prefix_state.checkpoints.pending_save
    request = Sequence(PROMPT + [1])
    verdict = verify(trie, reserved, request)
    assert verdict.status is VerifyStatus.STALE_CHECKPOINT and "reserved" in verdict.reason
    trie.checkpoints.release_reservation(producer)
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
        "tail tokens differ": Sequence(PROMPT[:36] + [0] + PROMPT[37:] + [1]),
        "tail multimodal identity differs": Sequence(
            PROMPT + [1], multimodal=[MultimodalSpan(33, 35, "image", "x")]
        ),
        "tail has no routed experts": Sequence(PROMPT + [1], want_routed_experts=True),
    }
    for reason, request in cases.items():
        verdict = verify(trie, record, request)
        assert (verdict.status, verdict.reason) == (VerifyStatus.REQUEST_MISMATCH, reason)


# --- the prefix before the anchor (BlockTrie._path_to_anchor) ---------------------------------


def test_prefix_before_the_anchor_differs(hybrid):
    """A request whose first block differs has the record's key (a key is the step and the
    anchor block's own value) and passes ``verify``; the exact comparison of the anchor's path
    rejects it, and a match misses without touching the record."""
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 37)
    request = Sequence([0] + PROMPT[1:] + [1])
    assert request_key(trie, request, 37) == record.key
    assert verify(trie, record, request).status is VerifyStatus.HIT
    assert path_to(trie, record, request) is None
    assert request.prefix_state.trie.verified == NO_NODE  # a rejected anchor is not verified
    trie.stats.reset()
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
    assert trie.stats.match.misses == {MissReason.NO_CACHED_PREFIX.value: 1}
    assert record.is_published and indexed(trie, record)
    trie.rollback(txn)
    trie.check_invariants([request])


def test_prefix_multimodal_identity_differs(hybrid):
    """Equal tokens, but an image in a block before the anchor block: same key, same tail, and
    the anchor's path is still rejected by its multimodal identity."""
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 37)
    for spans in ([MultimodalSpan(2, 6, "image", "x")], [MultimodalSpan(0, 16, "video", "y")]):
        request = Sequence(PROMPT + [1], multimodal=spans)
        assert request_key(trie, request, 37) == record.key  # the span is not in the anchor block
        assert verify(trie, record, request).status is VerifyStatus.HIT
        assert path_to(trie, record, request) is None
        txn = trie.match(request)
        assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
        trie.rollback(txn)
    # the producer's own identity matches
    _, with_image = produce(trie, PROMPT, 40, multimodal=[MultimodalSpan(2, 6, "image", "x")])
    request = Sequence(PROMPT + [1], multimodal=[MultimodalSpan(2, 6, "image", "x")])
    assert_usable(trie, with_image, request)
    other_image = Sequence(PROMPT + [1], multimodal=[MultimodalSpan(2, 6, "image", "z")])
    assert request_key(trie, other_image, 40) == with_image.key
    assert path_to(trie, with_image, other_image) is None
    trie.check_invariants([])


def test_prefix_lacks_routed_experts(hybrid):
    """An aligned record whose prefix blocks carry no routed experts fits a routed-expert
    request in ``verify`` (no tail) but not in the prefix check; once the blocks get their rows
    the same record is usable."""
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 32)
    request = Sequence(PROMPT + [1], want_routed_experts=True)
    assert verify(trie, record, request).status is VerifyStatus.HIT
    assert path_to(trie, record, request) is None
    assert path_to(trie, record, Sequence(PROMPT + [1])) is not None  # without experts it fits
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
    trie.rollback(txn)
    # a routed-expert run of the prompt gives the cached blocks their rows
    enricher = Sequence(PROMPT, want_routed_experts=True)
    admit(trie, enricher)
    forward(trie, enricher)
    rows = (np.arange(48 * 4).reshape(48, 4) % 256).astype(np.int16)
    enricher.append_routed_experts(rows)
    trie.cache_routed_experts(enricher)
    trie.free_sequence(enricher)
    request = Sequence(PROMPT + [1], want_routed_experts=True)
    assert_usable(trie, record, request)
    txn = trie.match(request)
    assert request.prefix_state.checkpoints.restore is record and request.num_computed == 32
    np.testing.assert_array_equal(request.routed_experts, rows[:32])
    trie.rollback(txn)
    trie.check_invariants([request])


def test_prefix_beyond_the_requests_cached_path(hybrid):
    """A request whose cached path is shallower than the anchor cannot use the record."""
    pool, states, trie = hybrid
    _, record = produce(trie, PROMPT, 32)
    request = Sequence(PROMPT[:16] + [0] * 32)
    assert verify(trie, record, request).status is VerifyStatus.HIT  # no tail to compare
    assert path_to(trie, record, request) is None
    assert request_key(trie, request, 32) != record.key  # and a match never probes it
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
    trie.rollback(txn)
    trie.check_invariants([request])


def test_path_to_anchor_compares_only_beyond_the_verified_node(hybrid, monkeypatch):
    """Tokens are compared once: below the verified node a shallower anchor is accepted only
    if it lies on the verified path (no token is compared again); a deeper one is compared
    from the verified node on and becomes the new verified node."""
    pool, states, trie = hybrid
    _, shallow = produce(trie, PROMPT, 16)
    _, deep = produce(trie, PROMPT, 48)
    _, foreign = produce(trie, [0] + PROMPT[1:], 16)  # another branch at depth 1
    compared = []
    same_tokens = trie.lookup.same_tokens

    def spy(seq, runs):
        compared.append(sorted(int(trie.nodes.depth[s]) for first, last in runs for s in range(first, last + 1)))
        return same_tokens(seq, runs)

    monkeypatch.setattr(trie.lookup, "same_tokens", spy)
    request = Sequence(PROMPT + [1])
    path = path_to(trie, shallow, request)
    assert path is not None and path.node == shallow.anchor and compared == [[1]]
    state = request.prefix_state
    assert (state.trie.verified, state.trie.verified_generation) == (shallow.anchor, shallow.anchor_generation)
    path = path_to(trie, deep, request)
    assert path is not None and path.node == deep.anchor and compared == [[1], [2, 3]]
    assert state.trie.verified == deep.anchor
    path = path_to(trie, shallow, request)  # on the verified path: nothing compared
    assert path is not None and (path.node, path.depth) == (shallow.anchor, 1)
    assert path_to(trie, foreign, request) is None  # not on the verified path
    assert compared == [[1], [2, 3]] and state.trie.verified == deep.anchor
    fresh = Sequence(PROMPT + [1])
    assert path_to(trie, foreign, fresh) is None and compared[-1] == [1]
    assert fresh.prefix_state.trie.verified == NO_NODE


def test_verify_simulated_key_collision(hybrid):
    """A foreign record under the request's key is rejected by the anchor's path, not trusted
    by its key: naturally (its anchor block equals the request's, an earlier block differs) and
    by a simulated hash collision (a record of another anchor block filed under the request's
    key)."""
    pool, states, trie = hybrid
    _, foreign = produce(trie, [0] + PROMPT[1:], 32)
    _, other = produce(trie, [0] * 32 + PROMPT[32:], 32)
    request = Sequence(PROMPT + [1])
    store_kv(trie, PROMPT)
    request_key_32 = request_key(trie, request, 32)
    assert foreign.key == request_key_32  # the anchor block (tokens 16-32) is the request's
    assert other.key != request_key_32
    trie.index.remove(other)
    other.key = request_key_32  # the collision
    trie.index.add(other)
    assert trie.index.bucket(NS, request_key_32) == (foreign, other)
    for record in (foreign, other):
        assert verify(trie, record, request).status is VerifyStatus.HIT
        assert path_to(trie, record, request) is None
    trie.stats.reset()
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
    assert trie.stats.match.misses == {MissReason.NO_CHECKPOINT.value: 1}
    for record in (foreign, other):  # a mismatch changes nothing
        assert record.is_published and indexed(trie, record)
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
        assert request.prefix_state.checkpoints.restore is None
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
    stale_key = request_key(trie, request, 48)  # a bucket the match probes
    trie.index.add(record, stale_key)
    assert trie.index.candidate_steps(NS, 0, 64) == [48, 32]
    free_slots = states.num_free
    txn = trie.match(request)
    assert request.prefix_state.checkpoints.restore is record and request.num_computed == 32
    assert trie.index.bucket(NS, stale_key) == ()
    assert trie.index.bucket(NS, record.key) == (record,)
    assert trie.index.candidate_steps(NS, 0, 64) == [32]
    assert states.num_free == free_slots and record.is_published
    trie.rollback(txn)
    trie.check_invariants([request])


def test_stale_index_key_alone_is_a_miss(hybrid):
    pool, states, trie = hybrid
    _, record = produce(trie, tokens(32), 32)
    store_kv(trie, tokens(16) + [0] * 32)
    request = Sequence(tokens(16) + [0] * 32 + [1])
    stale_key = request_key(trie, request, 32)
    assert stale_key != record.key
    trie.index.add(record, stale_key)
    trie.stats.reset()
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
    assert trie.stats.match.misses == {MissReason.NO_CHECKPOINT.value: 1}
    assert trie.index.bucket(NS, stale_key) == () and indexed(trie, record)
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
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
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
    reserved = producer.prefix_state.checkpoints.pending_save
    trie.index.add(reserved)
    free_slots = states.num_free
    request = Sequence(tokens(49))
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
    assert reserved.state is CheckpointState.RELEASED and len(trie.index) == 0
    assert states.num_free == free_slots + 1
    # the producer's publish now fails cleanly
    forward(trie, producer)
    assert trie.checkpoints.publish_save(producer) is False
    assert producer.prefix_state.checkpoints.pending_save is None and states.num_free == free_slots + 1
    assert slot not in [r.slot for r in trie.checkpoints.live_records()]
    trie.rollback(txn)
    trie.check_invariants([request, producer])


def test_bucket_is_a_snapshot(index):
    """Callers iterate a bucket while cleanup removes entries from it."""
    record = fake_record(16, 3)
    index.add(record)
    snapshot = index.bucket(NS, record.key)
    index.remove(record)
    assert snapshot == (record,) and index.bucket(NS, record.key) == ()
