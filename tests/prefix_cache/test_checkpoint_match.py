"""Hybrid-mode matching: a hit needs an exactly verified published checkpoint; the blocks a
hit hands over, the fresh range, the cursor and the restore it selects; and the cases where a
simpler checkpoint design goes wrong (shared blocks rewritten after an aligned hit, no save at
the prompt end after a partial hit, one record per anchor, a checkpoint evicted for a save that
cannot happen, no partial checkpoints for routed-expert requests)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.prefix_cache.checkpoint_lifecycle import NO_SAVE
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from hybridcache.prefix_cache.stats import MissReason
from hybridcache.prefix_cache import BlockKeyer
from hybridcache.sequence import MultimodalSpan, Namespace, Sequence

from tests.keyers import ConstantKeyer, TwoBitKeyer

from ._helpers import (
    B,
    admit,
    admit_leaving_restore_unpinned,
    cursor_depth,
    forward,
    path_blocks,
    seq_state,
    slots_at_depth,
    tokens,
)
from ._hybrid import indexed, make_hybrid, produce, store_kv

NS = Namespace()


def expert_rows(n: int, start: int = 0, width: int = 4) -> np.ndarray:
    positions = np.arange(start, start + n)[:, None]
    return ((positions * 7 + np.arange(width)[None, :] * 3) % 256).astype(np.int16)


def match(trie, seq):
    """Match with fresh statistics; return (txn, misses, shortened) of this match alone."""
    trie.stats.reset()
    txn = trie.match(seq)
    return txn, dict(trie.stats.match.misses), dict(trie.stats.match.shortened)


def grow_and_allocate(trie, seq) -> None:
    trie.pool.grow_table(seq, seq.num_tokens, trie.block_size)
    trie.allocate(seq)


def produce_with_experts(trie, prompt, step):
    """A producer that records routed experts: rows arrive with the forward's output, after the
    save was published, and are offered to the trie at the output boundary."""
    cp = trie.checkpoints
    seq = Sequence(prompt, want_routed_experts=True)
    admit(trie, seq)
    assert cp.reserve_save(seq, step) > 0
    record = seq.prefix_state.checkpoints.pending_save
    forward(trie, seq)
    assert cp.publish_save(seq, pin=True)
    seq.append_routed_experts(expert_rows(len(prompt)))
    trie.cache_routed_experts(seq)
    assert cp.unpin_save(seq)
    trie.free_sequence(seq)
    return record


# --- basic hits and misses --------------------------------------------------------------------


def test_kv_without_a_checkpoint_is_a_miss_then_a_published_checkpoint_hits():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    store_kv(trie, tokens(32))
    request = Sequence(tokens(33))
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and request.num_computed == 0 and request.num_blocks == 0
    assert misses == {MissReason.NO_CHECKPOINT.value: 1}
    trie.rollback(txn)
    # a sequence whose cursor reaches the existing leaf saves on it
    producer = Sequence(tokens(32))
    admit(trie, producer)
    assert cursor_depth(trie, producer) == 2
    slot = cp.reserve_save(producer, 32)
    record = producer.prefix_state.checkpoints.pending_save
    forward(trie, producer)
    assert cp.publish_save(producer)
    assert int(trie.nodes.depth[record.anchor]) == 2 and record.slot == slot
    txn, misses, _ = match(trie, request)
    assert request.num_computed == 32 and request.num_blocks == 2 and misses == {}
    assert request.prefix_state.checkpoints.restore.slot == slot
    assert request.block_table.tolist() == path_blocks(trie, request)
    trie.commit(txn)
    trie.check_invariants([request, producer])


def test_the_deepest_published_step_wins_not_the_deepest_kv():
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(48), 32)  # KV for 3 blocks, checkpoint on the leaf's parent
    request = Sequence(tokens(49))
    txn, _, _ = match(trie, request)
    assert request.num_computed == 32 and request.prefix_state.checkpoints.restore is record
    assert request.num_blocks == 2 and request.prefix_state.overlap.fresh_range == (2, 2)  # no MTP: no KV looked up
    trie.commit(txn)
    assert cursor_depth(trie, request) == 2  # the anchor
    trie.check_invariants([request])


def test_a_hit_ends_before_the_last_token():
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(32), 32)
    request = Sequence(tokens(32))  # exactly the checkpoint's tokens
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and misses == {MissReason.NO_CHECKPOINT.value: 1}
    trie.rollback(txn)
    tiny = Sequence([1])
    txn, misses, _ = match(trie, tiny)
    assert misses == {MissReason.NOTHING_TO_MATCH.value: 1}
    trie.rollback(txn)
    other = Sequence(tokens(40, start=900))
    txn, misses, _ = match(trie, other)
    assert misses == {MissReason.NO_CACHED_PREFIX.value: 1}
    trie.rollback(txn)


@pytest.mark.parametrize(("full", "rest"), [(0, 1), (1, 1), (1, 15)])
def test_partial_checkpoint_hit(full, rest):
    """A partial checkpoint at q*B + r hit by a request with one more token: step, restore,
    q canonical blocks, fresh range [q, q+1); the private block q is kept (it is not the
    frozen block)."""
    pool, states, trie = make_hybrid()
    step = full * B + rest
    prompt = tokens(step)
    _, record = produce(trie, prompt, step)
    request = Sequence(prompt + [999])
    txn, misses, _ = match(trie, request)
    assert misses == {} and request.num_computed == step
    assert request.prefix_state.checkpoints.restore is record and record.slot > 0
    assert request.num_blocks == full and request.prefix_state.overlap.fresh_range == (full, full + 1)
    assert request.prefix_state.trie.cursor == record.anchor
    assert trie.checkpoints.pin_restore(request)
    grow_and_allocate(trie, request)
    trie.commit(txn)
    private = int(request.block_table[full])
    assert private != record.frozen_block
    if request.num_tokens % B:
        assert cursor_depth(trie, request) == full  # the partial block is not attached
        assert pool.refcount_of(private) == 1
    else:
        # the request completes block q itself: its own block is attached and the cursor moves on
        assert cursor_depth(trie, request) == full + 1
        assert pool.refcount_of(private) == 2 and path_blocks(trie, request)[full] == private
    trie.check_invariants([request])


def test_partial_checkpoint_requests_differing_in_prefix_or_tail_miss():
    pool, states, trie = make_hybrid()
    prompt = tokens(19)
    _, record = produce(trie, prompt, 19)
    slot, free_slots = record.slot, states.num_free
    for request in (Sequence([0] + prompt[1:] + [5]), Sequence(prompt[:17] + [0, prompt[18], 5])):
        txn, misses, _ = match(trie, request)
        assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
        trie.rollback(txn)
    assert record.is_published and record.slot == slot and indexed(trie, record)
    assert states.num_free == free_slots


def test_request_mismatch_in_an_earlier_block_keeps_the_checkpoint():
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(48), 40)
    free_slots = states.num_free
    request = Sequence([0] + tokens(48)[1:] + [1])  # same tail, different first block
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and misses == {MissReason.NO_CACHED_PREFIX.value: 1}
    trie.rollback(txn)
    assert record.is_published and indexed(trie, record) and states.num_free == free_slots
    assert trie.index.candidate_steps(NS, 0, 100) == [40]


def test_miss_on_a_long_prefix_differing_in_the_last_block_keeps_the_checkpoint():
    pool, states, trie = make_hybrid()
    prompt = tokens(12 * B)
    _, record = produce(trie, prompt, 12 * B)
    request = Sequence(prompt[: 11 * B] + [0] * B + [1])
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and request.num_computed == 0 and request.num_blocks == 0
    assert misses == {MissReason.NO_CHECKPOINT.value: 1}
    trie.rollback(txn)
    assert record.is_published and indexed(trie, record)
    assert trie.index.candidate_steps(NS, 0, 1000) == [12 * B]
    assert trie.checkpoints.live_records() == [record]
    trie.check_invariants([request])


def test_collision_bucket_bad_record_first_then_the_good_one_hits():
    pool, states, trie = make_hybrid()
    # a key is the step and the anchor block's own value: records whose anchor blocks are equal
    # share a bucket whatever their earlier blocks; the bad one was published first
    _, bad = produce(trie, [0] + tokens(32)[1:], 32)
    _, good = produce(trie, tokens(32), 32)
    assert bad.key == good.key and bad.anchor != good.anchor
    assert trie.index.bucket(NS, good.key) == (bad, good)
    request = Sequence(tokens(33))
    txn, misses, _ = match(trie, request)
    assert request.prefix_state.checkpoints.restore is good and request.num_computed == 32 and misses == {}
    assert trie.index.bucket(NS, good.key) == (bad, good) and bad.is_published
    trie.rollback(txn)
    # a simulated hash collision (another anchor block filed under the same key, ahead of the
    # good record) is rejected the same way
    _, other = produce(trie, tokens(32, start=500), 32)
    trie.index.remove(other)
    trie.index.remove(good)
    other.key = good.key
    trie.index.add(other)
    trie.index.add(good)
    assert trie.index.bucket(NS, good.key) == (bad, other, good)
    request = Sequence(tokens(33))  # a fresh request: nothing verified for it yet
    txn, misses, _ = match(trie, request)
    assert request.prefix_state.checkpoints.restore is good and request.num_computed == 32 and misses == {}
    assert trie.index.bucket(NS, good.key) == (bad, other, good) and other.is_published
    trie.rollback(txn)
    trie.check_invariants([request])


@pytest.mark.parametrize("keyer", [ConstantKeyer(B), TwoBitKeyer(B, secret=b"few-bits")], ids=["constant", "two-bit"])
def test_colliding_keys_never_hide_a_deeper_checkpoint_from_a_fresh_request(keyer):
    """A fresh request with many candidate steps first asks whether its first block is cached
    at all (a miss then probes only steps inside it). Under colliding keys that question must
    be asked with the key the node was stored under: it used to be rebuilt by a second
    derivation a keyer could change apart from the first, and read "not cached" (issue 19,
    item 24, found by the soak: a miss, or a hit inside the first block, not the deepest)."""
    pool, states, trie = make_hybrid(num_slots=9, budget=7, keyer=keyer)
    prompt = tokens(6 * B)
    steps = [5, B + 1, 2 * B + 3, 3 * B, 4 * B + 5, 5 * B + 2]  # more than the probes before the test
    records = [produce(trie, prompt, step)[1] for step in steps]
    store_kv(trie, tokens(B, start=900))  # a colliding first block that is not the request's
    request = Sequence(prompt + [0])
    txn, misses, _ = match(trie, request)
    assert request.prefix_state.checkpoints.restore is records[-1] and request.num_computed == steps[-1]
    assert misses == {}
    trie.rollback(txn)
    trie.check_invariants([request])


def test_check_invariants_catch_a_keyer_whose_stored_keys_are_not_its_prefix_keys():
    """The keys nodes are stored under and the keys probes are made with come from one
    derivation (``BlockKeyer.prefix_keys``); a keyer that changes only what ``extend`` returns
    would make probes miss stored nodes, and the invariants say so."""

    class ExtendOnlyKeyer(BlockKeyer):
        def extend(self, seq):
            keys = super().extend(seq)
            keys &= np.uint64(3)
            return keys

    pool, states, trie = make_hybrid(keyer=ExtendOnlyKeyer(B))
    store_kv(trie, tokens(2 * B))
    with pytest.raises(AssertionError, match="not the keyer's key of its running sum"):
        trie.check_invariants([])


def test_namespaces_never_share_a_checkpoint():
    pool, states, trie = make_hybrid()
    _, base = produce(trie, tokens(40), 40)
    _, root = produce(trie, tokens(5), 5)
    for kwargs in ({"adapter": "lora"}, {"cache_salt": "tenant"}):
        for prompt in (tokens(41), tokens(6)):
            request = Sequence(prompt, **kwargs)
            txn, _, _ = match(trie, request)
            assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
            trie.rollback(txn)
    _, lora = produce(trie, tokens(40), 40, adapter="lora")
    assert lora.anchor != base.anchor
    request = Sequence(tokens(41), adapter="lora")
    txn, _, _ = match(trie, request)
    assert request.prefix_state.checkpoints.restore is lora
    trie.rollback(txn)
    assert trie.index.candidate_steps(Namespace(adapter="lora"), 0, 100) == [40]
    assert sorted(trie.index.candidate_steps(NS, 0, 100)) == [5, 40]


def test_rollback_after_a_hybrid_hit_unpins_and_clears_the_selection():
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(48), 32)
    request = Sequence(tokens(49))
    before = seq_state(request)
    stats = trie.stats.snapshot()
    txn = trie.match(request)
    assert trie.checkpoints.pin_restore(request) and record.restore_pins == 1
    trie.rollback(txn)
    assert record.restore_pins == 0 and request.prefix_state.checkpoints.restore is None
    assert not request.prefix_state.checkpoints.restore_pinned
    assert seq_state(request) == before and trie.stats.snapshot() == stats
    trie.check_invariants([request])


def test_rematch_after_a_deeper_checkpoint_appends_only_the_suffix_blocks():
    pool, states, trie = make_hybrid()
    _, shallow = produce(trie, tokens(64), 16)
    request = Sequence(tokens(65))
    txn = trie.match(request)
    assert request.num_computed == 16 and request.prefix_state.checkpoints.restore is shallow
    trie.commit(txn)
    first_block = int(request.block_table[0])
    _, deep = produce(trie, tokens(64), 48)
    txn = trie.match(request)
    assert request.num_computed == 48 and request.prefix_state.checkpoints.restore is deep
    assert request.num_blocks == 3 and int(request.block_table[0]) == first_block
    assert txn.table_start == 1 and txn.taken.size == 2 and txn.displaced.size == 0
    assert request.block_table.tolist() == path_blocks(trie, request)
    trie.commit(txn)
    trie.check_invariants([request])


# --- ingest (prepare) and its reuse by match ---------------------------------------------------


def count_calls(monkeypatch, obj, name):
    """Count calls of ``obj.name`` (the original still runs)."""
    calls = []
    original = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


def hit_of(seq):
    state = seq.prefix_state
    return seq.num_computed, seq.block_table.tolist(), state.overlap.fresh_range, state.checkpoints.restore, state.trie.cursor


def test_prepare_verifies_the_checkpoint_once_and_match_reuses_it(monkeypatch):
    pool, states, trie = make_hybrid()
    _, shallow = produce(trie, tokens(64), 16)
    _, record = produce(trie, tokens(64), 32)
    request = Sequence(tokens(49))
    path = trie.prepare(request)
    assert (path.node, path.depth) == (record.anchor, 2)
    assert request.prefix_state.trie.last_search.record is record
    assert request.prefix_state.trie.verified == record.anchor
    assert request.num_computed == 0 and request.num_blocks == 0  # ingest takes nothing
    verifies = count_calls(monkeypatch, trie.index, "verify")
    paths = count_calls(monkeypatch, trie.matcher, "_path_to_anchor")
    txn, misses, _ = match(trie, request)
    assert misses == {} and request.prefix_state.checkpoints.restore is record and request.num_computed == 32
    assert verifies == [] and paths == []  # nothing deeper than 32 to probe, nothing re-verified
    reused = hit_of(request)
    trie.rollback(txn)
    txn, _, _ = match(trie, request)  # a rollback keeps what ingest verified
    assert hit_of(request) == reused and verifies == [] and paths == []
    trie.rollback(txn)
    fresh = Sequence(tokens(49))  # the same match without ingest
    txn, _, _ = match(trie, fresh)
    assert hit_of(fresh)[:4] == reused[:4] and fresh.prefix_state.trie.cursor == record.anchor
    trie.rollback(txn)
    assert shallow.is_published
    trie.check_invariants([request, fresh])


def test_a_deeper_checkpoint_published_after_prepare_wins(monkeypatch):
    pool, states, trie = make_hybrid()
    prompt = tokens(64)
    _, shallow = produce(trie, prompt, 32)
    request = Sequence(prompt + [1])
    assert trie.prepare(request).node == shallow.anchor
    _, deep = produce(trie, prompt, 40)
    _, deepest = produce(trie, prompt, 64)
    verifies = count_calls(monkeypatch, trie.index, "verify")
    txn, misses, _ = match(trie, request)
    assert misses == {} and request.prefix_state.checkpoints.restore is deepest and request.num_computed == 64
    assert [args[0] for args in verifies] == [deepest]  # only steps deeper than the ingested one
    trie.rollback(txn)
    trie.checkpoints.release(deepest)
    txn, _, _ = match(trie, request)
    assert request.prefix_state.checkpoints.restore is deep and request.num_computed == 40
    trie.rollback(txn)
    trie.check_invariants([request])


def test_a_checkpoint_released_or_detached_after_prepare_is_not_used():
    pool, states, trie = make_hybrid()
    prompt = tokens(64)
    _, shallow = produce(trie, prompt, 16)
    _, deep = produce(trie, prompt, 40)
    request = Sequence(prompt + [1])
    trie.prepare(request)
    assert request.prefix_state.trie.last_search.record is deep
    trie.checkpoints.release(deep)
    txn, misses, _ = match(trie, request)
    assert misses == {} and request.prefix_state.checkpoints.restore is shallow and request.num_computed == 16
    trie.rollback(txn)
    # the anchor of the ingested checkpoint is detached behind the lifecycle's back
    _, again = produce(trie, prompt, 48)
    other = Sequence(prompt + [1])
    trie.prepare(other)
    assert other.prefix_state.trie.last_search.record is again
    evicted = trie.kv.evict(2)  # the leaf at depth 4, then the anchor at depth 3
    assert len(evicted) == 2 and evicted[1] == again.anchor
    txn, _, _ = match(trie, other)
    assert other.prefix_state.checkpoints.restore is shallow and other.num_computed == 16
    assert again.state is CheckpointState.RELEASED  # the match cleaned the stale record
    trie.rollback(txn)
    trie.check_invariants([request, other])


def test_prepare_of_a_grown_or_computed_request_searches_again():
    """What ingest verified is reused only for the same window (computed step, last token): a
    request that grew finds a checkpoint beyond its old last token, and one that computed past
    the ingested step never restores behind its computed step."""
    pool, states, trie = make_hybrid()
    prompt = tokens(64)
    _, shallow = produce(trie, prompt, 16)
    request = Sequence(prompt[:20])
    trie.prepare(request)
    assert request.prefix_state.trie.last_search.record is shallow
    _, deep = produce(trie, prompt, 40)  # not reachable before the request grows past 40
    request.append_tokens(prompt[20:])
    txn, _, _ = match(trie, request)
    assert request.prefix_state.checkpoints.restore is deep and request.num_computed == 40
    trie.rollback(txn)
    # the request runs its first 20 tokens (restoring at 16), then asks again
    late = Sequence(prompt[:20])
    trie.prepare(late)
    assert late.prefix_state.trie.last_search.record is shallow
    trie.checkpoints.release(deep)
    admit(trie, late)
    assert late.num_computed == 16
    forward(trie, late)
    assert late.num_computed == 20
    late.append_tokens(prompt[20:24])
    txn, misses, _ = match(trie, late)
    assert txn.hit_tokens == 0 and late.num_computed == 20 and late.prefix_state.checkpoints.restore is None
    trie.rollback(txn)
    trie.check_invariants([request, late])


def test_prepare_of_a_hybrid_miss_returns_the_verified_path():
    pool, states, trie = make_hybrid()
    store_kv(trie, tokens(48))
    request = Sequence(tokens(49))
    path = trie.prepare(request)
    assert request.prefix_state.trie.last_search.record is None and path.node == trie.nodes.find_root(NS)
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and misses == {MissReason.NO_CHECKPOINT.value: 1}
    trie.rollback(txn)


def test_a_remembered_miss_is_searched_again_once_something_is_published():
    pool, states, trie = make_hybrid()
    store_kv(trie, tokens(48))
    request = Sequence(tokens(49))
    trie.prepare(request)
    calls = []
    search = trie.matcher._search
    trie.matcher._search = lambda *args: calls.append(1) or search(*args)
    txn = trie.match(request)
    assert txn.hit_tokens == 0 and calls == []  # the miss from ingest is reused
    trie.rollback(txn)
    _, record = produce(trie, tokens(48), 32)
    calls.clear()
    txn = trie.match(request)
    assert calls == [1] and txn.hit_tokens == 32 and request.prefix_state.checkpoints.restore is record
    trie.rollback(txn)


def test_overlap_is_checked_again_when_kv_is_evicted_after_prepare():
    """A checkpoint at s needs cached KV to s + R*B (MTP overlap): if the block after the
    anchor is evicted between ingest and match, the match misses as a fresh one would."""
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(48), 32)
    request = Sequence(tokens(48) + [1] * 17)
    request.prefix_state.overlap.recompute_blocks = 1
    assert trie.prepare(request).node == record.anchor
    assert trie.kv.evict(1) != []  # the leaf at depth 3, after the anchor
    fresh = Sequence(tokens(48) + [1] * 17)
    fresh.prefix_state.overlap.recompute_blocks = 1
    txn, misses, _ = match(trie, fresh)
    assert txn.hit_tokens == 0 and misses == {MissReason.RECOMPUTE_OVERLAP.value: 1}
    trie.rollback(txn)
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and misses == {MissReason.RECOMPUTE_OVERLAP.value: 1}
    trie.rollback(txn)


# --- multimodal identity ------------------------------------------------------------------------


def test_partial_checkpoint_at_an_image_end():
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    image = MultimodalSpan(16, 20, "image", "img-a")
    prompt = tokens(24)
    producer = Sequence(prompt, multimodal=[image])
    admit(trie, producer)
    assert cp.reserve_save(producer, 18) == NO_SAVE  # inside the image
    assert cp.reserve_save(producer, 20) > 0
    record = producer.prefix_state.checkpoints.pending_save
    forward(trie, producer)
    assert cp.publish_save(producer)
    trie.free_sequence(producer)
    assert record.tail_identity == (image,)
    same = Sequence(prompt[:20] + [7], multimodal=[MultimodalSpan(16, 20, "image", "img-a")])
    txn, _, _ = match(trie, same)
    assert same.num_computed == 20 and same.prefix_state.checkpoints.restore is record
    trie.rollback(txn)
    other = Sequence(prompt[:20] + [7], multimodal=[MultimodalSpan(16, 20, "image", "img-b")])
    txn, _, _ = match(trie, other)
    assert txn.hit_tokens == 0 and record.is_published
    trie.rollback(txn)
    text = Sequence(prompt[:20] + [7])  # the same placeholder tokens without the image
    txn, _, _ = match(trie, text)
    assert txn.hit_tokens == 0
    trie.rollback(txn)


def test_image_in_an_earlier_block_is_part_of_the_identity():
    pool, states, trie = make_hybrid()
    prompt = tokens(48)
    _, record = produce(trie, prompt, 48, multimodal=[MultimodalSpan(20, 28, "image", "img-a")])
    same = Sequence(prompt + [1], multimodal=[MultimodalSpan(20, 28, "image", "img-a")])
    txn, _, _ = match(trie, same)
    assert same.num_computed == 48 and same.prefix_state.checkpoints.restore is record
    trie.rollback(txn)
    other = Sequence(prompt + [1], multimodal=[MultimodalSpan(20, 28, "image", "img-b")])
    txn, misses, _ = match(trie, other)
    assert txn.hit_tokens == 0 and misses == {MissReason.NO_CHECKPOINT.value: 1}
    trie.rollback(txn)
    moved = Sequence(prompt + [1], multimodal=[MultimodalSpan(21, 29, "image", "img-a")])
    txn, _, _ = match(trie, moved)
    assert txn.hit_tokens == 0
    trie.rollback(txn)


def test_a_request_whose_span_covers_the_step_cannot_restore_there():
    pool, states, trie = make_hybrid()
    _, shallow = produce(trie, tokens(48), 16)
    _, deep = produce(trie, tokens(48), 40)
    request = Sequence(tokens(48) + [1], multimodal=[MultimodalSpan(36, 44, "image", "x")])
    txn, _, _ = match(trie, request)
    # the image changes block 2's identity, so only the shallow checkpoint is reachable
    assert request.num_computed == 16 and request.prefix_state.checkpoints.restore is shallow
    trie.rollback(txn)


# --- recompute overlap (MTP) ------------------------------------------------------------------


def test_worked_example_b_aligned_checkpoint_with_overlap():
    pool, states, trie = make_hybrid()
    prompt = tokens(64)
    _, record = produce(trie, prompt, 32)  # KV: A B C D
    request = Sequence(prompt + [1])
    request.prefix_state.overlap.recompute_blocks = 1
    txn, misses, _ = match(trie, request)
    assert misses == {} and request.num_computed == 32 and request.prefix_state.checkpoints.restore is record
    a, b = request.block_table.tolist()
    assert request.prefix_state.overlap.fresh_range == (2, 4)
    assert trie.checkpoints.pin_restore(request)
    grow_and_allocate(trie, request)
    trie.commit(txn)
    canonical = path_blocks(trie, request)
    assert canonical[:2] == [a, b] and cursor_depth(trie, request) == 4
    c, d = canonical[2:]
    private = request.block_table.tolist()
    assert len(private) == 5 and private[2] != c and private[3] != d
    assert request.prefix_state.overlap.trie_block_map == {2: c, 3: d}
    assert pool.refcounts([c, d]).tolist() == [1, 1]  # only the trie: the forward cannot reach them
    trie.check_invariants([request])


def test_worked_example_b_overlap_bound():
    """A checkpoint at s needs cached KV to s + R*B: exactly enough hits, one block short misses."""
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(48), 32)  # KV to 48 = 32 + 16
    request = Sequence(tokens(48) + [1] * 17)
    request.prefix_state.overlap.recompute_blocks = 1
    txn, _, _ = match(trie, request)
    assert request.num_computed == 32 and request.prefix_state.overlap.fresh_range == (2, 3)
    trie.rollback(txn)
    pool, states, trie = make_hybrid()
    produce(trie, tokens(32), 32)  # KV to 32 only
    request = Sequence(tokens(32) + [1] * 33)
    request.prefix_state.overlap.recompute_blocks = 1
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and misses == {MissReason.RECOMPUTE_OVERLAP.value: 1}
    trie.rollback(txn)


def test_overlap_falls_back_to_a_shallower_checkpoint():
    pool, states, trie = make_hybrid()
    prompt = tokens(64)
    _, at48 = produce(trie, prompt, 48)
    _, at64 = produce(trie, prompt, 64)
    request = Sequence(prompt + [1])
    request.prefix_state.overlap.recompute_blocks = 1
    txn, misses, _ = match(trie, request)
    assert request.num_computed == 48 and request.prefix_state.checkpoints.restore is at48
    assert request.prefix_state.overlap.fresh_range == (3, 4)
    trie.rollback(txn)
    plain = Sequence(prompt + [1])  # without MTP the deepest one is used
    txn, _, _ = match(trie, plain)
    assert plain.prefix_state.checkpoints.restore is at64 and plain.num_computed == 64
    trie.rollback(txn)


@pytest.mark.parametrize("recompute", [1, 0])
def test_worked_example_c_partial_checkpoint(recompute):
    pool, states, trie = make_hybrid()
    prompt = tokens(64)
    _, record = produce(trie, prompt, 33)  # anchor B (depth 2), frozen copy of block 2
    request = Sequence(prompt + [9])
    request.prefix_state.overlap.recompute_blocks = recompute
    txn, misses, _ = match(trie, request)
    assert misses == {} and request.num_computed == 33 and request.prefix_state.checkpoints.restore is record
    # with MTP the range reaches the cached KV the overlap needs; without, the partial block
    assert request.num_blocks == 2 and request.prefix_state.overlap.fresh_range == ((2, 4) if recompute else (2, 3))
    assert trie.checkpoints.pin_restore(request)
    grow_and_allocate(trie, request)
    trie.commit(txn)
    canonical = path_blocks(trie, request)
    table = request.block_table.tolist()
    assert cursor_depth(trie, request) == 4 and table[:2] == canonical[:2]
    assert table[2] != canonical[2] and table[3] != canonical[3]  # kept private
    assert record.frozen_block not in table
    assert request.prefix_state.overlap.trie_block_map == {2: canonical[2], 3: canonical[3]}
    trie.check_invariants([request])


# --- routed experts -------------------------------------------------------------------------


def test_routed_experts_replay_through_an_aligned_checkpoint():
    pool, states, trie = make_hybrid()
    prompt = tokens(48)
    record = produce_with_experts(trie, prompt, 32)
    request = Sequence(prompt + [1], want_routed_experts=True)
    txn, _, _ = match(trie, request)
    assert request.prefix_state.checkpoints.restore is record and request.num_computed == 32
    np.testing.assert_array_equal(request.routed_experts, expert_rows(32))
    trie.rollback(txn)
    assert request.num_routed_experts == 0
    plain = Sequence(prompt + [1])  # a request that did not ask gets none
    txn, _, _ = match(trie, plain)
    assert plain.num_computed == 32 and plain.routed_experts is None
    trie.rollback(txn)


def test_checkpoint_whose_nodes_lack_routed_experts_misses_for_an_experts_request():
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(48), 32)
    request = Sequence(tokens(49), want_routed_experts=True)
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and request.num_routed_experts == 0
    assert misses == {MissReason.NO_CHECKPOINT.value: 1}
    assert record.is_published
    trie.rollback(txn)


def test_partial_checkpoint_without_tail_rows_misses_for_an_experts_request():
    pool, states, trie = make_hybrid()
    _, record = produce(trie, tokens(40), 37)  # the producer recorded no experts
    request = Sequence(tokens(41), want_routed_experts=True)
    txn, _, _ = match(trie, request)
    assert txn.hit_tokens == 0 and request.num_routed_experts == 0 and record.is_published
    trie.rollback(txn)


# --- cases a simpler checkpoint design gets wrong ---------------------------------------------


def test_aligned_hit_keeps_the_cached_continuation_private():
    """After an aligned hit every block from the computed step on is one the next forward
    writes, even where the trie already holds that KV (blocks C and D here): ``allocate`` keeps
    the request's private blocks and only maps them to C and D, so the forward never writes
    blocks other sequences read; once computed they are swapped for the canonical ones. Without
    a recompute overlap the match does not look up the KV after the checkpoint at all."""
    pool, states, trie = make_hybrid()
    prompt = tokens(64)
    _, record = produce(trie, prompt, 32)
    reader = Sequence(prompt + [1])  # another sequence reading C and D
    txn = trie.match(reader)
    assert reader.prefix_state.overlap.fresh_range == (2, 2)
    assert trie.checkpoints.pin_restore(reader)
    grow_and_allocate(trie, reader)
    trie.commit(txn)
    canonical = path_blocks(trie, reader)
    c, d = canonical[2:4]
    table = reader.block_table.tolist()
    assert table[2] != c and table[3] != d  # the forward writes 32..65 into private blocks
    assert pool.refcounts([c, d]).tolist() == [1, 1]  # nobody but the trie holds C and D
    assert reader.prefix_state.overlap.trie_block_map == {2: c, 3: d}
    trie.check_invariants([reader])
    forward(trie, reader)
    reader.append_tokens([2])
    grow_and_allocate(trie, reader)  # the next allocate settles the computed duplicates
    assert reader.block_table.tolist()[:4] == canonical and reader.prefix_state.overlap.trie_block_map == {}
    assert pool.refcounts([c, d]).tolist() == [2, 2]
    trie.check_invariants([reader])


def test_prompt_end_is_saved_in_the_same_forward_after_a_partial_hit():
    """After a partial (mid-block) hit, ``allocate`` attaches the request's own new blocks up
    to the prompt end, so the cursor reaches it and the same forward can reserve and publish a
    checkpoint there, which a follow-up request then restores."""
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    _, first = produce(trie, tokens(40), 40)  # KV A B, partial checkpoint at 40
    prompt = tokens(40) + tokens(30, start=500)
    seq = Sequence(prompt)
    txn = trie.match(seq)
    assert seq.num_computed == 40 and seq.prefix_state.checkpoints.restore is first
    assert cp.pin_restore(seq)
    grow_and_allocate(trie, seq)
    trie.commit(txn)
    assert cursor_depth(trie, seq) == 70 // B
    slot = cp.reserve_save(seq)
    assert slot > 0
    forward(trie, seq)
    assert cp.publish_save(seq)
    saved = cp.live_records()[-1]
    assert saved.step == 70 and saved.slot == slot
    trie.check_invariants([seq])
    follow_up = Sequence(prompt + [1])
    txn = trie.match(follow_up)
    assert follow_up.num_computed == 70 and follow_up.prefix_state.checkpoints.restore is saved
    trie.rollback(txn)


def test_records_share_an_anchor_and_a_new_save_replaces_nothing():
    """Several records live on one anchor: a save at 40 on the anchor of the aligned
    checkpoint at 32 leaves that checkpoint published and matchable while in flight, loses
    nothing when abandoned, and once published each record serves its own requests. The
    per-anchor cap releases the least recently used unpinned record, never a pinned one."""
    pool, states, trie = make_hybrid(max_checkpoints_per_anchor=2)
    cp = trie.checkpoints
    prompt = tokens(48)
    _, aligned = produce(trie, prompt, 32)
    # an in-flight save on the same anchor leaves the aligned one matchable, and its
    # abandonment loses nothing
    seq = Sequence(prompt)
    admit(trie, seq)
    assert cp.reserve_save(seq, 40) > 0
    pending = seq.prefix_state.checkpoints.pending_save
    assert pending.anchor == aligned.anchor and aligned.is_published
    diverging = Sequence(prompt[:35] + [0] * 10)
    txn = trie.match(diverging)
    assert diverging.prefix_state.checkpoints.restore is aligned and diverging.num_computed == 32
    trie.rollback(txn)
    assert cp.release_reservation(seq)
    assert aligned.is_published and indexed(trie, aligned)
    # both published on one anchor: each serves its own requests
    assert cp.reserve_save(seq, 40) > 0
    forward(trie, seq)
    assert cp.publish_save(seq)
    partial = cp.live_records()[-1]
    assert partial.step == 40 and cp.records_at(aligned.anchor) == (aligned, partial)
    for request, expected in ((Sequence(prompt[:35] + [0] * 10), aligned), (Sequence(prompt[:41]), partial)):
        txn = trie.match(request)
        assert request.prefix_state.checkpoints.restore is expected and request.num_computed == expected.step
        assert cp.pin_restore(request)  # a hit touches its record
        trie.rollback(txn)
    # the cap (2): a third save releases the least recently used one (the partial), neither
    # the newest nor the one that keeps serving hits
    assert aligned.stamp < partial.stamp
    reader = Sequence(prompt[:33])
    admit(trie, reader)
    cp.unpin_restore(reader)
    assert aligned.stamp > partial.stamp  # aligned is now the most recently used
    _, third = produce(trie, prompt[:38] + [0] * 10, 44)  # its own match restores from aligned
    assert third.anchor == aligned.anchor and partial.state is CheckpointState.RELEASED
    assert cp.records_at(aligned.anchor) == (aligned, third)
    # pinned records are never released by the cap
    producer, pinned = produce(trie, prompt, 36, pin=True)  # restores from aligned: third goes
    assert third.state is CheckpointState.RELEASED
    _, fifth = produce(trie, prompt, 38)  # restores from pinned (36): aligned is the LRU unpinned
    assert aligned.state is CheckpointState.RELEASED
    assert pinned.is_published and fifth.is_published
    assert cp.records_at(pinned.anchor) == (pinned, fifth)
    assert cp.unpin_save(producer)
    trie.check_invariants([seq, reader, producer])


def test_no_frozen_block_is_checked_before_evicting_a_checkpoint():
    """A mid-block reserve that needs a state row and a frozen block, with neither free,
    detects the block shortage before evicting anything: the only checkpoint stays published
    and matchable. An aligned save needs no block and may evict it for its row."""
    pool, states, trie = make_hybrid(num_blocks=4, num_slots=2, budget=0)
    cp = trie.checkpoints
    _, useful = produce(trie, tokens(32), 32)  # the only usable state row
    seq = Sequence(tokens(20, start=100))
    admit(trie, seq)
    assert pool.num_free == 0 and states.num_free == 0
    assert cp.reserve_save(seq) == NO_SAVE
    assert useful.is_published and indexed(trie, useful)
    request = Sequence(tokens(33))
    txn = trie.match(request)
    assert request.prefix_state.checkpoints.restore is useful
    trie.rollback(txn)
    assert cp.reserve_save(seq, 16) == useful.slot  # an aligned save may evict for its row
    assert useful.state is CheckpointState.RELEASED
    trie.check_invariants([seq, request])


def test_partial_checkpoint_replays_tail_expert_rows():
    """A routed-expert request may hit a mid-block checkpoint: the record keeps the expert rows
    of its partial tail (read-only), and the hit replays rows for every restored token, for an
    anchor below the root and at the root alike."""
    pool, states, trie = make_hybrid()
    prompt = tokens(48)
    record = produce_with_experts(trie, prompt, 37)
    np.testing.assert_array_equal(record.tail_experts, expert_rows(48)[32:37])
    assert not record.tail_experts.flags.writeable
    request = Sequence(prompt + [1], want_routed_experts=True)
    txn, misses, _ = match(trie, request)
    assert misses == {} and request.prefix_state.checkpoints.restore is record and request.num_computed == 37
    np.testing.assert_array_equal(request.routed_experts, expert_rows(37))
    trie.rollback(txn)
    root = produce_with_experts(trie, tokens(5, start=700), 5)  # root-anchored: tail rows only
    request = Sequence(tokens(6, start=700), want_routed_experts=True)
    txn, _, _ = match(trie, request)
    assert request.prefix_state.checkpoints.restore is root
    np.testing.assert_array_equal(request.routed_experts, expert_rows(5))
    trie.rollback(txn)


def test_tail_rows_arriving_without_a_new_complete_block_are_attached():
    """Chunked prefill: chunk 1 ends at 32 (blocks 0-1 get rows), chunk 2 saves mid-block at 40.
    Its rows complete no new block, yet the partial record must still receive its tail rows."""
    pool, states, trie = make_hybrid()
    cp = trie.checkpoints
    prompt = tokens(40)
    seq = Sequence(prompt, want_routed_experts=True)
    admit(trie, seq)
    for end in (32, 40):
        assert cp.reserve_save(seq, end) > 0
        record = seq.prefix_state.checkpoints.pending_save
        seq.set_computed(end)
        assert cp.publish_save(seq)
        seq.append_routed_experts(expert_rows(end - seq.num_routed_experts, seq.num_routed_experts))
        trie.cache_routed_experts(seq)
    assert record.step == 40 and seq.prefix_state.checkpoints.records_missing_experts == []
    np.testing.assert_array_equal(record.tail_experts, expert_rows(8, 32))
    request = Sequence(prompt + [1], want_routed_experts=True)
    txn = trie.match(request)
    assert request.prefix_state.checkpoints.restore is record and request.num_computed == 40
    np.testing.assert_array_equal(request.routed_experts, expert_rows(40))
    trie.rollback(txn)


# --- pending nodes (engines that attach blocks before their forward) ---------------------------


def test_prompt_end_checkpoint_on_pending_nodes_becomes_matchable_after_the_forward():
    pool, states, trie = make_hybrid(track_pending=True)
    cp = trie.checkpoints
    producer = Sequence(tokens(40))
    admit(trie, producer)
    assert trie.nodes.pending[trie.nodes.attached_slots()].all()  # blocks 0-1, not computed yet
    assert cp.reserve_save(producer) > 0  # the anchor is the producer's own pending node
    record = producer.prefix_state.checkpoints.pending_save
    assert cp.publish_save(producer, pin=True, in_flight=True)
    request = Sequence(tokens(41))
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None and len(misses) == 1
    trie.rollback(txn)
    start = producer.num_computed
    producer.set_computed(producer.num_tokens)
    trie.mark_computed(producer, start)
    assert not trie.nodes.pending[trie.nodes.attached_slots()].any()
    txn, _, _ = match(trie, request)
    assert txn.hit_tokens == 0  # computed, but the save copy is still in flight
    trie.rollback(txn)
    assert cp.unpin_save(producer)
    txn, _, _ = match(trie, request)
    assert request.num_computed == 40 and request.prefix_state.checkpoints.restore is record
    trie.rollback(txn)
    trie.check_invariants([producer, request])


def test_a_hit_on_computed_nodes_shares_the_record_path_with_track_pending():
    """With pending tracking on, a hit whose path has no pending node reuses the record's
    anchor path as is (and its block ids), like a trie without pending tracking."""
    pool, states, trie = make_hybrid(track_pending=True)
    producer = Sequence(tokens(40))
    admit(trie, producer)
    trie.checkpoints.reserve_save(producer)
    record = producer.prefix_state.checkpoints.pending_save
    start = producer.num_computed
    producer.set_computed(producer.num_tokens)
    trie.mark_computed(producer, start)
    assert trie.checkpoints.publish_save(producer)
    first, second = Sequence(tokens(41)), Sequence(tokens(45))
    assert trie.prepare(first) is record.anchor_path and trie.prepare(second) is record.anchor_path
    txn = trie.match(first)
    assert txn.hit_tokens == 40 and record.anchor_path.blocks is not None
    assert first.block_table.tolist() == record.anchor_path.blocks.tolist()
    trie.rollback(txn)
    trie.check_invariants([producer, first, second])


def test_a_miss_on_pending_nodes_is_no_cached_prefix():
    """Pending nodes are not cached yet: a request whose only cached blocks are pending misses
    with NO_CACHED_PREFIX, as in an attention-only trie."""
    pool, states, trie = make_hybrid(track_pending=True)
    producer = Sequence(tokens(40))
    admit(trie, producer)
    assert trie.nodes.pending[trie.nodes.attached_slots()].all()
    request = Sequence(tokens(41))
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and misses == {MissReason.NO_CACHED_PREFIX.value: 1}
    trie.rollback(txn)


def test_a_checkpoint_below_pending_nodes_the_request_verified_does_not_hit():
    """The request's verified node (set by its allocate) is another sequence's pending node: a
    checkpoint anchored below it must wait for that forward, as for a request that verified
    nothing (the path to the anchor is cut at its first pending node)."""
    pool, states, trie = make_hybrid(track_pending=True)
    cp = trie.checkpoints
    owner = Sequence(tokens(48))
    admit(trie, owner)  # blocks 0-2 attached pending; this forward never runs
    prompt = tokens(32) + tokens(16, start=500) + [7]
    producer = Sequence(prompt)
    admit(trie, producer)  # maps the owner's pending blocks 0-1, attaches its own block 2
    start = producer.num_computed
    forward(trie, producer)
    trie.mark_computed(producer, start)
    assert cp.reserve_save(producer, 48) > 0
    record = producer.prefix_state.checkpoints.pending_save
    assert cp.publish_save(producer)
    parent = int(trie.nodes.parent[record.anchor])
    assert not trie.nodes.pending[record.anchor] and trie.nodes.pending[parent]
    fresh = Sequence(prompt[:48] + [1])
    txn, _, _ = match(trie, fresh)
    assert txn.hit_tokens == 0  # the anchor's path waits for the owner's forward
    trie.rollback(txn)
    request = Sequence(prompt[:40])
    admit(trie, request)  # its verified node is now the owner's pending node at depth 2
    assert trie.nodes.pending[request.prefix_state.trie.verified]
    trie.free_sequence(request)
    request.append_tokens(prompt[40:48] + [1])
    txn, _, _ = match(trie, request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None and request.num_blocks == 0
    trie.rollback(txn)
    trie.check_invariants([owner, producer, request])


def test_pending_blocks_after_the_anchor_do_not_count_for_the_overlap():
    """A checkpoint at s needs cached KV to s + R*B: a pending block there is not cached yet."""
    pool, states, trie = make_hybrid(track_pending=True)
    cp = trie.checkpoints
    producer = Sequence(tokens(32))
    admit(trie, producer)
    start = producer.num_computed
    assert cp.reserve_save(producer, 32) > 0
    forward(trie, producer)
    trie.mark_computed(producer, start)
    assert cp.publish_save(producer)
    trie.free_sequence(producer)
    other = Sequence(tokens(48) + [5])
    admit_leaving_restore_unpinned(trie, other)  # attaches block 2, pending until its forward
    assert [bool(trie.nodes.pending[s]) for s in slots_at_depth(trie, 3)] == [True]
    request = Sequence(tokens(48) + [1] * 17)
    request.prefix_state.overlap.recompute_blocks = 1
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and misses == {MissReason.RECOMPUTE_OVERLAP.value: 1}
    trie.rollback(txn)
    start = other.num_computed
    forward(trie, other)
    trie.mark_computed(other, start)
    request = Sequence(tokens(48) + [1] * 17)
    request.prefix_state.overlap.recompute_blocks = 1
    txn, misses, _ = match(trie, request)
    assert misses == {} and request.num_computed == 32
    trie.rollback(txn)
    trie.check_invariants([other, request])


def test_failed_forward_discards_its_pending_nodes_and_their_checkpoints():
    pool, states, trie = make_hybrid(track_pending=True)
    cp = trie.checkpoints
    producer = Sequence(tokens(40))
    admit(trie, producer)
    assert cp.reserve_save(producer, 32) > 0
    record = producer.prefix_state.checkpoints.pending_save
    assert cp.publish_save(producer, pin=True, in_flight=True)
    cp.release_failed_save(producer)
    assert trie.discard_pending(producer) == 2
    assert record.state is CheckpointState.RELEASED and trie.nodes.num_attached == 0
    assert cp.live_records() == [] and states.num_free == states.num_slots - 1
    trie.check_invariants([producer])
    trie.free_sequence(producer)
    assert pool.num_free == pool.num_blocks


def test_a_remembered_miss_takes_its_path_afresh_after_evictions():
    """Evictions cannot turn a miss into a hit, but they can free the verified node (whose slot
    may be reused elsewhere): the reused miss must report the current verified path."""
    pool, states, trie = make_hybrid()
    produce(trie, tokens(48), 32)
    request = Sequence(tokens(49))
    assert trie.prepare(request).depth == 2  # a hit: the anchor became the verified node
    assert trie.free_state_slots(8) == 1
    missed = trie.prepare(request)
    assert request.prefix_state.trie.last_search.record is None and missed.depth == 2
    trie.clear()
    store_kv(trie, [7] * 16, adapter="x")  # a new root and one node reuse the freed slots
    path = trie.prepare(request)
    assert int(trie.nodes.depth[path.node]) == path.depth
    assert path.root == trie.nodes.find_root(NS)
    trie.check_invariants([request])


# --- what a remembered search may reuse ------------------------------------------------------


def test_an_overlap_chosen_after_ingest_is_applied_at_match():
    """A search remembered at ingest is for the policy it was made with: an MTP overlap set
    afterwards (KV cached only to the checkpoint) turns the hit into an overlap miss, as for
    a request that had it from the start."""
    pool, states, trie = make_hybrid()
    produce(trie, tokens(32), 32)
    request = Sequence(tokens(32) + [1] * 33)
    trie.prepare(request)
    request.prefix_state.overlap.recompute_blocks = 1
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 0 and misses == {MissReason.RECOMPUTE_OVERLAP.value: 1}
    trie.rollback(txn)


def test_a_remembered_overlap_miss_ends_when_the_kv_arrives():
    """An overlap miss is reused only while no KV was attached since: once the blocks after
    the checkpoint are cached, the same request hits like a new one."""
    pool, states, trie = make_hybrid()
    produce(trie, tokens(32), 32)
    request = Sequence(tokens(48) + [1] * 17)
    request.prefix_state.overlap.recompute_blocks = 1
    txn, _, _ = match(trie, request)
    assert txn.hit_tokens == 0
    trie.rollback(txn)
    store_kv(trie, tokens(48) + [1] * 3)
    txn, misses, _ = match(trie, request)
    assert txn.hit_tokens == 32 and misses == {}
    trie.rollback(txn)


def test_a_search_remembered_by_another_trie_is_not_reused():
    """Two tries never share an index epoch, so a sequence matched on one and then offered to
    another is searched afresh there."""
    _, _, first = make_hybrid()
    _, _, second = make_hybrid()
    produce(first, tokens(64), 32)
    produce(second, tokens(64, start=500), 32)  # the same history of changes, other tokens
    assert second.nodes.version == first.nodes.version
    request = Sequence(tokens(64) + [1])
    first.prepare(request)
    assert request.prefix_state.trie.last_search.record is not None
    txn, misses, _ = match(second, request)
    assert txn.hit_tokens == 0 and request.prefix_state.checkpoints.restore is None
    second.rollback(txn)
