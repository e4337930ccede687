"""Multi-replica replay: routing, sharing through a tier (exact), independence without one,
real Redis and Mooncake shared tiers, host and disk tiers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError
from hybridcache.replay import replay, resolve_policy
from hybridcache.replay.shared_tier import only_loopback
from hybridcache.replay.tiering import TierSetup
from hybridcache.sequence import Sequence
from hybridcache.tiers.backends import HostMemoryStore

from ._helpers import PROFILE, budget, config, request, run_fleet

RNG = np.random.default_rng(7)
S, T, X = (RNG.integers(0, 50_000, size=n) for n in (512, 988, 600))
BIG = budget(4096, 64)


def routing_trace():
    """r0 = S+T, r1 = S, r2 = S + T[:480] + X: S's checkpoint exists only once r1 ran, on the
    replica r1 went to; r2 hits only if it follows r1 there."""
    return [request(0, np.concatenate([S, T])), request(1, S), request(2, np.concatenate([S, T[:480], X]))]


@pytest.mark.parametrize(
    "routing, replicas, hits",
    [
        ("round-robin", [0, 1, 0], [0, 0, 0]),  # r2 lands where S has no checkpoint
        ("kv-overlap", [0, 0, 0], [0, 0, 512]),  # S's KV is on replica 0, so everything goes there
        # r1 has no checkpoint anywhere: it goes where its KV is (where its checkpoint will
        # land), so r2 finds S's checkpoint there; depth alone sent r1 round robin to replica 1
        ("restorable", [0, 0, 0], [0, 0, 512]),
    ],
)
def test_routing_choices_on_a_hand_made_trace(routing, replicas, hits):
    record, check = run_fleet(routing_trace(), "reference", BIG, 2, routing)
    assert [replica for replica, _ in check.served] == replicas
    assert [hit for _, hit in check.served] == hits
    assert record.replicas == 2 and record.routing == routing and record.shared_tier == "none"
    assert record.remote_hit_tokens == 0


def test_probing_a_replica_changes_nothing():
    record, _ = run_fleet(routing_trace()[:1], "reference", BIG, 1)
    from hybridcache.replay.adapter import CacheAdapter, PoolGeometry

    adapter = CacheAdapter(PoolGeometry(32, 4096, 64))
    turn = adapter.start_turn(routing_trace()[0].prompt)
    adapter.admit(turn, 10_000)
    adapter.forward(turn, [1500], {1500: "prompt_end"})
    adapter.finish(turn)
    before = adapter.stats()
    scratch = Sequence(routing_trace()[2].prompt)
    assert adapter.cached_prefix(scratch) == (0, 992)
    assert adapter.stats() == before
    adapter.check_invariants()


def sharing_trace():
    prefix = RNG.integers(0, 50_000, size=1000)
    return [
        request(0, prefix),
        request(1, np.concatenate([prefix, RNG.integers(0, 50_000, size=300)])),
        request(2, RNG.integers(0, 50_000, size=700)),
        request(3, np.concatenate([prefix, RNG.integers(0, 50_000, size=500)])),
    ]


def shared_setup(store, name="host"):
    return TierSetup(shared=store, shared_name=name)


def test_sharing_turns_misses_into_exact_remote_hits():
    requests = sharing_trace()
    alone, _ = run_fleet(requests, "reference", BIG, 2)
    record, check = run_fleet(requests, "reference", BIG, 2, tiers=shared_setup(HostMemoryStore(1 << 30)))
    # r1 (replica 1) restores the chunk-aligned 768 tokens r0 (replica 0) published
    assert [replica for replica, _ in check.served] == [0, 1, 0, 1]
    assert check.adopted[1] == 768 and check.served[1][1] == 768
    assert alone.prefill_tokens_saved == 0 < record.prefill_tokens_saved
    assert record.remote_hit_tokens == sum(check.adopted) > 0
    tiers = record.tiers
    assert tiers["restores"] == sum(1 for step in check.adopted if step)
    assert tiers["restores_using"]["shared"] == tiers["restores"]
    assert tiers["bytes_moved_per_hit_nominal"] >= 3 * PROFILE.kv_bytes_per_token * 256 + PROFILE.state_bytes
    assert 0 < tiers["bytes_moved_per_hit_actual"] < 20_000  # stand-in payloads: headers only
    assert 0 < tiers["restore_s"] < tiers["recompute_s"]


def test_without_sharing_replicas_are_independent():
    requests = sharing_trace() + routing_trace()
    requests = [request(i, r.prompt) for i, r in enumerate(requests)]
    record, _ = run_fleet(requests, "reference", BIG, 2)
    for replica in range(2):
        alone = replay(requests[replica::2], config(resolve_policy("reference"), BIG))
        assert record.per_replica[replica].hit_tokens == alone.prefill_tokens_saved
        assert record.per_replica[replica].requests == alone.requests


def test_a_run_removes_its_objects_from_the_shared_store():
    store = HostMemoryStore(1 << 30)
    run_fleet(sharing_trace(), "reference", BIG, 2, tiers=shared_setup(store))
    assert store.used_bytes == 0


def test_host_and_disk_tiers_restore_what_the_device_evicted(tmp_path):
    prefix = RNG.integers(0, 50_000, size=1024)
    requests = [
        request(0, prefix),
        request(1, RNG.integers(0, 50_000, size=1100)),  # evicts the prefix from the small device cache
        request(2, RNG.integers(0, 50_000, size=1100)),
        request(3, np.concatenate([prefix, RNG.integers(0, 50_000, size=100)])),
    ]
    chunk = PROFILE.kv_bytes_per_token * 256
    tiers = TierSetup(host_bytes=6 * chunk + PROFILE.state_bytes, disk_bytes=100 * chunk, disk_root=tmp_path)
    # at 400 TFLOP/s recomputing 1,024 tokens beats reading 94 MB from disk at 2 GB/s: skipped
    record, check = run_fleet(requests, "reference", budget(40, 2), 1, tiers=tiers)
    assert not any(check.adopted) and record.tiers["misses"]["slower_than_recompute"] >= 1
    record, check = run_fleet(requests, "reference", budget(40, 2), 1, tiers=tiers, device_tflops=20)
    assert check.adopted == [0, 0, 0, 1024] and check.served[3][1] == 1024
    assert record.tiers["restores_using"]["disk"] == 1
    assert record.tiers["held_bytes_nominal"]["disk"] > 0


def test_tier_options_are_checked():
    with pytest.raises(InvalidArgumentError, match="host tier above"):
        TierSetup(disk_bytes=10)
    with pytest.raises(InvalidArgumentError, match="name the shared tier"):
        TierSetup(shared=HostMemoryStore(10))
    with pytest.raises(InvalidArgumentError, match="multiple of the block size"):
        config(resolve_policy("reference"), BIG, tiers=TierSetup(chunk_size=100, host_bytes=10**12))
    with pytest.raises(InvalidArgumentError, match="unknown routing"):
        config(resolve_policy("reference"), BIG, routing="random")


@pytest.mark.parametrize("store_fixture, name", [("redis_shared", "redis"), ("mooncake_remote", "mooncake")])
def test_real_shared_tiers_serve_exact_cross_replica_hits(request_fixture_store, store_fixture, name):
    store = request_fixture_store(store_fixture)
    record, check = run_fleet(sharing_trace(), "reference", BIG, 2, tiers=shared_setup(store, name))
    assert check.served[1] == (1, 768) and check.adopted[1] == 768  # r0 on replica 0 produced it
    assert record.shared_tier == name
    assert record.remote_hit_tokens > 0 and any(check.adopted)
    assert store.exists([f"hc1-ck-{'0' * 64}"]) == [False]


@pytest.fixture
def request_fixture_store(request):
    return request.getfixturevalue



def test_loopback_only_is_told_from_the_process_network_namespace():
    probe = "from hybridcache.replay.shared_tier import only_loopback; print(only_loopback())"
    inside = subprocess.run(["unshare", "-n", sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.strip() == "True"
    interfaces = [line.split(":")[0].strip() for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]]
    assert only_loopback() is (interfaces == ["lo"])
