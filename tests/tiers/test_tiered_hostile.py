"""TieredStore under hostile or careless use (issue 19): a store failure only ever costs a miss
(counted by its real reason) or a failed publish; squatters are removed; a stall does not switch
a tier off for good; forged objects fail without the deployment key; one store serves threads."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig
from hybridcache.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError, StoreClosedError
from hybridcache.tiers import encode_checkpoint
from hybridcache.tiers.backends import DiskStore, HostMemoryStore
from hybridcache.tiers.restore_cost import RestoreCost
from hybridcache.tiers.restore import SLOWER_THAN_RECOMPUTE
from hybridcache.tiers.tier_calls import TierAccess
from hybridcache.tiers.tiered import TieredStore

from .faults import Fault, FaultInjectingStore, Operation
from .helpers import CHUNK, chain, kv_arrays, state_arrays

KEY = b"deployment-key-0123456789abcdef!"


def publish(store: TieredStore, keys, step: int, seed: int = 0):
    return store.store_prefix(keys, step, lambda index: kv_arrays(seed + index), lambda: state_arrays(seed + step))


@pytest.mark.parametrize("bad", [0, -1, "5", float("nan"), float("inf"), True, np.float64("nan"), np.int64(0), None, [1]])
def test_bad_timeouts_are_refused_when_built(bad):
    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        if bad is None:
            HostMemoryStore(1 << 20, default_timeout=bad)
        else:
            TieredStore(shared=HostMemoryStore(1 << 20), access=TierAccess(timeout=bad))


@pytest.mark.parametrize("good", [1, 0.5, np.float32(2.0), np.int64(3)])
def test_numeric_timeouts_of_any_real_type_are_accepted(good):
    assert TieredStore(shared=HostMemoryStore(1 << 20), access=TierAccess(timeout=good)).timeout == float(good)


def test_a_closed_store_costs_misses_and_failed_publishes_never_an_exception(tmp_path):
    keys = chain()
    host, disk, shared = HostMemoryStore(1 << 24), DiskStore(tmp_path / "disk", 1 << 24), HostMemoryStore(1 << 24)
    store = TieredStore(host=host, disk=disk, shared=shared)
    publish(store, keys, 2 * CHUNK)
    for tier in (host, disk, shared):
        tier.close()
    with pytest.raises(StoreClosedError):
        shared.exists(["a"])  # direct callers learn it is closed
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None
    assert publish(store, keys, 3 * CHUNK).checkpoint_stored == {"host": False, "shared": False}
    assert store.misses["unavailable"] == 3 and store.misses["missing"] == 0  # the real reason
    store.check_invariants()


def test_a_closed_shared_store_under_a_running_engine_is_only_misses():
    model = TinyHybridConfig(vocab_size=64, hidden_size=16, attention_head_dim=8, ssm_head_dim=8, expert_hidden_size=16)
    config = EngineConfig(block_size=8, num_kv_blocks=96, num_state_slots=10, checkpoint_budget=6, max_batch_tokens=64,
                          prefill_chunk=24, tier_chunk_size=CHUNK, model=model)
    shared = HostMemoryStore(1 << 26)
    engine = Engine(config, tiers=TieredStore(shared=shared))
    base = np.random.default_rng(1).integers(1, 64, 100).tolist()
    engine.generate([Request(base, max_new_tokens=2)])
    shared.close()
    (result,) = engine.generate([Request(base + [5, 6, 7], max_new_tokens=3)])
    reference = Engine(EngineConfig(**{**config.__dict__, "prefix_caching": False}))
    assert result.error is None and result.tokens == reference.generate([Request(base + [5, 6, 7], max_new_tokens=3)])[0].tokens
    engine.check_invariants()


def test_a_step_no_tier_could_be_asked_about_counts_the_store_failure_not_missing():
    keys = chain()
    shared = FaultInjectingStore(HostMemoryStore(1 << 24))
    store = TieredStore(shared=shared)
    publish(store, keys, 2 * CHUNK)
    shared.add(Fault.fail(Operation.EXISTS))
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None
    assert store.misses == {"unavailable": 3}
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is not None  # one failure is not an outage


@pytest.mark.parametrize("squat", ["corrupt", "foreign", "forged"])
def test_a_squatter_under_a_key_is_removed_so_the_next_publish_replaces_it(squat):
    keys, other = chain(), chain(tokens=[7] * (3 * CHUNK + 5))
    shared = HostMemoryStore(1 << 24)
    store = TieredStore(shared=shared)
    name = keys.checkpoint_key(CHUNK).name
    squatter = {
        "corrupt": b"HCTO" + b"\0" * 60,
        "foreign": encode_checkpoint(other, CHUNK, state_arrays(9)),  # another prefix's object
        "forged": encode_checkpoint(keys, CHUNK, state_arrays(9), auth_key=b"x" * 32),  # another deployment's
    }[squat]
    shared.put_if_absent([(name, squatter)])
    if squat == "forged":
        store = TieredStore(shared=shared, access=TierAccess(deployment_key=KEY))
    assert publish(store, keys, CHUNK).checkpoint_stored == {"shared": True}  # PRESENT: the squatter stays ...
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None  # ... until a reader rejects it
    assert store.counters["shared_rejected_removed"] == 1 and shared.exists([name]) == [False]
    publish(store, keys, CHUNK)
    restore = store.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
    assert restore is not None and restore.step == CHUNK
    assert np.array_equal(restore.checkpoint.payload["state.0"], state_arrays(CHUNK)["state.0"])


def test_one_stalled_read_does_not_switch_a_tier_off_for_good():
    keys = chain()
    cost = RestoreCost(recompute_s_per_token=1e-4)  # 64 tokens: 6.4 ms to recompute
    store = TieredStore(shared=HostMemoryStore(1 << 24), cost=cost)
    publish(store, keys, 2 * CHUNK)
    cost.observe_read("shared", 4096, 1.0)  # one read stalled for a second
    tries = 0
    while store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None:
        tries += 1
        assert tries < 30, "the stall kept the shared tier switched off"
    assert store.misses[SLOWER_THAN_RECOMPUTE] >= 1 and store.counters["restores"] == 1


def test_with_a_deployment_key_a_forged_object_fails_as_a_checksum_mismatch_and_salts_stay_private():
    keys = chain(cache_salt="tenant-secret-salt")
    shared = HostMemoryStore(1 << 24)
    sealed = TieredStore(shared=shared, access=TierAccess(deployment_key=KEY))
    publish(sealed, keys, CHUNK)
    stored = shared.get([keys.checkpoint_key(CHUNK).name])[0]
    assert b"tenant-secret-salt" not in stored  # a keyed digest of the salt, never the salt
    assert sealed.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is not None
    forger = TieredStore(shared=HostMemoryStore(1 << 24))  # can write the store, lacks the key
    publish(forger, keys, CHUNK, seed=5)
    shared.remove([keys.checkpoint_key(CHUNK).name])
    shared.put_if_absent([(keys.checkpoint_key(CHUNK).name, forger.tiers["shared"].get([keys.checkpoint_key(CHUNK).name])[0])])
    reader = TieredStore(shared=shared, access=TierAccess(deployment_key=KEY))
    assert reader.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None
    assert reader.misses["fingerprint_mismatch"] + reader.misses["checksum_mismatch"] == 1
    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        TieredStore(shared=shared, access=TierAccess(deployment_key=b"short"))
    with pytest.raises(InvalidTypeError):
        TieredStore(shared=shared, access=TierAccess(deployment_key="text key of enough length"))


def test_a_forged_object_with_the_right_header_fails_as_a_checksum_mismatch():
    """A writer without the key copies a sealed header (salt digest included) and swaps the
    payload, recomputing every unkeyed checksum: only the keyed MAC can catch it."""
    from hybridcache.tiers import objects, payload

    keys = chain(cache_salt="tenant")
    genuine = encode_checkpoint(keys, CHUNK, state_arrays(0), auth_key=KEY)
    header = objects.decode_header(genuine)
    forged_payload = payload.encode_payload(payload.checked_arrays(state_arrays(7)))
    described = bytearray(genuine[: header.header_length - 48])
    forged = bytes(described) + objects._payload_checksum(described, forged_payload, None)
    forged += objects._header_checksum(forged) + forged_payload
    store = TieredStore(shared=HostMemoryStore(1 << 24), access=TierAccess(deployment_key=KEY))
    store.tiers["shared"].put_if_absent([(keys.checkpoint_key(CHUNK).name, forged)])
    store.tiers["shared"].put_if_absent([(keys.chunk_key(0).name, objects.encode_kv_chunk(keys, 0, kv_arrays(0), auth_key=KEY))])
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None
    assert store.misses["checksum_mismatch"] == 1


def test_one_store_serves_two_threads_at_once(tmp_path, monkeypatch):
    """Two engines' threads restoring the same prefixes from disk through one store: each
    call promotes what it read (one list per call; a shared one named a key twice), and each
    restore holds exactly the objects of the chain it asked for (one attempt per call)."""
    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)  # restored after the test
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    store = TieredStore(host=HostMemoryStore(12_000), disk=DiskStore(tmp_path / "disk", 1 << 24))
    chains = [chain(tokens=[seed] * (3 * CHUNK + 5)) for seed in range(1, 5)]
    for keys in chains:
        publish(store, keys, 3 * CHUNK)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def serve() -> None:
        try:
            start.wait()
            for _ in range(40):
                for keys in chains:
                    restore = store.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
                    assert restore is None or _is_own(restore, keys)
                    publish(store, keys, 2 * CHUNK)
        except BaseException as error:  # noqa: BLE001 -- collected for the assertion below
            errors.append(error)

    threads = [threading.Thread(target=serve) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(0.005)
    assert errors == []
    # Every call counted (counters are locked); an object evicted by one thread while the other
    # judged its prefix may be dropped as dead weight, so not every lookup need restore.
    assert store.counters["restore_lookups"] == 2 * 40 * len(chains)
    assert store.counters["restores"] > 0 and store.counters["promoted_to_host"] > 0
    store.check_invariants()


def _is_own(restore, keys) -> bool:
    checkpoint = restore.checkpoint.header
    return (
        checkpoint.key == keys.checkpoint_key(restore.step)
        and np.array_equal(checkpoint.tokens, keys.tokens[: restore.step])
        and all(chunk.key == keys.chunk_key(index) for index, chunk in restore.chunks.items())
    )


def test_a_read_only_disk_tier_under_a_tiered_store_serves_and_refuses_demotions(tmp_path):
    keys = chain()
    writer = TieredStore(disk=DiskStore(tmp_path / "disk", 1 << 24))
    publish(writer, keys, 2 * CHUNK)
    writer.close()
    reader = TieredStore(host=HostMemoryStore(6000), disk=DiskStore(tmp_path / "disk", 1 << 24, read_only=True))
    restore = reader.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
    assert restore is not None and restore.step == 2 * CHUNK and set(restore.bytes_by_tier) == {"disk"}
    other = chain(tokens=[9] * (3 * CHUNK))
    publish(reader, other, 3 * CHUNK)  # its evicted objects are new to the disk, which cannot take them
    assert reader.counters["disk_demotion_refused"] >= 1 and reader.counters["demoted_to_disk"] == 0
    reader.check_invariants()


@pytest.mark.parametrize("huge", [86_400.5, 1e10, np.float64(1e300), 10**30])
def test_timeouts_over_one_day_are_refused_at_every_boundary(huge, tmp_path):
    """1e10 s used to be accepted, then every Redis call raised OverflowError."""
    with pytest.raises(InvalidArgumentError, match="one day"):
        TieredStore(shared=HostMemoryStore(1 << 20), access=TierAccess(timeout=huge))
    with pytest.raises(InvalidArgumentError, match="one day"):
        HostMemoryStore(1 << 20, default_timeout=huge)
    with pytest.raises(InvalidArgumentError, match="one day"):
        DiskStore(tmp_path / "disk", capacity_bytes=1 << 20, default_timeout=huge)
    store = HostMemoryStore(1 << 20)
    with pytest.raises(InvalidArgumentError, match="one day"):
        store.get(["k"], timeout=huge)
    assert TieredStore(shared=store, access=TierAccess(timeout=86_400)).timeout == 86_400.0


@pytest.mark.parametrize("query", ["socket_timeout=1e10", "socket_connect_timeout=1e10", "socket_timeout=-1"])
def test_a_redis_url_cannot_smuggle_a_bad_timeout(query):
    pytest.importorskip("redis")
    from hybridcache.tiers.backends import RedisStore

    with pytest.raises(InvalidConfigError, match="timeout"):
        RedisStore(f"redis://127.0.0.1:1/0?{query}")


def test_disk_shards_linked_elsewhere_under_a_running_engine_cost_misses_and_write_nothing_there(tmp_path):
    """Another user replaces every shard of a shared disk tier by a link to their folder: a
    second engine's restore is a miss with the uncached tokens, its publishes land nowhere."""
    model = TinyHybridConfig(vocab_size=64, hidden_size=16, attention_head_dim=8, ssm_head_dim=8, expert_hidden_size=16)
    config = EngineConfig(block_size=8, num_kv_blocks=96, num_state_slots=10, checkpoint_budget=6, max_batch_tokens=64,
                          prefill_chunk=24, tier_chunk_size=CHUNK, model=model)
    disk = DiskStore(tmp_path / "disk", 1 << 26)
    tiers = TieredStore(disk=disk)
    base = np.random.default_rng(2).integers(1, 64, 100).tolist()
    Engine(config, tiers=tiers).generate([Request(base, max_new_tokens=2)])
    assert disk.used_bytes > 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for shard in (tmp_path / "disk" / "objects").iterdir():
        for name in os.listdir(shard):
            (elsewhere / name).write_bytes((shard / name).read_bytes())  # forgeries that verify
            (shard / name).unlink()
        shard.rmdir()
        shard.symlink_to(elsewhere)
    planted = sorted(os.listdir(elsewhere))
    engine = Engine(config, tiers=tiers)
    follow = Request(base + [5, 6, 7], max_new_tokens=3)
    (result,) = engine.generate([follow])
    (reference,) = Engine(EngineConfig(**{**config.__dict__, "prefix_caching": False})).generate([follow])
    assert result.error is None and result.tokens == reference.tokens
    assert engine.stats()["tiers"]["remote_hit_tokens"] == 0
    assert sorted(os.listdir(elsewhere)) == planted  # nothing written, nothing removed there
    engine.check_invariants()
    disk.close()
