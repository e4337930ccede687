"""Helpers of the checkpoint (hybrid-mode) tests: building a hybrid trie and running the
producer / consumer protocol of a forward with a state save."""

from __future__ import annotations

import numpy as np

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache import BlockTrie
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.sequence import Sequence

from ._helpers import B, admit, forward, snapshot


def make_hybrid(num_blocks: int = 64, num_slots: int = 8, budget: int = 4, block_size: int = B, **kwargs):
    """(pool, states, trie) of a hybrid trie."""
    pool = BlockPool(num_blocks)
    states = StatePool(num_slots, checkpoint_budget=budget)
    trie = BlockTrie(pool, block_size, state_pool=states, **kwargs)
    return pool, states, trie


def produce(
    trie: BlockTrie, tokens, step: int | None = None, *, free: bool = True, pin: bool = False, **seq_kwargs
) -> tuple[Sequence, CheckpointRecord]:
    """Run a request that saves its state after ``step`` tokens (default: all) and publishes it.

    With ``free`` the sequence is released afterwards (its producer pin, if any, stays)."""
    seq = Sequence(tokens, **seq_kwargs)
    admit(trie, seq)
    slot = trie.checkpoints.reserve_save(seq, step)
    assert slot > 0, f"reserve_save refused step {step}"
    record = seq.prefix_state.checkpoints.pending_save
    assert record is not None and record.slot == slot
    forward(trie, seq)
    assert trie.checkpoints.publish_save(seq, pin=pin)
    assert record.state is CheckpointState.PUBLISHED
    if free:
        trie.free_sequence(seq)
    return seq, record


def store_kv(trie: BlockTrie, tokens, **seq_kwargs) -> Sequence:
    """Run a request without any checkpoint: only its complete KV blocks stay in the trie."""
    seq = Sequence(tokens, **seq_kwargs)
    admit(trie, seq)
    forward(trie, seq)
    trie.free_sequence(seq)
    return seq


def indexed(trie: BlockTrie, record: CheckpointRecord) -> bool:
    return any(entry is record for entry in trie.index.bucket(record.namespace, record.key))


def request_key(trie: BlockTrie, seq: Sequence, step: int) -> tuple[int, int]:
    """The key a match probes for ``seq`` at ``step``: (step, the keyed value of the request's
    block ending at the anchor), or (step, the namespace seed) for a root anchor."""
    depth = step // trie.block_size
    if depth == 0:
        return step, trie.keyer.namespace_seed(seq.namespace)
    return step, int(trie.keyer.block_values(seq, np.array([depth - 1]))[0])


def path_to(trie: BlockTrie, record: CheckpointRecord, seq: Sequence):
    """The trie's exact check of the prefix before ``record``'s anchor for ``seq`` (the part of
    a checkpoint match ``CheckpointIndex.verify`` leaves out): the anchor's path, or None."""
    trie.keyer.identity(seq)  # the request's multimodal blocks, as a match computes them first
    return trie.matcher._path_to_anchor(seq, record, record.step // trie.block_size)


def world(pool, states, trie, *seqs):
    """Deep snapshot of everything a failed call must leave unchanged."""
    return snapshot(pool, states, trie, *seqs)


__all__ = ["B", "indexed", "make_hybrid", "path_to", "produce", "request_key", "store_kv", "world"]
