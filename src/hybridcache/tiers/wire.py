"""Byte-level helpers shared by keys and object headers: a bounds-checked reader and spans.

Owns no shared state; a :class:`Reader` owns only its cursor over one buffer.
Everything is little-endian. A read past the end raises :class:`CorruptObjectError`, never
``struct.error`` or ``IndexError``.
"""

from __future__ import annotations

import struct
from typing import Iterable

import numpy as np

from hybridcache.errors import CorruptObjectError, InvalidSpanError, InvalidTypeError
from hybridcache.sequence import MultimodalSpan

TOKEN_WIRE_DTYPE = np.dtype("<i4")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SPAN_BOUNDS = struct.Struct("<QQ")


class Reader:
    """A cursor over a read-only buffer that refuses to run past its end."""

    def __init__(self, data: memoryview, offset: int = 0, end: int | None = None) -> None:
        self._data = data
        self._offset = offset
        self._end = len(data) if end is None else end

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def remaining(self) -> int:
        return self._end - self._offset

    def take(self, count: int, what: str) -> memoryview:
        if count < 0 or count > self.remaining:
            raise CorruptObjectError(f"truncated object: {what} needs {count} bytes, {self.remaining} left")
        piece = self._data[self._offset : self._offset + count]
        self._offset += count
        return piece

    def u8(self, what: str) -> int:
        return _U8.unpack(self.take(1, what))[0]

    def u16(self, what: str) -> int:
        return _U16.unpack(self.take(2, what))[0]

    def u32(self, what: str) -> int:
        return _U32.unpack(self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack(self.take(8, what))[0]

    def text(self, what: str) -> str:
        raw = self.take(self.u16(what), what)
        try:
            return bytes(raw).decode()
        except UnicodeDecodeError as error:
            raise CorruptObjectError(f"{what} is not UTF-8") from error

    def skip_to(self, offset: int, what: str) -> None:
        self.take(offset - self._offset, what)


def pack_u8(value: int) -> bytes:
    return _U8.pack(value)


def pack_u16(value: int) -> bytes:
    return _U16.pack(value)


def pack_u32(value: int) -> bytes:
    return _U32.pack(value)


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def pack_text(value: str) -> bytes:
    raw = value.encode()
    return _U16.pack(len(raw)) + raw


def encode_spans(spans: Iterable[MultimodalSpan]) -> bytes:
    """Canonical bytes of spans (already in start order): count, then bounds, modality, content."""
    spans = tuple(spans)
    parts = [_U32.pack(len(spans))]
    for span in spans:
        parts.append(_SPAN_BOUNDS.pack(span.start, span.end))
        parts.append(pack_text(span.modality))
        parts.append(pack_text(span.content_id))
    return b"".join(parts)


def read_spans(reader: Reader) -> tuple[MultimodalSpan, ...]:
    """Inverse of :func:`encode_spans`; malformed spans are a :class:`CorruptObjectError`."""
    count = reader.u32("multimodal span count")
    if count > reader.remaining // _SPAN_BOUNDS.size:
        raise CorruptObjectError(f"truncated object: {count} multimodal spans cannot fit")
    spans = []
    for _ in range(count):
        start = reader.u64("span start")
        end = reader.u64("span end")
        modality = reader.text("span modality")
        content_id = reader.text("span content id")
        try:
            spans.append(MultimodalSpan(start, end, modality, content_id))
        except (InvalidSpanError, InvalidTypeError) as error:
            raise CorruptObjectError(f"invalid multimodal span in header: {error}") from error
    return tuple(spans)
