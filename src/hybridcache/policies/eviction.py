"""Eviction policies: what the cache keeps, as score functions of the library's eviction heaps.

The library evicts from three lazy-invalidation heaps (``prefix_cache.lru.EvictionHeap``): KV
leaves (KV pressure), checkpoint records (state-slot pressure) and mid-block records owning a
frozen block (KV pressure). A policy gives the score of each (lowest goes first) through
``kv_score(slot)`` and ``checkpoint_score(record)``; ``None`` keeps the library's recency order.
Every eviction stays O(log n) amortized: a score is a pure function of what the item looked
like when it was last touched (memoized per touch), so it only changes when the item is filed
again, and the scale constants below are refreshed only when the memo is compacted (every
Theta(n) touches), after which stale entries are re-filed lazily as they surface.

A policy state sees its cache only through the ``prefix_cache.eviction_view.EvictionView``
the trie binds it to (stamps, depths, the records on a slot, the clock, the pool sizes), never
the trie's node arrays or lifecycles.

Owns (``MarconiEviction``, ``AutoEviction``): the view it is bound to (``bind``), a memo of
each live record's score at its last touch, what the producer said about each record
(``note_save``: the step of the state it was computed from, why it was saved), and the
scale constants; ``AutoState`` also owns its reuse learner (``policies.reuse``), told of every
admitted request (``note_admitted``) and asked about every planned save (``admits``: a
declined one stays in the learner as a ghost) and, with ``weigh_shortfalls``, a heap of its
mid-block records in the library's frozen-block order (``frozen_cost``). ``LeafLRUState`` owns
only the view it is bound to;
``LRUEviction`` owns nothing.

Under KV pressure the library drops mid-block checkpoints (one frozen block each) ahead of
any leaf, which suits admissions that write mid-block states beside aligned ones. ``leaf-lru``
and ``marconi`` say ``states_with_leaves``, which the trie reads when it is built: a state
then goes with its anchor leaf, least recently used first, as in Marconi's radix tree, where a
leaf node's state is evicted with its edge and every state is a branch point or a turn end
some hit needs. ``auto:weighed`` (``AutoEviction.weigh_shortfalls``) gives the trie its
``shortfall_costs`` instead: each block then comes from the cheaper of the next leaf and the next
mid-block state, priced in tokens later hits are expected to lose (``lost_per_block``).

``marconi`` (Marconi, MLSys'25): score = recency + alpha * FLOP efficiency, each min-max
normalized over the candidates; FLOP efficiency = FLOPs the item saves relative to its parent
state (the edge from the state it was computed from) / bytes it holds (state + edge KV). Min-max
normalization is affine, so the order of ``r/Rr + alpha * f/Rf`` is that of
``r + alpha * (Rr/Rf) * f``: with the ranges Rr, Rf measured exactly over the live candidates at
each compaction the key is time-invariant between touches. Recency is the logical clock of the
last touch (Marconi's ``1/(now - t)`` has the same order alone, but is not time-invariant, so
no heap could keep it). ``alpha`` is set by the autotuner (``tuning``).

``auto``: KV leaves that anchor no checkpoint go first (KV beyond the deepest checkpoint of its
path can serve no hybrid hit), least recently used first; then leaves anchoring checkpoints,
least recently used first, a proven one's recency given a grace (``PROVEN_GRACE``).
Checkpoints are ordered by what the traffic has shown them to be worth, learned online
(``policies.reuse``): the key is ``learner clock at last touch - expected interval to the next
reuse + efficiency``, the interval being the mean wait of the reuses seen in the record's class
(kind of save, turns of its conversation served in a row, reuses so far) over the odds that a
record of that class is reused at all (hits and ghost hits, counted by the learner). So a kind
that keeps coming back soon stays, one that stopped paying goes first, a state whose
conversation has moved on (a turn end already resumed from) is dead weight, and at equal
expectations the least recently used goes; efficiency (FLOPs saved per byte, squashed into
[0, 1)) breaks ties.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.errors import InvalidArgumentError, LifecycleError
from hybridcache.policies.admission import BRANCH, SPECULATIVE, checked_kind
from hybridcache.policies.reuse import ReuseLearner
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.prefix_cache.eviction_view import EvictionView
from hybridcache.prefix_cache.lru import EvictionHeap
from hybridcache.profiles import ModelProfile

# Clock ticks per KV block a proven checkpoint's leaf is counted younger (auto): measured on
# mooncake-synthetic, 0.1 keeps auto above reference at every budget on the first 2,000
# requests and on all 3,993; unbounded (a tier of its own) lost 5.6 points on all of them.
PROVEN_GRACE = 0.1


@dataclass(frozen=True)
class LRUEviction:
    """The library's own order: least recently used checkpoints and trie leaves first, with
    ``states_with_leaves`` (``leaf-lru``) a mid-block checkpoint going with its leaf."""

    name: str = "lru"
    states_with_leaves: bool = False

    def new_state(self, profile: ModelProfile | None) -> "LeafLRUState | None":
        return LeafLRUState() if self.states_with_leaves else None


class LeafLRUState:
    """Recency, as the library scores by default, with states kept with their leaves."""

    states_with_leaves = True

    def __init__(self) -> None:
        self._view: EvictionView | None = None

    def bind(self, view: EvictionView) -> None:
        if self._view is not None:
            raise LifecycleError("an eviction policy state serves one cache")
        self._view = view

    def note_save(self, record: CheckpointRecord, parent_step: int, kind: str) -> None:
        """Recency needs nothing from the producer; the kind is still checked."""
        checked_kind(kind)

    def note_admitted(self, seq, restore: CheckpointRecord | None) -> None:
        """Recency learns nothing from a request."""

    def admits(self, seq, step: int, kind: str) -> bool:
        """Every save the admission policy plans is made."""
        return True

    def kv_score(self, slot: int) -> int:
        return self._view.stamp(slot)

    def checkpoint_score(self, record: CheckpointRecord) -> int:
        return record.stamp


@dataclass
class _Saved:
    parent_step: int
    kind: str
    record: CheckpointRecord


class _Scored:
    """Shared machinery of the value-aware policies: binding, producer notes, per-touch memo."""

    states_with_leaves = False

    def __init__(self, profile: ModelProfile | None) -> None:
        if profile is not None and not isinstance(profile, ModelProfile):
            raise InvalidArgumentError("profile must be a ModelProfile or None")
        self.profile = profile
        self._view: EvictionView | None = None
        self._notes: dict[int, _Saved] = {}
        self._memo: dict[int, tuple[int, float, CheckpointRecord]] = {}
        self._limit = 64
        self._clock = 0  # the newest record id seen: the record clock

    def bind(self, view: EvictionView) -> None:
        """Attach to the view of the trie whose heaps call the scores (once it is built)."""
        if self._view is not None:
            raise LifecycleError("an eviction policy state serves one cache")
        self._view = view

    def note_save(self, record: CheckpointRecord, parent_step: int, kind: str) -> None:
        """The producer reserved ``record``, computed from the state at ``parent_step`` (its
        restore point or its previous checkpoint in the same turn), for reason ``kind``."""
        checked_kind(kind)
        if not 0 <= parent_step < record.step:
            parent_step = 0
        self._notes[record.record_id] = _Saved(int(parent_step), kind, record)
        self._memo.pop(record.record_id, None)
        self._tick(record)

    def note_admitted(self, seq, restore: CheckpointRecord | None) -> None:
        """A request was admitted, resuming from ``restore`` (None: from nothing); only an
        online policy learns from it."""

    def admits(self, seq, step: int, kind: str) -> bool:
        """Whether the save ``seq``'s admission policy plans at ``step`` (for reason ``kind``)
        is made; only an online policy declines one."""
        return True

    def kind_of(self, record: CheckpointRecord) -> str:
        note = self._notes.get(record.record_id)
        return SPECULATIVE if note is None else note.kind

    def parent_step(self, record: CheckpointRecord) -> int:
        note = self._notes.get(record.record_id)
        return 0 if note is None else note.parent_step

    def _tick(self, record: CheckpointRecord) -> None:
        self._clock = max(self._clock, record.record_id)
        if len(self._memo) + len(self._notes) > self._limit:
            self._compact()

    def edge_flops(self, record: CheckpointRecord) -> float:
        """FLOPs of recomputing the record's state from its parent state."""
        start = self.parent_step(record)
        if self.profile is None:
            return float(record.step - start)
        return self.profile.prefill_flops(start, record.step)

    def checkpoint_score(self, record: CheckpointRecord) -> float:
        memo = self._memo.get(record.record_id)
        if memo is not None and memo[0] == record.stamp:
            return memo[1]
        self._tick(record)
        score = self._fresh_score(record)
        self._memo[record.record_id] = (record.stamp, score, record)
        return score

    def _compact(self) -> None:
        """Forget released records, then refresh the scale constants over the live ones."""
        self._memo = {rid: m for rid, m in self._memo.items() if m[2].state is not CheckpointState.RELEASED}
        self._notes = {rid: n for rid, n in self._notes.items() if n.record.state is not CheckpointState.RELEASED}
        self._limit = 2 * (len(self._memo) + len(self._notes)) + 64
        self._refresh([m[2] for m in self._memo.values() if m[2].is_published])

    def _fresh_score(self, record: CheckpointRecord) -> float:
        raise NotImplementedError

    def _refresh(self, records: list[CheckpointRecord]) -> None:
        """Recompute scale constants over the live records (subclasses)."""


