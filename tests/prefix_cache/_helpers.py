"""Shared helpers of the prefix-cache tests: building tries, admitting sequences, deep snapshots.

Admission has one helper, ``admit``, which runs the production ``CacheProtocol.admit``. A test that
stops inside an admission or takes its steps in another order on purpose says so with a
helper named after what it does (``grow_attach_commit``, ``admit_leaving_restore_unpinned``).
"""

from __future__ import annotations

import dataclasses
import enum
import types

import numpy as np

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache import BlockTrie, MatchTxn
from hybridcache.types import NO_NODE
from hybridcache.cache import CacheComponents
from hybridcache.protocol import CacheProtocol
from hybridcache.sequence import Sequence

B = 16


def make_trie(num_blocks: int = 64, block_size: int = B, **kwargs) -> tuple[BlockPool, BlockTrie]:
    pool = BlockPool(num_blocks)
    return pool, BlockTrie(pool, block_size, **kwargs)


def admit(trie: BlockTrie, seq: Sequence) -> None:
    """Admit all of ``seq`` through the production admission (``CacheProtocol.admit``: match, pin the
    selected restore, free blocks under pressure, grow the table, attach, commit); its forward
    has not run yet.

    Admission also takes a runtime state row. These tests follow the cache, not the recurrent
    state, so the row comes from a one-row pool of its own and goes straight back: the trie's
    state pool keeps exactly the checkpoints a test put there, and nothing leaks."""
    runtime_rows = StatePool(2)
    admitted = CacheProtocol(CacheComponents(trie.pool, runtime_rows, trie)).admit(seq, seq.num_tokens)
    assert admitted.admitted, f"admission refused {seq}: {admitted.refused}"
    runtime_rows.free_runtime(admitted.runtime_slot)


def forward(trie: BlockTrie, seq: Sequence) -> None:
    """The forward over every token ran: all tokens are computed, and the restore copy (if
    any) is queued, so the restore pin goes."""
    seq.set_computed(seq.num_tokens)
    if seq.prefix_state.checkpoints.restore_pinned:
        trie.checkpoints.unpin_restore(seq)


def prefill(trie: BlockTrie, seq: Sequence) -> None:
    """Admit ``seq`` and run its forward."""
    admit(trie, seq)
    forward(trie, seq)


def grow_attach_commit(trie: BlockTrie, seq: Sequence, txn: MatchTxn) -> None:
    """Finish an admission by hand after a match the test inspected: grow the table to the
    whole sequence, attach its complete blocks, commit. Unlike ``admit`` it pins no restore
    and frees nothing under pressure (a full pool raises ``OutOfBlocksError``)."""
    trie.pool.grow_table(seq, seq.num_tokens, trie.block_size)
    trie.allocate(seq)
    trie.commit(txn)


def admit_leaving_restore_unpinned(trie: BlockTrie, seq: Sequence) -> MatchTxn:
    """Admit ``seq`` without pinning the restore its match selected (production pins it), for
    what becomes of a selected but unpinned checkpoint."""
    txn = trie.match(seq)
    grow_attach_commit(trie, seq, txn)
    return txn


def decode(trie: BlockTrie, seq: Sequence, tokens) -> None:
    """Append tokens (as a decode step would), grow the table, attach, and run the forward."""
    seq.append_tokens(tokens)
    trie.pool.grow_table(seq, seq.num_tokens, trie.block_size)
    trie.allocate(seq)
    seq.set_computed(seq.num_tokens)


def produce(trie: BlockTrie, tokens, **kwargs) -> Sequence:
    """Run a request to completion and free it: its complete blocks stay in the trie."""
    seq = Sequence(tokens, **kwargs)
    prefill(trie, seq)
    trie.free_sequence(seq)
    return seq


def refs(pool: BlockPool, seq: Sequence) -> list[int]:
    return pool.refcounts(seq.block_table).tolist()


