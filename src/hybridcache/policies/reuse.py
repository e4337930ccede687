"""What ``auto``'s checkpoints turn out to be worth on the traffic seen so far, learned online.

Owns (``ReuseLearner``): a window of the most recently touched checkpoints of one cache, live or
released (a released one is a *ghost*: metadata only, its state bytes are gone), and of the
saves it declined (ghosts from the start), indexed by the prefix key of their anchor block;
which conversation turn each running request continues; and, per *class*, how often a record
of that class was reused while in the window, how long after its last touch, and how often one
left the window unused, plus how often a saved record was found evicted or still held. A class
is the *save class* (the kind of save: branch point, prompt end, turn end, or speculative, a
grid save split by the coarsest grid it lies on, 2,048 to 16,384 tokens, and the last block
boundary apart), its *lineage* (how many turns of its conversation in a row were resumed from
the previous turn's state: a request resuming from a turn end or prompt end continues a
conversation) and how often it was reused so far (0, 1, 2 or more each).

A reuse is a request that resumed from the record (a hit), or one that would have (a ghost hit):
its prompt reaches a released or declined record's position deeper than the state it resumed
from. Counting ghost hits as reuses is what keeps the estimate honest: a kind of state the
eviction drops too early, or the admission declines, would otherwise look worthless because it
is not there, and be dropped earlier still. The odds of a class are its reuses over its
outcomes with two pseudo-outcomes at the odds of its save class (Laplace's rule over the save
class: one half before any evidence), so a class seen rarely, such as a first hit, borrows
from its save class, and nothing here is fitted to a trace. The window holds ``window``
records (the eviction policy makes it four checkpoint pools, twice what ARC's directory holds,
so that a conversation coming back after its state was evicted is still seen). The counts
are not faded: halving them every window made the flip below faster but cost 1.3 points on
`conversation` with Qwen3-Next at 10 + 1 GB (docs/hitrate.md).

*Admission* (``admits``): a speculative save is declined when its class is reused less than
once a window, scaled by the pressure (the share of saved records found evicted rather than
still held when they left the window: where nothing is evicted, a save displaces nothing and
is always made). A declined save stays a ghost, so if later prompts would have resumed there
its class is admitted again. The other kinds are always saved: they are what Marconi saves and
what a later turn resumes from; measured, declining them (or the grid on value per byte)
cost more than it saved (docs/hitrate.md).

Per request, ``admitted`` hashes the prompt's blocks once (vectorized) and looks each block key
past the resume point up in a dict; per save, ``saved`` and ``admits`` are O(1) (a declined
save hashes the prompt's blocks up to it once); a record leaves the window in O(1) (an ordered
dict by last touch); ``odds`` and ``expected_interval`` are O(classes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from hybridcache.errors import InvalidArgumentError
from hybridcache.policies.admission import DEFAULT_GRID, KINDS, PROMPT_END, SPECULATIVE, TURN_END
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState, anchor_step
from hybridcache.sequence import Sequence
from hybridcache.types import as_int

LEVELS = 3  # reuses so far, and turns of one conversation served in a row: 0, 1, 2 or more
CONTINUED = (TURN_END, PROMPT_END)  # a request resuming from one of these continues a conversation
GRID_LEVELS = 4  # a grid save's level: how many times its multiple of the grid halves (0..3+)
# save classes: a speculative save off the grid (the last block boundary), the grid's levels,
# then the other kinds
SAVE_CLASSES = 1 + GRID_LEVELS + len(KINDS) - 1


def save_class(kind: str, step: int) -> int:
    """The class of a save for what the learner counts: its kind, a grid save split by how
    coarse a grid it lies on (every 2,048 tokens, 4,096, 8,192, 16,384 or coarser), so that
    the learner can find the spacing that pays instead of a fixed one."""
    if kind != SPECULATIVE:
        return 1 + GRID_LEVELS + KINDS.index(kind) - 1
    if step % DEFAULT_GRID:
        return 0
    multiple = step // DEFAULT_GRID
    return 1 + min(GRID_LEVELS - 1, (multiple & -multiple).bit_length() - 1)


@dataclass
class _Declined:
    """A save the learner declined: a ghost from the start (its position, no state)."""

    record_id: int  # negative: never a live record's id
    step: int
    tail_tokens: np.ndarray
    producer_id: int
    hits: int = 0
    state: CheckpointState = CheckpointState.RELEASED


@dataclass
class _Entry:
    record: CheckpointRecord | _Declined
    kind: str
    save_class: int
    anchor_key: int  # prefix key of the anchor block (0: a root anchor, never looked up)
    lineage: int  # turns of its conversation served from the cache in a row before it was saved
    touched: int  # the learner's clock (saves noted) at the last touch


class ReuseLearner:
    def __init__(self, block_size: int, window: int) -> None:
        if block_size < 1 or window < 1:
            raise InvalidArgumentError(f"block_size and window must be >= 1, got {block_size}, {window}")
        self.block_size = block_size
        self.window = window
        self.clock = 0  # saves noted
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # record id -> entry, oldest touch first
        self._by_anchor: dict[int, dict[int, _Entry]] = {}  # anchor key -> record id -> entry
        self._lineage_of: dict[int, int] = {}  # producer sequence id -> lineage of what it saves
        self._declined_at: dict[tuple[int, int], int] = {}  # (producer id, step) -> its ghost's id, in the window
        shape = (SAVE_CLASSES, LEVELS, LEVELS)  # save class, lineage, reuses so far
        self.reused = np.zeros(shape, np.int64)
        self.unused = np.zeros(shape, np.int64)
        self.reuse_ages = np.zeros(shape, np.int64)  # summed clock ticks from last touch to reuse
        self.ghost_hits = 0
        self.declined = 0  # saves declined (each a ghost while in the window)
        self.declined_by_class = np.zeros(SAVE_CLASSES, np.int64)
        self.left_evicted = 0  # saved records found released (at a ghost hit, or leaving the window)
        self.left_live = 0  # saved records that left the window still held: no pressure took them

    def _class(self, entry: _Entry, hits: int) -> tuple[int, int, int]:
        return entry.save_class, min(entry.lineage, LEVELS - 1), min(max(hits, 0), LEVELS - 1)

    def odds(self, record: CheckpointRecord) -> float:
        """The chance that ``record`` is reused again while in the window: its class's reuses
        over its outcomes, with two pseudo-outcomes at the odds of its kind as a whole (which
        in turn start at one half), so a class seen rarely borrows from its kind."""
        entry = self._entries.get(record.record_id)
        if entry is None:
            return 0.5
        return self._class_odds(self._class(entry, record.hits))

    def held_odds(self, record: CheckpointRecord) -> float:
        """``odds`` of a record in the window; one that left it unreused is reused less than
        once in the learner's horizon: ``1 / window``."""
        if record.record_id not in self._entries:
            return 1.0 / self.window
        return self.odds(record)

    def _class_odds(self, index: tuple[int, int, int]) -> float:
        kind_reused, kind_unused = int(self.reused[index[0]].sum()), int(self.unused[index[0]].sum())
        prior = (kind_reused + 1) / (kind_reused + kind_unused + 2)
        reused, unused = int(self.reused[index]), int(self.unused[index])
        return (reused + 2 * prior) / (reused + unused + 2)

    def expected_interval(self, record: CheckpointRecord) -> float:
        """Clock ticks from the last touch of ``record`` to its next reuse, as its class says:
        the mean wait of the reuses seen (of its kind when its class has none; half the
        window before any) over the odds of one, at most the window (beyond it the learner
        has seen nothing come back)."""
        entry = self._entries.get(record.record_id)
        if entry is None:
            return float(self.window)
        index = self._class(entry, record.hits)
        reused, ages = int(self.reused[index]), int(self.reuse_ages[index])
        if not reused:
            reused, ages = int(self.reused[index[0]].sum()), int(self.reuse_ages[index[0]].sum())
        wait = ages / reused if reused else self.window / 2
        return min(float(self.window), wait / self.odds(record))

    def saved(self, record: CheckpointRecord, kind: str, anchor_key: int) -> None:
        """A checkpoint was reserved for reason ``kind`` on an anchor whose prefix key is
        ``anchor_key``: it enters the window (pushing the least recently touched out)."""
        if kind not in KINDS:
            raise InvalidArgumentError(f"kind must be one of {KINDS}, got {kind!r}")
        if record.record_id in self._entries:
            return
        self._enter(record, kind, anchor_key)

    def _enter(self, record: CheckpointRecord | _Declined, kind: str, anchor_key: int) -> None:
        self.clock += 1
        lineage = self._lineage_of.get(record.producer_id, 0)
        anchor_key = int(anchor_key) if record.step >= self.block_size else 0
        entry = _Entry(record, kind, save_class(kind, record.step), anchor_key, lineage, self.clock)
        self._entries[record.record_id] = entry
        if entry.anchor_key:
            self._by_anchor.setdefault(entry.anchor_key, {})[record.record_id] = entry
        while len(self._entries) > self.window:
            self._leave(next(iter(self._entries.values())))

    def admits(self, seq: Sequence, step: int, kind: str) -> bool:
        """Whether the save ``seq`` plans at ``step`` for reason ``kind`` is made: always for
        a branch point, prompt end or turn end; a speculative one when its class (save class,
        lineage, fresh) is reused at least once a window, times the pressure (the share of
        saved records found evicted: what an admission displaces; none, and every save is
        made). The odds count the ghosts of declined saves, so a declined class that later
        requests would have resumed from is admitted again."""
        if kind not in KINDS:
            raise InvalidArgumentError(f"kind must be one of {KINDS}, got {kind!r}")
        step = as_int("step", step, 1)
        if kind != SPECULATIVE:
            return True
        lineage = min(self._lineage_of.get(seq.seq_id, 0), LEVELS - 1)
        index = (save_class(kind, step), lineage, 0)
        pressure = (self.left_evicted + 1) / (self.left_evicted + self.left_live + 2)
        return self._class_odds(index) >= pressure / self.window

    def decline(self, seq: Sequence, step: int, kind: str, anchor_key: int) -> None:
        """The save at ``step`` was declined: a ghost enters the window (its position, the
        tail tokens past its anchor block, whose prefix key is ``anchor_key``). A save declined
        again (the sequence re-planned the same step after a preemption) while its ghost is in
        the window adds no second ghost: one position is one candidate."""
        step = as_int("step", step, 1)
        if kind not in KINDS or step > seq.num_tokens:
            raise InvalidArgumentError(f"cannot decline a {kind!r} save at {step} of {seq.num_tokens} tokens")
        if (seq.seq_id, step) in self._declined_at:
            return
        self.declined += 1
        self.declined_by_class[save_class(kind, step)] += 1
        start = anchor_step(step, self.block_size)
        tail = np.array(seq.tokens[start:step], dtype=np.int32)
        self._declined_at[seq.seq_id, step] = -self.declined
        self._enter(_Declined(-self.declined, step, tail, seq.seq_id), kind, anchor_key)

    def admitted(self, seq: Sequence, restore: CheckpointRecord | None, keys_of) -> None:
        """A request was admitted, resuming from ``restore`` (None: from nothing). Credits the
        record it resumed from and the deepest ghost its prompt reaches beyond it, and notes
        the lineage of what it will save. ``keys_of(seq, blocks)``: the keys the cache files
        the sequence's first whole blocks under, in its own namespace."""
        hit = 0 if restore is None else restore.step
        entry = None if restore is None else self._entries.get(restore.record_id)
        lineage = 0
        if entry is not None:  # the trie counted this hit already
            self._reused(entry, restore.hits - 1)
            self._entries.move_to_end(restore.record_id)
            entry.touched = self.clock
            lineage = entry.lineage + 1 if entry.kind in CONTINUED else 0
        ghost = self._deepest_ghost(seq, hit, keys_of)
        if ghost is not None:
            self.ghost_hits += 1
            self.left_evicted += ghost.record.record_id > 0
            self._reused(ghost, ghost.record.hits)
            self._forget(ghost)  # the position is recomputed now; a new save there starts anew
        if len(self._lineage_of) >= self.window:
            self._lineage_of.clear()  # producers long gone; bounded
        self._lineage_of[seq.seq_id] = lineage

    def _deepest_ghost(self, seq: Sequence, hit: int, keys_of) -> _Entry | None:
        size, length = self.block_size, seq.num_tokens
        first, last = max(hit // size, 1), (length - 1) // size  # anchor depths past the resume point
        if last < first or not self._by_anchor:
            return None
        tokens = seq.tokens
        keys = keys_of(seq, last)[first - 1 : last].tolist()
        best = None
        for key in set(keys).intersection(self._by_anchor):
            for entry in self._by_anchor[key].values():
                record = entry.record
                if record.state is not CheckpointState.RELEASED or not hit < record.step < length:
                    continue
                if best is not None and record.step <= best.record.step:
                    continue
                start = anchor_step(record.step, size)
                if np.array_equal(tokens[start : record.step], record.tail_tokens):
                    best = entry
        return best

    def _reused(self, entry: _Entry, hits: int) -> None:
        index = self._class(entry, hits)
        self.reused[index] += 1
        self.reuse_ages[index] += self.clock - entry.touched

    def _leave(self, entry: _Entry) -> None:
        self.unused[self._class(entry, entry.record.hits)] += 1
        if entry.record.record_id > 0:
            released = entry.record.state is CheckpointState.RELEASED
            self.left_evicted += released
            self.left_live += not released
        self._forget(entry)

    def _forget(self, entry: _Entry) -> None:
        record_id = entry.record.record_id
        del self._entries[record_id]
        if record_id < 0:
            del self._declined_at[entry.record.producer_id, entry.record.step]
        bucket = self._by_anchor.get(entry.anchor_key)
        if bucket is not None:
            bucket.pop(record_id, None)
            if not bucket:
                del self._by_anchor[entry.anchor_key]

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.window and len(self._lineage_of) <= self.window, "bounded"
        indexed = {rid for bucket in self._by_anchor.values() for rid in bucket}
        assert indexed == {rid for rid, e in self._entries.items() if e.anchor_key}, "anchor index = window"
        assert all(bucket for bucket in self._by_anchor.values()), "no empty anchor bucket"
        touched = [e.touched for e in self._entries.values()]
        assert all(0 < t <= self.clock for t in touched) and touched == sorted(touched), "ordered by last touch"
        assert all(e.record.record_id == rid and e.kind in KINDS and e.lineage >= 0 for rid, e in self._entries.items())
        assert all(e.save_class == save_class(e.kind, e.record.step) for e in self._entries.values()), "classes"
        declined = [e.record for e in self._entries.values() if e.record.record_id < 0]
        assert all(d.state is CheckpointState.RELEASED and not d.hits for d in declined), "declined = ghosts"
        assert self._declined_at == {(d.producer_id, d.step): d.record_id for d in declined}, "one ghost per declined position"
        assert all(-self.declined <= d.record_id for d in declined) and int(self.declined_by_class.sum()) == self.declined
        assert (self.reused >= 0).all() and (self.unused >= 0).all() and (self.reuse_ages >= 0).all()
        assert self.ghost_hits <= int(self.reused.sum()) and min(self.left_evicted, self.left_live) >= 0
