"""The engine-facing protocol: what an engine calls, in order, to serve with the prefix cache.

Owns nothing between calls (every structure belongs to the pools and the trie it drives). A
request's life is four steps:

1. ``prepare(seq)`` when it arrives: ingest, exact verification, remembered on the sequence.
2. ``admit(seq, tokens)`` when the scheduler wants to run it: match, pin the restore, free what
   pressure needs, take a runtime state slot and the blocks of the first chunk, attach, commit;
   or change nothing and say why (``Admission.refused``). ``extend(seq, end)`` makes room for a
   running sequence's next chunk the same way. ``admit_many(seqs, budgets)`` is ``admit`` for
   a scheduler step's sequences in one call, every argument checked before the first.
3. The forward boundaries: ``reserve_save`` / ``reserve_decode_save`` before a forward is
   queued, ``forward_queued`` right after (publishes the save pinned and in flight, releases the
   restore pin), and ``forward_done`` after its output (the save becomes usable, computed nodes
   become matchable) or ``forward_failed`` (nothing it would have produced stays matchable).
4. ``free(seq, runtime_slot)`` when it ends: blocks and checkpoints stay cached until evicted.

``run_forwards(seq, ends, saves)`` is step 3 for several forwards of one sequence in a row
(with nothing else queued between them): one call for a chunk cut at every save step, making
the same calls in the same order as the one-by-one boundaries, so the same decisions and
records, without a Python round trip per save.

An eviction policy that learns from the producer (``eviction_view.ProducerNotes``) is told
here, not by each caller: every admission (not a replay's ``suppress_stats`` pass), every save
given a reason (it may decline it) and every one reserved, with the step it is computed from.

``adopt(seq, step, write)`` makes a prefix computed elsewhere (fetched from a lower tier or
another replica's store) cached here, through the same four steps with the caller's ``write``
in place of a forward.

Every call says what it did in a frozen value (``protocol_values``): the admission, the
reserved record, the save a landed forward made usable, what an adoption gained and published,
and the checkpoints each released on the way, by cause. ``branch_point``, ``cached_prefix``,
``stats`` and ``released_checkpoints`` answer the rest, so a caller never reads the trie.

How one admission is decided and taken (match, room, allocation, commit) is
``admission_steps.AdmissionSteps``; the batch side of ``admit_many`` is ``batch_admission``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from collections.abc import Sequence as SequenceLike

import numpy as np

from hybridcache.admission_steps import AdmissionSteps
from hybridcache.batch_admission import admit_batch, validated_batch
from hybridcache.cache import CacheComponents
from hybridcache.errors import AdoptionWriteError, InvalidStepError, InvalidTypeError
from hybridcache.memory.protocols import BatchBlockAllocator, BatchSlotAllocator
from hybridcache.prefix_cache.change_log import CacheChanges
from hybridcache.prefix_cache.attach import forward_start
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.policies.admission import SPECULATIVE, checked_kind
from hybridcache.prefix_cache.checkpoint_store import NO_RELEASE_COUNTS, NO_RELEASES, CheckpointReleases
from hybridcache.prefix_cache.eviction_view import UNHEEDED_NOTES, ProducerNotes
from hybridcache.protocol_args import (
    called_back,
    forward_ends,
    forward_saves,
    require_not_in_flight,
    require_sequence,
    require_unpinned_save,
    runtime_slot_of,
    token_count,
)
from hybridcache.protocol_values import Admission, Adopted, Adoption, ForwardLanded, ForwardRun, Refusal, SaveReservation
from hybridcache.sequence import Sequence
from hybridcache.types import NO_SAVE, NO_SLOT, as_int

# the protocol and the values its calls answer with, importable from here
__all__ = ["Admission", "Adopted", "Adoption", "CacheProtocol", "ForwardLanded", "ForwardRun", "Refusal", "SaveReservation"]


class CacheProtocol:
    def __init__(self, components: CacheComponents) -> None:
        self._components = components
        self.pool = components.pool
        self.states = components.states
        self.trie = components.trie
        self.checkpoints = components.trie.checkpoints
        self.block_size = components.trie.block_size
        # pools that take a batch's deferred allocations in one call (admit_many)
        self._batch_pools = isinstance(self.pool, BatchBlockAllocator) and isinstance(self.states, BatchSlotAllocator)
        self._notes = components.eviction if isinstance(components.eviction, ProducerNotes) else UNHEEDED_NOTES
        self._steps = AdmissionSteps(components)

    @property
    def is_hybrid(self) -> bool:
        """Every hit restores a published recurrent-state checkpoint."""
        return self.trie.is_hybrid

    @property
    def enabled(self) -> bool:
        return self.trie.enabled

    # --- arrival and admission -------------------------------------------------------------

    def prepare(self, seq: Sequence) -> None:
        self.trie.prepare(seq)

    def branch_point(self, seq: Sequence) -> int:
        """Whole-block tokens of ``seq`` the cache holds as KV: where its prompt leaves every
        cached path (an admission policy may checkpoint there)."""
        return self.trie.cached_prefix_tokens(seq)

    def cached_prefix(self, seq: Sequence) -> tuple[int, int]:
        """What the cache holds for ``seq`` now, without changing it: the step of the checkpoint
        its admission would restore (0: none) and its whole-block KV tokens. A lower tier is
        worth asking only beyond them."""
        self.trie.prepare(seq)
        search = seq.prefix_state.trie.last_search
        step = search.record.step if search is not None and search.record is not None else 0
        return step, self.trie.cached_prefix_tokens(seq)

    def admit(self, seq: Sequence, tokens: int, stop_at: Callable[[int], int | None] | None = None) -> Admission:
        """Admit ``seq`` for a first chunk of at most ``tokens`` tokens, or change nothing.
        ``stop_at(start)``, called once the match fixed the resume point, may end the chunk
        earlier (where an admission policy wants a checkpoint); None or a position outside the
        chunk changes nothing. A ``stop_at`` that returns neither None nor an int, or raises,
        is refused (``InvalidTypeError``; what it raised, a non-hybridcache error as
        ``InvalidArgumentError``) after the match is rolled back, so nothing changed. A
        sequence whose forward is in flight is refused with ``LifecycleError``."""
        require_not_in_flight(seq, "admit")
        admitted = self._steps.admit(seq, as_int("tokens", tokens, 0), stop_at)
        self._note_admitted(seq, admitted)
        return admitted

    def _note_admitted(self, seq: Sequence, admitted: Admission) -> None:
        if admitted.admitted and not seq.prefix_state.suppress_stats:
            self._notes.note_admitted(seq, admitted.restore)

    def admit_many(self, seqs: SequenceLike[Sequence], budgets: int | SequenceLike[int]) -> list[Admission]:
        """Admit each of ``seqs`` in order for a first chunk of at most its budget
        (``budgets``: one int for all, or one per sequence), one call per scheduler step: the
        same decisions and records as ``admit`` called for each in turn (a refusal changes
        nothing for its sequence, and the next one is still tried). Every argument is checked
        before the first admission, so bad input raises and changes nothing.

        The leading sequences whose match is the checkpoint hit their ingest remembered
        (nothing changed since), whose chunks fit what is free and attach nothing, are
        admitted together first, their checks over arrays (``batch_admission.admit_remembered``). Each one
        after them is matched and its restore pinned in turn (a match can depend on what
        the admissions before it attached). While the chunks matched so far fit the free
        blocks and runtime slots without eviction and complete no block to attach, their
        blocks, slots and commits are deferred and then taken for all of them at once
        (``batch_admission.DeferredAdmissions``); anything else is admitted one by one after the deferred
        ones are taken."""
        seqs, budgets = validated_batch(self.trie, seqs, budgets)
        if not self._batch_pools:
            return [self._steps.admit(seq, budget, None) for seq, budget in zip(seqs, budgets)]
        admitted = admit_batch(self._components, seqs, budgets, lambda *matched: self._steps.admit_matched(*matched, None))
        for seq, admission in zip(seqs, admitted):  # told after the step's admissions, in order
            self._note_admitted(seq, admission)
        return admitted

    def swap_computed_duplicates(self, seq: Sequence) -> None:
        """Swap a running sequence's private duplicates of blocks already computed for their
        canonical trie blocks. That frees blocks: call it before deciding whether the next chunk
        fits (or whom to preempt); deciding without it can livelock."""
        require_sequence(seq)
        self.trie.allocate(seq, upto=seq.num_computed)

    def extend(self, seq: Sequence, end: int) -> bool:
        """Give a running sequence the blocks of its next chunk (up to ``end`` tokens), evicting
        what pressure needs; False (and no block taken) when they cannot be had, and nothing
        evicted when they never could."""
        require_sequence(seq)
        return self._steps.extend(seq, token_count("end", end))

    def blocks_needed(self, seq: Sequence, tokens: int) -> int:
        """Fresh blocks ``seq``'s table needs to cover ``tokens`` tokens."""
        require_sequence(seq)
        return self._steps.blocks_needed(seq, token_count("tokens", tokens))

    def make_block_room(self, needed: int) -> bool:
        """Free KV blocks until ``needed`` are free (frozen checkpoints, then leaves); True when
        they are. A need that eviction could never meet evicts nothing."""
        return self._steps.make_block_room(as_int("needed", needed, 0))

    # --- forward boundaries ----------------------------------------------------------------

    def reserve_save(self, seq: Sequence, step: int, kind: str | None = None, parent_step: int = 0) -> SaveReservation:
        """Before a forward is queued: reserve a checkpoint of the state after ``step`` tokens,
        computed from the state at ``parent_step`` (its ``record`` None when none can be had, or
        the eviction policy declined a save of reason ``kind``), and say what was released."""
        kind, parent_step = None if kind is None else checked_kind(kind), as_int("parent_step", parent_step, 0)
        if kind is not None and not self._notes.admits(seq, step, kind):
            return SaveReservation(None, NO_RELEASES)
        before = self.checkpoints.release_counts()
        return SaveReservation(self._reserve(seq, step, kind, parent_step), self._released_since(before))

    def reserve_decode_save(self, seq: Sequence, interval: int, parent_step: int = 0) -> SaveReservation:
        """Before a decode forward: the periodic decode checkpoint, at multiples of ``interval``
        (speculative, computed from the state at ``parent_step``)."""
        parent_step = as_int("parent_step", parent_step, 0)
        before = self.checkpoints.release_counts()
        reserved = self.trie.enabled and self.checkpoints.reserve_decode_save(seq, interval) != NO_SAVE
        record = seq.prefix_state.checkpoints.pending_save if reserved else None
        if record is not None:
            self._notes.note_save(record, parent_step, SPECULATIVE)
        return SaveReservation(record, self._released_since(before))

    def _reserve(self, seq: Sequence, step: int, kind: str | None = None, parent_step: int = 0) -> CheckpointRecord | None:
        if not self.trie.enabled or self.checkpoints.reserve_save(seq, step) == NO_SAVE:
            return None
        record = seq.prefix_state.checkpoints.pending_save
        if kind is not None:
            self._notes.note_save(record, parent_step, kind)
        return record

    def _released_since(self, before: tuple[int, ...]) -> CheckpointReleases:
        after = self.checkpoints.release_counts()
        return NO_RELEASES if after == before else CheckpointReleases.between(before, after)

    def run_forwards(
        self, seq: Sequence, ends: SequenceLike[int], saves: Collection[int] | Mapping[int, str] = (), parent_step: int = 0
    ) -> ForwardRun:
        """Run forwards of ``seq`` ending at each of ``ends`` (increasing, past its computed
        tokens; the first one's blocks already held, from ``admit`` or ``extend``), nothing else
        queued between them, as one call: per end, ``swap_computed_duplicates`` and ``extend``
        (after the first), ``reserve_save`` when the end is in ``saves``, ``forward_queued``, the
        step, ``forward_done``. A mapping of ``saves`` gives each its reason (the eviction policy
        may decline those first); each is computed from the last save this call published, else
        ``parent_step``. Stops before a forward whose blocks cannot be had (nothing taken)."""
        ends = forward_ends(seq, ends, self.block_size)
        saves = forward_saves(saves, ends)
        parent_step = as_int("parent_step", parent_step, 0)
        saves = {end: kind for end, kind in saves.items() if kind is None or self._notes.admits(seq, end, kind)}
        before = self.checkpoints.release_counts()
        published: list[bool] = []
        last_published = 0
        for index, end in enumerate(ends):
            if index:
                self.swap_computed_duplicates(seq)
                if not self._steps.extend(seq, end):
                    break
            if end in saves:
                self._reserve(seq, end, saves[end], last_published or parent_step)
            self.forward_queued(seq)
            start = seq.num_computed
            seq.set_computed(end)
            published.append(self._land(seq, start) is not None)
            last_published = end if published[-1] else last_published
        return ForwardRun(published, self._released_since(before))

    def writable_blocks(self, seq: Sequence, start: int, end: int) -> frozenset[int]:
        """Blocks the forward carrying ``seq`` may write for positions ``[start, end)`` (the
        shared-write guard): never a block another holder shares. ``start`` and ``end`` are
        ints with ``0 <= start <= end``."""
        return self.trie.exclusive_blocks(seq, start, end)

    def forward_queued(self, seq: Sequence) -> None:
        """Right after the forward carrying ``seq`` (with its restore and save copies) is
        queued: publish the save, pinned and unusable until the output is in, and release the
        restore pin (forwards run in queue order, so the restore copy is safe)."""
        if self.checkpoints.publish_save(seq, pin=True, in_flight=True):
            self.trie.stats.written_checkpoints += 1
        self.checkpoints.unpin_restore(seq)

    def forward_done(self, seq: Sequence, start: int, expert_rows: np.ndarray | None = None) -> ForwardLanded:
        """The forward's output is in and ``seq`` computed ``[start, end)`` (its step already set
        by the caller): the save becomes usable, its pending nodes matchable, and its
        routed-expert rows (when it records them) join the cached blocks. Says which save is
        now usable and what was released as it landed. ``start`` lies in ``[0, computed
        tokens]``; it and the rows are checked before anything changes."""
        before = self.checkpoints.release_counts()
        save = self._land(seq, start, expert_rows)
        return ForwardLanded(save, self._released_since(before))

    def _land(self, seq: Sequence, start: int, expert_rows: np.ndarray | None = None) -> CheckpointRecord | None:
        require_sequence(seq)
        start = forward_start(seq, start)
        rows = None
        if expert_rows is not None and seq.want_routed_experts and seq.num_routed_experts == start:
            rows = seq.checked_routed_experts(expert_rows)
        save = seq.prefix_state.checkpoints.producer_pin
        self.checkpoints.unpin_save(seq)
        if rows is not None:
            seq.place_routed_experts(rows)
        self.trie.mark_computed(seq, start)
        self.trie.cache_routed_experts(seq)
        return save if save is not None and save.is_published else None

    def forward_failed(self, seq: Sequence) -> None:
        """The forward carrying ``seq`` failed: drop its save and detach what it attached for
        blocks it did not write. The caller then frees or requeues the sequence."""
        self.checkpoints.release_failed_save(seq)
        self.trie.discard_pending(seq)

    # --- prefixes computed elsewhere ---------------------------------------------------------

    def adopt(self, seq: Sequence, step: int, write: Callable[[Adoption], bool]) -> Adopted:
        """Cache ``seq``'s first ``step`` tokens, their KV and a checkpoint at ``step``, from
        data the caller already has (a verified lower-tier object): admit ``seq`` for
        ``[hit, step)``, reserve the save at ``step``, let ``write`` fill what the cache does
        not hold yet, publish, free. Says the tokens gained (``step`` - the local hit), 0
        when nothing was gained: the cache already reaches ``step``, the pools cannot make room,
        or ``write`` returned False (then nothing it touched stays matchable); the checkpoint
        published; what was released on the way. A ``write`` that raises is failed the same
        way before its error propagates (a non-hybridcache error as ``AdoptionWriteError``).
        ``seq`` is the caller's scratch sequence of exactly those tokens and is freed on
        return, whatever happens."""
        require_sequence(seq)
        step = as_int("step", step, 1)
        if step != seq.num_tokens or seq.num_computed or seq.num_blocks:
            raise InvalidStepError("adopt takes a fresh sequence of exactly the adopted tokens")
        if not callable(write):
            raise InvalidTypeError("write must be callable")
        if not self.is_hybrid or not self.enabled:
            return Adopted(0)
        before = self.checkpoints.release_counts()
        gained, checkpoint = self._adopt(seq, step, write)
        return Adopted(gained, checkpoint, self._released_since(before))

    def _adopt(self, seq: Sequence, step: int, write: Callable[[Adoption], bool]) -> tuple[int, CheckpointRecord | None]:
        admitted = self._steps.admit(seq, step, None)  # a restore, not a request: no producer notes
        if not admitted.admitted:
            self.free(seq)
            return 0, None
        record = self._reserve(seq, step) if admitted.end == step else None
        if record is None:
            self.free(seq, admitted.runtime_slot)
            return 0, None
        adoption = Adoption(
            admitted.start, step, tuple(seq.block_table), self.writable_blocks(seq, admitted.start, step), record.slot
        )
        self.forward_queued(seq)

        def undo() -> None:  # returned False or raised: nothing it touched stays matchable or held
            self.forward_failed(seq)
            self.free(seq, admitted.runtime_slot)

        if not called_back(lambda: bool(write(adoption)), AdoptionWriteError, "the adoption's write", undo):
            undo()
            return 0, None
        seq.set_computed(step)
        checkpoint = self._land(seq, admitted.start)
        self.free(seq, admitted.runtime_slot)
        return step - admitted.start, checkpoint

    # --- end -------------------------------------------------------------------------------

    def free(self, seq: Sequence, runtime_slot: int = NO_SLOT) -> None:
        """Release what a finished, cancelled or preempted sequence holds. A sequence whose
        forward is in flight (``forward_queued`` without ``forward_done`` or ``forward_failed``)
        is refused with ``LifecycleError`` and nothing changes: its save would stay pinned, with
        nobody left to release it. So is a ``runtime_slot`` that holds no runtime state."""
        require_unpinned_save(seq)
        runtime_slot = runtime_slot_of(self.states, runtime_slot)
        self.trie.free_sequence(seq)
        if runtime_slot != NO_SLOT:
            self.states.free_runtime(runtime_slot)

    def clear(self) -> int:
        """Evict every unpinned checkpoint and every block only the cache holds; returns how
        many entries went."""
        return self.trie.clear()

    # --- observers -------------------------------------------------------------------------

    def record_changes(self) -> None:
        """Start logging what an event publisher announces (see ``take_changes``)."""
        self.trie.record_changes()

    def take_changes(self) -> CacheChanges:
        """Blocks made matchable or gone, and checkpoints published or gone, since the last
        call (since ``record_changes`` for the first)."""
        return self.trie.take_changes()

    # --- diagnostics -----------------------------------------------------------------------

    def stats(self) -> dict:
        """Match and eviction counters, what the pools have free and the live checkpoints."""
        stats = self.trie.stats.as_dict()
        stats["free_blocks"] = self.pool.num_free
        stats["free_state_slots"] = self.states.num_free
        stats["live_checkpoints"] = self.states.num_checkpoint
        return stats

    def released_checkpoints(self) -> CheckpointReleases:
        """Every checkpoint released since the cache was built, by cause (the trie's
        ``evicted_checkpoints`` counts those under state-slot and KV pressure)."""
        return CheckpointReleases.between(NO_RELEASE_COUNTS, self.checkpoints.release_counts())

    def check_invariants(self, sequences: list[Sequence] | tuple[Sequence, ...] = ()) -> None:
        """The trie's cross-owner invariants over ``sequences`` (every live one), and the pools'."""
        self.trie.check_invariants(sequences)
        self.states.check_invariants()
