"""Host and disk tiers announced on the streams: ``CPU`` / ``DISK`` blocks and checkpoints on
the same hash chain the device announces, following publishes, host evictions, their demotion
to disk and disk evictions, so that what the streams say each medium holds is what it holds."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.engine import Engine, EngineConfig, Request
from hybridcache.events.config import KVEventsConfig
from hybridcache.events.hashing import chain_hashes
from hybridcache.events.schema import (
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
    decode_kv_batch,
    decode_state_batch,
)
from hybridcache.events.tier_announcer import TierAnnouncer, TierPublish
from hybridcache.sequence import Sequence
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.keys import KeyChain
from tests.engine.test_kv_events import _events  # every event a publisher's replay buffer holds
from hybridcache.tiers.tiered import TieredStore

LOOPBACK = "tcp://127.0.0.1:*"
BLOCK, CHUNK = 8, 16


def _one_per_object(key: str, size: int) -> int:
    return 1  # each object counts one against the budget: evictions come at a known count


def _engine(tmp_path, host_objects: int, disk_objects: int) -> Engine:
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=LOOPBACK, replay_endpoint=LOOPBACK, topic="kv@p@m",
                            state_endpoint=LOOPBACK, state_replay_endpoint=LOOPBACK, state_topic="hcstate@p@m")
    config = EngineConfig(block_size=BLOCK, num_kv_blocks=64, num_state_slots=8, checkpoint_budget=4, max_batch_tokens=64,
                          max_running=4, prefill_chunk=32, tier_chunk_size=CHUNK, kv_events=events)
    tiers = TieredStore(host=HostMemoryStore(host_objects, charge=_one_per_object),
                        disk=DiskStore(tmp_path, disk_objects, charge=_one_per_object))
    return Engine(config, tiers=tiers)


def _held(kv_events, state_events, medium: str) -> tuple[set[int], set[int]]:
    """The block hashes and checkpoint positions the streams say ``medium`` holds at the end."""
    blocks: dict[int, int] = {}
    for event in kv_events:
        if event.medium != medium:
            continue
        for block_hash in event.block_hashes:
            blocks[block_hash] = blocks.get(block_hash, 0) + (1 if isinstance(event, BlockStored) else -1)
    checkpoints: dict[int, int] = {}
    for event in state_events:
        if isinstance(event, CheckpointStored) and event.medium == medium:
            checkpoints[event.checkpoint_id] = event.position
        elif isinstance(event, CheckpointRemoved) and event.medium == medium:
            for checkpoint_id in event.checkpoint_ids:
                del checkpoints[checkpoint_id]
    assert all(count in (0, 1) for count in blocks.values()), "a tier block announced twice on one medium"
    return {h for h, count in blocks.items() if count}, set(checkpoints.values())


def _truth(engine: Engine, prompts, tier: str) -> tuple[set[int], set[int]]:
    """What ``tier`` actually holds of the prompts' chunk-aligned prefixes."""
    store = engine.tiers.store.tiers[tier]
    blocks, positions = set(), set()
    for prompt in prompts:
        keys = KeyChain.for_sequence(engine.tiers.fingerprint, Sequence(prompt))
        hashes = chain_hashes(prompt, BLOCK)
        per_chunk = CHUNK // BLOCK
        for index in range(keys.num_chunks):
            if store.exists([keys.chunk_key(index).name])[0]:
                blocks.update(hashes[index * per_chunk : (index + 1) * per_chunk])
        for step in keys.checkpoint_steps():
            if store.exists([keys.checkpoint_key(step).name])[0]:
                positions.add(step)
    return blocks, positions


