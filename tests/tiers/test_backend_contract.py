"""The object-store contract, run against every backend: host RAM, disk, Redis and Mooncake."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidKeyError, InvalidTypeError, StoreTimeoutError
from hybridcache.tiers import encode_checkpoint, encode_kv_chunk
from hybridcache.tiers.backends import PutOutcome

from .faults import Fault, FaultInjectingStore, Operation, fetch_verified
from .helpers import CHUNK, chain, kv_arrays, state_arrays

STORED, PRESENT = PutOutcome.STORED, PutOutcome.PRESENT


def test_put_then_batch_get_and_exists(store, new_key):
    a, b, missing = new_key(), new_key(), new_key()
    assert store.put_if_absent([(a, b"alpha"), (b, bytearray(b"beta"))]) == [STORED, STORED]
    assert store.get([a, missing, b, a]) == [b"alpha", None, b"beta", b"alpha"]
    assert store.exists([missing, a, b]) == [False, True, True]


def test_put_if_absent_never_overwrites(store, new_key):
    key, other = new_key(), new_key()
    assert store.put_if_absent([(key, b"first")]) == [STORED]
    assert store.put_if_absent([(other, b"x"), (key, b"second")]) == [STORED, PRESENT]
    assert store.get([key]) == [b"first"]


def test_the_store_keeps_its_own_copy(store, new_key):
    key = new_key()
    value = bytearray(b"original")
    store.put_if_absent([(key, value)])
    value[:] = b"mutated!"
    assert store.get([key]) == [b"original"]


def test_remove_then_put_again(store, new_key):
    key, missing = new_key(), new_key()
    store.put_if_absent([(key, b"v1")])
    assert store.remove([key, missing]) == [True, False]
    assert store.get([key]) == [None] and store.exists([key]) == [False]
    assert store.remove([key]) == [False]
    assert store.put_if_absent([(key, b"v2")]) == [STORED]
    assert store.get([key]) == [b"v2"]


def test_get_into_fills_buffers(store, new_key):
    key, big, missing = new_key(), new_key(), new_key()
    store.put_if_absent([(key, b"abc"), (big, b"0123456789")])
    fits, small, unused = bytearray(8), np.zeros(4, np.uint8), bytearray(4)
    assert store.get_into([key, big, missing], [fits, small, unused]) == [3, None, None]
    assert bytes(fits[:3]) == b"abc"


def test_large_objects_round_trip_bit_exact(store, new_key):
    key = new_key()
    value = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    assert store.put_if_absent([(key, value)]) == [STORED]
    assert store.get([key]) == [value]


def test_empty_batches(store):
    assert store.exists([]) == [] and store.get([]) == [] and store.put_if_absent([]) == [] and store.remove([]) == []


def test_bad_input_is_refused_with_specific_errors(store, new_key):
    key = new_key()
    for call, error in [
        (lambda: store.get(key), InvalidTypeError),  # a bare str is not a batch
        (lambda: store.get([b"bytes"]), InvalidTypeError),
        (lambda: store.get(["has space"]), InvalidKeyError),
        (lambda: store.get(["x" * 251]), InvalidKeyError),
        (lambda: store.exists([""]), InvalidKeyError),
        (lambda: store.put_if_absent([(key, b"")]), InvalidArgumentError),
        (lambda: store.put_if_absent([(key, "text")]), InvalidTypeError),
        (lambda: store.put_if_absent([(key, b"a"), (key, b"b")]), InvalidArgumentError),
        (lambda: store.put_if_absent([[key, b"a"]]), InvalidTypeError),
        (lambda: store.get([key], timeout=0), InvalidArgumentError),
        (lambda: store.get([key], timeout=float("inf")), InvalidArgumentError),
        (lambda: store.get([key], timeout="1"), InvalidTypeError),
        (lambda: store.get_into([key], []), InvalidArgumentError),
        (lambda: store.get_into([key], [b"readonly"]), InvalidArgumentError),
        (lambda: store.get_into([key], [object()]), InvalidTypeError),
    ]:
        with pytest.raises(error):
            call()
    assert store.exists([key]) == [False]  # nothing was written by a refused call


def test_a_stalled_store_times_out(store, new_key):
    key = new_key()
    store.put_if_absent([(key, b"v")])
    slow = FaultInjectingStore(store)
    slow.add(Fault.delay(Operation.GET, seconds=60))
    with pytest.raises(StoreTimeoutError):
        slow.get([key], timeout=0.02)
    assert slow.get([key], timeout=5) == [b"v"]  # the one-shot stall is over


def test_verified_objects_through_the_store(store, new_key):
    keys = chain()
    items = [(keys.chunk_key(i).name, encode_kv_chunk(keys, i, kv_arrays(i))) for i in range(3)]
    items.append((keys.checkpoint_key(2 * CHUNK).name, encode_checkpoint(keys, 2 * CHUNK, state_arrays())))
    store.put_if_absent(items)
    wanted = [keys.expect_chunk(0), keys.expect_chunk(1), keys.expect_chunk(2), keys.expect_checkpoint(2 * CHUNK)]
    verdicts = fetch_verified(store, wanted)
    assert all(v.ok for v in verdicts)
    assert np.array_equal(verdicts[1].obj.payload["v"], kv_arrays(1)["v"])
    store.remove([name for name, _ in items])
