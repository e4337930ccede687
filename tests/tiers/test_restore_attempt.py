"""One lookup's RestoreAttempt and the stateless RestorePath that works on it."""

from __future__ import annotations

import dataclasses
import sys
import threading

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.tiers.backends import DiskStore, HostMemoryStore
from hybridcache.tiers.restore_attempt import RestoreAttempt
from hybridcache.tiers.tiered import TieredStore

from .helpers import CHUNK, chain, kv_arrays, state_arrays


def publish(store: TieredStore, keys, step: int, seed: int = 0):
    return store.store_prefix(keys, step, lambda index: kv_arrays(seed + index), lambda: state_arrays(seed + step))


def test_an_attempt_names_the_steps_beyond_the_local_hit_and_the_chunks_they_may_need():
    keys = chain(tokens=list(range(3 * CHUNK + 5)))
    attempt = RestoreAttempt.beyond(keys, CHUNK, 2 * CHUNK)
    assert attempt.steps == [3 * CHUNK, 2 * CHUNK] and attempt.first_chunk == 2
    assert attempt.names == [keys.checkpoint_key(3 * CHUNK).name, keys.checkpoint_key(2 * CHUNK).name, keys.chunk_key(2).name]
    assert [e.key for e in attempt.needed(2 * CHUNK)] == [keys.checkpoint_key(2 * CHUNK)]  # the device holds its KV
    attempt.check_invariants()
    assert RestoreAttempt.beyond(keys, 3 * CHUNK, 3 * CHUNK).steps == []


def test_an_attempt_refuses_bad_arguments():
    with pytest.raises(InvalidTypeError):
        RestoreAttempt.beyond("tokens", 0, 0)
    with pytest.raises(InvalidArgumentError):
        RestoreAttempt.beyond(chain(), 0, -1)


def test_a_restore_counts_the_bytes_of_its_own_objects_by_the_tier_that_served_them():
    keys = chain(tokens=list(range(2 * CHUNK + 3)))
    attempt = RestoreAttempt.beyond(keys, 0, 0)
    for name, tier, nbytes in [
        (keys.checkpoint_key(2 * CHUNK).name, "shared", 7),
        (keys.chunk_key(0).name, "host", 11),
        (keys.chunk_key(1).name, "shared", 13),
    ]:
        attempt.fetched_object(name, object(), tier, nbytes)
        attempt.check_invariants()
    restore = attempt.restore_at(2 * CHUNK)
    assert restore.bytes_by_tier == {"shared": 20, "host": 11} and restore.checkpoint_tier == "shared"
    assert restore.chunk_tiers == {0: "host", 1: "shared"}


def test_a_restore_path_holds_no_state_of_a_lookup():
    store = TieredStore(shared=HostMemoryStore(1 << 24))
    with pytest.raises(dataclasses.FrozenInstanceError):
        store.reader.promotions = []  # per-lookup state has nowhere to go but the attempt
    assert {f.name for f in dataclasses.fields(store.reader)} == {"calls", "cost", "sizes", "ledger", "deployment_key"}


def test_two_threads_restoring_concurrently_each_get_their_own_prefix(tmp_path, monkeypatch):
    """Each thread restores its own chains from disk through one store (host promotions
    evicting each other): every restore holds exactly the objects of the chain asked for."""
    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)  # restored after the test
    sys.setswitchinterval(1e-6)
    store = TieredStore(host=HostMemoryStore(12_000), disk=DiskStore(tmp_path / "disk", 1 << 24))
    chains = {seed: chain(tokens=[seed] * (2 * CHUNK + 3)) for seed in range(1, 7)}
    for seed, keys in chains.items():
        publish(store, keys, 2 * CHUNK, seed=10 * seed)
    errors: list[BaseException] = []
    restored = [0, 0]
    start = threading.Barrier(2)

    def serve(thread: int) -> None:
        try:
            start.wait()
            for _ in range(25):
                for seed in range(1 + thread, 7, 2):  # thread 0 the odd seeds, thread 1 the even
                    restore = store.fetch_prefix(chains[seed], local_step=0, local_kv_tokens=0)
                    if restore is None:
                        continue
                    restored[thread] += 1
                    assert np.array_equal(restore.checkpoint.header.tokens, chains[seed].tokens[: 2 * CHUNK])
                    for name, array in state_arrays(10 * seed + 2 * CHUNK).items():
                        assert np.array_equal(restore.checkpoint.payload[name], array)
                    for index, obj in restore.chunks.items():
                        assert obj.key == chains[seed].chunk_key(index)
        except BaseException as error:  # noqa: BLE001 -- collected for the assertion below
            errors.append(error)

    threads = [threading.Thread(target=serve, args=(thread,)) for thread in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(0.005)
    assert errors == []
    assert restored[0] > 0 and restored[1] > 0 and store.counters["promoted_to_host"] > 0
    store.check_invariants()
