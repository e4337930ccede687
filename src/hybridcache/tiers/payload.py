"""The payload of a stored object: a table of named plain-numeric arrays, each 64-byte aligned.

Owns no state. ``objects`` seals and checks the header around it; this module checks what a
caller hands in (names, dtypes, dimensions), lays the arrays out, and reads them back as
read-only views, refusing any table whose entries break the layout. The layout::

    array count u32 | per array: name, dtype, ndim u8, shape u64 each, offset u64, length u64
    | array bytes, each starting at a multiple of 64 from the payload start
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Mapping

import numpy as np

from hybridcache.errors import CorruptObjectError, InvalidArgumentError, InvalidTypeError
from hybridcache.tiers import wire

PAYLOAD_ALIGNMENT = 64
_MAX_NDIM = 8
_MAX_NAME_BYTES = 255
_DTYPE_TEXT = re.compile(r"[<>|][biufc][0-9]{1,2}")


# --- building ----------------------------------------------------------------------------------


def checked_arrays(arrays: object) -> dict[str, np.ndarray]:
    if not isinstance(arrays, Mapping):
        raise InvalidTypeError("arrays must be a mapping of name -> numpy array")
    if not arrays:
        raise InvalidArgumentError("an object needs at least one array")
    return {name: checked_array(name, array) for name, array in arrays.items()}


def checked_array(name: object, array: object) -> np.ndarray:
    if not isinstance(name, str):
        raise InvalidTypeError("array names must be str")
    if not name or len(name.encode()) > _MAX_NAME_BYTES:
        raise InvalidArgumentError(f"array name must have 1..{_MAX_NAME_BYTES} UTF-8 bytes, got {name!r}")
    if not isinstance(array, np.ndarray):
        raise InvalidTypeError(f"array {name!r} must be a numpy array")
    if not _DTYPE_TEXT.fullmatch(array.dtype.str):
        raise InvalidTypeError(f"array {name!r} has unsupported dtype {array.dtype} (plain numeric only)")
    if array.ndim > _MAX_NDIM:
        raise InvalidArgumentError(f"array {name!r} has more than {_MAX_NDIM} dimensions")
    return array if array.flags.c_contiguous else array.copy(order="C")  # ascontiguousarray lifts 0-d


def encode_payload(arrays: dict[str, np.ndarray]) -> bytes:
    """The payload bytes of ``arrays`` (already checked by :func:`checked_arrays`)."""
    table = [wire.pack_u32(len(arrays))]
    table_size = 4 + sum(_entry_size(name, array) for name, array in arrays.items())
    offset = _aligned(table_size)
    regions = []
    for name, array in arrays.items():
        table.append(wire.pack_text(name) + wire.pack_text(array.dtype.str) + wire.pack_u8(array.ndim))
        table.extend(wire.pack_u64(extent) for extent in array.shape)
        table.append(wire.pack_u64(offset) + wire.pack_u64(array.nbytes))
        regions.append((offset, array))
        offset = _aligned(offset + array.nbytes)
    payload = bytearray(regions[-1][0] + regions[-1][1].nbytes)
    head = b"".join(table)
    payload[: len(head)] = head
    for start, array in regions:
        payload[start : start + array.nbytes] = array.reshape(-1).view(np.uint8).data
    return bytes(payload)


def _entry_size(name: str, array: np.ndarray) -> int:
    return 2 + len(name.encode()) + 2 + len(array.dtype.str) + 1 + 8 * array.ndim + 16


def _aligned(offset: int) -> int:
    return -(-offset // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


# --- reading -----------------------------------------------------------------------------------


def decode_arrays(view: memoryview) -> Mapping[str, np.ndarray]:
    """The arrays of the payload bytes ``view`` (read-only), as read-only views into it."""
    reader = wire.Reader(view)
    count = reader.u32("array count")
    if count == 0:
        raise CorruptObjectError("payload holds no arrays")
    entries = [_read_entry(reader) for _ in range(min(count, reader.remaining))]
    if len(entries) != count:
        raise CorruptObjectError("truncated payload table")
    return MappingProxyType(_place_arrays(view, entries, reader.offset))


def _read_entry(reader: wire.Reader) -> tuple[str, np.dtype, tuple[int, ...], int, int]:
    name = reader.text("array name")
    dtype_text = reader.text("array dtype")
    dtype = _read_dtype(dtype_text)
    if not name or dtype is None:
        raise CorruptObjectError(f"bad array entry {name!r} with dtype {dtype_text!r}")
    ndim = reader.u8("array ndim")
    if ndim > _MAX_NDIM:
        raise CorruptObjectError(f"array {name!r} claims {ndim} dimensions")
    shape = tuple(reader.u64("array shape") for _ in range(ndim))
    offset = reader.u64("array offset")
    length = reader.u64("array length")
    if length != dtype.itemsize * int(np.prod(shape, dtype=object)):
        raise CorruptObjectError(f"array {name!r} length {length} does not match {dtype} {shape}")
    return name, dtype, shape, offset, length


def _read_dtype(text: str) -> np.dtype | None:
    """The dtype named by ``text`` when it is a plain numeric one in canonical form."""
    if not _DTYPE_TEXT.fullmatch(text):
        return None
    try:
        dtype = np.dtype(text)
    except TypeError:  # e.g. "<f3": the pattern allows sizes NumPy does not have
        return None
    return dtype if dtype.str == text else None


def _place_arrays(view: memoryview, entries: list, table_end: int) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    expected_offset = _aligned(table_end)
    for name, dtype, shape, offset, length in entries:
        if name in arrays:
            raise CorruptObjectError(f"array {name!r} appears twice")
        if offset != expected_offset or offset + length > len(view):
            raise CorruptObjectError(f"array {name!r} at {offset} breaks the payload layout")
        flat = np.frombuffer(view, dtype=dtype, count=length // dtype.itemsize, offset=offset)
        arrays[name] = flat.reshape(shape)
        expected_offset = _aligned(offset + length)
    *_, last_offset, last_length = entries[-1]
    if last_offset + last_length != len(view):
        raise CorruptObjectError("payload has trailing bytes")
    return arrays


# --- stand-ins ---------------------------------------------------------------------------------


class StandInPayloads:
    """One fixed array table as the payload of every chunk and of the state, for a caller whose
    stored objects stand in for real ones (the replay): each still carries a real header and is
    verified as any other; what it stands for is ``restore_cost.StandInSizes``."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = checked_arrays(arrays)

    def chunk(self, index: int) -> Mapping[str, np.ndarray]:
        return self.arrays

    def state(self) -> Mapping[str, np.ndarray]:
        return self.arrays
