"""Which prompt heads this engine has served, so that a prompt the cache restores nothing for,
though the engine computed its first block before, is told apart as ``evicted`` (in its own
namespace) or ``namespace`` (the same tenant computed it under another adapter).

Owns: a bounded, least-recently-served-first record of heads, each a tenant (the cache salt)
and the tokens of a prompt's first block, with the adapters it was served under. Heads are
keyed by salt so that nothing is ever said about another tenant's prompts. A head whose block
overlaps a multimodal span is never recorded nor claimed (the same tokens may stand for another
image). Nothing here reads the cache: the record says only what this engine computed, not what
the cache holds.
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
        self._heads: OrderedDict[tuple, tuple[str | None, ...]] = OrderedDict()  # head -> its adapters

    def _head(self, seq: Sequence) -> tuple | None:
        """A prompt's head, when it has a whole block before its last token and no span in it."""
        block = self.block_size
        if seq.num_tokens <= block or seq.spans_overlapping(0, block):
            return None
        return seq.namespace.cache_salt, seq.tokens[:block].tobytes()

    def served(self, seq: Sequence) -> None:
        head = self._head(seq)
        if head is None:
            return
        adapters = self._heads.pop(head, ())
        adapter = seq.namespace.adapter
        self._heads[head] = adapters if adapter in adapters else (*adapters, adapter)
        if len(self._heads) > self.max_heads:
            self._heads.popitem(last=False)

    def seen(self, seq: Sequence) -> bool:
        """Whether a prompt with this head was served before in its namespace (and not
        forgotten since)."""
        return seq.namespace.adapter in self.adapters_served(seq)

    def adapters_served(self, seq: Sequence) -> tuple[str | None, ...]:
        """The adapters (None: the base model) under which the same tenant (same cache salt)
        was served a prompt with this head; empty when none or forgotten."""
        head = self._head(seq)
        return () if head is None else self._heads.get(head, ())

    def check_invariants(self) -> None:
        assert len(self._heads) <= self.max_heads, "more heads than the bound"
        for adapters in self._heads.values():
            assert adapters and len(set(adapters)) == len(adapters), "a head without adapters, or one twice"
