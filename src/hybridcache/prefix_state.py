"""Per-sequence prefix-cache protocol state.

Owns: what the prefix cache remembers about one sequence between calls: its cached block keys,
its trie cursor, the one-shot fresh-block window of the last match, the private-to-canonical
block map of recompute overlap, the routed-expert enrichment watermark and the statistics
suppression flag. The trie writes these fields; nothing else does.

Lifetimes:
- ``block_keys`` / ``key_sum`` / ``mm_blocks``: grow with the sequence; valid for one keyer
  (``keyer_id``). ``mm_blocks`` maps a block index to the multimodal spans overlapping it.
- ``cursor``: deepest trie node known to match, with the generation it had; set by match and
  allocate, reset by rollback and release. A cursor whose node was evicted is detected in O(1).
- ``fresh_range``: set by match, consumed and cleared by the next allocate.
- ``trie_block_map``: lives as long as the private blocks it maps stay on the sequence.
- ``recompute_blocks``: policy of the sequence's decoding strategy; never cleared.
- ``experts_cached_blocks``: blocks whose routed experts were already offered to the trie.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NO_NODE = -1


@dataclass
class PrefixState:
    block_keys: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    num_keys: int = 0
    key_sum: int = 0
    keyer_id: int = -1
    mm_blocks: dict = field(default_factory=dict)
    cursor: int = NO_NODE
    cursor_generation: int = -1
    fresh_range: tuple[int, int] = (0, 0)
    trie_block_map: dict[int, int] = field(default_factory=dict)
    recompute_blocks: int = 0
    match_start_step: int = -1
    experts_cached_blocks: int = 0
    suppress_stats: bool = False

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
        self.match_start_step = -1
        self.experts_cached_blocks = 0
