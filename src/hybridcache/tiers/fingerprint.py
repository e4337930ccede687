"""The namespace fingerprint: everything that must be equal for a stored object to be reusable.

Owns no mutable state: a :class:`NamespaceFingerprint` is a frozen value. Its canonical encoding
is carried in every object header (so a fetch compares it field by field) and its digest seeds
every key chain (so a change of any field also changes every key).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, fields, replace
from functools import cached_property

from hybridcache.errors import CorruptObjectError, InvalidArgumentError, InvalidTypeError

FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 256
DIGEST_BYTES = 32
_MAX_TEXT_BYTES = 1024
DIGESTED_TEXT_PREFIX = "~blake2b:"  # marks a name the tiers carry as its digest
_ABSENT = 0xFFFF  # length marker of an absent optional text field (adapter, cache salt)
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class NamespaceFingerprint:
    """Model, numeric layout and tenant identity of cached tensors.

    ``kv_layout`` and ``state_layout`` are the caller's exact descriptions of how tensors are laid
    out (for example ``"L=24,H=8,D=128,order=LHTD"``); they are compared as opaque strings.
    ``adapter`` and ``cache_salt`` are ``None`` for the base model and no tenant salt.
    """

    model_id: str
    weights_revision: str
    dtype: str
    kv_layout: str
    state_layout: str
    block_size: int
    chunk_size: int = DEFAULT_CHUNK_SIZE
    adapter: str | None = None
    cache_salt: str | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("model_id", "weights_revision", "dtype", "kv_layout", "state_layout"):
            _check_text(name, getattr(self, name), optional=False)
        for name in ("adapter", "cache_salt"):
            _check_text(name, getattr(self, name), optional=True)
        for name in ("block_size", "chunk_size", "format_version"):
            _check_positive_int(name, getattr(self, name))
        if self.chunk_size % self.block_size:
            raise InvalidArgumentError(
                f"chunk_size {self.chunk_size} must be a multiple of block_size {self.block_size}"
            )

    def in_namespace(self, adapter: str | None, cache_salt: str | None) -> NamespaceFingerprint:
        """This fingerprint for a request's adapter and cache salt, each as ``tier_text``
        carries it (so a name of any length is served, and exactly)."""
        adapter, cache_salt = tier_text(adapter), tier_text(cache_salt)
        if (adapter, cache_salt) == (self.adapter, self.cache_salt):
            return self  # keeps the digest already computed
        return replace(self, adapter=adapter, cache_salt=cache_salt)

    def encode(self) -> bytes:
        """The canonical bytes: every field in declaration order, length-prefixed."""
        parts = []
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int):
                parts.append(_U32.pack(value))
            elif value is None:
                parts.append(_U16.pack(_ABSENT))
            else:
                raw = value.encode()
                parts.append(_U16.pack(len(raw)) + raw)
        return b"".join(parts)

    @cached_property
    def digest(self) -> bytes:
        """BLAKE2b-256 of the canonical bytes; the root of every key chain in this namespace."""
        return hashlib.blake2b(self.encode(), digest_size=DIGEST_BYTES, person=b"hc-fingerprint").digest()

    def differing_fields(self, other: NamespaceFingerprint) -> tuple[str, ...]:
        """Names of the fields whose values differ, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))

    @classmethod
    def decode(cls, raw: bytes) -> NamespaceFingerprint:
        """Parse canonical bytes; raises :class:`CorruptObjectError` on any malformation."""
        view = memoryview(raw)
        offset = 0
        values = {}
        for field in fields(cls):
            if field.type == "int":
                if offset + 4 > len(view):
                    raise CorruptObjectError(f"fingerprint truncated in {field.name}")
                values[field.name] = _U32.unpack_from(view, offset)[0]
                offset += 4
                continue
            if offset + 2 > len(view):
                raise CorruptObjectError(f"fingerprint truncated in {field.name}")
            length = _U16.unpack_from(view, offset)[0]
            offset += 2
            if length == _ABSENT:
                values[field.name] = None
                continue
            if offset + length > len(view):
                raise CorruptObjectError(f"fingerprint truncated in {field.name}")
            try:
                values[field.name] = bytes(view[offset : offset + length]).decode()
            except UnicodeDecodeError as error:
                raise CorruptObjectError(f"fingerprint field {field.name} is not UTF-8") from error
            offset += length
        if offset != len(view):
            raise CorruptObjectError("fingerprint has trailing bytes")
        try:
            return cls(**values)
        except (InvalidArgumentError, InvalidTypeError) as error:
            raise CorruptObjectError(f"fingerprint holds invalid values: {error}") from error


def tier_text(value: str | None) -> str | None:
    """A caller's name (adapter, cache salt, modality, content id) as object headers and key
    chains carry it: itself, or ``DIGESTED_TEXT_PREFIX`` + a BLAKE2b-256 hex digest of it when
    it is longer than a header field holds or already starts with that prefix. Distinct names
    stay distinct (short names never take the digest form), so nothing is shared by accident."""
    if value is None:
        return None
    raw = value.encode()
    if len(raw) <= _MAX_TEXT_BYTES and not value.startswith(DIGESTED_TEXT_PREFIX):
        return value
    return DIGESTED_TEXT_PREFIX + hashlib.blake2b(raw, digest_size=DIGEST_BYTES, person=b"hc-tier-text").hexdigest()


def _check_text(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise InvalidTypeError(f"{name} must be a str{' or None' if optional else ''}, got {type(value).__name__}")
    if not value:
        raise InvalidArgumentError(f"{name} must not be empty")
    if len(value.encode()) > _MAX_TEXT_BYTES:
        raise InvalidArgumentError(f"{name} is longer than {_MAX_TEXT_BYTES} UTF-8 bytes")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 < value < 2**32:
        raise InvalidArgumentError(f"{name} must lie in [1, 2**32), got {value}")
