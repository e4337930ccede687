"""Immutable stored objects (KV chunks and checkpoints) and their binary encoding.

Owns no shared state: an :class:`ObjectHeader` and a :class:`StoredObject` are frozen values
whose arrays are read-only. The byte layout is documented in ``docs/tiers.md``; in short::

    header  magic "HCTO" | version u16 | kind u8 | flags u8 | header length u32
            | start u64 | step u64 | own digest 32 B | fingerprint (u16 length + bytes)
            | tokens (u32 count + int32 each) | multimodal spans (u32 count + spans)
            | payload length u64 | payload BLAKE2b-256 | header BLAKE2b-128
    payload array count u32 | per array: name, dtype, ndim u8, shape u64 each, offset u64,
            length u64 | array bytes, each starting at a multiple of 64 from the payload start
            (the payload's layout and checks are in :mod:`~hybridcache.tiers.payload`)

Encoding is canonical (one object, one byte string), so equal objects have equal bytes.

A header never carries a tenant's cache salt, only its digest (:func:`sealed_fingerprint`). With
a deployment key (``auth_key``, 16 to 64 bytes) the salt's digest is keyed, and the payload
checksum becomes a keyed BLAKE2b (a MAC) over the header fields before it and the payload, so
whoever can write the store but lacks the key cannot plant an object that verifies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from hybridcache.errors import (
    CorruptObjectError,
    InvalidArgumentError,
    InvalidTypeError,
    PayloadChecksumError,
    UnsupportedFormatError,
)
from hybridcache.sequence import MultimodalSpan
from hybridcache.tiers import wire
from hybridcache.tiers.payload import checked_array, checked_arrays, decode_arrays, encode_payload
from hybridcache.tiers.fingerprint import DIGEST_BYTES, FORMAT_VERSION, NamespaceFingerprint
from hybridcache.tiers.keys import Expectation, KeyChain, ObjectKey, ObjectKind

MAGIC = b"HCTO"
ROUTED_EXPERTS = "routed_experts"  # the payload name of a checkpoint's routed-expert rows
_HEADER_CHECKSUM_BYTES = 16
MIN_AUTH_KEY_BYTES = 16
MAX_AUTH_KEY_BYTES = 64  # BLAKE2b's key limit
_FIXED_PREFIX = 4 + 2 + 1 + 1 + 4  # magic, version, kind, flags, header length


@dataclass(frozen=True)
class ObjectHeader:
    """Everything an object says about itself; the payload is described, not held."""

    key: ObjectKey
    fingerprint: NamespaceFingerprint
    start: int
    step: int
    tokens: np.ndarray
    multimodal: tuple[MultimodalSpan, ...]
    payload_length: int
    payload_checksum: bytes
    header_length: int

    @property
    def kind(self) -> ObjectKind:
        return self.key.kind


@dataclass(frozen=True)
class StoredObject:
    """A decoded object: its header and its named read-only arrays."""

    header: ObjectHeader
    payload: Mapping[str, np.ndarray]

    @property
    def key(self) -> ObjectKey:
        return self.header.key

    @property
    def kind(self) -> ObjectKind:
        return self.header.key.kind


# --- building ----------------------------------------------------------------------------------


def encode_kv_chunk(
    chain: KeyChain, index: int, arrays: Mapping[str, np.ndarray], *, auth_key: bytes | None = None
) -> bytes:
    """The bytes of chunk ``index`` of ``chain`` holding its KV ``arrays`` (any layout)."""
    if not isinstance(chain, KeyChain):
        raise InvalidTypeError("chain must be a KeyChain")
    return _encode(chain.expect_chunk(index), checked_arrays(arrays), check_auth_key(auth_key))


def encode_checkpoint(
    chain: KeyChain,
    step: int,
    states: Mapping[str, np.ndarray],
    routed_experts: np.ndarray | None = None,
    *,
    auth_key: bytes | None = None,
) -> bytes:
    """The bytes of the checkpoint at ``step``: every recurrent layer's state, optionally the
    routed-expert rows of the whole prefix (one row per token, stored as ``routed_experts``)."""
    if not isinstance(chain, KeyChain):
        raise InvalidTypeError("chain must be a KeyChain")
    expected = chain.expect_checkpoint(step)
    auth_key = check_auth_key(auth_key)
    arrays = checked_arrays(states)
    if ROUTED_EXPERTS in arrays:
        raise InvalidArgumentError(f"state name {ROUTED_EXPERTS!r} is reserved for routed-expert rows")
    if routed_experts is not None:
        rows = checked_array(ROUTED_EXPERTS, routed_experts)
        if rows.ndim < 1 or rows.shape[0] != step:
            raise InvalidArgumentError(f"routed_experts needs {step} rows, got shape {rows.shape}")
        arrays[ROUTED_EXPERTS] = rows
    return _encode(expected, arrays, auth_key)


def check_auth_key(auth_key: object) -> bytes | None:
    """A deployment key: None, or 16 to 64 bytes."""
    if auth_key is None:
        return None
    if not isinstance(auth_key, bytes):
        raise InvalidTypeError(f"auth_key must be bytes or None, got {type(auth_key).__name__}")
    if not MIN_AUTH_KEY_BYTES <= len(auth_key) <= MAX_AUTH_KEY_BYTES:
        raise InvalidArgumentError(f"auth_key must hold {MIN_AUTH_KEY_BYTES} to {MAX_AUTH_KEY_BYTES} bytes, got {len(auth_key)}")
    return auth_key


def sealed_fingerprint(fingerprint: NamespaceFingerprint, auth_key: bytes | None = None) -> NamespaceFingerprint:
    """The fingerprint as a header carries it: the cache salt replaced by its digest (keyed
    by ``auth_key`` when given), so a store's reader never learns a tenant's salt."""
    if fingerprint.cache_salt is None:
        return fingerprint
    hasher = hashlib.blake2b(fingerprint.cache_salt.encode(), digest_size=DIGEST_BYTES, key=auth_key or b"", person=b"hc-salt")
    return replace(fingerprint, cache_salt="blake2b:" + hasher.hexdigest())


def _encode(expected: Expectation, arrays: dict[str, np.ndarray], auth_key: bytes | None) -> bytes:
    payload = encode_payload(arrays)
    described = b"".join(
        (
            wire.pack_u64(expected.start),
            wire.pack_u64(expected.step),
            expected.key.digest,
            _pack_fingerprint(sealed_fingerprint(expected.fingerprint, auth_key)),
            wire.pack_u32(expected.tokens.size),
            np.ascontiguousarray(expected.tokens, dtype=wire.TOKEN_WIRE_DTYPE).tobytes(),
            wire.encode_spans(expected.multimodal),
            wire.pack_u64(len(payload)),
        )
    )
    header_length = _FIXED_PREFIX + len(described) + DIGEST_BYTES + _HEADER_CHECKSUM_BYTES
    prefix = MAGIC + wire.pack_u16(FORMAT_VERSION) + wire.pack_u8(expected.key.kind) + b"\0"
    before_checksum = prefix + wire.pack_u32(header_length) + described
    unsigned = before_checksum + _payload_checksum(before_checksum, payload, auth_key)
    return unsigned + _header_checksum(unsigned) + payload


def _pack_fingerprint(fingerprint: NamespaceFingerprint) -> bytes:
    raw = fingerprint.encode()
    return wire.pack_u16(len(raw)) + raw


def _payload_checksum(described: bytes | memoryview, payload: bytes | memoryview, auth_key: bytes | None) -> bytes:
    """BLAKE2b-256 of the payload; with a deployment key, a keyed BLAKE2b over the header
    fields before the checksum and the payload (a MAC binding the two)."""
    if auth_key is None:
        return hashlib.blake2b(payload, digest_size=DIGEST_BYTES, person=b"hc-payload").digest()
    hasher = hashlib.blake2b(described, digest_size=DIGEST_BYTES, key=auth_key, person=b"hc-sealed")
    hasher.update(payload)
    return hasher.digest()


def _header_checksum(header: bytes | memoryview) -> bytes:
    return hashlib.blake2b(header, digest_size=_HEADER_CHECKSUM_BYTES, person=b"hc-header").digest()


# --- reading -----------------------------------------------------------------------------------


def decode_header(data: object) -> ObjectHeader:
    """Parse and check the header of an object's bytes (not the payload checksum).

    Raises :class:`CorruptObjectError` for truncated or garbled bytes and
    :class:`UnsupportedFormatError` for another format version.
    """
    view = _readonly_view(data)
    reader = wire.Reader(view)
    if bytes(reader.take(4, "magic")) != MAGIC:
        raise CorruptObjectError("not a hybridcache object (bad magic)")
    version = reader.u16("format version")
    if version != FORMAT_VERSION:
        raise UnsupportedFormatError(f"object format version {version}, this build reads {FORMAT_VERSION}")
    kind = _read_kind(reader.u8("kind"))
    if reader.u8("flags") != 0:
        raise CorruptObjectError("unknown header flags")
    header_length = reader.u32("header length")
    if header_length > len(view) or header_length < _FIXED_PREFIX + _HEADER_CHECKSUM_BYTES:
        raise CorruptObjectError(f"header length {header_length} does not fit {len(view)} bytes")
    checksum_at = header_length - _HEADER_CHECKSUM_BYTES
    if bytes(view[checksum_at:header_length]) != _header_checksum(view[:checksum_at]):
        raise CorruptObjectError("header checksum mismatch")
    fields = wire.Reader(view, reader.offset, checksum_at)
    header = _read_header_fields(fields, kind, header_length)
    if fields.remaining:
        raise CorruptObjectError("header has trailing bytes")
    if header_length + header.payload_length != len(view):
        raise CorruptObjectError(
            f"object is {len(view)} bytes, header says {header_length + header.payload_length}"
        )
    return header


def _read_kind(value: int) -> ObjectKind:
    try:
        return ObjectKind(value)
    except ValueError as error:
        raise CorruptObjectError(f"unknown object kind {value}") from error


def _read_header_fields(reader: wire.Reader, kind: ObjectKind, header_length: int) -> ObjectHeader:
    start = reader.u64("start")
    step = reader.u64("step")
    digest = bytes(reader.take(DIGEST_BYTES, "own key"))
    fingerprint = NamespaceFingerprint.decode(bytes(reader.take(reader.u16("fingerprint"), "fingerprint")))
    count = reader.u32("token count")
    if step < start or count != step - start:
        raise CorruptObjectError(f"header covers [{start}, {step}) but holds {count} tokens")
    tokens = np.frombuffer(reader.take(4 * count, "tokens"), dtype=wire.TOKEN_WIRE_DTYPE)
    if count and int(tokens.min()) < 0:
        raise CorruptObjectError("negative token id in header")
    multimodal = wire.read_spans(reader)
    payload_length = reader.u64("payload length")
    payload_checksum = bytes(reader.take(DIGEST_BYTES, "payload checksum"))
    return ObjectHeader(
        ObjectKey(kind, digest), fingerprint, start, step, tokens, multimodal,
        payload_length, payload_checksum, header_length,
    )


def payload_matches(data: object, header: ObjectHeader, auth_key: bytes | None = None) -> bool:
    """True when the payload bytes hash to the header's checksum (keyed with ``auth_key``)."""
    view = _readonly_view(data)
    described_end = header.header_length - _HEADER_CHECKSUM_BYTES - DIGEST_BYTES
    checksum = _payload_checksum(view[:described_end], view[header.header_length :], check_auth_key(auth_key))
    return checksum == header.payload_checksum


def decode(data: object, *, auth_key: bytes | None = None) -> StoredObject:
    """Parse a whole object: header, payload checksum (keyed with ``auth_key``) and every array.

    Raises :class:`PayloadChecksumError` when the payload was altered, and the errors of
    :func:`decode_header`.
    """
    view = _readonly_view(data)
    header = decode_header(view)
    if not payload_matches(view, header, auth_key):
        raise PayloadChecksumError(f"payload checksum mismatch for {header.key.name}")
    return StoredObject(header, decode_payload(view, header))


def decode_payload(data: object, header: ObjectHeader) -> Mapping[str, np.ndarray]:
    """The payload's arrays as read-only views into ``data`` (the checksum is not checked here)."""
    return decode_arrays(_readonly_view(data)[header.header_length :])


def _readonly_view(data: object) -> memoryview:
    if isinstance(data, memoryview):
        view = data
    elif isinstance(data, (bytes, bytearray)):
        view = memoryview(data)
    else:
        raise InvalidTypeError(f"object bytes must be bytes-like, got {type(data).__name__}")
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view.toreadonly()
