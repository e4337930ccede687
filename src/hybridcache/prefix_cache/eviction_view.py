"""What an eviction policy sees of the cache it orders, and what the trie asks of the policy.

Owns nothing: ``EvictionView`` reads the trie's parts for a policy (recency stamps, depths,
keys, the records on a slot, the clock, the pool sizes) and lets it re-file a leaf whose score
dropped; ``EvictionScores`` is the policy's side, read once when the trie is built (its two
score functions and whether states go with their leaves) and then bound to the view. A policy
never holds the trie, so the node arrays and the lifecycles stay the trie's own.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from hybridcache.memory.protocols import KVBlockAllocator, StateSlotAllocator
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.kv_lifecycle import KVLifecycle
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.sequence import Sequence


class EvictionView:
    """The reads an eviction policy scores with, by node slot or checkpoint record."""

    def __init__(
        self,
        nodes: NodeTable,
        pools: tuple[KVBlockAllocator, StateSlotAllocator | None],
        checkpoints: object,
        kv: KVLifecycle,
        keyer: BlockKeyer,
    ) -> None:
        """``checkpoints``: the trie's checkpoint side (``CheckpointLifecycle`` or
        ``NoCheckpoints``)."""
        self._nodes = nodes
        self._pool, self._states = pools
        self._checkpoints = checkpoints
        self._kv = kv
        self._keyer = keyer
        self.block_size = keyer.block_size

    # --- KV leaves, by node slot ---------------------------------------------------------------

    def stamp(self, slot: int) -> int:
        """The recency stamp of the node's block (the library's own leaf order)."""
        return self._pool.stamp_of(int(self._nodes.block[slot]))

    def depth(self, slot: int) -> int:
        """The node's depth in blocks (1: a namespace root's child)."""
        return int(self._nodes.depth[slot])

    def key(self, slot: int) -> int:
        """The node's prefix key: equal for equal prefixes of a namespace (see ``prefix_keys``)."""
        return int(self._nodes.key[slot])

    def records_at(self, slot: int) -> tuple[CheckpointRecord, ...]:
        """The live checkpoint records anchored on the node (none in an attention-only cache)."""
        return self._checkpoints.records_at(slot)

    # --- the cache as a whole ------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """The pool's logical clock: the newest stamp."""
        return self._pool.clock

    @property
    def num_kv_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_state_slots(self) -> int:
        """State slots of the pool, every role (0 in an attention-only cache)."""
        return 0 if self._states is None else self._states.num_slots

    @property
    def checkpoint_budget(self) -> int:
        return 0 if self._states is None else self._states.checkpoint_budget

    def published_records(self) -> list[CheckpointRecord]:
        return [record for record in self._checkpoints.live_records() if record.is_published]

    def prefix_keys(self, tokens: np.ndarray) -> np.ndarray:
        """The prefix keys the cache files ``tokens``' whole blocks under (default namespace)."""
        return self._keyer.extend(Sequence(tokens)).copy()

    def keys_of(self, seq: Sequence, blocks: int) -> np.ndarray:
        """The prefix keys of an admitted sequence's first ``blocks`` whole blocks, in its own
        namespace (what its ghosts would be filed under)."""
        return self._keyer.keys_anew(seq, blocks)

    # --- the one write: a score that dropped ---------------------------------------------------

    def rescore_leaf(self, key: int, depth: int) -> bool:
        """A policy's score of the node with prefix key ``key`` at ``depth`` dropped: file it
        again when it is a leaf (a heap only re-files scores that grew). False when no such
        node is cached."""
        nodes = self._nodes
        for slot in nodes.candidates(key):
            if int(nodes.depth[slot]) == depth:
                if nodes.num_children[slot] == 0:
                    self._kv.offer_leaf(slot)
                return True
        return False


@runtime_checkable
class EvictionScores(Protocol):
    """An eviction policy's per-cache state, as the trie reads it when it is built: a score
    per KV leaf slot and per checkpoint record (lowest goes first; see ``lru``), whether a
    mid-block state goes with its anchor leaf under KV pressure (``states_with_leaves``;
    otherwise mid-block states go first, see ``BlockTrie.free_kv_blocks``), and ``bind``, which
    hands it the view of the built trie. ``hybridcache.policies`` has the project's policies."""

    states_with_leaves: bool

    def kv_score(self, slot: int) -> object: ...

    def checkpoint_score(self, record: CheckpointRecord) -> object: ...

    def bind(self, view: EvictionView) -> None: ...


@runtime_checkable
class ProducerNotes(Protocol):
    """An eviction policy state that learns from the producer, which ``CacheProtocol`` tells
    (so every engine and the replay tell it alike): each admitted request (``note_admitted``),
    each planned save, which it may decline (``admits``), and each reserved one, with why and
    from which state it was computed (``note_save``)."""

    def note_admitted(self, seq: Sequence, restore: CheckpointRecord | None) -> None: ...

    def admits(self, seq: Sequence, step: int, kind: str) -> bool: ...

    def note_save(self, record: CheckpointRecord, parent_step: int, kind: str) -> None: ...


class _UnheededNotes:
    """The notes of a policy that learns nothing from the producer: every save admitted."""

    def note_admitted(self, seq: Sequence, restore: CheckpointRecord | None) -> None:
        pass

    def admits(self, seq: Sequence, step: int, kind: str) -> bool:
        return True

    def note_save(self, record: CheckpointRecord, parent_step: int, kind: str) -> None:
        pass


UNHEEDED_NOTES = _UnheededNotes()

