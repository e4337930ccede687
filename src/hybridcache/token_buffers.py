"""Spare token buffers: the int32 buffers of dead sequences, kept for the next sequences.

Owns: the process-wide spares, by capacity class (their byte total bounded).

Why: a long prompt's fresh buffer costs a page fault per 4 KiB page at its first write, and
an engine whose requests come and go (a scheduler admitting a batch, the batch finishing)
frees and faults the same amount of memory again each time; on a loaded host those faults
cost several times the copy itself (measured: ~300 µs of the ~400 µs a 64K-token prompt's
copy took with 128 such buffers alive). A
buffer is taken back only when nothing but its dying sequence refers to it (no view of its
tokens outlives it), so a recycled buffer can never change what any view shows.

Capacities are rounded up to classes 1/8 octave apart, so a class holds interchangeable
buffers (at most 12.5 % larger than asked for). Only buffers of at least ``MIN_SPARE_TOKENS``
are kept: smaller ones are cheap to allocate. Taking and giving are single list operations and
the byte total is counted from the lists themselves, so a garbage collection that runs a
sequence's finalizer in the middle of either loses nothing and leaves no count behind.
"""

from __future__ import annotations

import sys

import numpy as np

from hybridcache.types import TOKEN_DTYPE

MIN_SPARE_TOKENS = 1 << 14
MAX_SPARE_BYTES = 256 << 20
_CLASS_STEPS = 8  # classes per octave
_spares: dict[int, list[np.ndarray]] = {}


def capacity_class(tokens: int) -> int:
    """The capacity a buffer for ``tokens`` tokens gets (even; a class for long buffers)."""
    tokens += tokens & 1
    if tokens < MIN_SPARE_TOKENS:
        return tokens
    step = (1 << (tokens.bit_length() - 1)) // _CLASS_STEPS  # a step of the octave ``tokens`` lies in
    return -(-tokens // step) * step


def take(capacity: int) -> np.ndarray:
    """An int32 buffer of exactly ``capacity`` (a ``capacity_class``) tokens, a spare when
    one is kept; its contents are arbitrary."""
    bucket = _spares.get(capacity)
    if bucket:
        try:
            return bucket.pop()
        except IndexError:  # another thread took the last one since the test
            pass
    return np.empty(capacity, dtype=TOKEN_DTYPE)


def give(buffer: np.ndarray) -> None:
    """Keep ``buffer`` for a later ``take`` if the caller's reference is the only one left
    (the caller drops it right after) and the spares have room; otherwise let it go."""
    capacity = buffer.size
    if capacity < MIN_SPARE_TOKENS or capacity != capacity_class(capacity) or buffer.dtype != TOKEN_DTYPE:
        return
    # references: the caller's, this frame's argument, getrefcount's argument
    if sys.getrefcount(buffer) > 3 or buffer.base is not None or not buffer.flags.writeable:
        return
    if spare_bytes() + buffer.nbytes > MAX_SPARE_BYTES:
        return
    _spares.setdefault(capacity, []).append(buffer)


def spare_bytes() -> int:
    """Bytes held in spare buffers now (a copy of the few classes is iterated: a finalizer
    may add one meanwhile)."""
    itemsize = np.dtype(TOKEN_DTYPE).itemsize
    return sum(len(bucket) * capacity * itemsize for capacity, bucket in _spares.copy().items())


def clear() -> None:
    """Drop every spare (memory back to the allocator)."""
    _spares.clear()
