"""``hybridcache demo``: a multi-turn chat workload replayed through the KV prefix cache.

Several conversations share one system prompt; every turn sends the whole conversation so far
plus a new user message, then "generates" a reply (deterministic pseudo-random tokens). The
table shows, per turn, how many prompt tokens the request asked for and how many the prefix
cache served.
"""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table

from hybridcache.memory.block_pool import BlockPool
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.sequence import Sequence

BLOCK_SIZE = 16
SYSTEM_PROMPT_TOKENS = 200
CONVERSATIONS = 4
TURNS = 4
USER_TOKENS = (24, 60)
REPLY_TOKENS = (20, 48)


def _serve(trie: BlockTrie, pool: BlockPool, prompt: np.ndarray, reply: np.ndarray) -> tuple[int, int]:
    """Run one request: match, prefill, decode the reply, free. Returns (query, hit) tokens."""
    seq = Sequence(prompt)
    before = trie.stats.snapshot()
    txn = trie.match(seq)
    pool.grow_table(seq, seq.num_tokens, BLOCK_SIZE)
    trie.allocate(seq)
    trie.commit(txn)
    seq.set_computed(seq.num_tokens)
    for token in reply.tolist():
        seq.append_tokens([token])
        pool.grow_table(seq, seq.num_tokens, BLOCK_SIZE)
        trie.allocate(seq)
        seq.set_computed(seq.num_tokens)
    trie.free_sequence(seq)
    after = trie.stats.match
    return after.query_tokens - before.query_tokens, after.hit_tokens - before.hit_tokens


def run_demo(console: Console, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    pool = BlockPool(4096)
    trie = BlockTrie(pool, BLOCK_SIZE)
    system = rng.integers(0, 32000, SYSTEM_PROMPT_TOKENS, dtype=np.int32)
    history = [system.copy() for _ in range(CONVERSATIONS)]
    table = Table(title="multi-turn chat through the KV prefix cache (block size 16)")
    for column in ("turn", "conversation", "query tokens", "hit tokens", "hit rate"):
        table.add_column(column, justify="right")
    for turn in range(1, TURNS + 1):
        turn_query = turn_hit = 0
        for conversation in range(CONVERSATIONS):
            user = rng.integers(0, 32000, rng.integers(*USER_TOKENS), dtype=np.int32)
            prompt = np.concatenate([history[conversation], user])
            reply = rng.integers(0, 32000, rng.integers(*REPLY_TOKENS), dtype=np.int32)
            query, hit = _serve(trie, pool, prompt, reply)
            history[conversation] = np.concatenate([prompt, reply])
            turn_query, turn_hit = turn_query + query, turn_hit + hit
            table.add_row(str(turn), str(conversation), str(query), str(hit), f"{hit / query:.1%}")
        table.add_row(f"turn {turn}", "all", str(turn_query), str(turn_hit), f"{turn_hit / turn_query:.1%}", style="bold")
        table.add_section()
    stats = trie.stats
    table.add_row(
        "overall", "", str(stats.match.query_tokens), str(stats.match.hit_tokens), f"{stats.hit_rate:.1%}", style="bold green"
    )
    console.print(table)
    console.print(
        f"cached blocks: {trie.nodes.num_attached}, free blocks: {pool.num_free}/{pool.num_blocks}, "
        f"misses by reason: {dict(stats.match.misses)}"
    )
    trie.check_invariants()
