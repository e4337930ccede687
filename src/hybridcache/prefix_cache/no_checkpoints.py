"""The checkpoint side of an attention-only trie: a null object with the surface of
``CheckpointLifecycle``.

Owns nothing. An attention-only model has no recurrent state, so there is nothing to reserve,
publish, pin, restore or evict; every call answers "nothing" (the same values
``CheckpointLifecycle`` returns when it declines). The trie, the scheduler and the engine call
the checkpoint side unconditionally instead of asking which kind of trie they hold.
"""

from __future__ import annotations

from hybridcache.prefix_cache.checkpoint_store import NO_RELEASE_COUNTS, Released
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.sequence import Sequence
from hybridcache.types import NO_SAVE

_NOTHING_RELEASED = Released(records=0, frozen_blocks=0)


class NoCheckpoints:
    index = None
    num_live = 0

    def release_counts(self) -> tuple[int, ...]:
        return NO_RELEASE_COUNTS

    def records_at(self, anchor: int) -> tuple[CheckpointRecord, ...]:
        return ()

    def live_records(self) -> list[CheckpointRecord]:
        return []

    def frozen_blocks(self) -> list[int]:
        return []

    def metadata_bytes(self) -> int:
        return 0

    def is_anchor_protected(self, anchor: int) -> bool:
        return False

    def reserve_save(self, seq: Sequence, step: int | None = None, *, is_decode: bool = False) -> int:
        return NO_SAVE

    def reserve_decode_save(self, seq: Sequence, interval: int) -> int:
        return NO_SAVE

    def publish_save(self, seq: Sequence, *, pin: bool = False, in_flight: bool = False) -> bool:
        return False

    def release_reservation(self, seq: Sequence) -> bool:
        return False

    def pin_restore(self, seq: Sequence) -> bool:
        return False

    def unpin_restore(self, seq: Sequence) -> bool:
        return False

    def unpin_save(self, seq: Sequence) -> bool:
        return False

    def release_failed_save(self, seq: Sequence) -> None:
        return None

    def release_sequence(self, seq: Sequence) -> None:
        return None

    def attach_pending_tail_experts(self, seq: Sequence) -> None:
        return None

    def release_anchored(self, anchor: int) -> Released:
        return _NOTHING_RELEASED

    def evict(self, count: int, cause: object = None) -> int:
        return 0

    def evict_frozen(self, count: int) -> int:
        return 0

    def invalidate_searches(self) -> None:
        return None

    def check_invariants(self, sequences=()) -> None:
        return None
