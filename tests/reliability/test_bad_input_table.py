"""One table of bad calls, one per public entry point and misuse: each raises the documented
exception class from ``hybridcache.errors`` and leaves every structure exactly as it was (a deep
snapshot of pools, trie, sequences, transactions and engine taken before the call equals the one
after it; see ``_snapshot.py`` for the one documented cache it skips)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

from hybridcache import errors as E
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache import BlockKeyer, BlockTrie
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from hybridcache.sequence import MultimodalSpan, Sequence

from tests.prefix_cache._helpers import admit, forward, grow_attach_commit

from ._snapshot import snapshot

B = 4
NUM_BLOCKS = 24


def cache_world() -> SimpleNamespace:
    """Pools and a hybrid trie in the middle of things: a producer holding a producer pin and a
    fresh reservation, a consumer whose match is open with its restore pinned, a closed
    transaction, published / released records and a few state pools at their limits."""
    pool = BlockPool(NUM_BLOCKS)
    states = StatePool(8, checkpoint_budget=3)
    trie = BlockTrie(pool, B, keyer=BlockKeyer.deterministic(B), state_pool=states, max_checkpoints_per_anchor=2)
    cp = trie.checkpoints
    runtime_slot = states.allocate_runtime()

    # a finished request whose checkpoint stays published, unpinned
    done = Sequence(list(range(50, 61)))
    admit(trie, done)
    assert cp.reserve_save(done, 8) > 0
    forward(trie, done)
    assert cp.publish_save(done)
    published = [r for r in cp.live_records() if r.is_published][0]
    trie.free_sequence(done)

    # a record that was released
    gone = Sequence(list(range(70, 78)))
    admit(trie, gone)
    assert cp.reserve_save(gone, 4) > 0
    forward(trie, gone)
    released = gone.prefix_state.checkpoints.pending_save
    assert cp.publish_save(gone)
    cp.release(released)
    trie.free_sequence(gone)

    # the producer: a published mid-block checkpoint it still pins, and a new reservation
    producer = Sequence(list(range(1, 12)), multimodal=[MultimodalSpan(1, 3, "image", "img-a")])
    admit(trie, producer)
    assert cp.reserve_save(producer, 10) > 0
    forward(trie, producer)
    pinned = producer.prefix_state.checkpoints.pending_save
    assert cp.publish_save(producer, pin=True)
    assert cp.reserve_save(producer, 8) > 0
    reserved = producer.prefix_state.checkpoints.pending_save

    # the consumer: matched the producer's checkpoint and pinned it; its transaction is open
    consumer = Sequence(list(range(1, 14)), multimodal=[MultimodalSpan(1, 3, "image", "img-a")])
    txn = trie.match(consumer)
    assert consumer.prefix_state.checkpoints.restore is pinned and cp.pin_restore(consumer)

    # a committed (closed) transaction of a running request
    running = Sequence(list(range(30, 40)))
    closed = trie.match(running)
    grow_attach_commit(trie, running, closed)
    forward(trie, running)

    fresh = Sequence([1, 2, 3])
    free_block = int(pool._free[pool.num_free - 1])
    held_block = int(running.block_table[0])
    free_slot = states._free[-1]
    no_runtime = StatePool(3, checkpoint_budget=2)  # runtime cap 0
    no_slots = StatePool(2)
    no_slots.allocate_checkpoint()
    world = SimpleNamespace(
        pool=pool, states=states, trie=trie, cp=cp, producer=producer, consumer=consumer, running=running,
        fresh=fresh, txn=txn, closed=closed, pinned=pinned, reserved=reserved, published=published,
        released=released, free_block=free_block, held_block=held_block, free_slot=free_slot,
        runtime_slot=runtime_slot, no_runtime=no_runtime, no_slots=no_slots,
    )
    world.live = (producer, consumer, running, fresh)
    world.state = (pool, states, trie, producer, consumer, running, fresh, txn, closed, no_runtime, no_slots)
    assert pinned.is_published and pinned.pin_count == 2 and reserved.state is CheckpointState.RESERVED
    assert released.state is CheckpointState.RELEASED and published.pin_count == 0
    trie.check_invariants(world.live)
    return world


def engine_world() -> SimpleNamespace:
    """A tiny engine with a registered adapter, something cached and a request waiting."""
    from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig

    model = TinyHybridConfig(
        vocab_size=64, hidden_size=8, layer_pattern="RA", num_attention_heads=1, attention_head_dim=4,
        num_ssm_heads=1, ssm_head_dim=4, ssm_state_size=2, conv_kernel=2, num_experts=2,
        experts_per_token=1, expert_hidden_size=8, adapter_rank=1,
    )
    engine = Engine(EngineConfig(block_size=4, num_kv_blocks=32, num_state_slots=8, checkpoint_budget=3,
                                 max_batch_tokens=32, prefill_chunk=16, model=model, adapters=("a",)))
    engine.generate([Request(list(range(1, 12)), max_new_tokens=2), Request(list(range(1, 10)), max_new_tokens=1, adapter="a")])
    engine.add_request(Request(list(range(1, 14)), max_new_tokens=2))
    world = SimpleNamespace(engine=engine, vocab=model.vocab_size)
    world.state = (engine,)
    return world


# --- the table ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: str
    call: Callable[[SimpleNamespace], object]
    error: type
    world: str = "cache"
    setup: Callable[[SimpleNamespace], object] | None = None  # misuse done before the snapshot


def _request(**kwargs):
    from hybridcache.engine import Request

    kwargs.setdefault("prompt", [1, 2, 3, 4, 5])
    return Request(**kwargs)


def _image(start, end):
    from hybridcache.engine import MultimodalInput

    return MultimodalInput(start, end, b"pixels")


def _forge_restore_pin(w):
    """A sequence claims a restore pin nobody took (misuse): unpinning would go below zero."""
    w.fresh.prefix_state.checkpoints.restore = w.published
    w.fresh.prefix_state.checkpoints.restore_pinned = True
    w.state = (*w.state, w.published)
    w.live = ()  # the pin owners no longer add up: check the rest of the invariants only


def _drop_private_block(w):
    """Somebody else dropped the sequence's reference on its private last block (misuse)."""
    w.pool.unref([int(w.running.block_table[-1])])
    w.live = ()  # refcounts no longer equal their owners


