"""Which prompt heads this engine has served, so that a prompt the cache restores nothing for,
though the engine computed its first block before, is told apart as ``evicted``.

Owns: a bounded, least-recently-served-first record of heads, each the namespace (adapter,
cache salt) and the tokens of a prompt's first block. A head whose block overlaps a multimodal
span is never recorded nor claimed (the same tokens may stand for another image). Nothing here
reads the cache: the record says only what this engine computed, not what the cache holds.
"""

from __future__ import annotations

from collections import OrderedDict

from hybridcache.sequence import Sequence
from hybridcache.types import as_int

DEFAULT_MAX_HEADS = 1 << 16  # a head is its block's token bytes plus a namespace: ~200 B each


class ServedHeads:
    def __init__(self, block_size: int, max_heads: int = DEFAULT_MAX_HEADS) -> None:
        self.block_size = as_int("block_size", block_size, 1)
        self.max_heads = as_int("max_heads", max_heads, 1)
        self._heads: OrderedDict[tuple, None] = OrderedDict()

    def _head(self, seq: Sequence) -> tuple | None:
        """A prompt's head, when it has a whole block before its last token and no span in it."""
        block = self.block_size
        if seq.num_tokens <= block or seq.spans_overlapping(0, block):
            return None
        return seq.namespace, seq.tokens[:block].tobytes()

    def served(self, seq: Sequence) -> None:
        head = self._head(seq)
        if head is None:
            return
        self._heads[head] = None
        self._heads.move_to_end(head)
        if len(self._heads) > self.max_heads:
            self._heads.popitem(last=False)

    def seen(self, seq: Sequence) -> bool:
        """Whether a prompt with this head was served before (and not forgotten since)."""
        head = self._head(seq)
        return head is not None and head in self._heads

    def check_invariants(self) -> None:
        assert len(self._heads) <= self.max_heads, "more heads than the bound"
