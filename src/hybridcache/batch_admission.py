"""The batch side of ``CacheProtocol.admit_many``: its argument checks, the run of remembered
checkpoint hits admitted over arrays, the admissions whose allocations are deferred and then
taken for the whole batch at once, and the step that drives them (``admit_batch``).

Owns: the deferred admissions of one ``admit_many`` call (``DeferredAdmissions``), for that
call only; everything else it changes belongs to the pools and the trie it is handed.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceLike
from typing import NamedTuple

import numpy as np

from hybridcache.cache import CacheComponents
from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.prefix_cache.match_txn import MatchTxn
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.protocol_args import require_not_in_flight
from hybridcache.protocol_values import Admission
from hybridcache.sequence import Sequence
from hybridcache.types import as_int, is_int


def admission_of(seq: Sequence, txn: MatchTxn, start: int, end: int, runtime_slot: int) -> Admission:
    """The admission ``seq`` got from its committed match ``txn``: the chunk, the runtime slot,
    the restore and the miss reason the match recorded."""
    reason = txn.recorded[2] if txn.recorded is not None else None
    restore = seq.prefix_state.checkpoints.restore
    return Admission(start, end, runtime_slot, restore, txn.hit_tokens, None, None if reason is None else reason.value)


def admit_remembered(cache: CacheComponents, seqs: list[Sequence], budgets: list[int], admitted: list[Admission | None]) -> int:
    """Admit the leading ``seqs`` whose match is their remembered checkpoint hit (found at
    ``prepare``, nothing changed since) and whose first chunk fits what is free and
    attaches nothing, all at once: the checks over arrays, one pass of per-sequence
    writes, one clock advance, one ``allocate_stamped``, one ``allocate_runtimes``. Their
    ticks, ids and slots are the ones admitting them one by one would take (per sequence:
    the restore pin's tick, then, when it takes blocks, ``grow_table``'s). Returns how many."""
    trie, pool, states = cache.trie, cache.pool, cache.states
    size = trie.block_size
    hits = trie.remembered_hits(seqs)
    count = len(hits)
    if count == 0:
        return 0
    steps = np.fromiter((found.record.step for found in hits), np.int64, count)
    tokens = np.fromiter((seq.num_tokens for seq in seqs[:count]), np.int64, count)
    ends = np.minimum(tokens, steps + np.asarray(budgets[:count], dtype=np.int64))
    needed = np.maximum(0, -(-ends // size) - steps // size)
    fits = (ends > steps) & (np.cumsum(needed) <= pool.num_free) & (np.arange(count) < states.num_free_runtime)
    count = min(count if fits.all() else int(np.argmin(fits)), trie.attaching_nothing(seqs, hits, ends))
    if count == 0:
        return 0
    needed = needed[:count]
    ticks_each = 1 + (needed > 0)
    pin_stamps = pool.tick_many(int(ticks_each.sum())) + np.cumsum(ticks_each) - ticks_each
    trie.take_remembered_hits(seqs[:count], hits[:count], pin_stamps.tolist())
    ids = pool.allocate_stamped(np.repeat(pin_stamps + 1, needed))
    slots = states.allocate_runtimes(count)
    offsets = np.cumsum(needed).tolist()
    start = 0
    for index, (seq, found, end, slot, stop) in enumerate(zip(seqs, hits, ends.tolist(), slots, offsets)):
        if stop > start:
            seq.place_blocks(seq.num_blocks, ids[start:stop])
            start = stop
        step = found.record.step
        admitted[index] = Admission(step, end, slot, found.record, step)
    return count


AdmitMatched = Callable[[Sequence, MatchTxn, bool, int], Admission]


def admit_batch(cache: CacheComponents, seqs: list[Sequence], budgets: list[int], admit_matched: AdmitMatched) -> list[Admission]:
    """``admit_many`` over batch pools: the remembered hits first (``admit_remembered``), then
    each sequence matched and its restore pinned in turn, its allocations deferred while they
    fit what is free without eviction, else (the deferred ones taken first) admitted by
    ``admit_matched(seq, txn, pinned, budget)`` as ``admit`` would."""
    trie, checkpoints, pool, states = cache.trie, cache.trie.checkpoints, cache.pool, cache.states
    admitted: list[Admission | None] = [None] * len(seqs)
    first = admit_remembered(cache, seqs, budgets, admitted)
    deferred = DeferredAdmissions(cache, admitted)
    try:
        for index in range(first, len(seqs)):
            seq = seqs[index]
            txn = trie.match(seq)
            pinned = seq.prefix_state.checkpoints.restore is None or checkpoints.pin_restore(seq)
            if pool.num_free != deferred.free_blocks or states.num_free != deferred.free_slots:
                deferred.take_beneath_frees()  # the match freed blocks or slots (a stale checkpoint released)
            if pinned and deferred.defer(index, seq, txn, budgets[index]):
                continue
            deferred.take()
            admitted[index] = admit_matched(seq, txn, pinned, budgets[index])
            deferred.restart()
    finally:  # admissions decided before a failure end admitted, as they would one by one
        deferred.take()
    return admitted  # type: ignore[return-value]  # every entry was filled


def validated_batch(trie: BlockTrie, seqs: object, budgets: object) -> tuple[list[Sequence], list[int]]:
    """``admit_many``'s arguments checked before anything changes: sequences the trie can
    match, none twice, none whose forward is in flight, one budget each (an int for all)."""
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, SequenceLike):
        raise InvalidTypeError("seqs must be a sequence of Sequence objects")
    seqs = list(seqs)
    for seq in seqs:
        require_not_in_flight(seq, "admit")
        trie.check_matchable(seq)
    if len({id(seq) for seq in seqs}) != len(seqs):
        raise InvalidArgumentError("a sequence appears twice in one admit_many call")
    if is_int(budgets):
        return seqs, [as_int("budget", budgets, 0)] * len(seqs)
    if isinstance(budgets, (str, bytes)) or not isinstance(budgets, (SequenceLike, np.ndarray)):
        raise InvalidTypeError("budgets must be an int or a sequence of ints")
    budgets = [as_int("budget", budget, 0) for budget in budgets]
    if len(budgets) != len(seqs):
        raise InvalidArgumentError(f"{len(budgets)} budgets for {len(seqs)} sequences")
    return seqs, budgets


class _Deferred(NamedTuple):
    """One deferred admission: its place in the batch, its matched sequence, the blocks it
    still needs and the clock tick its allocation reserved (0 when it needs none)."""

    index: int
    seq: Sequence
    txn: MatchTxn
    start: int
    end: int
    needed: int
    tick: int


class DeferredAdmissions:
    """The admissions of one ``admit_many`` call whose allocations are deferred, and then
    taken for all of them at once: one ``allocate_stamped`` for their blocks, one
    ``allocate_runtimes`` for their slots, one commit. Lives for that call only.

    A deferred admission is one that ``admit`` would have completed without evicting
    anything (its chunk fits what is free beyond the ones deferred before it), without
    attaching a block and without displacing one, so the only effects left to it are the
    pools' free lists and the clock. Its clock tick is taken when ``grow_table``'s would
    have been, and the blocks and slots come off the free lists in the order one-by-one
    admission takes them; a match that freed blocks or slots in between (a stale checkpoint
    released) leaves those on top, for the admissions after it (``take_beneath_frees``).
    So the pools, the stamps and every record end as one by one.
    """

    __slots__ = ("pool", "states", "trie", "admitted", "entries", "blocks", "free_blocks", "free_slots", "free_runtime")

    def __init__(self, cache: CacheComponents, admitted: list[Admission | None]) -> None:
        self.pool, self.states, self.trie = cache.pool, cache.states, cache.trie
        self.admitted = admitted
        self.entries: list[_Deferred] = []
        self.blocks = 0
        self.restart()

    def restart(self) -> None:
        """Start deferring from the pools as they are now (nothing deferred). While deferring,
        only a match can change them, by freeing (``take_beneath_frees``)."""
        states = self.states
        self.free_blocks = self.pool.num_free
        self.free_slots = states.num_free
        self.free_runtime = states.num_free_runtime

    def defer(self, index: int, seq: Sequence, txn: MatchTxn, tokens: int) -> bool:
        """Defer the admission of matched and pinned ``seq`` when it qualifies; False (and
        nothing changed) when it must be admitted one by one."""
        start = seq.num_computed
        end = min(seq.num_tokens, start + tokens)
        if end <= start or txn.displaced.size or self.free_runtime <= len(self.entries):
            return False
        needed = -(-end // self.trie.block_size) - seq.num_blocks  # blocks_needed, inline: one call per request saved
        needed = needed if needed > 0 else 0
        if needed > self.free_blocks - self.blocks or not self.trie.allocate_if_trivial(seq, end):
            return False
        self.entries.append(_Deferred(index, seq, txn, start, end, needed, self.pool.tick() if needed else 0))
        self.blocks += needed
        return True

    def check_invariants(self) -> None:
        """Deferred admissions are in batch order, open and undisplaced, fit what was free
        when deferring started, and hold ticks the clock handed out, in order."""
        entries = self.entries
        assert [entry.index for entry in entries] == sorted({entry.index for entry in entries}), "entries out of order"
        assert all(entry.txn.open and not entry.txn.displaced.size for entry in entries), "a deferred match closed or displaced"
        assert self.blocks == sum(entry.needed for entry in entries) <= self.free_blocks, "deferred blocks do not fit"
        assert len(entries) <= self.free_runtime, "deferred runtime slots do not fit"
        ticks = [entry.tick for entry in entries if entry.needed]
        assert ticks == sorted(set(ticks)) and all(0 < tick <= self.pool.clock for tick in ticks), "bad ticks"

    def take_beneath_frees(self) -> None:
        """Take what is deferred now, leaving what the last match freed on top of the free
        lists (one by one, the deferred admissions took theirs before it was freed)."""
        pool, states = self.pool, self.states
        self.take(pool.num_free - self.free_blocks, states.num_free - self.free_slots)
        self.restart()

    def take(self, blocks_beneath: int = 0, slots_beneath: int = 0) -> None:
        """Give every deferred admission its blocks and runtime slot, commit their matches and
        record what they did; then nothing is deferred."""
        entries = self.entries
        if not entries:
            return
        needed = np.fromiter((entry.needed for entry in entries), dtype=np.int64, count=len(entries))
        ticks = np.fromiter((entry.tick for entry in entries), dtype=np.int64, count=len(entries))
        ids = self.pool.allocate_stamped(np.repeat(ticks, needed), blocks_beneath)
        slots = self.states.allocate_runtimes(len(entries), slots_beneath)
        self.trie.commit_undisplacing([entry.txn for entry in entries])
        offset = 0
        admitted = self.admitted
        for (index, seq, txn, start, end, count, _), slot in zip(entries, slots):
            if count:
                seq.place_blocks(seq.num_blocks, ids[offset : offset + count])
                offset += count
            admitted[index] = admission_of(seq, txn, start, end, slot)
        entries.clear()
        self.blocks = 0
        self.restart()
