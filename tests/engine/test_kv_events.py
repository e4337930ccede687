"""The engine's event streams: chains announced once matchable, removals on eviction,
checkpoints after their anchors, nothing when disabled."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.engine import Engine, EngineConfig, Request
from hybridcache.events.config import KVEventsConfig
from hybridcache.events.hashing import chain_hashes
from hybridcache.events.index import AnnouncedBlocks, AnnouncedCheckpoints
from hybridcache.events.schema import BlockRemoved, BlockStored, CheckpointStored, decode_kv_batch, decode_state_batch
from hybridcache.events.subscriber import RESET, StreamSubscriber

LOOPBACK = "tcp://127.0.0.1:*"
BLOCK = 8


def _engine(**overrides) -> Engine:
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=LOOPBACK, replay_endpoint=LOOPBACK, topic="kv@p@m",
        state_endpoint=LOOPBACK, state_replay_endpoint=LOOPBACK, state_topic="hcstate@p@m",
    )
    base = dict(block_size=BLOCK, num_kv_blocks=64, num_state_slots=8, checkpoint_budget=4, max_batch_tokens=64,
                max_running=4, prefill_chunk=32, kv_events=events)
    base.update(overrides)
    return Engine(EngineConfig(**base))


@pytest.fixture
def engine():
    built = _engine()
    yield built
    built.close()


def _events(publisher, decode) -> list:
    """Every event the publisher's replay buffer holds, in order."""
    assert publisher.flush()
    subscriber = StreamSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        delivered = subscriber.catch_up()
    finally:
        subscriber.close()
    assert RESET not in delivered
    return [event for item in delivered for event in decode(item.payload).events]


def test_a_prompt_is_announced_as_one_chain_of_its_full_blocks(engine):
    prompt = np.arange(1, 30)
    engine.generate([Request(prompt, max_new_tokens=1)])
    stored = [e for e in _events(engine.events.kv, decode_kv_batch) if isinstance(e, BlockStored)]
    hashes = [h for event in stored for h in event.block_hashes]
    assert hashes == chain_hashes(prompt.tolist(), BLOCK)[: len(hashes)] and len(hashes) == 3
    assert stored[0].parent_block_hash is None and stored[0].token_ids == prompt[:BLOCK * len(stored[0].block_hashes)].tolist()
    assert all(e.medium == "GPU" and e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention" for e in stored)


def test_evicted_blocks_are_removed_by_the_hash_they_were_stored_under(engine):
    engine.generate([Request(np.arange(1, 30), max_new_tokens=1)])
    engine.clear_cache()
    events = _events(engine.events.kv, decode_kv_batch)
    blocks = AnnouncedBlocks()
    blocks.apply(events)
    assert len(blocks) == 0 and any(isinstance(e, BlockRemoved) for e in events)


@pytest.mark.parametrize("async_depth", [0, 1])
def test_every_checkpoint_follows_its_anchor_and_carries_the_tail(async_depth):
    engine = _engine(async_depth=async_depth)
    try:
        rng = np.random.default_rng(1)
        prompts = [np.concatenate([np.arange(1, 21), rng.integers(0, 50, 11)]) for _ in range(4)]
        results = engine.generate([Request(p, max_new_tokens=3) for p in prompts])
        prompts = [np.concatenate([p, r.tokens]) for p, r in zip(prompts, results)]
        kv_events = _events(engine.events.kv, decode_kv_batch)
        state_events = _events(engine.events.state, decode_state_batch)
    finally:
        engine.close()
    announced = {h for e in kv_events if isinstance(e, BlockStored) for h in e.block_hashes}
    stored = [e for e in state_events if isinstance(e, CheckpointStored)]
    assert stored
    chains = {p.tobytes(): chain_hashes(p.tolist(), BLOCK) for p in prompts}
    for event in stored:
        assert event.anchor_block_hash is None or event.anchor_block_hash in announced
        anchor_blocks = event.position // BLOCK
        owner = [
            p for p in prompts
            if anchor_blocks == 0 or chains[p.tobytes()][anchor_blocks - 1 : anchor_blocks] == [event.anchor_block_hash]
        ]
        assert any(p[anchor_blocks * BLOCK : event.position].tolist() == event.tail_token_ids for p in owner)
        assert event.state_bytes and event.state_bytes > 0


def test_checkpoints_ride_their_own_stream_and_index_by_anchor(engine):
    engine.generate([Request(np.arange(1, 30), max_new_tokens=2)])
    kv_types = {type(e).__name__ for e in _events(engine.events.kv, decode_kv_batch)}
    checkpoints = AnnouncedCheckpoints()
    checkpoints.apply(_events(engine.events.state, decode_state_batch))
    assert kv_types <= {"BlockStored", "BlockRemoved"} and len(checkpoints) > 0
    checkpoints.check_invariants()


def test_a_disabled_config_opens_no_socket():
    engine = Engine(EngineConfig(block_size=BLOCK, num_kv_blocks=64, num_state_slots=8, checkpoint_budget=4))
    engine.generate([Request(np.arange(1, 20), max_new_tokens=1)])
    assert engine.events is None
    engine.close()
