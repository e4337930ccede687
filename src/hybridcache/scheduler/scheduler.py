"""Continuous batching: chunked prefill, decode, preemption by recompute, checkpoint saves.

Owns: the waiting and running queues and each request's serving state (``ServingSequence``):
its phase, runtime state slot, generated-token count and cached-token count; and the restore
pins waiting requests took on arrival (``ArrivalPins``). The cache
structures it drives (block pool, state pool, trie) own their own state.

One ``schedule`` call builds the next forward under a token budget and a cap on running
sequences: running sequences first (decode tokens and the next prefill chunks), then waiting
sequences admitted through ``CacheProtocol.admit``. A running sequence that cannot get a KV
block preempts the most recently admitted idle sequence (recompute: it goes back to the front
of the waiting queue with nothing cached on it). A request pins, on arrival, the checkpoint its
admission would restore then (``arrival_pins``), so a save beside it cannot evict what a router
predicted it restores before it is admitted; a finished request holds the checkpoint it saved at
its end for the next schedules, while its conversation's next turn is on its way. Checkpoint saves are reserved for each chunk
where the admission policy (``hybridcache.policies``, ``checkpoint_policy``; the engine's
default is ``auto``) plans one when the sequence is admitted (a prefill chunk ends there, so a
branch-point checkpoint exists in the engine too), at prefill chunk ends (``checkpoint_chunk_ends``), every
``decode_checkpoint_interval`` tokens and at the forward that finishes a request (the turn end;
``interval:N`` keeps only aligned ones). Each save names its reason and the step of the state it
is computed from, which the cache tells its eviction policy state.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hybridcache.errors import HybridCacheError, InvalidConfigError
from hybridcache.policies import (
    IntervalAdmission,
    ReferenceAdmission,
    TurnView,
    checked_state_weight,
    kind_of_step,
    resolve_policy,
)
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.protocol import CacheProtocol
from hybridcache.protocol_values import Refusal
from hybridcache.scheduler.arrival_pins import ArrivalPins
from hybridcache.sequence import Sequence
from hybridcache.types import NO_SLOT


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 256
    max_running: int = 8
    prefill_chunk: int = 64
    decode_checkpoint_interval: int = 0
    checkpoint_chunk_ends: bool = True
    checkpoint_policy: str = "reference"  # an admission + eviction pair (hybridcache.policies);
    # the engine's default is DEFAULT_POLICY (auto)
    chunk_align: int = 0  # > 0: prefill chunks also end at its multiples (tier publish steps)
    state_weight_tokens: float = 0.0  # KV tokens one checkpoint weighs (0: unknown; inf: KV is free)

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_running", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("decode_checkpoint_interval", "chunk_align"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidConfigError(f"{name} must be an int >= 0")
        try:
            resolve_policy(self.checkpoint_policy, prefill_chunk=self.prefill_chunk)
        except HybridCacheError as error:
            raise InvalidConfigError(f"checkpoint_policy: {error}") from None
        try:
            checked_state_weight(self.state_weight_tokens)
        except HybridCacheError as error:
            raise InvalidConfigError(f"state_weight_tokens: {error}") from None


@dataclass(eq=False)
class ServingSequence:
    request_id: int
    seq: Sequence
    max_new_tokens: int
    payload: object = None  # the engine's per-request data (multimodal bytes, ...)
    phase: Phase = Phase.WAITING
    runtime_slot: int = NO_SLOT
    generated: int = 0
    cached_tokens: int = 0
    miss_reason: str | None = None  # its first admission's (``Admission.miss_reason``)
    admissions: int = 0
    in_flight: bool = False
    cancelled: bool = False
    forward_failures: int = 0  # forwards carrying it that raised; after the first it runs alone
    final_routed_experts: np.ndarray | None = None  # captured when the request finishes
    view: TurnView | None = None  # what the admission policy saw when it was admitted
    planned_saves: tuple[int, ...] = ()  # checkpoint steps its admission policy asked for
    last_save_step: int = 0  # the state its next checkpoint is computed from

    @property
    def isolated(self) -> bool:
        """A forward carrying it failed: it is scheduled alone, so a failure tied to it cannot
        take other requests down with it again."""
        return self.forward_failures > 0

    @property
    def finishing(self) -> bool:
        """The next token this sequence produces is its last."""
        return self.generated + 1 >= self.max_new_tokens


@dataclass(eq=False)
class ScheduledChunk:
    entry: ServingSequence
    start: int
    end: int
    restore: CheckpointRecord | None = None
    zero_state: bool = False
    save: CheckpointRecord | None = None

    @property
    def produces_token(self) -> bool:
        return self.end == self.entry.seq.num_tokens


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.end - chunk.start for chunk in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheProtocol) -> None:
        """``cache``: the prefix cache, driven only through its engine-facing protocol (which
        tells the eviction policy state it was built with what the scheduler admits and saves)."""
        self.config = config
        self.cache = cache
        admission = resolve_policy(config.checkpoint_policy, prefill_chunk=config.prefill_chunk).admission
        self.admission = admission.for_state_weight(config.state_weight_tokens).fitted(
            cache.pool.num_blocks * cache.block_size, max(1, cache.states.num_slots - 2))
        self.waiting: deque[ServingSequence] = deque()
        self.running: list[ServingSequence] = []
        self.arrival_pins = ArrivalPins(cache)
        self.preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, entry: ServingSequence) -> None:
        entry.phase = Phase.WAITING
        self.waiting.append(entry)
        if entry.admissions == 0:
            self.arrival_pins.pin(entry.seq)

    # --- scheduling ------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        self.arrival_pins.schedule_begins()
        batch = ScheduledBatch()
        alone = self._isolated_chunk()
        if alone is not None:
            batch.chunks.append(alone)
        else:
            self._fill(batch)
        for chunk in batch.chunks:
            chunk.save = self._reserve_save(chunk)
            chunk.entry.in_flight = True
        return batch

    def _isolated_chunk(self) -> ScheduledChunk | None:
        """The next chunk of an isolated sequence, which then makes up the whole batch.
        Isolated sequences go first so that later traffic cannot starve them."""
        budget = self.config.max_batch_tokens
        for entry in self.running:
            if entry.isolated and not entry.in_flight and entry.phase is Phase.RUNNING:
                chunk = self._continue(entry, budget)
                if chunk is not None:
                    return chunk
        if self.waiting and self.waiting[0].isolated and len(self.running) < self.config.max_running:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is not None:
                self.waiting.popleft()
                return chunk
        return None

    def _fill(self, batch: ScheduledBatch) -> None:
        """Running sequences first, then waiting ones, up to the token budget; isolated
        sequences are left to ``_isolated_chunk``."""
        budget = self.config.max_batch_tokens
        for entry in list(self.running):
            if budget == 0:
                break
            if entry.in_flight or entry.phase is not Phase.RUNNING or entry.isolated:
                continue
            chunk = self._continue(entry, budget)
            if chunk is not None:
                entry.in_flight = True  # scheduled: never a preemption victim of a later chunk
                batch.chunks.append(chunk)
                budget -= chunk.end - chunk.start
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            if self.waiting[0].isolated:
                break
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            batch.chunks.append(chunk)
            budget -= chunk.end - chunk.start

    def _continue(self, entry: ServingSequence, budget: int) -> ScheduledChunk | None:
        seq = entry.seq
        start = seq.num_computed
        end = self._planned_end(entry, start, min(seq.num_tokens, start + min(budget, self.config.prefill_chunk)))
        self.cache.swap_computed_duplicates(seq)
        while not self.cache.extend(seq, end):
            if self.arrival_pins.release_all():
                continue  # a running request goes before what waiting ones pinned
            victim = self._preemption_victim(exclude=entry)
            if victim is None:
                if any(other is not entry and other.in_flight for other in self.running):
                    # Wait: once its forward is done, that sequence frees blocks or becomes a
                    # victim. Preempting ourselves instead can livelock two sequences that
                    # cannot fit together (each is recomputed while the other is in flight).
                    return None
                self.preempt(entry)
                return None
            self.preempt(victim)
        return ScheduledChunk(entry, start, end)

    def _admit(self, entry: ServingSequence, budget: int) -> ScheduledChunk | None:
        seq = entry.seq
        seq.prefix_state.suppress_stats = entry.admissions > 0  # a recompute replay is not a new query
        arrival = self.arrival_pins.release(seq)  # the match below pins it again (or a deeper one)
        branch = self.cache.branch_point(seq)

        def stop_at(start: int) -> int | None:
            self._plan(entry, start, branch)
            return self._planned_end(entry, start, seq.num_tokens)

        admitted = self.cache.admit(seq, min(budget, self.config.prefill_chunk), stop_at)
        room = admitted.refused in (Refusal.NO_STATE_SLOT, Refusal.NO_KV_BLOCKS)
        if room and not self.running and self.arrival_pins.release_all():
            # nothing will finish to make room: the pins' goes to the head, in this schedule
            admitted = self.cache.admit(seq, min(budget, self.config.prefill_chunk), stop_at)
        if not admitted.admitted:
            if arrival is not None and not (room and not self.running):
                self.arrival_pins.repin(seq, arrival)  # running requests make room as they finish
            return None
        entry.last_save_step = admitted.start
        if entry.admissions == 0:
            entry.cached_tokens, entry.miss_reason = admitted.hit_tokens, admitted.miss_reason
        entry.admissions += 1
        entry.runtime_slot = admitted.runtime_slot
        entry.phase = Phase.RUNNING
        self.running.append(entry)
        return ScheduledChunk(
            entry, admitted.start, admitted.end, restore=admitted.restore, zero_state=admitted.restore is None
        )

    def _preemption_victim(self, exclude: ServingSequence) -> ServingSequence | None:
        for entry in reversed(self.running):
            if entry is not exclude and not entry.in_flight and entry.seq.num_blocks:
                return entry
        return None

    def _plan(self, entry: ServingSequence, start: int, branch: int) -> None:
        """Ask the admission policy where this turn's checkpoints go, once its resume point is
        known (the prompt is what the sequence holds now; the turn end is decided by decode)."""
        length = entry.seq.num_tokens
        entry.view = TurnView(start, length, length, min(branch, length), self.cache.block_size)
        if not self.cache.is_hybrid:
            entry.planned_saves = ()
        elif isinstance(self.admission, ReferenceAdmission):  # today's rule: chunk ends by the config
            entry.planned_saves = (length,) if start < length else ()
        else:
            entry.planned_saves = self.admission.save_steps(entry.view)

    def _planned_end(self, entry: ServingSequence, start: int, end: int) -> int:
        """``end``, or the first planned checkpoint (or ``chunk_align`` multiple) inside
        ``(start, end)``: a chunk ends there."""
        align = self.config.chunk_align
        if align and start // align < (end - 1) // align:
            end = (start // align + 1) * align
        for step in entry.planned_saves:
            if start < step < end:
                return step
        return end

    def _reserve_save(self, chunk: ScheduledChunk) -> CheckpointRecord | None:
        if not self.cache.is_hybrid or not self.cache.enabled:
            return None
        seq, entry = chunk.entry.seq, chunk.entry
        kind = None
        if not chunk.produces_token or entry.generated == 0:
            if chunk.end in entry.planned_saves:
                kind = kind_of_step(entry.view, chunk.end)
            elif not chunk.produces_token and self.config.checkpoint_chunk_ends:
                kind = "speculative"
        if chunk.produces_token and entry.finishing and kind is None:
            kind = "turn_end" if not isinstance(self.admission, IntervalAdmission) else None
        if kind is not None:  # the cache tells the eviction policy, which may decline it
            record = self.cache.reserve_save(seq, chunk.end, kind, entry.last_save_step).record
        elif chunk.produces_token and self._decode_interval():
            record = self.cache.reserve_decode_save(seq, self._decode_interval(), entry.last_save_step).record
        else:
            record = None
        if record is None:
            return None
        entry.last_save_step = chunk.end
        return record

    def _decode_interval(self) -> int:
        """The decode checkpoint interval: the configured one, or an aligned ``interval:N``."""
        if self.config.decode_checkpoint_interval:
            return self.config.decode_checkpoint_interval
        interval = getattr(self.admission, "interval", 0)
        return interval if interval and interval % self.cache.block_size == 0 else 0

    # --- completion --------------------------------------------------------------------------

    def cancel(self, entry: ServingSequence) -> None:
        """Drop a request. One whose forward is in flight is dropped when that forward ends."""
        if entry.phase in (Phase.FINISHED, Phase.CANCELLED):
            return
        if entry.in_flight:
            entry.cancelled = True
            return
        if entry in self.waiting:
            self.waiting.remove(entry)
        self._release(entry)
        entry.phase = Phase.CANCELLED

    def complete(self, chunk: ScheduledChunk, next_token: int, expert_rows: np.ndarray | None) -> bool:
        """Apply a finished forward to the chunk's sequence. Returns True when it finished."""
        entry, seq = chunk.entry, chunk.entry.seq
        entry.in_flight = False
        if entry.cancelled:
            self.cache.forward_done(seq, chunk.start)  # its save is complete; nothing else counts
            self.cancel(entry)
            return False
        seq.set_computed(chunk.end)
        self.cache.forward_done(seq, chunk.start, expert_rows)
        if not chunk.produces_token:
            return False
        seq.append_tokens([next_token])
        entry.generated += 1
        if entry.generated < entry.max_new_tokens:
            return False
        if seq.want_routed_experts and seq.routed_experts is not None:
            entry.final_routed_experts = np.array(seq.routed_experts)
        self._release(entry)
        if self.has_work:  # otherwise no save can run before the next turn arrives and pins it
            self.arrival_pins.hold_turn_end(seq, chunk.save)
        entry.phase = Phase.FINISHED
        return True

    def abort(self, chunk: ScheduledChunk, *, retry: bool = True) -> None:
        """The forward carrying ``chunk`` failed: drop what it would have produced and send the
        sequence back to recompute from scratch, or with ``retry=False`` end it (FAILED)."""
        entry, seq = chunk.entry, chunk.entry.seq
        entry.in_flight = False
        self.cache.forward_failed(seq)
        if entry.cancelled:
            self.cancel(entry)
        elif retry:
            self.preempt(entry)
        else:
            self._release(entry)
            entry.phase = Phase.FAILED

    def drop_waiting_head(self) -> ServingSequence:
        """End the sequence at the head of the waiting queue (FAILED): it can never be admitted."""
        entry = self.waiting.popleft()
        self.arrival_pins.release(entry.seq)
        entry.phase = Phase.FAILED
        return entry

    def preempt(self, entry: ServingSequence) -> None:
        """Recompute preemption: free everything the sequence holds; it waits at the front."""
        self._release(entry)
        entry.phase = Phase.WAITING
        self.waiting.appendleft(entry)
        self.preemptions += 1

    def _release(self, entry: ServingSequence) -> None:
        self.arrival_pins.release(entry.seq)
        if entry in self.running:
            self.running.remove(entry)
        self.cache.free(entry.seq, entry.runtime_slot)
        entry.runtime_slot = NO_SLOT
        if not self.has_work:
            self.arrival_pins.release_holds()  # an idle scheduler pins nothing

    def live_sequences(self) -> list[Sequence]:
        return [*(entry.seq for entry in (*self.running, *self.waiting)), *self.arrival_pins.holders()]

    def check_invariants(self) -> None:
        running_slots = [e.runtime_slot for e in self.running]
        assert NO_SLOT not in running_slots, "a running sequence has no runtime slot"
        assert len(set(running_slots)) == len(running_slots), "two running sequences share a slot"
        assert self.cache.states.num_runtime == len(running_slots), "runtime slots leaked"
        self.arrival_pins.check_invariants([entry.seq for entry in self.waiting])
        for entry in self.waiting:
            assert entry.runtime_slot == NO_SLOT and entry.seq.num_blocks == 0, "a waiting sequence holds resources"
        assert sum(entry.seq.prefix_state.checkpoints.restore_pinned for entry in self.waiting) == len(self.arrival_pins), (
            "a waiting sequence holds a restore pin that is not its arrival pin")
        assert len(self.running) <= self.config.max_running