def test_a_publish_is_announced_on_cpu_with_the_devices_hashes(tmp_path):
    engine = _engine(tmp_path, host_objects=1000, disk_objects=1000)
    try:
        prompt = np.random.default_rng(1).integers(1, 200, 41).tolist()
        engine.generate([Request(prompt, max_new_tokens=2)])
        kv, state = _events(engine.events.kv, decode_kv_batch), _events(engine.events.state, decode_state_batch)
    finally:
        engine.close()
    cpu_blocks = [e for e in kv if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu_blocks and all(e.block_size == BLOCK and e.group_idx == 0 for e in cpu_blocks)
    hashes = chain_hashes(prompt, BLOCK)
    assert [h for e in cpu_blocks for h in e.block_hashes] == hashes[: 2 * CHUNK // BLOCK]  # steps 16 and 32
    assert cpu_blocks[0].parent_block_hash is None and cpu_blocks[1].parent_block_hash == hashes[CHUNK // BLOCK - 1]
    cpu_checkpoints = [e for e in state if isinstance(e, CheckpointStored) and e.medium == "CPU"]
    assert sorted(e.position for e in cpu_checkpoints) == [CHUNK, 2 * CHUNK]
    for event in cpu_checkpoints:
        assert event.anchor_block_hash == hashes[event.position // BLOCK - 1] and event.tail_token_ids == []
    assert {e.medium for e in kv} == {"GPU", "CPU"}  # the device announces its own copy as before


def test_evictions_and_demotions_keep_the_announced_media_equal_to_the_tiers(tmp_path):
    engine = _engine(tmp_path, host_objects=5, disk_objects=7)  # both tiers evict
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 200, 50).tolist() for _ in range(5)]
    try:
        for prompt in prompts:
            engine.generate([Request(prompt, max_new_tokens=2)])
            engine.check_invariants()
        engine.events.publish_changes()
        kv, state = _events(engine.events.kv, decode_kv_batch), _events(engine.events.state, decode_state_batch)
        truth = {medium: _truth(engine, prompts, tier) for tier, medium in (("host", "CPU"), ("disk", "DISK"))}
    finally:
        engine.close()
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in kv)  # the host evicted
    assert any(isinstance(e, BlockStored) and e.medium == "DISK" for e in kv)  # and demoted to disk
    assert any(isinstance(e, BlockRemoved) and e.medium == "DISK" for e in kv)  # the disk evicted too
    for medium, held in truth.items():
        assert _held(kv, state, medium) == held


def test_a_chunk_evicted_by_its_own_publish_is_not_announced():
    announcer = TierAnnouncer(BLOCK)
    tokens = list(range(1, 33))
    publish = TierPublish(tokens, None, None, 32, ["c0", "c1"], "k32")
    assert announcer.moved("host", ["c0"], []) == ([], [])  # the tier's puts come before the publish says what they hold
    assert announcer.moved("host", ["c1"], ["c0"]) == ([], [])  # c0 evicted by the put of c1
    assert announcer.moved("host", ["k32"], []) == ([], [])
    kv, state = announcer.published("host", publish)
    assert [e.block_hashes for e in kv] == [chain_hashes(tokens, BLOCK)[2:4]]
    assert [e.position for e in state] == [32]
    announcer.check_invariants()
    assert announcer.published("shared", publish) == ([], [])  # the shared tier is no medium of this replica


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_the_same_checkpoint_on_two_media_has_an_id_per_medium(tier):
    announcer = TierAnnouncer(BLOCK)
    publish = TierPublish(list(range(1, 17)), "adapter-a", "salt", 16, ["c0"], "k16")
    announcer.moved("host", ["c0", "k16"], [])
    _, (on_cpu,) = announcer.published("host", publish)
    _, (on_disk,) = announcer.moved("disk", ["k16", "c0"], [])
    assert on_cpu.checkpoint_id != on_disk.checkpoint_id and (on_cpu.medium, on_disk.medium) == ("CPU", "DISK")
    assert on_cpu.lora_name == "adapter-a" and on_cpu.extra_keys == [("salt", "salt")]
    assert on_cpu.anchor_block_hash == chain_hashes(publish.tokens, BLOCK, "adapter-a", "salt")[1]
    medium, kept = ("CPU", on_disk) if tier == "host" else ("DISK", on_cpu)
    gone = on_cpu if tier == "host" else on_disk
    kv, state = announcer.moved(tier, [], ["c0", "k16"])
    assert [e.medium for e in kv] == [medium] and state[0].checkpoint_ids == [gone.checkpoint_id]
    assert kept.checkpoint_id != gone.checkpoint_id
    assert announcer.moved("disk" if tier == "host" else "host", [], ["c0", "k16"])[1][0].checkpoint_ids == [kept.checkpoint_id]
    announcer.check_invariants()
