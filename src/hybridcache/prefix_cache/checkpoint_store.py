"""The live checkpoint records and what they hold: the store under the checkpoint lifecycle.

Owns: every live checkpoint record by anchor node, its checkpoint-role state slot and frozen
KV block (returned on release), the index entries of published records, and two eviction
heaps (``lru.EvictionHeap``: all published records, and published records that own a frozen
block). ``CheckpointLifecycle`` adds the transitions that create, pin and end records; a record
only ever leaves through ``_release`` here.

An anchor holds up to ``max_per_anchor`` published records at different steps; when a newly
published one makes it hold more, its least recently used unpinned records go.

Every release is counted by its cause (``ReleaseCause``): ``release_counts`` is monotonic, so a
caller tells what one call released, and why, by the difference (``CheckpointReleases.between``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

from hybridcache.errors import AlreadyPublishedError, InvalidArgumentError, LifecycleError, PinnedError
from hybridcache.memory.protocols import KVBlockAllocator, StateSlotAllocator
from hybridcache.memory.state_pool import SlotRole
from hybridcache.prefix_cache.checkpoint_index import CheckpointIndex, Verdict, VerifyStatus
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.prefix_cache.lru import EvictionHeap
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.types import NO_BLOCK

_HEAP_SLACK = 64  # stale entries tolerated beyond twice the live records before compaction


@dataclass(frozen=True)
class Released:
    records: int
    frozen_blocks: int


class ReleaseCause(enum.IntEnum):
    """Why a record was released: the index of its count (``CheckpointReleases``' fields)."""

    SAVE_SLOT = 0
    STATE_SLOTS = 1
    KV_BLOCKS = 2
    ANCHOR_CAP = 3
    REPLACED = 4
    STALE = 5
    ABANDONED = 6
    REQUESTED = 7


@dataclass(frozen=True)
class CheckpointReleases:
    """Checkpoint records released, by cause (the fields in ``ReleaseCause`` order)."""

    save_slots: int = 0  # evicted (least valuable first) for the slot of a new save
    state_slots: int = 0  # evicted the same way under state-slot pressure (an admission's runtime slot)
    kv_blocks: int = 0  # evicted with their anchor leaf, or for their frozen block (KV pressure)
    anchor_cap: int = 0  # beyond their anchor's cap when a newer save there became usable
    replaced: int = 0  # a sequence's decode checkpoint, replaced by its next one
    stale: int = 0  # found stale by a match
    abandoned: int = 0  # a reservation or save whose forward was abandoned or failed
    requested: int = 0  # released by an explicit ``release`` call

    @classmethod
    def between(cls, before: tuple[int, ...], after: tuple[int, ...]) -> CheckpointReleases:
        """What was released between two ``release_counts``."""
        return cls(*(later - earlier for earlier, later in zip(before, after)))

    @property
    def total(self) -> int:
        return sum(getattr(self, field.name) for field in fields(self))


NO_RELEASES = CheckpointReleases()
NO_RELEASE_COUNTS = (0,) * len(ReleaseCause)


class CheckpointStore:
    def __init__(
        self,
        nodes: NodeTable,
        index: CheckpointIndex,
        pool: KVBlockAllocator,
        states: StateSlotAllocator,
        block_size: int,
        max_per_anchor: int,
        score: Callable[[CheckpointRecord], object] | None,
    ) -> None:
        if isinstance(max_per_anchor, bool) or not isinstance(max_per_anchor, int) or max_per_anchor < 1:
            raise InvalidArgumentError("max_per_anchor must be an int >= 1")
        self._nodes = nodes
        self._index = index
        self._pool = pool
        self._states = states
        self._block_size = block_size
        self._max_per_anchor = max_per_anchor
        self._by_anchor: dict[int, list[CheckpointRecord]] = {}
        self._lru = self._eviction_heap(score)  # published records (state-slot pressure)
        self._frozen_lru = self._eviction_heap(score)  # published partial records (KV pressure)
        self._num_live = 0
        self._released = [0] * len(ReleaseCause)

    def release_counts(self) -> tuple[int, ...]:
        """Records released so far, by ``ReleaseCause`` (monotonic)."""
        return tuple(self._released)

    def _add(self, record: CheckpointRecord) -> None:
        """A new reservation joins the live records of its anchor."""
        self._by_anchor.setdefault(record.anchor, []).append(record)
        self._num_live += 1

    @property
    def index(self) -> CheckpointIndex:
        return self._index

    @property
    def num_live(self) -> int:
        return self._num_live

    def records_at(self, anchor: int) -> tuple[CheckpointRecord, ...]:
        return tuple(self._by_anchor.get(anchor, ()))

    def live_records(self) -> list[CheckpointRecord]:
        return [record for records in self._by_anchor.values() for record in records]

    def is_anchor_protected(self, anchor: int) -> bool:
        """A node anchoring a pinned record must not be evicted."""
        return any(record.pin_count for record in self._by_anchor.get(anchor, ()))

    @property
    def metadata_bytes(self) -> int:
        return sum(record.metadata_bytes for record in self.live_records())

    def frozen_blocks(self) -> list[int]:
        return [r.frozen_block for r in self.live_records() if r.frozen_block != NO_BLOCK]

    def publish(self, record: CheckpointRecord) -> None:
        """Index a reserved record. Publishing twice, or a released record, raises."""
        if record.state is CheckpointState.PUBLISHED:
            raise AlreadyPublishedError(f"{record} is already published")
        if record.state is not CheckpointState.RESERVED:
            raise LifecycleError(f"{record} was released")
        self._index.add(record)
        record.state = CheckpointState.PUBLISHED
        self._touch(record)
        if self._nodes.changes is not None:
            self._nodes.changes.published.append(record)

    def _enforce_anchor_cap(self, newest: CheckpointRecord) -> None:
        published = [r for r in self._by_anchor.get(newest.anchor, ()) if r.is_published]
        surplus = len(published) - self._max_per_anchor
        if surplus <= 0:
            return
        for record in sorted((r for r in published if r is not newest and r.pin_count == 0), key=lambda r: r.stamp):
            if surplus == 0:
                break
            self.release(record, ReleaseCause.ANCHOR_CAP)
            surplus -= 1

    def release(self, record: CheckpointRecord, cause: ReleaseCause = ReleaseCause.REQUESTED) -> None:
        """Return a record's slot and frozen block. A pinned record raises; releasing twice
        raises."""
        if record.pin_count:
            raise PinnedError(f"cannot release pinned {record}")
        if record.state is CheckpointState.RELEASED:
            raise LifecycleError(f"{record} was already released")
        self._release(record, cause)

    def _release(self, record: CheckpointRecord, cause: ReleaseCause) -> None:
        self._released[cause] += 1
        if record.state is CheckpointState.PUBLISHED:
            self._index.remove(record)
            if self._nodes.changes is not None:
                self._nodes.changes.released.append(record.record_id)
        record.state = CheckpointState.RELEASED
        if record.frozen_block != NO_BLOCK:
            self._pool.unref([record.frozen_block])
        self._states.free_checkpoint(record.slot)
        records = self._by_anchor[record.anchor]
        records.remove(record)
        if not records:
            del self._by_anchor[record.anchor]
        self._num_live -= 1

    def release_anchored(self, anchor: int) -> Released:
        """Release every record on an anchor that was just evicted (none can be pinned)."""
        records = list(self._by_anchor.get(anchor, ()))
        frozen = sum(record.frozen_block != NO_BLOCK for record in records)
        for record in records:
            self._release(record, ReleaseCause.KV_BLOCKS)
        return Released(records=len(records), frozen_blocks=frozen)

    def evict(self, count: int, cause: ReleaseCause = ReleaseCause.STATE_SLOTS) -> int:
        """Release up to ``count`` least recently used unpinned published records (state-slot
        pressure; ``cause`` says whose). Returns how many were released."""
        return self._evict_from(self._lru, count, cause)

    def evict_frozen(self, count: int) -> int:
        """Release up to ``count`` least recently used partial records (KV pressure); each one
        frees one frozen block. Returns how many were released."""
        return self._evict_from(self._frozen_lru, count, ReleaseCause.KV_BLOCKS)

    def _evict_from(self, heap: EvictionHeap[CheckpointRecord], count: int, cause: ReleaseCause) -> int:
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise InvalidArgumentError("count must be a non-negative int")
        released = 0
        set_aside = []
        while released < count:
            entry = heap.pop()
            if entry is None:
                break
            record = entry[3]
            if record.pin_count:
                set_aside.append(entry)
                continue
            self._release(record, cause)
            released += 1
        heap.restore(set_aside)
        return released

    @staticmethod
    def _eviction_heap(score: Callable[[CheckpointRecord], object] | None = None) -> EvictionHeap[CheckpointRecord]:
        """Records by ``score`` (recency by default); an entry is live while its record is
        published with the stamp it was filed under (every touch files the record again)."""
        return EvictionHeap(score or _stamp_of, _id_of, _filed_and_published, _HEAP_SLACK)

    def _touch(self, record: CheckpointRecord) -> None:
        record.stamp = self._pool.tick()
        self._lru.push(record, record.stamp, self._num_live)
        if record.is_partial:
            self._frozen_lru.push(record, record.stamp, self._num_live)

    def clean_stale(self, record: CheckpointRecord, key: tuple[int, int], verdict: Verdict) -> None:
        """Act on a non-hit verdict from matching: drop a stale index entry, release a stale
        record unless it is pinned. A request mismatch changes nothing."""
        if verdict.status is VerifyStatus.STALE_INDEX_ENTRY:
            self._index.remove(record, key)
        elif verdict.status is VerifyStatus.STALE_CHECKPOINT:
            if record.pin_count:
                return
            self._index.remove(record, key)
            if record.state is not CheckpointState.RELEASED:
                self._release(record, ReleaseCause.STALE)

    def _check_records(self) -> None:
        """Every live record owns one checkpoint slot (and at most one frozen block with a single
        reference); published records are indexed exactly once under their key on an attached
        anchor; nothing released is indexed."""
        self._states.check_invariants()
        live = self.live_records()
        assert len(live) == self._num_live, "live record count drifted"
        slots = [record.slot for record in live]
        assert len(set(slots)) == len(slots), "two records share a state slot"
        assert self._states.num_checkpoint == len(live), "checkpoint slots differ from live records"
        for record in live:
            assert self._states.role_of(record.slot) is SlotRole.CHECKPOINT
            assert record.state is not CheckpointState.RELEASED
            assert record.pin_count >= 0 and record.restore_pins >= 0 and record.producer_pins >= 0
            if record.frozen_block != NO_BLOCK:
                assert self._pool.refcount_of(record.frozen_block) == 1, "frozen block shared"
            if record.is_published:
                assert self._nodes.is_valid(record.anchor, record.anchor_generation), "published on a detached anchor"
                assert int(self._nodes.depth[record.anchor]) == record.step // self._block_size
                assert (record.anchor_path.node, record.anchor_path.generation) == (
                    record.anchor,
                    record.anchor_generation,
                ), "a record keeps another node's path"
                self._nodes.check_path(record.anchor_path)
            elif record.state is CheckpointState.RESERVED:
                assert record.pin_count == 0, "a reservation is pinned"
        entries = list(self._index.entries())
        indexed = [record for _, record in entries]
        assert len({id(r) for r in indexed}) == len(indexed), "a record is indexed twice"
        for key, record in entries:
            assert record.is_published and key == record.key, "stale or foreign index entry"
        assert {id(r) for r in indexed} == {id(r) for r in live if r.is_published}, "published record not indexed"
        frozen = [r.frozen_block for r in live if r.frozen_block != NO_BLOCK]
        assert len(set(frozen)) == len(frozen), "two records share a frozen block"


# Module-level (not lambdas) so that a lifecycle pickles.
def _stamp_of(record: CheckpointRecord) -> int:
    return record.stamp


def _id_of(record: CheckpointRecord) -> int:
    return record.record_id


def _filed_and_published(record: CheckpointRecord, stamp: int) -> bool:
    return record.is_published and record.stamp == stamp
