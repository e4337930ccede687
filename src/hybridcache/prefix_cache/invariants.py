"""Cross-owner invariants of a trie: what no single component can check on its own.

Owns nothing. Each component checks its own structure (``NodeTable``, ``KVLifecycle``,
``CheckpointLifecycle``, the pools); this module checks what spans them: every block's
refcount equals its owners (attached nodes, sequence tables beyond their borrowed range, open
transactions' displaced blocks, checkpoints' frozen blocks), path pins equal the sequences that
borrow, and every sequence's cursor lies on an exact path of its own namespace.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hybridcache.memory.protocols import KVBlockAllocator
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.lookup import PathLookup
from hybridcache.prefix_cache.match_txn import MatchTxn
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.prefix_cache.token_store import TokenStore
from hybridcache.sequence import Sequence


class TrieParts(Protocol):
    """What the checks read of a trie (``BlockTrie`` has it; no import of the facade here)."""

    trie_id: int
    block_size: int
    nodes: NodeTable
    tokens: TokenStore
    kv: KVLifecycle
    pool: KVBlockAllocator
    lookup: PathLookup
    checkpoints: object  # CheckpointLifecycle or NoCheckpoints: frozen_blocks, check_invariants


def check_trie(trie: TrieParts, sequences: tuple[Sequence, ...] | list[Sequence], transactions: tuple[MatchTxn, ...] | list[MatchTxn]) -> None:
    nodes = trie.nodes
    nodes.check_invariants()
    trie.kv.check_invariants()
    attached = nodes.attached_slots()
    if attached.size:
        assert trie.tokens.capacity > attached.max(), "a node has no token row"
    assert np.array_equal(nodes.key[attached], trie.lookup.keyer.prefix_keys(nodes.key_sums[attached])), (
        "a node's key is not the keyer's key of its running sum (a probe would miss it)"
    )
    blocks = nodes.block[attached]
    assert np.unique(blocks).size == blocks.size, "two trie nodes own one block"
    expected = np.zeros(trie.pool.num_blocks, dtype=np.int64)
    np.add.at(expected, blocks, 1)
    borrowers: dict[int, int] = {}
    for seq in sequences:
        state = seq.prefix_state
        borrowing = state.borrow
        np.add.at(expected, seq.block_table[borrowing.depth :].astype(np.int64), 1)
        if borrowing.depth:
            borrowers[borrowing.node] = borrowers.get(borrowing.node, 0) + 1
        _check_sequence(trie, seq)
    assert borrowers == trie.kv.pins(), "path pins differ from the sequences that borrow"
    for txn in transactions:
        if txn.open:
            np.add.at(expected, txn.displaced.astype(np.int64), 1)
    np.add.at(expected, np.asarray(trie.checkpoints.frozen_blocks(), dtype=np.int64), 1)
    trie.checkpoints.check_invariants(sequences)
    trie.pool.check_invariants(expected)


def _check_sequence(trie: TrieParts, seq: Sequence) -> None:
    nodes, lookup, state = trie.nodes, trie.lookup, seq.prefix_state
    for path in (state.trie.verified_path, state.trie.last_search.path if state.trie.last_search is not None else None):
        if path is not None and state.trie.owner == trie.trie_id:
            nodes.check_path(path)
    if state.borrow.depth:
        borrowed = state.borrow.node
        assert nodes.attached[borrowed] and nodes.depth[borrowed] == state.borrow.depth
        runs, _ = nodes.path_runs(borrowed, 0)
        borrowed_blocks = lookup.path_blocks(runs, state.borrow.depth)
        assert np.array_equal(seq.block_table[: state.borrow.depth], borrowed_blocks), "borrowed table differs"
    if not nodes.is_valid(state.trie.cursor, state.trie.cursor_generation) or nodes.is_root[state.trie.cursor]:
        return
    depth = int(nodes.depth[state.trie.cursor])
    runs, root = nodes.path_runs(state.trie.cursor, 0)
    assert root == nodes.find_root(seq.namespace), "cursor path leads to another namespace"
    assert depth * trie.block_size <= seq.num_valid and depth <= seq.num_blocks
    assert lookup.same_tokens(seq, runs), "cursor path differs from the sequence's tokens"
    canonical = lookup.path_blocks(runs, depth)
    table = seq.block_table[:depth]
    for index in np.flatnonzero(table != canonical).tolist():
        assert state.overlap.trie_block_map.get(index) == int(canonical[index]), (
            f"block {index} is neither canonical nor a mapped private block"
        )
