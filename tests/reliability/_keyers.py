"""Test hooks that replace the block key function with a degenerate one."""

from __future__ import annotations

import numpy as np

from hybridcache.prefix_cache import BlockKeyer

CONSTANT = 7


class ConstantKeyer(BlockKeyer):
    """Every block gets the same key: every prefix key of a sequence is ``CONSTANT``, and the
    keyed value of every block (what a checkpoint probe hashes, where the keyer has it) is
    ``CONSTANT`` too. Every trie lookup and every checkpoint bucket of a step collides, so only
    the exact comparisons decide."""

    def extend(self, seq):
        keys = super().extend(seq)
        keys[...] = CONSTANT
        return keys

    if hasattr(BlockKeyer, "block_values"):  # keyers that key checkpoints by one block's value

        def block_values(self, seq, first, end):
            return np.full(end - first, CONSTANT, dtype=np.uint64)

    if hasattr(BlockKeyer, "values_of"):

        def values_of(self, seq, indices):
            return np.full(len(indices), CONSTANT, dtype=np.uint64)

    if hasattr(BlockKeyer, "value_of"):

        def value_of(self, seq, index):
            return CONSTANT
