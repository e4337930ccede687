"""Workload builders shared by benchmark scenarios."""

from __future__ import annotations

from typing import Callable

import numpy as np

from hybridcache.memory.block_pool import BlockPool
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.sequence import Sequence

VOCAB = 151_000


def distinct_prompts(batch: int, context: int, seed: int = 0) -> list[np.ndarray]:
    """``batch`` random int32 prompts of ``context`` tokens that differ from their first block."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=context, dtype=np.int32) for _ in range(batch)]


def prefill_into_trie(
    trie: BlockTrie, pool: BlockPool, prompts: list[np.ndarray], progress: Callable[[], None] = lambda: None
) -> None:
    """Run each prompt as a finished request: its complete blocks end up owned by the trie."""
    for prompt in prompts:
        seq = Sequence(prompt)
        txn = trie.match(seq)
        pool.grow_table(seq, seq.num_tokens, trie.block_size)
        trie.allocate(seq)
        trie.commit(txn)
        seq.set_computed(seq.num_tokens)
        trie.free_sequence(seq)
        progress()


def with_suffix(prompts: list[np.ndarray], suffix_tokens: int, seed: int) -> list[Sequence]:
    """New requests: the same prompts plus an uncached suffix."""
    rng = np.random.default_rng(seed)
    return [Sequence(np.concatenate([p, rng.integers(0, VOCAB, suffix_tokens, dtype=np.int32)])) for p in prompts]
