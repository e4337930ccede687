"""Degenerate block keyers for the tests: keys that collide on purpose, so that only the
trie's exact comparisons (tokens, namespace, multimodal identity) decide what is a hit.

A keyer produces two kinds of numbers and each keyer here degrades both: the prefix keys the
node index stores (``prefix_keys``, the one derivation ``extend`` and ``key_after`` share), and
the keyed value of one block (``block_values``, ``values_of``, ``value_of``), which a checkpoint
probe hashes together with its step. Every derivation of a number is degraded alike, so the
trie sees one consistent (if colliding) keyer, as it would a real one.
"""

from __future__ import annotations

import numpy as np

from hybridcache.prefix_cache import BlockKeyer

__all__ = ["CONSTANT", "ConstantKeyer", "TwoBitKeyer"]

CONSTANT = 7


class ConstantKeyer(BlockKeyer):
    """Every prefix key and every block value is ``CONSTANT``: every node lookup and every
    checkpoint bucket of a step collides."""

    def prefix_keys(self, block_sums):
        return np.full(np.shape(block_sums), CONSTANT, dtype=np.uint64)

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

    def prefix_keys(self, block_sums):
        return super().prefix_keys(block_sums) & self._MASK

    def block_values(self, seq, first, end):
        return super().block_values(seq, first, end) & self._MASK

    def values_of(self, seq, indices):
        return super().values_of(seq, indices) & self._MASK

    def value_of(self, seq, index):
        return super().value_of(seq, index) & int(self._MASK)
