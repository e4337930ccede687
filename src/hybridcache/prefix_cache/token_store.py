"""Block tokens, stored once.

Owns: one int32 row of ``block_size`` tokens per trie node slot. Nodes attached together get
consecutive slots, so the tokens of a path are a few contiguous runs of rows and an exact
prefix comparison reads them in place (no gather, no copy).

The comparison is the floor of every hit (it reads every token of the prefix once), so it is
a ``memcmp`` of the two buffers where the C library is reachable: it streams both arrays
without the boolean temporary ``np.array_equal`` writes and reads back (about 1.4x faster
at 64K tokens). Elsewhere it falls back to ``np.array_equal``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from hybridcache.errors import InvalidStepError
from hybridcache.sequence import Sequence
from hybridcache.types import TOKEN_DTYPE


def _load_memcmp():
    try:
        # PyDLL keeps the GIL during the call: no other thread can free a buffer mid-compare.
        memcmp = ctypes.PyDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return memcmp


_MEMCMP = _load_memcmp()


class TokenStore:
    def __init__(self, block_size: int, capacity: int = 0) -> None:
        self.block_size = block_size
        self._rows = np.zeros((capacity, block_size), dtype=TOKEN_DTYPE)
        self._row_bytes = block_size * self._rows.itemsize
        self._address = self._rows.ctypes.data  # of row 0, refreshed when the rows move

    def __setstate__(self, state: dict) -> None:  # a copy's rows live elsewhere
        self.__dict__.update(state)
        self._address = self._rows.ctypes.data

    @property
    def capacity(self) -> int:
        return self._rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self._rows.nbytes

    def ensure_capacity(self, capacity: int) -> None:
        if capacity > self.capacity:
            grown = np.zeros((max(capacity, 2 * self.capacity), self.block_size), dtype=TOKEN_DTYPE)
            grown[: self.capacity] = self._rows
            self._rows = grown
            self._address = grown.ctypes.data

    def write(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Store whole blocks: ``tokens`` is flat, ``len(slots) * block_size`` long."""
        rows = tokens.reshape(-1, self.block_size)
        if slots.size and slots[-1] - slots[0] == slots.size - 1:
            self._rows[slots[0] : slots[-1] + 1] = rows
        else:
            self._rows[slots] = rows

    def run(self, first: int, last: int) -> np.ndarray:
        """Flat read-only view of the tokens of slots ``first..last`` (inclusive)."""
        view = self._rows[first : last + 1].reshape(-1)
        view.flags.writeable = False
        return view

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """A copy of the token rows of ``slots``, one row per slot."""
        return self._rows[slots]

    def equals(self, first: int, last: int, seq: Sequence, start: int) -> bool:
        """Whether slots ``first..last`` hold exactly the sequence's tokens from ``start`` on."""
        rows = last - first + 1
        end = start + rows * self.block_size
        if _MEMCMP is None:
            return end <= seq.num_tokens and bool(np.array_equal(self.run(first, last), seq.token_view(start, end)))
        try:  # one call on every hit's path: the range is checked where the address is taken
            address = seq.token_address(start, end)
        except InvalidStepError:  # the run would read past the sequence's end
            return False
        return _MEMCMP(self._address + first * self._row_bytes, address, rows * self._row_bytes) == 0

    def matching_rows(self, first: int, last: int, seq: Sequence, start: int) -> int:
        """How many leading slots of ``first..last`` hold exactly the sequence's tokens from
        ``start`` on: where a path and a sequence part. Galloping comparisons of growing,
        then halving, runs of rows, so the cost follows the matching part (a comparison stops
        at the first difference), not the run's length."""
        rows = min(last - first + 1, (seq.num_tokens - start) // self.block_size)
        matched, step = 0, 1
        while matched + step <= rows and self._rows_equal(first, matched, step, seq, start):
            matched += step
            step *= 2
        while step > 1:
            step //= 2
            if matched + step <= rows and self._rows_equal(first, matched, step, seq, start):
                matched += step
        return matched

    def _rows_equal(self, first: int, offset: int, count: int, seq: Sequence, start: int) -> bool:
        return self.equals(first + offset, first + offset + count - 1, seq, start + offset * self.block_size)
