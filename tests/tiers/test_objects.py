"""Stored objects: bit-exact round trips, canonical bytes, strict decoding of bad bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hybridcache import MultimodalSpan
from hybridcache.errors import (
    CorruptObjectError,
    InvalidArgumentError,
    InvalidStepError,
    InvalidTypeError,
    PayloadChecksumError,
    UnsupportedFormatError,
)
from hybridcache.tiers import ROUTED_EXPERTS, ObjectKind, decode, decode_header, encode_checkpoint, encode_kv_chunk
from hybridcache.tiers.objects import MAGIC

from .helpers import CHUNK, chain, kv_arrays, state_arrays

DTYPES = st.sampled_from(["<f2", "<f4", ">f4", "<f8", "<i1", "<i2", "<u2", "<i4", "<i8", "|u1", "|b1", "<c8"])
ARRAYS = DTYPES.flatmap(lambda dtype: hnp.arrays(np.dtype(dtype), hnp.array_shapes(min_dims=0, max_dims=4, max_side=5)))
NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(NAMES, ARRAYS, min_size=1, max_size=4), st.integers(0, 2))
def test_kv_chunk_round_trip_is_bit_exact_for_any_dtype_and_shape(arrays, index):
    keys = chain()
    obj = decode(encode_kv_chunk(keys, index, arrays))
    assert obj.kind is ObjectKind.KV_CHUNK and obj.key == keys.chunk_key(index)
    assert (obj.header.start, obj.header.step) == (index * CHUNK, (index + 1) * CHUNK)
    assert np.array_equal(obj.header.tokens, keys.tokens[index * CHUNK : (index + 1) * CHUNK])
    assert list(obj.payload) == list(arrays)
    for name, array in arrays.items():
        got = obj.payload[name]
        assert got.dtype == array.dtype and got.shape == array.shape
        assert got.tobytes() == np.ascontiguousarray(array).tobytes()  # bit-exact, NaNs included
        assert not got.flags.writeable


def test_checkpoint_carries_every_state_the_whole_prefix_and_routed_experts():
    keys = chain(multimodal=[MultimodalSpan(3, 9, "image", "sha256:aa")])
    experts = np.arange(2 * CHUNK * 2, dtype=np.int16).reshape(2 * CHUNK, 2)
    obj = decode(encode_checkpoint(keys, 2 * CHUNK, state_arrays(), routed_experts=experts))
    assert obj.kind is ObjectKind.CHECKPOINT and obj.key == keys.checkpoint_key(2 * CHUNK)
    assert (obj.header.start, obj.header.step) == (0, 2 * CHUNK)
    assert np.array_equal(obj.header.tokens, keys.tokens[: 2 * CHUNK])
    assert obj.header.multimodal == (MultimodalSpan(3, 9, "image", "sha256:aa"),)
    assert set(obj.payload) == {"state.0", "state.1", ROUTED_EXPERTS}
    assert np.array_equal(obj.payload[ROUTED_EXPERTS], experts)


def test_non_contiguous_arrays_are_stored_in_c_order():
    array = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    obj = decode(encode_kv_chunk(chain(), 0, {"k": array}))
    assert np.array_equal(obj.payload["k"], array)


def test_encoding_is_canonical():
    keys = chain()
    assert encode_kv_chunk(keys, 1, kv_arrays(3)) == encode_kv_chunk(keys, 1, kv_arrays(3))


def test_decode_accepts_bytearray_and_memoryview():
    data = encode_kv_chunk(chain(), 0, kv_arrays())
    assert decode(bytearray(data)).key == decode(memoryview(data)).key


@pytest.mark.parametrize(
    "arrays, error",
    [
        ({}, InvalidArgumentError),
        ({"k": [1, 2]}, InvalidTypeError),
        ({"k": np.array(["a"])}, InvalidTypeError),
        ({"k": np.zeros(2, dtype=object)}, InvalidTypeError),
        ({"": np.zeros(2)}, InvalidArgumentError),
        ({1: np.zeros(2)}, InvalidTypeError),
        ({"k": np.zeros((1,) * 9)}, InvalidArgumentError),
        ([("k", np.zeros(2))], InvalidTypeError),
    ],
)
def test_bad_payloads_are_refused_before_encoding(arrays, error):
    with pytest.raises(error):
        encode_kv_chunk(chain(), 0, arrays)


def test_bad_chunk_index_and_checkpoint_step_are_refused():
    keys = chain()
    with pytest.raises(InvalidArgumentError):
        encode_kv_chunk(keys, 3, kv_arrays())  # only three complete chunks
    for step in (0, CHUNK + 1, 4 * CHUNK):
        with pytest.raises(InvalidStepError):
            encode_checkpoint(keys, step, state_arrays())
    with pytest.raises(InvalidArgumentError):
        encode_checkpoint(keys, CHUNK, {ROUTED_EXPERTS: np.zeros(2)})
    with pytest.raises(InvalidArgumentError):
        encode_checkpoint(keys, CHUNK, state_arrays(), routed_experts=np.zeros((CHUNK - 1, 2), np.int16))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_truncation_is_a_corrupt_object_error(data):
    blob = encode_checkpoint(chain(), CHUNK, state_arrays())
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CorruptObjectError):
        decode(blob[:cut])


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_any_flipped_byte_is_detected(data):
    blob = bytearray(encode_kv_chunk(chain(), 1, kv_arrays()))
    position = data.draw(st.integers(0, len(blob) - 1))
    blob[position] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptObjectError):  # header garbling or PayloadChecksumError
        decode(bytes(blob))


def test_a_flipped_payload_byte_is_a_payload_checksum_error():
    blob = bytearray(encode_kv_chunk(chain(), 1, kv_arrays()))
    blob[-1] ^= 1
    decode_header(bytes(blob))  # the header is intact
    with pytest.raises(PayloadChecksumError):
        decode(bytes(blob))


def test_trailing_bytes_wrong_magic_and_other_versions_are_refused():
    blob = encode_kv_chunk(chain(), 0, kv_arrays())
    with pytest.raises(CorruptObjectError):
        decode(blob + b"\0")
    with pytest.raises(CorruptObjectError):
        decode(b"XXXX" + blob[4:])
    with pytest.raises(UnsupportedFormatError):
        decode(MAGIC + (2).to_bytes(2, "little") + blob[6:])
    with pytest.raises(CorruptObjectError):
        decode(b"")
    with pytest.raises(InvalidTypeError):
        decode("not bytes")


@pytest.mark.parametrize("dtype_text", ["<f3", "<b1", "|i4"])
def test_a_well_hashed_object_with_an_impossible_dtype_is_corrupt(dtype_text):
    blob = encode_kv_chunk(chain(), 0, {"k": np.zeros(3, dtype="<f4")})
    forged_payload = blob[decode_header(blob).header_length :].replace(b"<f4", dtype_text.encode())
    header = decode_header(blob)
    rebuilt = _with_payload(blob[: header.header_length], forged_payload)
    with pytest.raises(CorruptObjectError):
        decode(rebuilt)


def _with_payload(header: bytes, payload: bytes) -> bytes:
    """Re-sign a header for a forged payload: what a buggy writer could produce."""
    import hashlib

    checksum = hashlib.blake2b(payload, digest_size=32, person=b"hc-payload").digest()
    unsigned = header[: len(header) - 16 - 32] + checksum
    return unsigned + hashlib.blake2b(unsigned, digest_size=16, person=b"hc-header").digest() + payload
