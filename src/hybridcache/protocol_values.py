"""The values ``CacheProtocol`` hands out and takes: what each call did, so no caller infers it
from counters or reads the cache's internals.

Owns nothing: frozen values. ``Admission`` (``admit``), ``SaveReservation`` (``reserve_save``,
``reserve_decode_save``), ``ForwardLanded`` (``forward_done``), ``ForwardRun``
(``run_forwards``), ``Adopted`` (``adopt``) and ``Adoption`` (what ``adopt``'s write fills).
Every call that can release checkpoints reports them by cause (``CheckpointReleases``: for a
save's slot, under state-slot or KV pressure, over an anchor's cap, replaced, stale, abandoned).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.prefix_cache.checkpoint_store import NO_RELEASES, CheckpointReleases
from hybridcache.types import NO_SLOT


class Refusal(enum.Enum):
    NOTHING_TO_RUN = "nothing_to_run"  # the token budget, or the sequence, leaves no token to compute
    NO_STATE_SLOT = "no_state_slot"  # no runtime state slot, even after evicting a checkpoint
    NO_KV_BLOCKS = "no_kv_blocks"  # too few KV blocks for the first chunk, even after eviction
    RESTORE_GONE = "restore_gone"  # the selected checkpoint vanished twice between match and pin


@dataclass(frozen=True)
class Adoption:
    """What an ``adopt`` caller writes: KV for positions ``[start, end)`` into the blocks of
    ``block_table`` it may write (``writable``; every other block of that range already holds
    exactly that KV), and the recurrent state after ``end`` tokens into state slot ``slot``."""

    start: int
    end: int
    block_table: tuple[int, ...]
    writable: frozenset[int]
    slot: int


@dataclass(frozen=True)
class Admission:
    """What ``admit`` did: the first chunk ``[start, end)``, the runtime slot and the restore
    source (None: start from a zeroed state), or why it changed nothing."""

    start: int = 0
    end: int = 0
    runtime_slot: int = NO_SLOT
    restore: CheckpointRecord | None = None
    hit_tokens: int = 0
    refused: Refusal | None = None
    miss_reason: str | None = None  # why the match restored less than the cache holds (MissReason value)

    @property
    def admitted(self) -> bool:
        return self.refused is None


@dataclass(frozen=True)
class SaveReservation:
    """What ``reserve_save`` did: the reserved record (None: no save can be had now) and the
    checkpoints released for it (``save_slots`` for its state slot, ``kv_blocks`` for the
    frozen block of a mid-block save)."""

    record: CheckpointRecord | None
    released: CheckpointReleases = NO_RELEASES

    @property
    def reserved(self) -> bool:
        return self.record is not None


@dataclass(frozen=True)
class ForwardLanded:
    """What ``forward_done`` did: the forward's save, published and now usable (None: it had
    none, or its publication failed), and the checkpoints released as it landed (its anchor
    over its cap, the sequence's replaced decode checkpoint)."""

    save: CheckpointRecord | None
    released: CheckpointReleases = NO_RELEASES

    @property
    def published(self) -> bool:
        return self.save is not None


@dataclass(frozen=True)
class ForwardRun:
    """What ``run_forwards`` did: per forward run, whether its save was published (False when
    it had none), and every checkpoint released on the way, by cause."""

    published: list[bool]
    released: CheckpointReleases = NO_RELEASES

    @property
    def completed(self) -> int:
        """Forwards run; fewer than asked when one's blocks could not be had."""
        return len(self.published)


@dataclass(frozen=True)
class Adopted:
    """What ``adopt`` did: the tokens gained (0: nothing adopted), the checkpoint published at
    the adopted step (None when none was), and the checkpoints released on the way, by cause."""

    gained: int
    checkpoint: CheckpointRecord | None = None
    released: CheckpointReleases = NO_RELEASES

    @property
    def published(self) -> bool:
        return self.checkpoint is not None
