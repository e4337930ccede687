"""Checkpoint lifecycle: reserve, publish, pin, unpin, release, evict, stale cleanup.

Owns: the transitions of checkpoint records (reserve, publish, pin, unpin, abandon) and the
checkpoint fields of a sequence's ``prefix_state`` (pending save, restore selection, producer
pin, decode checkpoint). The live records, their slots and frozen blocks, and the eviction
order belong to ``CheckpointStore`` (checkpoint_store.py), which this class extends.

States: absent -> RESERVED (slot and frozen block held, save in flight, not matchable) ->
PUBLISHED (indexed, matchable) -> RELEASED. Pins (restore pins, the producer pin) overlay a
published record; a pinned record is never released or evicted.

An anchor may hold several records at different steps (bounded by ``max_per_anchor``). A new
save never replaces a published record before it is itself published; when the anchor then
holds too many, its least recently used unpinned records go. So an abandoned save loses
nothing, and a checkpoint that keeps serving hits outlives a newer one that does not.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hybridcache.errors import (
    ForeignSequenceError,
    InvalidArgumentError,
    InvalidStepError,
    InvalidTypeError,
    LifecycleError,
    OutOfBlocksError,
    OutOfStateSlotsError,
    PinUnderflowError,
)
from hybridcache.memory.protocols import KVBlockAllocator, StateSlotAllocator
from hybridcache.memory.state_pool import SlotRole
from hybridcache.prefix_cache.checkpoint_index import CheckpointIndex
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState, anchor_step
from hybridcache.prefix_cache.checkpoint_store import CheckpointStore, ReleaseCause
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.sequence import Sequence
from hybridcache.types import NO_BLOCK, NO_SAVE, as_int


class CheckpointLifecycle(CheckpointStore):
    def __init__(
        self,
        nodes: NodeTable,
        index: CheckpointIndex,
        pool: KVBlockAllocator,
        states: StateSlotAllocator,
        block_size: int,
        max_per_anchor: int = 4,
        *,
        owner: int = -1,
        score: Callable[[CheckpointRecord], object] | None = None,
        free_kv_blocks: Callable[[int, int], int] | None = None,
    ) -> None:
        """``owner`` is the id of the trie whose sequences this lifecycle serves: a sequence
        claimed by another trie is refused by every call that takes one. ``score(record)``
        orders both eviction heaps (lowest goes first; default: the record's recency stamp):
        the eviction policy seam (see ``lru``). ``free_kv_blocks(n, keep)`` is the owner's KV
        eviction (``BlockTrie.free_kv_blocks``, keeping node ``keep`` and so its path), asked
        for the frozen block of a mid-block save when the pool has none free, keeping the
        saving sequence's cursor; without it such a save is refused under KV pressure."""
        super().__init__(nodes, index, pool, states, block_size, max_per_anchor, score)
        self._owner = owner
        self._free_kv_blocks = free_kv_blocks

    def invalidate_searches(self) -> None:
        """Something that could turn a remembered miss into a hit happened (blocks computed,
        routed-expert rows cached): remembered checkpoint searches are redone."""
        self._index.invalidate_searches()

    def _require_own(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise InvalidTypeError(f"expected a Sequence, got {type(seq).__name__}")
        owner = seq.prefix_state.trie.owner
        if owner >= 0 and owner != self._owner:
            raise ForeignSequenceError("the sequence belongs to another trie")

    def reserve_save(self, seq: Sequence, step: int | None = None, *, is_decode: bool = False) -> int:
        """Reserve a checkpoint of ``seq``'s state after ``step`` tokens (default: all valid
        tokens). Returns the state slot to save into, or -1 when no save is possible now.

        Requires the sequence's blocks up to the anchor to be attached (``BlockTrie.allocate``).
        A save needs: a step in ``(0, num_valid]`` outside every multimodal span (aligned for a
        decode save), no equal record at the anchor, a free slot (one checkpoint may be evicted
        for it) and, mid-block, a free KV block for the frozen copy, checked *before* anything is
        evicted.
        """
        self._require_own(seq)
        step = seq.num_valid if step is None else as_int("step", step)
        if not 0 < step <= seq.num_valid:
            raise InvalidStepError(f"checkpoint step {step} outside (0, {seq.num_valid}]")
        self.release_reservation(seq)
        if not seq.is_boundary_safe(step):
            return NO_SAVE
        partial = step % self._block_size != 0
        if is_decode and partial:
            return NO_SAVE
        anchor = self._anchor_for(seq, step)
        if anchor is None or self._has_equal_record(anchor, seq, step):
            return NO_SAVE
        if partial and self._pool.num_free == 0 and not self._make_kv_room(seq):
            return NO_SAVE
        if self._states.num_free_checkpoint == 0 and self.evict(1, ReleaseCause.SAVE_SLOT) == 0:
            return NO_SAVE
        if self._anchor_for(seq, step) != anchor:  # an eviction released the empty namespace's root it was
            return NO_SAVE
        try:
            slot = self._states.allocate_checkpoint()
        except OutOfStateSlotsError:
            return NO_SAVE
        frozen = NO_BLOCK
        if partial:
            try:
                frozen = int(self._pool.allocate(1)[0])
            except OutOfBlocksError:
                self._states.free_checkpoint(slot)
                return NO_SAVE
        start = anchor_step(step, self._block_size)
        anchor_path = self._nodes.path_to(anchor)
        record = CheckpointRecord(
            namespace=seq.namespace,
            step=step,
            anchor=anchor,
            anchor_generation=anchor_path.generation,
            anchor_path=anchor_path,
            key=(step, self._nodes.last_block_value(anchor)),
            slot=slot,
            frozen_block=frozen,
            tail_tokens=_frozen_copy(seq.token_view(start, step)),
            tail_identity=seq.spans_overlapping(start, step),
            producer_id=seq.seq_id,
            is_decode=is_decode,
        )
        self._attach_tail_experts(seq, record)
        self._add(record)
        seq.prefix_state.checkpoints.pending_save = record
        return slot

    def reserve_decode_save(self, seq: Sequence, interval: int) -> int:
        """Reserve the sequence's periodic decode checkpoint at its current length, when that
        length is a positive multiple of ``interval`` (itself a multiple of the block size)."""
        self._require_own(seq)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise InvalidArgumentError("interval must be a non-negative int")
        if interval % self._block_size:
            raise InvalidArgumentError(f"interval must be a multiple of the block size {self._block_size}")
        step = seq.num_valid
        if interval == 0 or step % interval or step % self._block_size:
            return NO_SAVE
        previous = seq.prefix_state.checkpoints.decode_checkpoint
        if previous is not None and previous.step == step and previous.is_published:
            return NO_SAVE
        return self.reserve_save(seq, step, is_decode=True)

    def _make_kv_room(self, seq: Sequence) -> bool:
        """Evict for one frozen block, keeping the sequence's cursor (valid here: the anchor
        lies on its path), and so the anchor, attached."""
        if self._free_kv_blocks is None:
            return False
        return self._free_kv_blocks(1, seq.prefix_state.trie.cursor) > 0 and self._pool.num_free > 0

    def _anchor_for(self, seq: Sequence, step: int) -> int | None:
        state = seq.prefix_state
        position = state.trie
        depth = step // self._block_size
        if depth == 0:
            return self._nodes.find_root(seq.namespace)
        if not self._nodes.is_valid(position.cursor, position.cursor_generation):
            return None
        cursor_depth = int(self._nodes.depth[position.cursor])
        if cursor_depth < depth:
            return None
        _, anchor = self._nodes.path_runs(position.cursor, depth)
        return anchor

    def _has_equal_record(self, anchor: int, seq: Sequence, step: int) -> bool:
        start = anchor_step(step, self._block_size)
        for record in self._by_anchor.get(anchor, ()):
            if record.step == step and np.array_equal(record.tail_tokens, seq.token_view(start, step)):
                if record.tail_identity == seq.spans_overlapping(start, step):
                    return True
        return False

    def _attach_tail_experts(self, seq: Sequence, record: CheckpointRecord) -> None:
        if not record.is_partial or not seq.want_routed_experts or record.tail_experts is not None:
            return
        if seq.num_routed_experts >= record.step:
            start = anchor_step(record.step, self._block_size)
            record.tail_experts = _frozen_copy(seq.routed_experts[start : record.step])

    def attach_pending_tail_experts(self, seq: Sequence) -> None:
        """Give the sequence's published partial checkpoints the tail expert rows that arrived
        after publication (rows come with a forward's output)."""
        self._require_own(seq)
        waiting = seq.prefix_state.checkpoints.records_missing_experts
        for record in list(waiting):
            if record.state is not CheckpointState.PUBLISHED:
                waiting.remove(record)
                continue
            self._attach_tail_experts(seq, record)
            if record.tail_experts is not None:
                waiting.remove(record)

    def release_reservation(self, seq: Sequence) -> bool:
        """Drop the sequence's unpublished reservation (its forward was abandoned)."""
        self._require_own(seq)
        state = seq.prefix_state
        refs = state.checkpoints
        record = refs.pending_save
        refs.pending_save = None
        if record is None or record.state is not CheckpointState.RESERVED:
            return False
        self._release(record, ReleaseCause.ABANDONED)
        return True

    def publish_save(self, seq: Sequence, *, pin: bool = False, in_flight: bool = False) -> bool:
        """Make the sequence's reserved save matchable, after its save copy is queued.

        Transactional: the record must still be reserved, owned by this sequence, with its slot
        and frozen block, on an attached anchor. Otherwise the reservation is released and
        nothing is indexed. ``pin`` takes the producer pin (held until the copy completes).
        ``in_flight`` (with ``pin``) keeps the record unusable until ``unpin_save``, for engines
        that may still abandon the forward carrying the save copy.
        Returns whether a checkpoint was published.
        """
        self._require_own(seq)
        state = seq.prefix_state
        refs = state.checkpoints
        record = refs.pending_save
        if record is None:
            return False
        if pin and refs.producer_pin is not None:
            raise LifecycleError("the sequence already holds a producer pin")
        refs.pending_save = None
        if not self._publishable(seq, record):
            if record.state is CheckpointState.RESERVED:
                self._release(record, ReleaseCause.ABANDONED)
            return False
        self.publish(record)
        if seq.want_routed_experts and record.is_partial and record.tail_experts is None:
            refs.records_missing_experts.append(record)
        if record.is_decode:
            previous, refs.decode_checkpoint = refs.decode_checkpoint, record
            if pin and in_flight:
                refs.retiring_decode_checkpoint = previous  # released once this save completes
            else:
                self._release_replaced(previous)
        if pin:
            record.producer_pins += 1
            record.ready = not in_flight
            refs.producer_pin = record
        if not (pin and in_flight):  # an in-flight save may still be abandoned: trim when it lands
            self._enforce_anchor_cap(record)
        return True

    def _publishable(self, seq: Sequence, record: CheckpointRecord) -> bool:
        return (
            record.state is CheckpointState.RESERVED
            and record.producer_id == seq.seq_id
            and record.step <= seq.num_valid
            and self._nodes.is_valid(record.anchor, record.anchor_generation)
            and self._states.role_of(record.slot) is SlotRole.CHECKPOINT
            and (record.frozen_block == NO_BLOCK or self._pool.refcount_of(record.frozen_block) == 1)
        )

    def select_restore(self, seq: Sequence, record: CheckpointRecord) -> None:
        """Select ``record`` as the restore of ``seq``'s hit: the match, after ``BlockTrie.match``
        claimed the sequence and refused one whose restore is pinned, or ``hold_restore``."""
        seq.prefix_state.checkpoints.restore = record

    def pin_restore(self, seq: Sequence) -> bool:
        """Pin the selected restore until its copy is queued. False when nothing is selected,
        it is already pinned, or the checkpoint is gone (the match must then be dropped)."""
        self._require_own(seq)
        return self._pin_selected(seq, counts_hit=True)

    def hold_restore(self, seq: Sequence, record: CheckpointRecord) -> bool:
        """Select and pin ``record`` for ``seq`` before its admission (a request waiting in a
        queue), without counting a hit: the admission's own match counts it. Released with
        ``unpin_restore``. False as ``pin_restore``, the selection then unchanged."""
        self._require_own(seq)
        if not isinstance(record, CheckpointRecord):
            raise InvalidArgumentError("hold_restore takes a checkpoint record")
        if seq.prefix_state.checkpoints.restore_pinned or not record.is_published:
            return False
        if not any(live is record for live in self.records_at(record.anchor)):
            raise InvalidArgumentError("hold_restore takes a checkpoint record of this cache")
        self.select_restore(seq, record)
        return self._pin_selected(seq, counts_hit=False)

    def _pin_selected(self, seq: Sequence, counts_hit: bool) -> bool:
        refs = seq.prefix_state.checkpoints
        record = refs.restore
        if record is None or refs.restore_pinned or not record.is_published:
            return False
        record.restore_pins += 1
        record.hits += counts_hit
        refs.restore_pinned = True
        self._touch(record)
        return True

    def pin_selected_restores(self, seqs: list[Sequence], records: list[CheckpointRecord], stamps: list[int]) -> None:
        """``select_restore`` then ``pin_restore`` of each published ``records[k]`` for
        ``seqs[k]`` (its own, its restore not pinned), its recency stamped ``stamps[k]`` (ticks
        the caller took where ``pin_restore``'s would have been): a batch of admissions."""
        for seq, record, stamp in zip(seqs, records, stamps):
            refs = seq.prefix_state.checkpoints
            refs.restore = record
            refs.restore_pinned = True
            record.restore_pins += 1
            record.hits += 1
            record.stamp = stamp
        self._lru.push_many(records, stamps, self._num_live)
        partial = [k for k, record in enumerate(records) if record.is_partial]
        if partial:
            self._frozen_lru.push_many([records[k] for k in partial], [stamps[k] for k in partial], self._num_live)

    def unpin_restore(self, seq: Sequence) -> bool:
        """Release the restore pin (at the boundary after the restore copy is queued) and clear
        the selection. False when no pin is held."""
        self._require_own(seq)
        state = seq.prefix_state
        refs = state.checkpoints
        if not refs.restore_pinned:
            return False
        self._unpin(refs.restore, producer=False)
        refs.restore = None
        refs.restore_pinned = False
        return True

    def unpin_save(self, seq: Sequence) -> bool:
        """Release the producer pin at the boundary after the save copy completed; the
        checkpoint becomes usable by later matches."""
        self._require_own(seq)
        state = seq.prefix_state
        refs = state.checkpoints
        record = refs.producer_pin
        if record is None:
            return False
        self._unpin(record, producer=True)
        record.ready = True
        self.invalidate_searches()
        refs.producer_pin = None
        if record.is_published:
            self._enforce_anchor_cap(record)
        self._release_replaced(refs.retiring_decode_checkpoint)
        refs.retiring_decode_checkpoint = None
        return True

    def _release_replaced(self, record: CheckpointRecord | None) -> None:
        """Release a sequence's replaced decode checkpoint unless something still pins it."""
        if record is not None and record.is_published and record.pin_count == 0:
            self.release(record, ReleaseCause.REPLACED)

    def release_failed_save(self, seq: Sequence) -> None:
        """The forward that should have written the sequence's save failed: drop the pending
        reservation, or the record published for it (unpinning it first)."""
        self._require_own(seq)
        state = seq.prefix_state
        refs = state.checkpoints
        record = refs.producer_pin
        if record is not None:
            self._unpin(record, producer=True)
            refs.producer_pin = None
            if refs.decode_checkpoint is record:
                refs.decode_checkpoint = refs.retiring_decode_checkpoint
            refs.retiring_decode_checkpoint = None
            if record.state is not CheckpointState.RELEASED and record.pin_count == 0:
                self._release(record, ReleaseCause.ABANDONED)
        self.release_reservation(seq)

    def _unpin(self, record: CheckpointRecord, *, producer: bool) -> None:
        count = record.producer_pins if producer else record.restore_pins
        if count <= 0:
            raise PinUnderflowError(f"{record} is not pinned")
        if producer:
            record.producer_pins -= 1
        else:
            record.restore_pins -= 1

    def release_sequence(self, seq: Sequence) -> None:
        """A sequence ends: drop its reservation and restore pin; the producer pin stays until
        the engine's output boundary releases it."""
        self._require_own(seq)
        self.release_reservation(seq)
        self.unpin_restore(seq)
        state = seq.prefix_state
        refs = state.checkpoints
        refs.restore = None
        refs.decode_checkpoint = None
        refs.records_missing_experts = []

    def check_invariants(self, sequences=()) -> None:
        """The records' invariants, and that every pin is held by one of ``sequences``."""
        self._check_records()
        live = self.live_records()
        restore_pins = {}
        producer_pins = {}
        for seq in sequences:
            state = seq.prefix_state
            refs = state.checkpoints
            if refs.restore_pinned:
                restore_pins[id(refs.restore)] = restore_pins.get(id(refs.restore), 0) + 1
            if refs.producer_pin is not None:
                producer_pins[id(refs.producer_pin)] = producer_pins.get(id(refs.producer_pin), 0) + 1
        for record in live:  # ``sequences`` is every live one: a pin nobody holds is a leak
            assert record.restore_pins == restore_pins.get(id(record), 0), "restore pins without owners"
            assert record.producer_pins == producer_pins.get(id(record), 0), "producer pins without owners"

def _frozen_copy(array: np.ndarray) -> np.ndarray:
    copy = np.array(array, copy=True)
    copy.flags.writeable = False
    return copy
