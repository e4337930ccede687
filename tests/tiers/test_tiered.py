"""TieredStore: publish last, restore the deepest verified step from any mix of tiers, fail closed."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidStepError, InvalidTypeError, LifecycleError
from hybridcache.tiers.backends import DiskStore, HostMemoryStore, PutOutcome
from hybridcache.tiers.publish import NODE_BYTES, PublishIndex
from hybridcache.tiers.restore_cost import RestoreCost, StandInSizes
from hybridcache.tiers.restore import SLOWER_THAN_RECOMPUTE
from hybridcache.tiers.tier_calls import TierAccess
from hybridcache.tiers.tiered import TieredStore

from .faults import Fault, FaultInjectingStore, Operation
from .helpers import CHUNK, chain, kv_arrays, state_arrays

STEPS = (CHUNK, 2 * CHUNK, 3 * CHUNK)


class RecordingStore(HostMemoryStore):
    """A host-memory store that remembers the order of the keys put into it."""

    def __init__(self, capacity: int = 1 << 24) -> None:
        super().__init__(capacity)
        self.put_order: list[str] = []

    def _put_if_absent(self, items, timeout):
        self.put_order.extend(key for key, _ in items)
        return super()._put_if_absent(items, timeout)


def publish(store: TieredStore, keys, step: int, seed: int = 0):
    return store.store_prefix(keys, step, lambda index: kv_arrays(seed + index), lambda: state_arrays(seed + step))


def assert_restores(restore, keys, step: int, first_chunk: int = 0, seed: int = 0) -> None:
    assert restore is not None and restore.step == step and restore.first_chunk == first_chunk
    for name, array in state_arrays(seed + step).items():
        assert np.array_equal(restore.checkpoint.payload[name], array)
    assert sorted(restore.chunks) == list(range(first_chunk, step // CHUNK))
    for index, obj in restore.chunks.items():
        assert np.array_equal(obj.payload["k"], kv_arrays(seed + index)["k"])
        assert obj.header.tokens.tolist() == keys.tokens[index * CHUNK : (index + 1) * CHUNK].tolist()


def test_round_trip_through_each_tier_kind(tmp_path):
    keys = chain()
    for tiers in ({"host": HostMemoryStore(1 << 24)}, {"shared": HostMemoryStore(1 << 24)}):
        store = TieredStore(**tiers)
        report = publish(store, keys, 2 * CHUNK)
        assert all(report.checkpoint_stored.values()) and list(report.chunks_stored.values()) == [2]
        assert_restores(store.fetch_prefix(keys, local_step=0, local_kv_tokens=0), keys, 2 * CHUNK)
        store.check_invariants()


def test_chunks_are_put_before_the_checkpoint_and_only_once():
    shared = RecordingStore()
    store = TieredStore(shared=shared)
    keys = chain()
    publish(store, keys, 2 * CHUNK)
    publish(store, keys, 3 * CHUNK)
    kinds = [name.split("-")[1] for name in shared.put_order]
    assert kinds == ["kv", "kv", "ck", "kv", "ck"]  # the second publish adds only the third chunk


def test_a_refused_chunk_means_no_checkpoint_is_ever_put():
    shared = FaultInjectingStore(RecordingStore())
    shared.add(Fault.fail(Operation.PUT, keys=[chain().chunk_key(1).name]))
    store = TieredStore(shared=shared)
    keys = chain()
    report = publish(store, keys, 2 * CHUNK)
    assert report.checkpoint_stored == {"shared": False}
    assert not shared.exists([keys.checkpoint_key(2 * CHUNK).name])[0]
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None


def test_a_store_too_small_for_a_chunk_never_gets_the_checkpoint():
    keys = chain()
    store = TieredStore(shared=HostMemoryStore(64))  # smaller than any object
    assert publish(store, keys, CHUNK).checkpoint_stored == {"shared": False}
    assert store.counters["shared_publish_refused"] == 1


def test_restore_is_the_deepest_step_beyond_the_local_hit():
    keys = chain()
    store = TieredStore(shared=HostMemoryStore(1 << 24))
    for step in STEPS:
        publish(store, keys, step)
    assert_restores(store.fetch_prefix(keys, local_step=0, local_kv_tokens=0), keys, 3 * CHUNK)
    assert store.fetch_prefix(keys, local_step=3 * CHUNK, local_kv_tokens=3 * CHUNK) is None


def test_chunks_the_device_holds_are_not_fetched():
    keys = chain()
    shared = HostMemoryStore(1 << 24)
    store = TieredStore(shared=shared)
    publish(store, keys, 3 * CHUNK)
    shared.remove([keys.chunk_key(0).name])
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None  # chunk 0 is gone
    assert_restores(store.fetch_prefix(keys, local_step=0, local_kv_tokens=CHUNK), keys, 3 * CHUNK, first_chunk=1)


def test_a_missing_chunk_falls_back_to_a_shallower_step():
    keys = chain()
    shared = HostMemoryStore(1 << 24)
    store = TieredStore(shared=shared)
    for step in STEPS:
        publish(store, keys, step)
    shared.remove([keys.chunk_key(2).name])
    assert_restores(store.fetch_prefix(keys, local_step=0, local_kv_tokens=0), keys, 2 * CHUNK)
    assert store.misses["missing"] == 1


@pytest.mark.parametrize(
    "fault, reason",
    [
        (lambda keys: Fault.corrupt(keys=[keys.checkpoint_key(3 * CHUNK).name]), "checksum_mismatch"),
        (lambda keys: Fault.corrupt(keys=[keys.checkpoint_key(3 * CHUNK).name], offset=70), "corrupt"),
        (lambda keys: Fault.drop(Operation.GET, keys=[keys.checkpoint_key(3 * CHUNK).name]), "missing"),
        (lambda keys: Fault.fail(Operation.GET, keys=[keys.checkpoint_key(3 * CHUNK).name]), "unavailable"),
    ],
    ids=["payload byte", "header byte", "vanished", "store failure"],
)
def test_every_doubt_about_the_deepest_step_falls_back_and_is_counted(fault, reason):
    keys = chain()
    shared = FaultInjectingStore(HostMemoryStore(1 << 24))
    store = TieredStore(shared=shared)
    for step in STEPS:
        publish(store, keys, step)
    shared.add(fault(keys))
    assert_restores(store.fetch_prefix(keys, local_step=0, local_kv_tokens=0), keys, 2 * CHUNK)
    assert store.misses[reason] == 1


def test_another_prefix_under_the_requested_key_is_a_token_mismatch():
    keys = chain()
    other = chain(tokens=[7] * (3 * CHUNK + 5))
    shared = FaultInjectingStore(HostMemoryStore(1 << 24))
    store = TieredStore(shared=shared)
    publish(store, keys, CHUNK)
    publish(store, other, CHUNK)
    shared.add(Fault.substitute(keys.checkpoint_key(CHUNK).name, other.checkpoint_key(CHUNK).name))
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None
    assert store.misses["token_mismatch"] == 1


def test_another_namespace_never_hits():
    keys, salted = chain(), chain(cache_salt="tenant-b")
    store = TieredStore(shared=HostMemoryStore(1 << 24))
    publish(store, keys, 2 * CHUNK)
    assert store.fetch_prefix(salted, local_step=0, local_kv_tokens=0) is None


def test_a_slow_tier_is_skipped_when_recompute_is_faster():
    keys = chain()
    cost = RestoreCost(recompute_s_per_token=1e-15)
    store = TieredStore(shared=HostMemoryStore(1 << 24), cost=cost)
    publish(store, keys, 2 * CHUNK)
    assert store.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None
    assert store.misses[SLOWER_THAN_RECOMPUTE] == 1  # step 2C; 3C and C were never published
    assert store.misses["missing"] == 2


def test_stand_in_sizes_feed_the_cost_model():
    keys = chain()
    # 64 tokens: 64 ms to recompute; gigabytes per object: seconds
    cost = RestoreCost(recompute_s_per_token=1e-3, stand_in=StandInSizes(10**9, 10**9, CHUNK))
    huge = TieredStore(shared=HostMemoryStore(1 << 24), cost=cost)
    publish(huge, keys, 2 * CHUNK)
    assert huge.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is None
    small = TieredStore(shared=HostMemoryStore(1 << 24), cost=RestoreCost(1e-3, stand_in=StandInSizes(1, 1, CHUNK)))
    publish(small, keys, 2 * CHUNK)
    assert small.fetch_prefix(keys, local_step=0, local_kv_tokens=0) is not None


def test_a_measured_cost_model_learns_from_reads():
    cost = RestoreCost()
    before = cost.s_per_byte["shared"]
    cost.observe_read("shared", 10**6, 1.0)
    assert cost.s_per_byte["shared"] > before
    cost.observe_recompute(100, 0.5)
    assert cost.recompute_s_per_token == pytest.approx(0.005)


def test_objects_from_below_are_promoted_into_host_under_their_key(tmp_path):
    keys = chain()
    host, shared = HostMemoryStore(1 << 24), HostMemoryStore(1 << 24)
    TieredStore(shared=shared).store_prefix(keys, 2 * CHUNK, kv_arrays, lambda: state_arrays(2 * CHUNK))
    reader = TieredStore(host=host, shared=shared)
    restore = reader.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
    assert restore.bytes_by_tier.keys() == {"shared"}
    names = [keys.checkpoint_key(2 * CHUNK).name, keys.chunk_key(0).name, keys.chunk_key(1).name]
    assert host.exists(names) == [True, True, True]
    again = reader.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
    assert again.bytes_by_tier.keys() == {"host"}


def test_mixed_tiers_serve_one_restore():
    keys = chain()
    host, shared = HostMemoryStore(1 << 24), HostMemoryStore(1 << 24)
    writer = TieredStore(host=host, shared=shared)
    publish(writer, keys, 2 * CHUNK)
    host.remove([keys.chunk_key(1).name])
    shared.remove([keys.chunk_key(0).name, keys.checkpoint_key(2 * CHUNK).name])
    restore = writer.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
    assert_restores(restore, keys, 2 * CHUNK)
    assert set(restore.bytes_by_tier) == {"host", "shared"}


def test_host_evictions_are_demoted_to_disk_unless_dead_weight(tmp_path):
    keys = chain()
    one_chunk = 6000  # a chunk is ~4.6 kB, a checkpoint ~0.7 kB: chunk 1 evicts chunk 0
    host, disk = HostMemoryStore(one_chunk), DiskStore(tmp_path / "disk", 1 << 24)
    store = TieredStore(host=host, disk=disk)
    publish(store, keys, 2 * CHUNK)  # chunk 0 goes while its checkpoint is still being published
    assert store.counters["demoted_to_disk"] == 1 and disk.exists([keys.chunk_key(0).name]) == [True]
    restore = store.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
    assert_restores(restore, keys, 2 * CHUNK)
    assert set(restore.bytes_by_tier) == {"host", "disk"}
    store.check_invariants()


def test_a_chunk_no_checkpoint_needs_is_dropped_not_demoted(tmp_path):
    keys = chain()
    host, disk = HostMemoryStore(1 << 24), DiskStore(tmp_path / "disk", 1 << 24)
    store = TieredStore(host=host, disk=disk)
    publish(store, keys, CHUNK)
    host.remove([keys.checkpoint_key(CHUNK).name])  # its only user is gone from every tier
    store.ledger.demote(keys.chunk_key(0).name, b"unused")
    assert store.counters["host_dropped_dead_weight"] == 1
    assert not disk.exists([keys.chunk_key(0).name])[0]


def test_a_checkpoint_whose_chunks_are_gone_is_dropped_not_demoted(tmp_path):
    keys = chain()
    host, disk = HostMemoryStore(1 << 24), DiskStore(tmp_path / "disk", 1 << 24)
    store = TieredStore(host=host, disk=disk)
    publish(store, keys, 2 * CHUNK)
    host.remove([keys.chunk_key(1).name])
    store.ledger.demote(keys.checkpoint_key(2 * CHUNK).name, b"unused")
    assert store.counters["host_dropped_dead_weight"] == 1
    store.check_invariants()


def test_the_dead_weight_index_is_bounded_in_bytes():
    store = TieredStore(shared=HostMemoryStore(1 << 20))
    store.ledger.index = PublishIndex(budget_bytes=100 * NODE_BYTES)
    for number in range(300):  # 300 one-chunk requests: the oldest are forgotten
        store.ledger.index.begin(chain([number] * CHUNK), CHUNK)
        store.ledger.index.end(chain([number] * CHUNK).chunk_key(0).digest)
    assert store.ledger.index.nbytes <= 100 * NODE_BYTES
    assert store.ledger.index.chunks_needed(chain([299] * CHUNK).chunk_key(0).digest) is not None
    assert store.ledger.index.chunks_needed(chain([0] * CHUNK).chunk_key(0).digest) is None  # forgotten, not judged
    store.check_invariants()


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgumentError):
        TieredStore()
    with pytest.raises(InvalidTypeError):
        TieredStore(shared=object())
    with pytest.raises(InvalidTypeError):
        TieredStore(host=DiskStore.__new__(DiskStore))
    store = TieredStore(shared=HostMemoryStore(1 << 20))
    with pytest.raises(InvalidTypeError):
        store.fetch_prefix("tokens", local_step=0, local_kv_tokens=0)
    with pytest.raises(InvalidStepError):
        publish(store, chain(), CHUNK + 1)
    with pytest.raises(InvalidArgumentError):
        store.fetch_prefix(chain(), local_step=-1, local_kv_tokens=0)
    host = HostMemoryStore(1 << 20)
    TieredStore(host=host)
    with pytest.raises(LifecycleError):
        TieredStore(host=host)  # one host store serves one TieredStore


def test_put_outcomes_are_reported_per_tier():
    keys = chain()
    store = TieredStore(host=HostMemoryStore(1 << 24), shared=HostMemoryStore(1 << 24))
    first = publish(store, keys, CHUNK)
    again = publish(store, keys, CHUNK)
    assert first.chunks_stored == {"host": 1, "shared": 1} and again.chunks_stored == {"host": 0, "shared": 0}
    assert again.checkpoint_stored == {"host": True, "shared": True} and again.bytes_written == {"host": 0, "shared": 0}
    assert PutOutcome.STORED  # the outcome enum the reports summarize


def test_a_republish_restores_a_chunk_the_store_evicted_on_its_own():
    keys = chain()
    shared = HostMemoryStore(1 << 24)
    store = TieredStore(shared=shared)
    publish(store, keys, 2 * CHUNK)
    shared.remove([keys.chunk_key(1).name])  # one key of the logical entry, evicted alone
    assert store.fetch_prefix(keys, local_step=CHUNK, local_kv_tokens=CHUNK) is None
    report = publish(store, keys, 2 * CHUNK)
    assert report.chunks_stored == {"shared": 1} and report.checkpoint_stored == {"shared": True}
    assert_restores(store.fetch_prefix(keys, local_step=CHUNK, local_kv_tokens=CHUNK), keys, 2 * CHUNK, first_chunk=1)


def test_a_disk_only_store_is_written_through(tmp_path):
    keys = chain()
    store = TieredStore(disk=DiskStore(tmp_path / "disk", 1 << 24))
    assert publish(store, keys, CHUNK).checkpoint_stored == {"disk": True}
    assert_restores(store.fetch_prefix(keys, local_step=0, local_kv_tokens=0), keys, CHUNK)


@pytest.mark.parametrize("corrupted_chunk", [0, 1, 2])
def test_a_chunk_failing_verification_falls_back_below_it(corrupted_chunk):
    keys = chain()
    shared = FaultInjectingStore(HostMemoryStore(1 << 24))
    store = TieredStore(shared=shared, cost=RestoreCost(stand_in=StandInSizes(1, 1, CHUNK)))
    for step in STEPS:
        publish(store, keys, step)
    shared.add(Fault.corrupt(keys=[keys.chunk_key(corrupted_chunk).name]))
    restore = store.fetch_prefix(keys, local_step=0, local_kv_tokens=0)
    if corrupted_chunk == 0:
        assert restore is None
    else:
        assert_restores(restore, keys, corrupted_chunk * CHUNK)
    assert store.misses["checksum_mismatch"] == 1
    store.check_invariants()


def test_reachable_step_is_existence_only_and_can_take_a_shared_lookup():
    keys = chain()
    host, shared = HostMemoryStore(1 << 24), HostMemoryStore(1 << 24)
    writer = TieredStore(shared=shared)
    for step in STEPS:
        publish(writer, keys, step)
    shared.remove([keys.chunk_key(2).name])
    reader = TieredStore(host=host, shared=shared)
    assert reader.reachable_step(keys, local_step=0, local_kv_tokens=0) == 2 * CHUNK
    assert reader.reachable_step(keys, local_step=2 * CHUNK, local_kv_tokens=2 * CHUNK) == 2 * CHUNK  # none deeper
    assert host.used_bytes == 0 and not reader.misses  # nothing read, promoted or counted as a miss
    names = [keys.checkpoint_key(step).name for step in STEPS] + [keys.chunk_key(i).name for i in range(3)]
    located = writer.locate(names, ["shared"])
    assert reader.reachable_step(keys, local_step=0, local_kv_tokens=0, shared_located=located) == 2 * CHUNK
    assert reader.reachable_step(keys, local_step=0, local_kv_tokens=0, shared_located={}) == 0


def test_the_access_and_the_cost_model_are_checked_when_given():


    with pytest.raises(InvalidTypeError, match="TierAccess"):
        TieredStore(shared=HostMemoryStore(1 << 20), access={"timeout": 1.0})
    with pytest.raises(InvalidTypeError, match="stand_in"):
        RestoreCost(stand_in=lambda kind, tokens: 1)
    with pytest.raises(InvalidArgumentError):
        StandInSizes(1, 1, 0)
    with pytest.raises(InvalidTypeError, match="breaker"):
        TierAccess(breaker=60)
