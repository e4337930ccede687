"""``kv-match``: match a batch of new requests whose prompts are fully cached (attention-only).

Set-up (untimed): ``batch`` distinct prompts of ``context`` tokens are prefilled into the trie.
Each sample creates ``batch`` new requests (same prompts plus a 16-token uncached suffix).
Timed: one ``BlockTrie.match`` per request, which includes computing the request's block
keys, the lookup, the exact token verification, block references and recency stamps, the
block-table write, the step update and the statistics. Untimed: creating the requests and rolling the matches back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hybridcache.bench.method import measure
from hybridcache.bench.workload import distinct_prompts, prefill_into_trie, with_suffix
from hybridcache.memory.block_pool import BlockPool
from hybridcache.prefix_cache.trie import BlockTrie

SUFFIX_TOKENS = 16


@dataclass(frozen=True)
class KVMatchCase:
    batch: int
    context: int
    block_size: int = 64
    warmups: int = 2
    samples: int = 10


def run_case(case: KVMatchCase, progress: Callable[[], None] = lambda: None) -> dict:
    blocks_per_prompt = case.context // case.block_size
    pool = BlockPool(case.batch * (blocks_per_prompt + 2) + 16)
    trie = BlockTrie(pool, case.block_size)
    prompts = distinct_prompts(case.batch, case.context)
    prefill_into_trie(trie, pool, prompts, progress)
    sample_seed = iter(range(1, 1 << 30))

    def prepare():
        return with_suffix(prompts, SUFFIX_TOKENS, next(sample_seed)), []

    def run(context):
        requests, txns = context
        match, keep = trie.match, txns.append
        for seq in requests:
            keep(match(seq))

    def finish(context):
        requests, txns = context
        for seq, txn in zip(requests, txns):
            assert seq.num_computed == case.context, "benchmark request missed its cached prefix"
            trie.rollback(txn)

    timing = measure(prepare, run, finish, warmups=case.warmups, samples=case.samples)
    trie.check_invariants()
    return {
        "scenario": "kv-match",
        "impl": "hybridcache",
        "batch": case.batch,
        "context": case.context,
        "block_size": case.block_size,
        "p50_ms": timing.p50_ms,
        "p99_ms": timing.p99_ms,
        "per_request_us": timing.p50_ms * 1000 / case.batch,
        "samples_ms": timing.samples_ms,
    }
