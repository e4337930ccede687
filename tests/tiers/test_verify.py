"""Verification on fetch: every header field's mismatch is a miss with its own reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridcache import MultimodalSpan
from hybridcache.errors import InvalidTypeError
from hybridcache.tiers import KeyChain, FetchMiss, encode_checkpoint, encode_kv_chunk, verify
from hybridcache.tiers.backends import HostMemoryStore
from hybridcache.tiers.objects import MAGIC

from .faults import Fault, FaultInjectingStore, Operation, fetch_verified
from .helpers import CHUNK, chain, kv_arrays, state_arrays
from .test_keys import FINGERPRINT_CHANGES

SPAN = MultimodalSpan(CHUNK + 2, CHUNK + 9, "image", "sha256:aa")


def test_an_exact_object_verifies():
    keys = chain(multimodal=[SPAN])
    verdict = verify(encode_kv_chunk(keys, 1, kv_arrays()), keys.expect_chunk(1))
    assert verdict.ok and verdict.reason is None
    assert np.array_equal(verdict.obj.payload["k"], kv_arrays()["k"])
    assert verify(encode_checkpoint(keys, 2 * CHUNK, state_arrays()), keys.expect_checkpoint(2 * CHUNK)).ok


def test_missing_is_missing():
    assert verify(None, chain().expect_chunk(0)).reason is FetchMiss.MISSING


@pytest.mark.parametrize("field, value", FINGERPRINT_CHANGES, ids=[f for f, _ in FINGERPRINT_CHANGES])
def test_each_fingerprint_field_is_compared(field, value):
    base = chain()
    changes = {field: value} if field != "block_size" else {field: value, "chunk_size": 64}
    stored = KeyChain(dataclasses.replace(base.fingerprint, **changes), base.tokens)
    index = 0
    verdict = verify(encode_kv_chunk(stored, index, kv_arrays()), base.expect_chunk(index))
    assert verdict.reason is FetchMiss.FINGERPRINT_MISMATCH
    assert field in verdict.detail


def test_another_format_version_on_the_wire_is_a_fingerprint_miss():
    blob = encode_kv_chunk(chain(), 0, kv_arrays())
    forged = MAGIC + (9).to_bytes(2, "little") + blob[6:]
    assert verify(forged, chain().expect_chunk(0)).reason is FetchMiss.FINGERPRINT_MISMATCH


def test_token_mismatch_poison_under_the_requested_key():
    keys, other = chain(), chain([t + 1 for t in range(1, 3 * CHUNK + 5)])
    verdict = verify(encode_kv_chunk(other, 1, kv_arrays()), keys.expect_chunk(1))
    assert verdict.reason is FetchMiss.TOKEN_MISMATCH
    assert str(CHUNK) in verdict.detail


def test_a_checkpoint_compares_its_whole_prefix():
    keys = chain()
    tokens = keys.tokens.copy()
    tokens[3] += 1  # a different first chunk, same last chunk
    verdict = verify(encode_checkpoint(chain(tokens), 2 * CHUNK, state_arrays()), keys.expect_checkpoint(2 * CHUNK))
    assert verdict.reason is FetchMiss.TOKEN_MISMATCH


def test_multimodal_mismatch():
    keys = chain(multimodal=[SPAN])
    other = chain(multimodal=[dataclasses.replace(SPAN, content_id="sha256:bb")])
    assert verify(encode_kv_chunk(other, 1, kv_arrays()), keys.expect_chunk(1)).reason is FetchMiss.MULTIMODAL_MISMATCH
    plain = chain()
    assert verify(encode_kv_chunk(plain, 1, kv_arrays()), keys.expect_chunk(1)).reason is FetchMiss.MULTIMODAL_MISMATCH


def test_range_mismatch_for_another_kind_or_step():
    keys = chain()
    chunk_one = encode_kv_chunk(keys, 1, kv_arrays())
    assert verify(chunk_one, keys.expect_chunk(2)).reason is FetchMiss.RANGE_MISMATCH
    assert verify(chunk_one, keys.expect_checkpoint(2 * CHUNK)).reason is FetchMiss.RANGE_MISMATCH
    checkpoint = encode_checkpoint(keys, CHUNK, state_arrays())
    assert verify(checkpoint, keys.expect_chunk(0)).reason is FetchMiss.RANGE_MISMATCH


def test_key_mismatch_when_only_the_own_key_differs():
    keys = chain()
    expected = keys.expect_chunk(1)
    wrong_key = dataclasses.replace(expected, key=keys.chunk_key(2))
    assert verify(encode_kv_chunk(keys, 1, kv_arrays()), wrong_key).reason is FetchMiss.KEY_MISMATCH


def test_payload_checksum_and_corrupt_header():
    keys = chain()
    blob = bytearray(encode_kv_chunk(keys, 1, kv_arrays()))
    payload_flip = bytearray(blob)
    payload_flip[-3] ^= 0x10
    assert verify(bytes(payload_flip), keys.expect_chunk(1)).reason is FetchMiss.CHECKSUM_MISMATCH
    header_flip = bytearray(blob)
    header_flip[40] ^= 0x10
    assert verify(bytes(header_flip), keys.expect_chunk(1)).reason is FetchMiss.CORRUPT
    assert verify(bytes(blob[:100]), keys.expect_chunk(1)).reason is FetchMiss.CORRUPT


def test_verify_refuses_a_non_expectation():
    with pytest.raises(InvalidTypeError):
        verify(b"", "expected")


def test_fetch_verified_maps_store_failures_to_reasons():
    keys = chain()
    store = FaultInjectingStore(HostMemoryStore(1 << 20))
    store.put_if_absent([(keys.chunk_key(i).name, encode_kv_chunk(keys, i, kv_arrays(i))) for i in range(2)])
    wanted = [keys.expect_chunk(0), keys.expect_chunk(1), keys.expect_chunk(2)]
    assert [v.reason for v in fetch_verified(store, wanted)] == [None, None, FetchMiss.MISSING]
    store.add(Fault.delay(Operation.GET, seconds=60))
    assert {v.reason for v in fetch_verified(store, wanted, timeout=0.01)} == {FetchMiss.TIMEOUT}
    store.add(Fault.fail(Operation.GET))
    assert {v.reason for v in fetch_verified(store, wanted)} == {FetchMiss.UNAVAILABLE}
    store.add(Fault.substitute(keys.chunk_key(0).name, keys.chunk_key(1).name))
    assert fetch_verified(store, wanted[:1])[0].reason is FetchMiss.RANGE_MISMATCH
    with pytest.raises(InvalidTypeError):
        fetch_verified(store, ["not an expectation"])
