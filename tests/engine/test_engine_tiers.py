"""The engine with tiers, in one process: chunk-aligned prefixes are published after their
forward, and a later engine (or the same one after eviction) adopts them exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig
from hybridcache.engine.model_api import ATTENTION, RECURRENT, LayerLayout, ModelLayout, TensorSpec
from hybridcache.engine.paged_storage import PagedStorage
from hybridcache.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError
from hybridcache.tiers.backends import HostMemoryStore
from hybridcache.tiers.tiered import TieredStore
from tests.tiers.faults import Fault, FaultInjectingStore

CHUNK = 32
MODEL = TinyHybridConfig(vocab_size=64, hidden_size=16, attention_head_dim=8, ssm_head_dim=8, expert_hidden_size=16)


def config(**overrides) -> EngineConfig:
    values = dict(block_size=8, num_kv_blocks=96, num_state_slots=10, checkpoint_budget=6, max_batch_tokens=64,
                  prefill_chunk=24, tier_chunk_size=CHUNK, model=MODEL)
    values.update(overrides)
    return EngineConfig(**values)


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 64, length).tolist()


def uncached(requests: list[Request], **overrides) -> list[list[int]]:
    return [r.tokens for r in Engine(config(prefix_caching=False, **overrides)).generate(requests)]


def test_a_second_engine_restores_from_the_shared_tier_exactly():
    shared = HostMemoryStore(1 << 26)
    base = prompt(100, 1)
    first = Engine(config(), tiers=TieredStore(shared=shared))
    first.generate([Request(base, max_new_tokens=3)])
    assert first.stats()["tiers"]["published_steps"] >= 3  # steps 32, 64 and 96
    follow = Request(base + prompt(20, 2), max_new_tokens=5)
    second = Engine(config(), tiers=TieredStore(shared=shared))
    (result,) = second.generate([follow])
    stats = second.stats()["tiers"]
    assert result.tokens == uncached([follow])[0]
    assert stats["remote_hit_tokens"] == 96 and result.cached_tokens == 96
    assert stats["restored_bytes"]["shared"] > 0
    second.check_invariants()


def test_restores_under_pipelining_and_concurrent_requests_stay_exact():
    shared = HostMemoryStore(1 << 26)
    bases = [prompt(70 + 9 * i, 10 + i) for i in range(3)]
    Engine(config(), tiers=TieredStore(shared=shared)).generate([Request(b, max_new_tokens=2) for b in bases])
    engine = Engine(config(async_depth=1), tiers=TieredStore(shared=shared))
    requests = [Request(b + prompt(15, 20 + i), max_new_tokens=4) for i, b in enumerate(bases)]
    ids = [engine.add_request(r) for r in requests]
    done = {}
    for _ in range(500):
        for result in engine.step():
            done[result.request_id] = result.tokens
        engine.check_invariants()
        if len(done) == len(ids):
            break
    assert [done[i] for i in ids] == uncached(requests)
    assert engine.stats()["tiers"]["remote_hit_tokens"] >= 64 * 3


def test_evicted_device_prefixes_come_back_from_the_host_tier():
    engine = Engine(config(num_kv_blocks=40), tiers=TieredStore(host=HostMemoryStore(1 << 26)))
    base = prompt(96, 3)
    engine.generate([Request(base, max_new_tokens=2)])
    engine.clear_cache()
    follow = Request(base + prompt(9, 4), max_new_tokens=3)
    (result,) = engine.generate([follow])
    assert result.tokens == uncached([follow], num_kv_blocks=40)[0]
    assert engine.stats()["tiers"]["remote_hit_tokens"] == 96
    engine.check_invariants()


def test_a_corrupted_object_is_a_miss_and_the_output_is_still_exact():
    inner = HostMemoryStore(1 << 26)
    base = prompt(100, 5)
    Engine(config(), tiers=TieredStore(shared=inner)).generate([Request(base, max_new_tokens=2)])
    shared = FaultInjectingStore(inner)
    shared.add(Fault.corrupt(times=None))  # every object read is damaged
    engine = Engine(config(), tiers=TieredStore(shared=shared))
    follow = Request(base + prompt(5, 6), max_new_tokens=4)
    (result,) = engine.generate([follow])
    stats = engine.stats()["tiers"]
    assert result.tokens == uncached([follow])[0]
    assert stats["remote_hit_tokens"] == 0 and stats["store"]["misses"]["checksum_mismatch"] >= 1


@pytest.mark.parametrize(
    "change",
    [dict(seed=1), dict(tier_chunk_size=16), dict(dtype="float32")],
    ids=["other weights", "other chunk size", "other dtype"],
)
def test_another_model_fingerprint_never_hits(change):
    shared = HostMemoryStore(1 << 26)
    base = prompt(100, 7)
    Engine(config(), tiers=TieredStore(shared=shared)).generate([Request(base, max_new_tokens=2)])
    engine = Engine(config(**change), tiers=TieredStore(shared=shared))
    follow = Request(base + prompt(5, 8), max_new_tokens=3)
    (result,) = engine.generate([follow])
    assert engine.stats()["tiers"]["remote_hit_tokens"] == 0
    assert result.tokens == uncached([follow], **change)[0]


def test_tenants_and_adapters_never_share_tier_objects():
    shared = HostMemoryStore(1 << 26)
    base = prompt(100, 9)
    producer = Engine(config(adapters=("a",)), tiers=TieredStore(shared=shared))
    producer.generate([Request(base, max_new_tokens=2, cache_salt="tenant-1")])
    consumer = Engine(config(adapters=("a",)), tiers=TieredStore(shared=shared))
    others = [Request(base, max_new_tokens=2), Request(base, max_new_tokens=2, adapter="a"),
              Request(base, max_new_tokens=2, cache_salt="tenant-2")]
    consumer.generate(others)
    assert consumer.stats()["tiers"]["remote_hit_tokens"] == 0
    consumer.generate([Request(base, max_new_tokens=2, cache_salt="tenant-1")])
    assert consumer.stats()["tiers"]["remote_hit_tokens"] == 96


def test_bad_tier_arguments_are_refused():
    with pytest.raises(InvalidTypeError):
        Engine(config(), tiers=HostMemoryStore(1024))
    with pytest.raises(InvalidConfigError):
        config(tier_chunk_size=20)  # not a multiple of the block size


def test_storage_blocks_and_slots_round_trip_bit_exactly_and_refuse_misfits():
    engine = Engine(config())
    storage = engine.cache
    storage.kv.normal_()
    blocks = storage.read_blocks([3, 5])
    slot = storage.read_slot(2)
    storage.write_blocks([7, 9], blocks)
    storage.write_slot(4, slot)
    assert torch.equal(storage.kv[:, [7, 9]], storage.kv[:, [3, 5]])
    assert all(np.array_equal(storage.read_slot(4)[name], slot[name]) for name in slot)
    before = storage.kv.clone()
    with pytest.raises(InvalidArgumentError):
        storage.write_blocks([7], blocks)  # two blocks of data for one block
    with pytest.raises(InvalidArgumentError):
        storage.write_slot(4, {"conv": slot["conv"]})
    assert torch.equal(storage.kv, before)


def test_paged_storage_moves_bfloat16_without_rounding():
    layout = ModelLayout(
        (
            LayerLayout(0, ATTENTION, kv=(TensorSpec("k", (2, 4), "bfloat16"), TensorSpec("v", (2, 4), "bfloat16"))),
            LayerLayout(1, RECURRENT, state=(TensorSpec("ssm", (3, 5), "bfloat16"),)),
        ),
        vocab_size=16,
    )
    storage = PagedStorage(layout, num_blocks=6, block_size=4, num_state_slots=3)
    for tensor in (*storage.kv.values(), *storage.states.values()):
        tensor.normal_()
    storage.write_blocks([4, 5], storage.read_blocks([0, 1]))
    storage.write_slot(2, storage.read_slot(1))
    for tensor in storage.kv.values():
        assert torch.equal(tensor[[4, 5]].view(torch.int16), tensor[[0, 1]].view(torch.int16))
    assert torch.equal(storage.states[(1, "ssm")][2], storage.states[(1, "ssm")][1])
    with pytest.raises(InvalidArgumentError):
        storage.write_slot(2, {"1.ssm": np.zeros((3, 5), np.float32)})  # another element type