def cursor_depth(trie: BlockTrie, seq: Sequence) -> int | None:
    """Depth of the sequence's cursor, or None when it has no valid cursor."""
    state = seq.prefix_state
    if state.trie.cursor == NO_NODE or not trie.nodes.is_valid(state.trie.cursor, state.trie.cursor_generation):
        return None
    return int(trie.nodes.depth[state.trie.cursor])


def path_blocks(trie: BlockTrie, seq: Sequence) -> list[int]:
    """Canonical block ids of the path from the root to the sequence's cursor, in table order."""
    if cursor_depth(trie, seq) is None:
        return []
    nodes, slot, ids = trie.nodes, seq.prefix_state.trie.cursor, []
    while not nodes.is_root[slot]:
        ids.append(int(nodes.block[slot]))
        slot = int(nodes.parent[slot])
    return ids[::-1]


def leaves(trie: BlockTrie) -> list[int]:
    nodes = trie.nodes
    return [s for s in nodes.attached_slots().tolist() if nodes.num_children[s] == 0]


def slots_at_depth(trie: BlockTrie, depth: int) -> list[int]:
    nodes = trie.nodes
    return [s for s in nodes.attached_slots().tolist() if nodes.depth[s] == depth]


def node_tokens(trie: BlockTrie, slot: int) -> list[int]:
    return trie.tokens.run(slot, slot).tolist()


def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


# --- deep snapshots -----------------------------------------------------------------------------


def freeze(obj, _seen=None):
    """A hashable, comparable deep image of an object graph (numpy arrays by dtype, shape, bytes).

    Objects are followed through ``__dict__``; an object met twice is recorded by type only
    (the first visit already captured its state).
    """
    if _seen is None:
        _seen = set()
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, enum.Enum):
        return (type(obj).__name__, obj.value)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)):
        return ("callable", obj.__qualname__)  # behaviour, not state (a heap's score function)
    if isinstance(obj, dict):
        items = [(freeze(k, _seen), freeze(v, _seen)) for k, v in obj.items()]
        return ("dict", type(obj).__name__, tuple(sorted(items, key=repr)))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(freeze(v, _seen) for v in obj))
    if isinstance(obj, (set, frozenset)):
        return ("set", tuple(sorted((freeze(v, _seen) for v in obj), key=repr)))
    if id(obj) in _seen:
        return ("seen", type(obj).__name__)
    _seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not hasattr(obj, "__dict__"):
        state = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    elif not hasattr(obj, "__dict__"):
        state = {name: getattr(obj, name) for name in type(obj).__slots__}
    else:
        state = vars(obj)
    return (type(obj).__name__, freeze(state, _seen))


def snapshot(*objects):
    """Deep image of the given objects (pool, trie, sequences, transactions)."""
    return tuple(freeze(o) for o in objects)


# caches of facts about the tokens (kept by a rollback): the block keys, the verified node and
# its path, the remembered search and the trie they belong to
KEY_CACHE_FIELDS = {"verified", "verified_generation", "verified_path", "last_search", "owner"}


def seq_state(seq: Sequence):
    """What a rollback must restore on a sequence: everything but the cached block keys (a pure
    function of the tokens, extended by any match)."""
    prefix_state = seq.prefix_state
    position = {f.name: getattr(prefix_state.trie, f.name) for f in dataclasses.fields(prefix_state.trie)}
    position = {k: v for k, v in position.items() if k not in KEY_CACHE_FIELDS}
    groups = {f.name: getattr(prefix_state, f.name) for f in dataclasses.fields(prefix_state)}
    state = {**{k: v for k, v in groups.items() if k not in ("keys", "trie")}, "trie": position}
    experts = seq.routed_experts
    return freeze(
        {
            "tokens": seq.tokens.copy(),
            "computed": seq.num_computed,
            "table": seq.block_table.copy(),
            # no rows yet (None) and zero rows (an empty array) are the same history
            "experts": [] if experts is None else experts.tolist(),
            "prefix_state": state,
        }
    )
