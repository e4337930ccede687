"""Per-sequence prefix-cache protocol state, as grouped records.

Owns: what the prefix cache remembers about one sequence between calls. Each group names its
only writer; every other module only reads it:

- ``keys`` (``KeyCache``): the cached block keys, written by ``identity.BlockKeyer``.
- ``trie`` (``TriePosition``): which trie the facts belong to, the verified node and its path,
  the remembered checkpoint search and the cursor, written by the trie's match and attach path
  (``trie.BlockTrie`` and the modules it delegates to: ``lookup``, ``matchers``, ``attach``,
  ``match_txn`` for the rollback of a cursor).
- ``borrow`` (``BorrowedPath``): the path a match from the root borrows with one pin, written by
  ``match_txn.MatchBook``.
- ``overlap`` (``RecomputeOverlap``): the recompute overlap (``recompute_blocks``, the caller's
  decoding policy, e.g. MTP), the one-shot fresh range a match sets and the next allocate
  clears, and the private-to-canonical block map, written by the trie's match and attach path.
- ``checkpoints`` (``CheckpointRefs``): the checkpoints the sequence selected, reserved,
  produced or replaced, written by ``checkpoint_lifecycle.CheckpointLifecycle``.
- ``suppress_stats``: written by the scheduler (a recompute replay is not a new query).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hybridcache.types import NO_NODE, MultimodalSpan

NO_FRESH_RANGE = (0, 0)  # a fresh range recomputing no cached block

if TYPE_CHECKING:  # type-only: checkpoint_record and node import neither sequence nor this module
    from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointSearch
    from hybridcache.prefix_cache.node import NodePath


@dataclass(slots=True)
class KeyCache:
    """Block keys, valid for one keyer (``keyer_id``) from block ``keys_from`` on (keys resume
    at a verified node instead of hashing the prefix before it). ``mm_blocks`` maps a block
    index to the multimodal spans overlapping it. Writer: ``identity.BlockKeyer``."""

    block_keys: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    block_sums: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    num_keys: int = 0
    keys_from: int = 0
    key_sum: int = 0
    keyer_id: int = -1
    mm_blocks: dict[int, tuple[MultimodalSpan, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class TriePosition:
    """Node handles ``(slot, generation)`` of one trie (``owner``, its id; a sequence holding
    no blocks moves to another trie by forgetting them). ``verified``: the deepest node whose
    whole path was compared exactly (a cache of a fact: rollback keeps it), with its
    ``verified_path``; ``last_search``: the checkpoint search ingest did, reused while it stays
    usable; ``cursor``: the node up to which the block table holds the path's blocks (a cursor
    whose node was evicted is detected in O(1)); ``experts_cached_blocks``: blocks whose routed
    experts were already offered to the trie. Writer: the trie's match and attach path."""

    owner: int = -1
    verified: int = NO_NODE
    verified_generation: int = -1
    verified_path: NodePath | None = None
    last_search: CheckpointSearch | None = None
    cursor: int = NO_NODE
    cursor_generation: int = -1
    experts_cached_blocks: int = 0

    def clear_cursor(self) -> None:
        self.cursor = NO_NODE
        self.cursor_generation = -1


@dataclass(slots=True)
class BorrowedPath:
    """The trie node whose path the first ``depth`` table entries borrow (one pin on ``node``
    instead of a reference per block); set by a match from the root, undone by its rollback,
    released with the table. Writer: ``match_txn.MatchBook``."""

    node: int = NO_NODE
    depth: int = 0


@dataclass(slots=True)
class RecomputeOverlap:
    """``recompute_blocks``: blocks before the last valid token the sequence's next forward
    recomputes anyway (its decoding policy; never cleared). ``fresh_range``: the cached blocks
    the next forward recomputes, set by a match and cleared by the next allocate.
    ``trie_block_map``: private blocks mapped to their canonical trie blocks while a forward
    still writes them. Writer: the trie's match and attach path (the caller sets the policy)."""

    recompute_blocks: int = 0
    fresh_range: tuple[int, int] = NO_FRESH_RANGE
    trie_block_map: dict[int, int] = field(default_factory=dict)

    def in_fresh_range(self, block_index: int) -> bool:
        start, end = self.fresh_range
        return start <= block_index < end


@dataclass(slots=True)
class CheckpointRefs:
    """``restore``: the published checkpoint a hybrid match selected, pinned
    (``restore_pinned``) from admission until its restore copy is queued. ``pending_save``: the
    reservation the next forward saves into. ``producer_pin``: the checkpoint just published
    whose save copy is still in flight. ``decode_checkpoint``: the single replaceable decode
    checkpoint (``retiring_decode_checkpoint`` is the one it replaces while the new one's save
    is in flight). ``records_missing_experts``: published partial checkpoints still waiting for
    the tail's routed-expert rows. Writer: ``checkpoint_lifecycle.CheckpointLifecycle``."""

    restore: CheckpointRecord | None = None
    restore_pinned: bool = False
    pending_save: CheckpointRecord | None = None
    producer_pin: CheckpointRecord | None = None
    decode_checkpoint: CheckpointRecord | None = None
    retiring_decode_checkpoint: CheckpointRecord | None = None
    records_missing_experts: list[CheckpointRecord] = field(default_factory=list)


@dataclass(slots=True)
class PrefixState:
    keys: KeyCache = field(default_factory=KeyCache)
    trie: TriePosition = field(default_factory=TriePosition)
    borrow: BorrowedPath = field(default_factory=BorrowedPath)
    overlap: RecomputeOverlap = field(default_factory=RecomputeOverlap)
    checkpoints: CheckpointRefs = field(default_factory=CheckpointRefs)
    suppress_stats: bool = False

    def clear_tracking(self) -> None:
        """Forget everything tied to the blocks the sequence holds (keeps keys and policy)."""
        self.trie.clear_cursor()
        self.trie.experts_cached_blocks = 0
        self.overlap.fresh_range = NO_FRESH_RANGE
        self.overlap.trie_block_map = {}
