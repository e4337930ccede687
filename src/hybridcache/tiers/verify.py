"""Exact verification of fetched objects: every doubt is a miss with its reason (fail closed).

Owns no state. :func:`verify` checks bytes against an :class:`Expectation` in a fixed order
(decodable, fingerprint, kind and range, tokens, multimodal identity, own key, payload
checksum) and returns a :class:`FetchVerdict`; a caller falls back to a shallower step or to
recompute on any verdict that is not ``ok``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hybridcache.errors import CorruptObjectError, InvalidTypeError, UnsupportedFormatError
from hybridcache.tiers.keys import Expectation
from hybridcache.tiers.objects import (
    ObjectHeader,
    StoredObject,
    check_auth_key,
    decode_header,
    decode_payload,
    payload_matches,
    sealed_fingerprint,
)


class FetchMiss(enum.Enum):
    """Why a fetched object was not used."""

    MISSING = "missing"  # no object under the key in this store
    TIMEOUT = "timeout"  # the store did not answer in time
    UNAVAILABLE = "unavailable"  # the store failed or could not be reached
    CORRUPT = "corrupt"  # truncated, garbled, or a header checksum mismatch
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"  # another model, layout, namespace or format
    RANGE_MISMATCH = "range_mismatch"  # another kind, start or step than requested
    TOKEN_MISMATCH = "token_mismatch"
    MULTIMODAL_MISMATCH = "multimodal_mismatch"
    KEY_MISMATCH = "key_mismatch"  # the header names another key than the one requested
    CHECKSUM_MISMATCH = "checksum_mismatch"  # the payload was altered


@dataclass(frozen=True)
class FetchVerdict:
    """The outcome for one object: ``obj`` when usable, else the ``reason`` and a ``detail``."""

    reason: FetchMiss | None
    detail: str = ""
    obj: StoredObject | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def verify(data: bytes | bytearray | memoryview | None, expected: Expectation, *, auth_key: bytes | None = None) -> FetchVerdict:
    """Check fetched bytes (``None`` = not found) against what the request needs; with a
    deployment key, an object not sealed with it fails as ``CHECKSUM_MISMATCH``."""
    if not isinstance(expected, Expectation):
        raise InvalidTypeError("expected must be an Expectation")
    auth_key = check_auth_key(auth_key)
    if data is None:
        return FetchVerdict(FetchMiss.MISSING, expected.key.name)
    try:
        header = decode_header(data)
    except CorruptObjectError as error:
        return FetchVerdict(_decode_reason(error), str(error))
    mismatch = _header_mismatch(header, expected, auth_key)
    if mismatch is not None:
        return mismatch
    if not payload_matches(data, header, auth_key):
        return FetchVerdict(FetchMiss.CHECKSUM_MISMATCH, expected.key.name)
    try:
        return FetchVerdict(None, obj=StoredObject(header, decode_payload(data, header)))
    except CorruptObjectError as error:  # a well-hashed but malformed payload: a writer's bug
        return FetchVerdict(FetchMiss.CORRUPT, str(error))


def _decode_reason(error: CorruptObjectError) -> FetchMiss:
    # Another format version is another namespace: its fingerprint cannot be read to compare.
    return FetchMiss.FINGERPRINT_MISMATCH if isinstance(error, UnsupportedFormatError) else FetchMiss.CORRUPT


def _header_mismatch(header: ObjectHeader, expected: Expectation, auth_key: bytes | None) -> FetchVerdict | None:
    differing = sealed_fingerprint(expected.fingerprint, auth_key).differing_fields(header.fingerprint)
    if differing:
        return FetchVerdict(FetchMiss.FINGERPRINT_MISMATCH, "differs in " + ", ".join(differing))
    if (header.kind, header.start, header.step) != (expected.key.kind, expected.start, expected.step):
        return FetchVerdict(
            FetchMiss.RANGE_MISMATCH,
            f"{header.kind.name} [{header.start}, {header.step}) instead of "
            f"{expected.key.kind.name} [{expected.start}, {expected.step})",
        )
    if not np.array_equal(header.tokens, expected.tokens):
        first = int(np.argmax(header.tokens != expected.tokens))
        return FetchVerdict(FetchMiss.TOKEN_MISMATCH, f"first differing token at {header.start + first}")
    if header.multimodal != expected.multimodal:
        return FetchVerdict(FetchMiss.MULTIMODAL_MISMATCH, f"{header.multimodal} instead of {expected.multimodal}")
    if header.key != expected.key:
        return FetchVerdict(FetchMiss.KEY_MISMATCH, f"{header.key.name} instead of {expected.key.name}")
    return None