class MarconiState(_Scored):
    """One cache's Marconi eviction: alpha, the normalization ranges, the memo."""

    states_with_leaves = True  # a state goes with its leaf edge, as in Marconi

    def __init__(self, profile: ModelProfile | None, alpha: float) -> None:
        super().__init__(profile)
        self.alpha = float(alpha)
        self._range_recency = 1.0
        self._range_efficiency = 1.0
        self._kv_weight = 0.0
        self._max_depth = 2

    def set_alpha(self, alpha: float) -> None:
        if not alpha >= 0:
            raise InvalidArgumentError(f"alpha must be >= 0, got {alpha!r}")
        self.alpha = float(alpha)
        self._memo.clear()  # every key changes; stale entries are re-filed lazily
        self._refresh_kv()

    def efficiency(self, record: CheckpointRecord) -> float:
        """FLOPs saved relative to the parent state per byte held (state + edge KV)."""
        edge = record.step - self.parent_step(record)
        if self.profile is None:
            return edge / (edge + 1.0)
        held = self.profile.state_bytes + edge * self.profile.kv_bytes_per_token
        return self.edge_flops(record) / held

    def _fresh_score(self, record: CheckpointRecord) -> float:
        weight = self.alpha * self._range_recency / self._range_efficiency
        return record.stamp + weight * self.efficiency(record)

    def _refresh(self, records: list[CheckpointRecord]) -> None:
        if records and self._view is not None:
            efficiencies = [self.efficiency(record) for record in records]
            oldest = min(record.stamp for record in records)
            self._range_recency = float(max(1, self._view.clock - oldest))
            self._range_efficiency = max(efficiencies) - min(efficiencies) or 1.0
        self._refresh_kv()

    def _refresh_kv(self) -> None:
        if self._view is None:
            return
        spread = self.block_efficiency(self._max_depth) - self.block_efficiency(1)
        self._kv_weight = self.alpha * self._range_recency / spread if spread > 0 else 0.0

    def block_efficiency(self, depth: int) -> float:
        """FLOPs per KV byte of the block at ``depth`` (1-based): a leaf's edge (per token of it
        where KV costs no bytes)."""
        size = self._view.block_size
        if self.profile is None:
            return float(depth)
        flops = self.profile.prefill_flops((depth - 1) * size, depth * size)
        if self.profile.pure_recurrent:  # a block costs no bytes: weigh it by the FLOPs it saves alone
            return flops / size
        return flops / (size * self.profile.kv_bytes_per_token)

    def kv_score(self, slot: int) -> float:
        view = self._view
        stamp = view.stamp(slot)
        depth = view.depth(slot)
        self._max_depth = max(self._max_depth, depth)  # the range is refreshed at compaction
        return stamp + self._kv_weight * self.block_efficiency(depth)


