"""Admission of one waiting sequence as a transaction.

Owns nothing between calls. An admission is: tentative match -> pin the selected restore ->
make room (checkpoint LRU for a runtime state slot, then frozen checkpoints and KV leaves for
blocks) -> take the runtime slot and the blocks -> attach the completed blocks -> commit. Every
check that can fail runs before the first allocation, so a failure only has to roll back the
match, which restores the sequence, the references, the pins, the cursor, the fresh range and
the statistics exactly; a failed admission never leaks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.sequence import Sequence


@dataclass(frozen=True)
class Admitted:
    start: int
    end: int
    runtime_slot: int
    restore: CheckpointRecord | None
    hit_tokens: int


def blocks_needed(seq: Sequence, tokens: int, block_size: int) -> int:
    return max(0, -(-tokens // block_size) - seq.num_blocks)


def make_block_room(trie: BlockTrie, pool: BlockPool, needed: int) -> bool:
    """Evict until ``needed`` blocks are free; True when they are."""
    if pool.num_free < needed:
        trie.free_kv_blocks(needed - pool.num_free)
    return pool.num_free >= needed


def try_admit(
    seq: Sequence,
    trie: BlockTrie,
    pool: BlockPool,
    states: StatePool,
    token_budget: int,
    chunk_limit: int,
    stop_at: Callable[[int], int | None] | None = None,
) -> Admitted | None:
    """Admit ``seq`` for a first chunk of at most ``min(token_budget, chunk_limit)`` tokens, or
    leave everything exactly as it was and return None. ``stop_at(start)``, called once the
    match fixed the resume point, may end the chunk earlier (where an admission policy wants a
    checkpoint); None or a position outside the chunk changes nothing."""
    txn = trie.match(seq)
    checkpoints = trie.checkpoints
    if seq.prefix_state.restore is not None and not checkpoints.pin_restore(seq):
        trie.rollback(txn)  # the checkpoint vanished since the match; retry once without it
        txn = trie.match(seq)
        if seq.prefix_state.restore is not None and not checkpoints.pin_restore(seq):
            trie.rollback(txn)
            return None
    start = seq.num_computed
    end = min(seq.num_tokens, start + min(token_budget, chunk_limit))
    hint = None if stop_at is None else stop_at(start)
    if hint is not None and start < hint < end:
        end = int(hint)
    if end <= start or not _make_state_room(trie, states):
        trie.rollback(txn)
        return None
    if not make_block_room(trie, pool, blocks_needed(seq, end, trie.block_size)):
        trie.rollback(txn)
        return None
    pool.grow_table(seq, end, trie.block_size)
    runtime_slot = states.allocate_runtime()
    trie.allocate(seq, upto=end)
    trie.commit(txn)
    return Admitted(start, end, runtime_slot, seq.prefix_state.restore, txn.hit_tokens)


def _make_state_room(trie: BlockTrie, states: StatePool) -> bool:
    if states.num_free_runtime == 0:
        trie.free_state_slots(1)
    return states.num_free_runtime > 0
