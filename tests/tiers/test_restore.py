"""The read phase: one lookup's RestoreAttempt and the stateless RestorePath that works on it."""

from __future__ import annotations

import dataclasses

import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.tiers.backends import HostMemoryStore
from hybridcache.tiers.restore import RestoreAttempt
from hybridcache.tiers.tiered import TieredStore

from .helpers import CHUNK, chain


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