class AutoState(_Scored):
    """One cache's auto eviction: its reuse learner (made at ``bind``, its window four state
    pools: long enough to see a conversation come back after its state was evicted, twice
    ARC's directory), the memo, and (``weigh_shortfalls``) a heap of the mid-block records in
    the library's frozen-block order, so that it can price the next one KV pressure would take
    (``shortfall_costs``: the trie reads it when it is built)."""

    def __init__(self, profile: ModelProfile | None, weigh_shortfalls: bool = False) -> None:
        super().__init__(profile)
        self._reference_flops: float | None = None
        self.learner: ReuseLearner | None = None
        self._partials: EvictionHeap[CheckpointRecord] = EvictionHeap(
            self.checkpoint_score, _record_id, _filed_and_published, 64)
        self.shortfall_costs = self if weigh_shortfalls else None

    def bind(self, view: EvictionView) -> None:
        super().bind(view)
        self.learner = ReuseLearner(view.block_size, 4 * max(1, view.num_state_slots))

    def note_save(self, record: CheckpointRecord, parent_step: int, kind: str) -> None:
        super().note_save(record, parent_step, kind)
        if self.learner is not None:
            anchored = record.step >= self._view.block_size
            self.learner.saved(record, kind, self._view.key(record.anchor) if anchored else 0)

    def note_admitted(self, seq, restore: CheckpointRecord | None) -> None:
        """A request was admitted, resuming from ``restore``: what the learner learns from."""
        if self.learner is not None:
            self.learner.admitted(seq, restore, self._view.keys_of)

    def admits(self, seq, step: int, kind: str) -> bool:
        """The learner's admission (``ReuseLearner.admits``); a declined save stays as a
        ghost, filed under the prefix key of its anchor block."""
        learner = self.learner
        if learner is None or learner.admits(seq, step, kind):
            return True
        blocks = step // self._view.block_size
        learner.decline(seq, step, kind, int(self._view.keys_of(seq, blocks)[-1]) if blocks else 0)
        return False

    def kv_score(self, slot: int) -> tuple[int, float]:
        """(tier, recency): tier 0 = a leaf anchoring no checkpoint (no hit can use it), first
        to go; tier 1 = a leaf anchoring checkpoints, by recency, a proven one (it served a hit,
        or sits at a branch point where two sequences met) counted ``PROVEN_GRACE`` of a KV
        pool's worth of clock ticks younger. A grace, not a tier of its own: a proven leaf kept
        ahead of every unproven one forever fills the pool with stale paths on long traces."""
        view = self._view
        stamp = view.stamp(slot)
        records = view.records_at(slot)
        if not records:
            return (0, stamp)
        proven = any(record.hits or self.kind_of(record) == BRANCH for record in records)
        return (1, stamp + PROVEN_GRACE * view.num_kv_blocks if proven else stamp)

    def checkpoint_score(self, record: CheckpointRecord) -> float:
        """``_Scored``'s, and a mid-block record filed again joins the frozen-order heap."""
        memo = self._memo.get(record.record_id)
        score = super().checkpoint_score(record)
        if memo is None or memo[0] != record.stamp:
            if record.is_partial and self.shortfall_costs is not None:
                self._partials.push(record, record.stamp, len(self._memo))
        return score

    def frozen_cost(self) -> float | None:
        """The price of the mid-block record KV pressure would drop next (the lowest score
        among the unpinned published ones), or None when there is none."""
        heap, set_aside, price = self._partials, [], None
        while price is None:
            entry = heap.pop()
            if entry is None:
                break
            set_aside.append(entry)
            if not entry[3].pin_count:
                price = self.lost_per_block(entry[3])
        heap.restore(set_aside)
        return price

    def leaf_cost(self, slot: int) -> float:
        """The price of evicting leaf ``slot``: that of every checkpoint it anchors; one that
        anchors none can serve no hit, but a later prompt may branch off it (where a state is
        then saved), so it is priced as a block whose use the learner has not seen in its
        horizon (``block / window``: above every state that left the window unused)."""
        records = [record for record in self._view.records_at(slot) if record.is_published]
        if not records:
            return self._view.block_size / (self.learner.window if self.learner is not None else 1)
        return sum(self.lost_per_block(record) for record in records)

    def lost_per_block(self, record: CheckpointRecord) -> float:
        """Tokens later hits are expected to lose per KV block freed by dropping ``record``: a
        hit there falls back to the state it was computed from (its edge back to it) with the
        odds the learner gives its class, and dropping it frees its own block and leaves the
        KV of its edge to the leaves that anchor nothing (a block and ``edge / block size``
        more: ``odds * edge * block / (edge + block)``)."""
        block = self._view.block_size
        edge = record.step - self.parent_step(record)
        odds = 0.5 if self.learner is None else self.learner.held_odds(record)
        return odds * edge * block / (edge + block)

    def efficiency(self, record: CheckpointRecord) -> float:
        """In [0, 1): the FLOPs the record saves over its parent state, squashed."""
        flops = self.edge_flops(record)
        return flops / (flops + self._reference())

    def _reference(self) -> float:
        if self._reference_flops is None:
            edge = 2048
            self._reference_flops = float(edge) if self.profile is None else self.profile.prefill_flops(0, edge)
        return self._reference_flops

    def _fresh_score(self, record: CheckpointRecord) -> float:
        if self.learner is None:
            return self._clock + self.efficiency(record)
        return self.learner.clock - self.learner.expected_interval(record) + self.efficiency(record)


@dataclass(frozen=True)
class MarconiEviction:
    """Marconi's FLOP-aware eviction; ``alpha`` is the weight before the autotuner sets one."""

    alpha: float = 1.0
    name: str = "marconi"

    def new_state(self, profile: ModelProfile | None) -> MarconiState:
        return MarconiState(profile, self.alpha)


@dataclass(frozen=True)
class AutoEviction:
    """``weigh_shortfalls`` (``--eviction auto:weighed``): KV pressure takes each block from the
    cheaper of the next leaf and the next mid-block state, as ``AutoState`` prices them; off
    (the default: measured, it loses on the shared trace with Qwen3-Next, docs/hitrate.md),
    mid-block states go first."""

    name: str = "auto"
    weigh_shortfalls: bool = False

    def new_state(self, profile: ModelProfile | None) -> AutoState:
        return AutoState(profile, self.weigh_shortfalls)


def _record_id(record: CheckpointRecord) -> int:
    return record.record_id


def _filed_and_published(record: CheckpointRecord, stamp: int) -> bool:
    return record.is_published and record.stamp == stamp


Eviction = LRUEviction | MarconiEviction | AutoEviction
