"""The fault-injecting wrapper, over every backend: each fault does what it says, then stops."""

from __future__ import annotations

import pytest

from hybridcache.errors import InvalidArgumentError, InvalidKeyError, InvalidTypeError, StoreTimeoutError, StoreUnavailableError
from hybridcache.tiers import FetchMiss, encode_kv_chunk
from hybridcache.tiers.backends import HostMemoryStore, PutOutcome

from .faults import Fault, FaultInjectingStore, FaultKind, Operation, fetch_verified
from .helpers import chain, kv_arrays


@pytest.fixture
def faulty(store):
    wrapper = FaultInjectingStore(store, seed=3)
    yield wrapper
    wrapper.close()


def test_a_dropped_put_is_acknowledged_but_never_visible(faulty, new_key):
    lost, kept = new_key(), new_key()
    faulty.add(Fault.drop(Operation.PUT, keys=[lost]))
    assert faulty.put_if_absent([(lost, b"x"), (kept, b"y")]) == [PutOutcome.STORED, PutOutcome.STORED]
    assert faulty.exists([lost, kept]) == [False, True]
    assert faulty.log[0].kind is FaultKind.DROP and faulty.log[0].key == lost


def test_dropped_reads_report_missing_once(faulty, new_key):
    key = new_key()
    faulty.put_if_absent([(key, b"x")])
    faulty.add(Fault.drop(Operation.GET, keys=key))
    faulty.add(Fault.drop(Operation.EXISTS, keys=key))
    assert faulty.get([key]) == [None] and faulty.exists([key]) == [False]
    assert faulty.get([key]) == [b"x"] and faulty.exists([key]) == [True]


def test_corruption_is_a_checksum_miss(faulty, new_key):
    keys = chain()
    name = keys.chunk_key(0).name
    faulty.inner.put_if_absent([(name, encode_kv_chunk(keys, 0, kv_arrays()))])
    faulty.add(Fault.corrupt(keys=name, offset=-5))
    assert fetch_verified(faulty, [keys.expect_chunk(0)])[0].reason is FetchMiss.CHECKSUM_MISMATCH
    assert fetch_verified(faulty, [keys.expect_chunk(0)])[0].ok


def test_evicting_one_part_of_an_entry(faulty, new_key):
    first, second = new_key(), new_key()
    faulty.put_if_absent([(first, b"a"), (second, b"b")])
    faulty.add(Fault.evict([second]))
    assert faulty.get([first, second]) == [b"a", None]
    assert faulty.inner.exists([first, second]) == [True, False]


def test_another_keys_object_is_a_token_mismatch(faulty):
    asked, poison = chain(), chain([t + 7 for t in range(1, 200)])
    faulty.put_if_absent([
        (asked.chunk_key(1).name, encode_kv_chunk(asked, 1, kv_arrays())),
        (poison.chunk_key(1).name, encode_kv_chunk(poison, 1, kv_arrays())),
    ])
    faulty.add(Fault.substitute(asked.chunk_key(1).name, poison.chunk_key(1).name))
    assert fetch_verified(faulty, [asked.expect_chunk(1)])[0].reason is FetchMiss.TOKEN_MISMATCH


def test_failures_and_stalls(faulty, new_key):
    key = new_key()
    faulty.add(Fault.fail(Operation.PUT))
    with pytest.raises(StoreUnavailableError):
        faulty.put_if_absent([(key, b"x")])
    assert faulty.put_if_absent([(key, b"x")]) == [PutOutcome.STORED]
    faulty.add(Fault.delay(Operation.EXISTS, seconds=0.001))  # shorter than the timeout: just slow
    assert faulty.exists([key]) == [True]
    faulty.add(Fault.delay(Operation.REMOVE, seconds=30, times=None))
    for _ in range(2):
        with pytest.raises(StoreTimeoutError):
            faulty.remove([key], timeout=0.01)
    faulty.clear()
    assert faulty.remove([key]) == [True]


def test_probabilistic_faults_are_reproducible_with_a_seed():
    def run(seed):
        store = FaultInjectingStore(HostMemoryStore(1 << 20), seed=seed)
        store.put_if_absent([(f"k{i}", b"v") for i in range(50)])
        store.add(Fault(FaultKind.DROP, Operation.GET, times=None, probability=0.3))
        return store.get([f"k{i}" for i in range(50)])

    assert run(1) == run(1)
    assert 0 < sum(data is None for data in run(1)) < 50


@pytest.mark.parametrize(
    "build, error",
    [
        (lambda: Fault.corrupt(keys=["bad key"]), InvalidKeyError),
        (lambda: Fault(FaultKind.CORRUPT, Operation.PUT), InvalidArgumentError),
        (lambda: Fault.drop(Operation.REMOVE), InvalidArgumentError),
        (lambda: Fault.delay(Operation.GET, seconds=-1), InvalidArgumentError),
        (lambda: Fault.drop(times=0), InvalidArgumentError),
        (lambda: Fault(FaultKind.DROP, Operation.GET, probability=0), InvalidArgumentError),
        (lambda: Fault("drop", Operation.GET), InvalidTypeError),
        (lambda: FaultInjectingStore("store"), InvalidTypeError),
        (lambda: FaultInjectingStore(HostMemoryStore(10)).add("fault"), InvalidTypeError),
    ],
)
def test_bad_fault_rules(build, error):
    with pytest.raises(error):
        build()