ROWS = [
    # Sequence(...)
    Row("Sequence-tokens-str", lambda w: Sequence("abc"), E.InvalidTypeError),
    Row("Sequence-tokens-float", lambda w: Sequence([1, 2.5]), E.InvalidTypeError),
    Row("Sequence-tokens-bool", lambda w: Sequence([True, 2]), E.InvalidTypeError),
    Row("Sequence-tokens-none", lambda w: Sequence(None), E.InvalidTypeError),
    Row("Sequence-tokens-2d", lambda w: Sequence(np.ones((2, 2), dtype=np.int32)), E.InvalidTypeError),
    Row("Sequence-tokens-float-array", lambda w: Sequence(np.ones(3)), E.InvalidTypeError),
    Row("Sequence-token-negative", lambda w: Sequence([1, -1]), E.InvalidTokenError),
    Row("Sequence-token-2**31", lambda w: Sequence([1, 2**31]), E.InvalidTokenError),
    Row("Sequence-token-2**63", lambda w: Sequence([2**63]), E.InvalidTokenError),
    Row("Sequence-token-array-2**31", lambda w: Sequence(np.array([2**31], dtype=np.int64)), E.InvalidTokenError),
    Row("Sequence-adapter-empty", lambda w: Sequence([1], adapter=""), E.InvalidNamespaceError),
    Row("Sequence-adapter-int", lambda w: Sequence([1], adapter=5), E.InvalidNamespaceError),
    Row("Sequence-salt-bytes", lambda w: Sequence([1], cache_salt=b"x"), E.InvalidNamespaceError),
    Row("Sequence-span-beyond", lambda w: Sequence([1, 2, 3], multimodal=[MultimodalSpan(2, 4, "image", "x")]), E.InvalidSpanError),
    Row(
        "Sequence-spans-overlap",
        lambda w: Sequence(list(range(9)), multimodal=[MultimodalSpan(0, 4, "image", "x"), MultimodalSpan(3, 6, "image", "y")]),
        E.InvalidSpanError,
    ),
    Row("Sequence-span-not-a-span", lambda w: Sequence([1, 2], multimodal=[(0, 1)]), E.InvalidTypeError),
    Row("Sequence-span-single", lambda w: Sequence([1, 2], multimodal=MultimodalSpan(0, 1, "image", "x")), E.InvalidTypeError),
    Row("MultimodalSpan-empty", lambda w: MultimodalSpan(3, 3, "image", "x"), E.InvalidSpanError),
    Row("MultimodalSpan-no-content", lambda w: MultimodalSpan(0, 2, "image", ""), E.InvalidSpanError),
    # Sequence.append_tokens / set_computed / write_blocks
    Row("append_tokens-2**31", lambda w: w.running.append_tokens([5, 2**31]), E.InvalidTokenError),
    Row("append_tokens-negative", lambda w: w.running.append_tokens([-3]), E.InvalidTokenError),
    Row("append_tokens-str", lambda w: w.running.append_tokens(["a"]), E.InvalidTypeError),
    Row("append_tokens-int", lambda w: w.running.append_tokens(7), E.InvalidTypeError),
    Row("set_computed-negative", lambda w: w.running.set_computed(-1), E.InvalidStepError),
    Row("set_computed-beyond", lambda w: w.running.set_computed(w.running.num_tokens + 1), E.InvalidStepError),
    Row("set_computed-float", lambda w: w.running.set_computed(2.0), E.InvalidTypeError),
    Row("set_computed-bool", lambda w: w.running.set_computed(True), E.InvalidTypeError),
    Row("write_blocks-index-negative", lambda w: w.running.write_blocks(-1, [0]), E.InvalidBlockIdError),
    Row("write_blocks-index-hole", lambda w: w.running.write_blocks(w.running.num_blocks + 1, [0]), E.InvalidBlockIdError),
    Row("write_blocks-index-str", lambda w: w.running.write_blocks("0", [0]), E.InvalidTypeError),
    Row("write_blocks-id-negative", lambda w: w.running.write_blocks(0, [-1]), E.InvalidBlockIdError),
    Row("write_blocks-id-float", lambda w: w.running.write_blocks(0, [1.5]), E.InvalidTypeError),  # a wrong type, as attach_table says
    # BlockPool
    Row("BlockPool-negative", lambda w: BlockPool(-1), E.InvalidArgumentError),
    Row("BlockPool-float", lambda w: BlockPool(4.0), E.InvalidArgumentError),
    Row("allocate-negative", lambda w: w.pool.allocate(-1), E.InvalidArgumentError),
    Row("allocate-float", lambda w: w.pool.allocate(1.5), E.InvalidArgumentError),
    Row("allocate-too-many", lambda w: w.pool.allocate(w.pool.num_free + 1), E.OutOfBlocksError),
    Row("ref-out-of-range", lambda w: w.pool.ref([w.held_block, NUM_BLOCKS]), E.InvalidBlockIdError),
    Row("ref-negative", lambda w: w.pool.ref([-1]), E.InvalidBlockIdError),
    Row("ref-float", lambda w: w.pool.ref([1.0]), E.InvalidTypeError),
    Row("ref-free-block", lambda w: w.pool.ref([w.held_block, w.free_block]), E.DoubleFreeError),
    Row("unref-free-block (free twice)", lambda w: w.pool.unref([w.free_block]), E.DoubleFreeError),
    Row(
        "unref-below-zero",
        lambda w: w.pool.unref([w.held_block] * (w.pool.refcount_of(w.held_block) + 1)),
        E.RefcountUnderflowError,
    ),
    Row("touch-out-of-range", lambda w: w.pool.touch([NUM_BLOCKS + 3]), E.InvalidBlockIdError),
    Row("touch-str", lambda w: w.pool.touch(["0"]), E.InvalidTypeError),
    # StatePool
    Row("StatePool-zero", lambda w: StatePool(0), E.InvalidArgumentError),
    Row("StatePool-budget-negative", lambda w: StatePool(4, checkpoint_budget=-1), E.InvalidArgumentError),
    Row("allocate_runtime-cap", lambda w: w.no_runtime.allocate_runtime(), E.OutOfStateSlotsError),
    Row("allocate_checkpoint-none-free", lambda w: w.no_slots.allocate_checkpoint(), E.OutOfStateSlotsError),
    Row("free_runtime-reserved-slot", lambda w: w.states.free_runtime(0), E.InvalidBlockIdError),
    Row("free_runtime-out-of-range", lambda w: w.states.free_runtime(8), E.InvalidBlockIdError),
    Row("free_runtime-str", lambda w: w.states.free_runtime("1"), E.InvalidTypeError),
    Row("free_runtime-free-slot (free twice)", lambda w: w.states.free_runtime(w.free_slot), E.DoubleFreeError),
    Row("free_checkpoint-free-slot (free twice)", lambda w: w.states.free_checkpoint(w.free_slot), E.DoubleFreeError),
    Row("free_checkpoint-runtime-slot", lambda w: w.states.free_checkpoint(w.runtime_slot), E.WrongRoleError),
    Row("free_runtime-checkpoint-slot", lambda w: w.states.free_runtime(w.pinned.slot), E.WrongRoleError),
    # BlockTrie(...)
    Row("BlockTrie-odd-block-size", lambda w: BlockTrie(w.pool, 3), E.InvalidArgumentError),
    Row("BlockTrie-block-size-str", lambda w: BlockTrie(w.pool, "4"), E.InvalidArgumentError),
    Row("BlockTrie-pool-str", lambda w: BlockTrie("pool", B), E.InvalidTypeError),
    Row("BlockTrie-keyer-str", lambda w: BlockTrie(w.pool, B, keyer="k"), E.InvalidTypeError),
    Row("BlockTrie-keyer-block-size", lambda w: BlockTrie(w.pool, B, keyer=BlockKeyer(2 * B)), E.InvalidArgumentError),
    Row("BlockTrie-state-pool-str", lambda w: BlockTrie(w.pool, B, state_pool="states"), E.InvalidTypeError),
    Row("BlockTrie-per-anchor-zero", lambda w: BlockTrie(w.pool, B, state_pool=w.states, max_checkpoints_per_anchor=0), E.InvalidArgumentError),
    # BlockTrie match / commit / rollback / allocate / evict / free_sequence
    Row("match-not-a-sequence", lambda w: w.trie.match("seq"), E.InvalidTypeError),
    Row("match-restore-pinned", lambda w: w.trie.match(w.consumer), E.PinnedError),
    Row("commit-not-a-txn", lambda w: w.trie.commit(None), E.InvalidTypeError),
    Row("commit-closed-txn", lambda w: w.trie.commit(w.closed), E.StaleHandleError),
    Row("rollback-closed-txn", lambda w: w.trie.rollback(w.closed), E.StaleHandleError),
    Row("rollback-not-a-txn", lambda w: w.trie.rollback(object()), E.InvalidTypeError),
    Row("rollback-after-step-moved", lambda w: w.trie.rollback(w.txn), E.StaleHandleError, setup=lambda w: w.consumer.set_computed(0)),
    Row("allocate-not-a-sequence", lambda w: w.trie.allocate([1, 2, 3]), E.InvalidTypeError),
    Row("evict-negative", lambda w: w.trie.free_kv_blocks(-1), E.InvalidArgumentError),
    Row("evict-float", lambda w: w.trie.free_kv_blocks(1.5), E.InvalidTypeError),
    Row("evict-bool", lambda w: w.trie.free_kv_blocks(True), E.InvalidTypeError),
    Row("evict_checkpoints-negative", lambda w: w.trie.free_state_slots(-2), E.InvalidArgumentError),
    Row("evict_checkpoints-float", lambda w: w.trie.free_state_slots(0.5), E.InvalidArgumentError),
    Row("free_sequence-not-a-sequence", lambda w: w.trie.free_sequence(3), E.InvalidTypeError),
    Row(
        "free_sequence-block-already-freed (free twice)",
        lambda w: w.trie.free_sequence(w.running),
        E.DoubleFreeError,
        setup=lambda w: _drop_private_block(w),
    ),
    # CheckpointLifecycle
    Row("reserve_save-step-float", lambda w: w.cp.reserve_save(w.running, 2.0), E.InvalidTypeError),
    Row("reserve_decode_save-interval-not-block-multiple", lambda w: w.cp.reserve_decode_save(w.running, B + 1), E.InvalidArgumentError),
    Row("reserve_decode_save-interval-negative", lambda w: w.cp.reserve_decode_save(w.running, -B), E.InvalidArgumentError),
    Row("publish-twice", lambda w: w.cp.publish(w.published), E.AlreadyPublishedError),
    Row("publish-released", lambda w: w.cp.publish(w.released), E.LifecycleError),
    Row("publish_save-second-producer-pin", lambda w: w.cp.publish_save(w.producer, pin=True), E.LifecycleError),
    Row("release-pinned", lambda w: w.cp.release(w.pinned), E.PinnedError),
    Row("release-twice", lambda w: w.cp.release(w.released), E.LifecycleError),
    Row("unpin-below-zero", lambda w: w.cp.unpin_restore(w.fresh), E.PinUnderflowError, setup=_forge_restore_pin),
    # Engine.add_request
    Row("add_request-not-a-request", lambda w: w.engine.add_request([1, 2, 3]), E.InvalidTypeError, "engine"),
    Row("add_request-prompt-empty", lambda w: w.engine.add_request(_request(prompt=[])), E.InvalidTokenError, "engine"),
    Row("add_request-prompt-none", lambda w: w.engine.add_request(_request(prompt=None)), E.InvalidTypeError, "engine"),
    Row("add_request-prompt-int", lambda w: w.engine.add_request(_request(prompt=7)), E.InvalidTypeError, "engine"),
    Row("add_request-prompt-str", lambda w: w.engine.add_request(_request(prompt="hello")), E.InvalidTypeError, "engine"),
    Row("add_request-token-float", lambda w: w.engine.add_request(_request(prompt=[1, 2.0])), E.InvalidTypeError, "engine"),
    Row("add_request-token-bool", lambda w: w.engine.add_request(_request(prompt=[1, False])), E.InvalidTypeError, "engine"),
    Row("add_request-token-negative", lambda w: w.engine.add_request(_request(prompt=[1, -1])), E.InvalidTokenError, "engine"),
    Row("add_request-token-vocab", lambda w: w.engine.add_request(_request(prompt=[1, w.vocab])), E.InvalidTokenError, "engine"),
    Row("add_request-token-2**31", lambda w: w.engine.add_request(_request(prompt=[2**31])), E.InvalidTokenError, "engine"),
    Row("add_request-token-2**64", lambda w: w.engine.add_request(_request(prompt=[3, 2**64])), E.InvalidTokenError, "engine"),
    Row("add_request-span-beyond-prompt", lambda w: w.engine.add_request(_request(multimodal=[_image(3, 9)])), E.InvalidSpanError, "engine"),
    Row(
        "add_request-spans-overlap",
        lambda w: w.engine.add_request(_request(multimodal=[_image(0, 3), _image(2, 4)])),
        E.InvalidSpanError,
        "engine",
    ),
    Row("add_request-adapter-unknown", lambda w: w.engine.add_request(_request(adapter="b")), E.InvalidNamespaceError, "engine"),
    Row("add_request-adapter-empty", lambda w: w.engine.add_request(_request(adapter="")), E.InvalidNamespaceError, "engine"),
    Row("add_request-adapter-int", lambda w: w.engine.add_request(_request(adapter=3)), E.InvalidNamespaceError, "engine"),
    Row("add_request-salt-empty", lambda w: w.engine.add_request(_request(cache_salt="")), E.InvalidNamespaceError, "engine"),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_call_raises_the_documented_error_and_changes_nothing(row: Row):
    world = engine_world() if row.world == "engine" else cache_world()
    if row.setup is not None:
        row.setup(world)
    before = snapshot(*world.state)
    with pytest.raises(row.error) as raised:
        row.call(world)
    assert isinstance(raised.value, E.HybridCacheError), f"{type(raised.value).__name__} is not a HybridCacheError"
    assert snapshot(*world.state) == before, f"{row.id} changed state although it raised"
    if row.world == "engine":
        world.engine.check_invariants()
    elif row.setup is None:
        world.trie.check_invariants(world.live)


def test_every_row_is_distinct_and_covers_each_error_family():
    ids = [row.id for row in ROWS]
    assert len(set(ids)) == len(ids)
    raised = {row.error for row in ROWS}
    for family in (E.InvalidArgumentError, E.InvalidTypeError, E.LifecycleError, E.ResourceExhaustedError, E.InvalidBlockIdError):
        assert any(issubclass(error, family) for error in raised), family


def test_the_snapshot_sees_changes_anywhere():
    """The check above has teeth: a change deep in any structure changes the snapshot."""
    world = cache_world()
    changes = [
        lambda w: w.pool.touch([w.held_block]),
        lambda w: setattr(w.producer.prefix_state.overlap, "recompute_blocks", 1),
        lambda w: setattr(w.pinned, "hits", w.pinned.hits + 1),
        lambda w: w.trie.tokens.ensure_capacity(w.trie.tokens.capacity + 1),
        lambda w: w.trie.stats.match.misses.update(["x"]),
        lambda w: w.states.allocate_checkpoint(),
        lambda w: w.fresh.append_tokens([9]),
    ]
    for change in changes:
        before = snapshot(*world.state)
        change(world)
        assert snapshot(*world.state) != before
    engine = engine_world()
    before = snapshot(*engine.state)
    engine.engine.cache.kv.view(-1)[0] += 1
    assert snapshot(*engine.state) != before
