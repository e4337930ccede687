"""Routed-expert rows cached per trie node.

Owns: for each node slot, the ``(block_size, width)`` expert ids recorded when the block was
computed, and whether the slot has them. Rows are not part of identity; they enrich a hit so a
request that asks for routed experts gets them for cached tokens too.
"""

from __future__ import annotations

import numpy as np

from hybridcache.types import EXPERT_DTYPE


class RoutedExpertStore:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.has_rows = np.zeros(0, dtype=bool)
        self._rows: np.ndarray | None = None

    @property
    def width(self) -> int | None:
        return None if self._rows is None else self._rows.shape[2]

    def ensure_capacity(self, capacity: int) -> None:
        if capacity > self.has_rows.size:
            grown = np.zeros(max(capacity, 2 * self.has_rows.size), dtype=bool)
            grown[: self.has_rows.size] = self.has_rows
            self.has_rows = grown
        if self._rows is not None and capacity > self._rows.shape[0]:
            rows = np.zeros((self.has_rows.size, *self._rows.shape[1:]), dtype=EXPERT_DTYPE)
            rows[: self._rows.shape[0]] = self._rows
            self._rows = rows

    def store(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Record rows for whole blocks (``rows`` has ``len(slots) * block_size`` rows)."""
        if slots.size == 0:
            return
        if self._rows is None:
            self._rows = np.zeros((self.has_rows.size, self.block_size, rows.shape[1]), dtype=EXPERT_DTYPE)
        if rows.shape[1] != self._rows.shape[2]:
            return  # a sequence from a model with another expert layout cannot enrich this trie
        self._rows[slots] = rows.reshape(-1, self.block_size, rows.shape[1])
        self.has_rows[slots] = True

    def forget(self, slot: int) -> None:
        self.has_rows[slot] = False

    def first_missing_depth(self, runs: list[tuple[int, int]], depth: np.ndarray) -> int | None:
        """Shallowest depth on the path whose node lacks rows (``runs`` deepest first)."""
        for first, last in reversed(runs):
            missing = np.flatnonzero(~self.has_rows[first : last + 1])
            if missing.size:
                return int(depth[first] + missing[0])
        return None

    def gather(self, runs: list[tuple[int, int]]) -> np.ndarray:
        """Rows of the path (``runs`` deepest first) in token order."""
        parts = [self._rows[first : last + 1].reshape(-1, self._rows.shape[2]) for first, last in reversed(runs)]
        return np.concatenate(parts) if parts else np.zeros((0, self.width or 0), dtype=EXPERT_DTYPE)
