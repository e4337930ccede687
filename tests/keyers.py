"""Degenerate block keyers for the tests: keys that collide on purpose, so that only the
trie's exact comparisons (tokens, namespace, multimodal identity) decide what is a hit.

A keyer produces two kinds of numbers and each keyer here degrades both: the prefix keys the
node index stores (``prefix_keys``, the one derivation ``extend`` and ``key_after`` share), and
the keyed value of one block (``block_values``, the one derivation ``extend`` and the
checkpoint probes' ``value_of`` share), which a probe hashes together with its step. Degrading
those two methods degrades every number the trie sees alike, so it sees one consistent (if
colliding) keyer, as it would a real one.
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

    def block_values(self, seq, blocks):
        return np.full(len(blocks), CONSTANT, dtype=np.uint64)


class TwoBitKeyer(BlockKeyer):
    """Prefix keys and block values keep only their low 2 bits: four possible keys, so
    unrelated prefixes collide often but not always (a mix of true and false candidates)."""

    _MASK = np.uint64(3)

    def prefix_keys(self, block_sums):
        return super().prefix_keys(block_sums) & self._MASK

    def block_values(self, seq, blocks):
        return super().block_values(seq, blocks) & self._MASK
