"""Per-sequence prefix-cache protocol state.

Owns: what the prefix cache remembers about one sequence between calls: its cached block keys,
its trie cursor, the one-shot fresh-block window of the last match, the private-to-canonical
block map of recompute overlap, the routed-expert enrichment watermark and the statistics
suppression flag. The trie writes these fields; nothing else does.

Lifetimes:
- ``block_keys`` / ``block_sums`` / ``key_sum`` / ``mm_blocks``: grow with the sequence; valid
  for one keyer (``keyer_id``) and from block ``keys_from`` on (keys resume at a verified node
  instead of hashing the prefix before it). ``mm_blocks`` maps a block index to the multimodal
  spans overlapping it.
- ``owner``: the trie whose node handles every field below refers to (its ``trie_id``); a
  sequence holding no blocks moves to another trie by forgetting them, one holding blocks
  cannot.
- ``borrowed`` / ``borrowed_depth``: the trie node whose path the first ``borrowed_depth``
  table entries borrow (one pin on the node instead of a reference per block); set by a match
  from the root, undone by its rollback, released with the table.
- ``cursor``: the trie node up to which the block table holds the path's blocks (canonical, or
  private blocks mapped in ``trie_block_map``), with its generation; set by match and allocate,
  reset by rollback and release. A cursor whose node was evicted is detected in O(1).
- ``verified``: the deepest trie node whose whole path was compared exactly with the
  sequence's tokens (ingest); a later match or allocate only compares tokens beyond it. It is
  a cache of a fact, not tentative state, so rollback keeps it.
- ``fresh_range``: set by match, consumed and cleared by the next allocate.
- ``trie_block_map``: lives as long as the private blocks it maps stay on the sequence.
- ``recompute_blocks``: policy of the sequence's decoding strategy; never cleared.
- ``experts_cached_blocks``: blocks whose routed experts were already offered to the trie.
- ``restore`` / ``restore_pinned``: the published checkpoint a hybrid match selected; pinned
  from admission until its restore copy is queued; cleared by unpin, rollback and release.
- ``pending_save``: the reserved (unpublished) checkpoint this sequence's next forward saves
  into; cleared by publish, discard and release.
- ``producer_pin``: the checkpoint this sequence just published and whose save copy is still
  in flight; cleared at the engine's output boundary (``unpin_save``).
- ``decode_checkpoint``: the sequence's single replaceable decode checkpoint;
  ``retiring_decode_checkpoint`` is the one it replaces while the new one's save is in flight
  (released when that save completes, restored if it is abandoned).
- ``records_missing_experts``: its published partial checkpoints still waiting for the tail's
  routed-expert rows (they arrive with the forward's output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hybridcache.types import NO_NODE, MultimodalSpan

if TYPE_CHECKING:  # type-only: checkpoint_record and node import neither sequence nor this module
    from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointSearch
    from hybridcache.prefix_cache.node import NodePath


@dataclass
class PrefixState:
    block_keys: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    block_sums: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    num_keys: int = 0
    keys_from: int = 0
    key_sum: int = 0
    keyer_id: int = -1
    mm_blocks: dict[int, tuple[MultimodalSpan, ...]] = field(default_factory=dict)
    owner: int = -1
    borrowed: int = NO_NODE
    borrowed_depth: int = 0
    cursor: int = NO_NODE
    cursor_generation: int = -1
    verified: int = NO_NODE
    verified_generation: int = -1
    path: NodePath | None = None  # the path of ``verified``, reused while it is unchanged
    found: CheckpointSearch | None = None  # the checkpoint search ingest did, reused while it stays usable
    fresh_range: tuple[int, int] = (0, 0)
    trie_block_map: dict[int, int] = field(default_factory=dict)
    recompute_blocks: int = 0
    experts_cached_blocks: int = 0
    suppress_stats: bool = False
    restore: CheckpointRecord | None = None
    restore_pinned: bool = False
    pending_save: CheckpointRecord | None = None
    producer_pin: CheckpointRecord | None = None
    decode_checkpoint: CheckpointRecord | None = None
    retiring_decode_checkpoint: CheckpointRecord | None = None
    records_missing_experts: list[CheckpointRecord] = field(default_factory=list)

    def in_fresh_range(self, block_index: int) -> bool:
        start, end = self.fresh_range
        return start <= block_index < end

    def clear_cursor(self) -> None:
        self.cursor = NO_NODE
        self.cursor_generation = -1

    def clear_tracking(self) -> None:
        """Forget everything tied to the blocks the sequence holds (keeps keys and policy)."""
        self.clear_cursor()
        self.fresh_range = (0, 0)
        self.trie_block_map = {}
        self.experts_cached_blocks = 0
