"""``memory``: host memory of a hybrid prefix cache holding many long checkpointed prefixes.

Set-up and measurement: ``batch`` distinct prompts of ``context`` tokens are prefilled one at a
time into a hybrid trie, each publishing an aligned state checkpoint at its prompt end. The
process's resident memory is read before the pools and the trie exist and after the last
prompt was freed; the growth divided by the cached tokens is the host cost per cached token.
``metadata_bytes`` sums the checkpoints' exact-match metadata (their tails and fixed fields;
their prefixes are identified by trie paths, not copies).
"""

from __future__ import annotations

import gc
import os
from typing import Callable

import numpy as np

from hybridcache.bench.workload import VOCAB
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.sequence import Sequence


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(batch: int, context: int, block_size: int = 64, progress: Callable[[], None] = lambda: None) -> dict:
    gc.collect()
    before = resident_bytes()
    pool = BlockPool(batch * (context // block_size + 2))
    states = StatePool(batch + 2, checkpoint_budget=batch)
    trie = BlockTrie(pool, block_size, state_pool=states)
    rng = np.random.default_rng(0)
    published = 0
    for _ in range(batch):
        seq = Sequence(rng.integers(0, VOCAB, size=context, dtype=np.int32))
        txn = trie.match(seq)
        pool.grow_table(seq, seq.num_tokens, block_size)
        trie.allocate(seq)
        trie.commit(txn)
        trie.checkpoints.reserve_save(seq)
        seq.set_computed(seq.num_tokens)
        published += trie.checkpoints.publish_save(seq)
        trie.free_sequence(seq)
        del seq
        progress()
    gc.collect()
    growth = resident_bytes() - before
    cached_tokens = trie.nodes.num_attached * block_size
    assert published == batch, "every prompt should have published its checkpoint"
    trie.check_invariants()
    return {
        "scenario": "memory",
        "impl": "hybridcache",
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "checkpoints": published,
        "cached_tokens": cached_tokens,
        "metadata_bytes": trie.checkpoints.metadata_bytes,
        "host_bytes": growth,
        "host_bytes_per_token": growth / cached_tokens,
        "token_store_bytes": trie.tokens.nbytes,
    }
