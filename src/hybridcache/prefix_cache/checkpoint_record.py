"""A recurrent-state checkpoint record and checkpoint geometry.

A record describes the recurrent state after ``step`` tokens of one prefix, held in a
checkpoint state slot. It lives on its *anchor*: the trie node at depth ``step // block_size``
(a namespace root for ``step < block_size``). When ``step`` is mid-block the record also owns a
*frozen block*: a private copy of the KV block at index ``step // block_size`` as it was after
``step`` tokens, plus the tokens (and multimodal identity, and routed-expert rows) of that
partial *tail*. Everything before the anchor is identified by the anchor's trie path, which
cannot change while the anchor is attached (monotonic topology), so a record's exact-match
metadata is O(block_size) plus the anchor's path as a few runs of nodes (kept on the record so
a hit need not walk it), never a copy of its prefix.

Only ``checkpoint_lifecycle`` changes a record's lifecycle fields (state, slot, pins, stamp).
"""

from __future__ import annotations

import enum
import itertools
from typing import NamedTuple
from dataclasses import dataclass, field

import numpy as np

from hybridcache.prefix_cache.node import NodePath
from hybridcache.prefix_cache.stats import MissReason
from hybridcache.types import MultimodalSpan, Namespace

_record_ids = itertools.count(1)


def anchor_step(step: int, block_size: int) -> int:
    """The block boundary at or below ``step``: where the record's trie anchor ends."""
    return step - step % block_size


def tail_start(step: int, block_size: int) -> int:
    """Start of the last non-empty block-bounded range that ends at ``step``."""
    return ((step - 1) // block_size) * block_size


class CheckpointState(enum.Enum):
    RESERVED = "reserved"  # slot held, save in flight, not matchable
    PUBLISHED = "published"  # matchable
    RELEASED = "released"  # slot and frozen block returned; the record is dead


@dataclass(eq=False)
class CheckpointRecord:
    namespace: Namespace
    step: int
    anchor: int
    anchor_generation: int
    anchor_path: NodePath  # root..anchor, shared by every request verified against it
    key: tuple[int, int]
    slot: int
    frozen_block: int
    tail_tokens: np.ndarray
    tail_identity: tuple[MultimodalSpan, ...]
    producer_id: int
    is_decode: bool
    state: CheckpointState = CheckpointState.RESERVED
    restore_pins: int = 0
    producer_pins: int = 0
    stamp: int = 0
    hits: int = 0
    ready: bool = True  # False while the producer's save copy may still be in flight
    tail_experts: np.ndarray | None = None
    record_id: int = field(default_factory=lambda: next(_record_ids))

    @property
    def is_partial(self) -> bool:
        return self.tail_tokens.size > 0

    @property
    def pin_count(self) -> int:
        return self.restore_pins + self.producer_pins

    @property
    def is_published(self) -> bool:
        return self.state is CheckpointState.PUBLISHED

    @property
    def metadata_bytes(self) -> int:
        """Host bytes of exact-match metadata: the tail, its identity, the fixed fields and the
        anchor path (a few words per run; its block ids are a view of the trie's)."""
        experts = 0 if self.tail_experts is None else self.tail_experts.nbytes
        fixed = 16 * 8  # step, anchor, generation, key (2), slot, frozen block, pins, stamp, ...
        path = 64 * (len(self.anchor_path.runs) + 3)  # the path object, its run list and runs, the ids view
        return self.tail_tokens.nbytes + experts + fixed + path + 64 * len(self.tail_identity)

    def __repr__(self) -> str:
        return (
            f"CheckpointRecord(id={self.record_id}, step={self.step}, anchor={self.anchor}, slot={self.slot}, "
            f"frozen={self.frozen_block}, {self.state.value}, pins={self.restore_pins}+{self.producer_pins})"
        )


class CheckpointSearch(NamedTuple):
    """Outcome of a checkpoint search, remembered on the sequence (``prefix_state.trie.last_search``):
    the record (None on a miss), the verified path (to the anchor on a hit), how deep the KV
    trie holds the prefix beyond it, and the miss reason. It is reused outright while what it
    was searched for (``window``), the index epoch and the node table's version are unchanged."""

    record: CheckpointRecord | None
    path: NodePath
    cached_depth: int
    reason: MissReason | None
    window: tuple[int, int, int] = (0, 0, 0)  # what the search was for: see ``matchers.CheckpointMatcher.find``
    epoch: int = -1  # the index's epoch when searched
    version: int = -1  # the node table's version when searched
