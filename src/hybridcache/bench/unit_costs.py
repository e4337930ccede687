"""Unit costs of CPython and NumPy on this machine: the bricks the admission floor is built of.

Each figure is CPU time (``time.process_time``, so robust on a loaded machine) per operation,
with the cost of the timing loop itself (a ``pass`` statement) subtracted. An admission that
makes ``n`` Python calls and ``m`` small NumPy operations per request cannot cost less than
``n × call + m × numpy op`` however its work is arranged, which is what these figures bound.
"""

from __future__ import annotations

import heapq
import time
import timeit

import numpy as np

from hybridcache.memory.block_pool import BlockPool
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.protocol_values import Admission
from hybridcache.sequence import Sequence

BLOCK_TOKENS = 64
PROMPT_TOKENS = 131072
CACHED_TOKENS = 65536  # the 64K shape of kv-match and match, where the overhead weighs most


class _Holder:
    value = 1

    def method(self) -> None:
        return None


def _empty() -> None:
    return None


def _cached_trie() -> tuple[BlockTrie, Sequence]:
    """A trie caching one 64K-token prompt as one run, and a new request for those tokens."""
    tokens = np.arange(CACHED_TOKENS, dtype=np.int32)
    pool = BlockPool(CACHED_TOKENS // BLOCK_TOKENS + 8)
    trie = BlockTrie(pool, BLOCK_TOKENS)
    seq = Sequence(tokens)
    txn = trie.match(seq)
    pool.grow_table(seq, seq.num_tokens, BLOCK_TOKENS)
    trie.allocate(seq)
    trie.commit(txn)
    return trie, Sequence(tokens)


def _namespace() -> dict:
    prompt = np.arange(PROMPT_TOKENS, dtype=np.int32)
    trie, request = _cached_trie()
    blocks = CACHED_TOKENS // BLOCK_TOKENS
    first = trie.nodes.candidates(trie.keyer.key_after(request, 0, int(trie.nodes.key_sums[trie.lookup.root(request.namespace)])))[0]
    return {
        "trie": trie,
        "request": request,
        "first": first,
        "last": first + blocks - 1,
        "key": int(trie.nodes.key[first]),
        "window": slice(first, first + blocks),
        "half_prompt": prompt[:CACHED_TOKENS],
        "half_copy": prompt[:CACHED_TOKENS].copy(),
        "heap": [(k, k) for k in range(512)],
        "heapq": heapq,
        "Admission": Admission,
        "table": np.full(2 * blocks, -1, dtype=np.int32),
        "path_ids": np.arange(blocks, dtype=np.int32),
        "empty": _empty,
        "holder": _Holder(),
        "counts": np.zeros(1024, dtype=np.int32),
        "small": np.arange(16, dtype=np.int32),
        "block": prompt[:BLOCK_TOKENS].copy(),
        "block_copy": prompt[:BLOCK_TOKENS].copy(),
        "prompt": prompt,
        "prompt_copy": prompt.copy(),
        "np": np,
    }


# What each unit is, and the statement that performs it once.
UNITS: tuple[tuple[str, str], ...] = (
    ("empty Python function call", "empty()"),
    ("method call", "holder.method()"),
    ("attribute read", "holder.value"),
    ("NumPy scalar read (int(a[i]))", "int(counts[7])"),
    ("NumPy scalar write (a[i] = v)", "counts[7] = 3"),
    ("np.empty(0)", "np.empty(0, dtype=np.int32)"),
    ("small NumPy reduction (a.min())", "small.min()"),
    ("np.array_equal, one 64-token block", "np.array_equal(block, block_copy)"),
    ("np.array_equal, one 128K-token prompt", "np.array_equal(prompt, prompt_copy)"),
    # the bricks of a 64K-token hit (kv-match / match) beyond the comparison itself
    ("np.array_equal, one 64K-token prompt (the floor)", "np.array_equal(half_prompt, half_copy)"),
    ("memcmp of a cached 64K-token run (TokenStore.equals)", "trie.tokens.equals(first, last, request, 0)"),
    ("one block's prefix key (BlockKeyer.key_after)", "trie.keyer.key_after(request, 0, 0)"),
    ("key index lookup (NodeTable.candidates)", "trie.nodes.candidates(key)"),
    ("run check of 1,024 slots (run heads equal and attached, all)",
     "((trie.nodes.run_head[window] == trie.nodes.run_head[first]) & trie.nodes.attached[window]).all()"),
    ("1,024 block ids written into a table", "table[0:1024] = path_ids"),
    ("Admission(...) (frozen dataclass, 7 fields)", "Admission(1, 2, 3, None, 4, None, None)"),
    ("heappush + heappop, 512 entries", "heapq.heappush(heap, heapq.heappop(heap))"),
)


def _cpu_seconds_per_run(statement: str, namespace: dict, number: int, repeats: int) -> float:
    timer = timeit.Timer(statement, globals=namespace, timer=time.process_time)
    return min(timer.repeat(repeat=repeats, number=number)) / number


def measure_unit_costs(number: int = 200_000, repeats: int = 5) -> list[dict]:
    """One record per unit: ``unit``, ``statement`` and ``cpu_ns`` (loop cost subtracted)."""
    namespace = _namespace()
    loop = _cpu_seconds_per_run("pass", namespace, number, repeats)
    records = []
    for unit, statement in UNITS:
        # The whole-prompt comparison is ~2000× a call: fewer runs give the same precision.
        runs = max(1, number // 1000) if "prompt" in statement or "equals" in statement else number
        cost = _cpu_seconds_per_run(statement, namespace, runs, repeats) - loop
        records.append({"unit": unit, "statement": statement, "cpu_ns": max(cost, 0.0) * 1e9})
    return records
