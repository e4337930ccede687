"""Degenerate block keyers for the tests: keys that collide on purpose, so that only the
trie's exact comparisons (tokens, namespace, multimodal identity) decide what is a hit.

A keyer produces two kinds of numbers and each keyer here degrades both: the prefix keys the
node index stores (``extend``), and the keyed value of one block (``block_values``,
``values_of``, ``value_of``), which a checkpoint probe hashes together with its step.
"""

from __future__ import annotations

import numpy as np

from hybridcache.prefix_cache import BlockKeyer

__all__ = ["CONSTANT", "ConstantKeyer", "TwoBitKeyer"]

CONSTANT = 7


class ConstantKeyer(BlockKeyer):
    """Every prefix key and every block value is ``CONSTANT``: every node lookup and every
    checkpoint bucket of a step collides."""

    def extend(self, seq):
        keys = super().extend(seq)
        keys[...] = CONSTANT
        return keys

    def block_values(self, seq, first, end):
        return np.full(end - first, CONSTANT, dtype=np.uint64)

    def values_of(self, seq, indices):
        return np.full(len(indices), CONSTANT, dtype=np.uint64)

    def value_of(self, seq, index):
        return CONSTANT


class TwoBitKeyer(BlockKeyer):
    """Prefix keys and block values keep only their low 2 bits: four possible keys, so
    unrelated prefixes collide often but not always (a mix of true and false candidates)."""

    _MASK = np.uint64(3)

    def extend(self, seq):
        keys = super().extend(seq)
        keys &= self._MASK
        return keys

    def block_values(self, seq, first, end):
        return super().block_values(seq, first, end) & self._MASK

    def values_of(self, seq, indices):
        return super().values_of(seq, indices) & self._MASK

    def value_of(self, seq, index):
        return super().value_of(seq, index) & int(self._MASK)
