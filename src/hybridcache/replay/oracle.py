"""The offline oracle (``--policy oracle``): an estimate of the best hit rate a budget allows.

Owns: ``Foresight``, what the whole trace will ask for, read before the replay starts, and
the clock of the request being served (advanced by the replay); ``OracleState``, one cache's
next-use table of KV blocks in that cache's own block keys, and the identity of each
checkpoint it was told about.

*Resume points.* Under an unbounded cache, request q resumes at ``p_q``: the longest prefix of
its prompt that an earlier request computed (prompt and output up to the last token but one,
the last processed position of a turn), stopped before q's last prompt token (a hit never
covers it). A position is identified by its step, the prefix key of the block its anchor ends
with, and its tail tokens (as the library keys a checkpoint).

*Admission* saves a state only where a later request will resume from exactly that position:
request r saves at s when some q > r has ``p_q = s`` over the same prefix, and (Belady's
bypass) only when the checkpoint pool has a free slot or holds a state needed later than it.

*Eviction* is Belady's rule: the KV leaf or checkpoint whose next use is farthest goes first,
one never used again before any other (least recently used among those). The next use of a KV
block is the next request whose resume point lies at or beyond the block's end over the same
prefix; of a checkpoint, the next request resuming exactly there. Only leaves are evicted, so a
block's descendants go before it (their next use is never sooner). A score only drops when its
next use passes; the use list of the request just served is exactly what passed, so after each
request the deepest leaf of that list is filed again (``Foresight.advance``).

This is an estimate, not a proof: admission and eviction are each clairvoyant, but they are not
optimized jointly, the budget split between KV and states is the policy-independent rule of the
replay, and a request that finds its resume point evicted falls back to whatever the cache holds
(it does not re-plan). The tests compare it with a brute force over every admission choice.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass, field, replace

import numpy as np

from hybridcache.errors import InvalidArgumentError, LifecycleError
from hybridcache.policies import Policy
from hybridcache.policies.admission import KINDS, checked_state_weight
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, anchor_step
from hybridcache.prefix_cache.eviction_view import EvictionView
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.profiles import ModelProfile
from hybridcache.sequence import Sequence
from hybridcache.workloads.bound import infinite_cache_bound
from hybridcache.workloads.records import TraceRequest

Position = tuple[int, int, int]  # (step, prefix key of the anchor's last block or 0, hash of the tail tokens)


def final_end(request: TraceRequest) -> int:
    """The last position a turn processes: prompt + output - 1 (the last emitted token never runs)."""
    return request.prompt_length + max(0, request.output_length - 1)


def resume_points(requests: SequenceLike[TraceRequest]) -> np.ndarray:
    """``p_q`` for every request (module doc): the bound over what earlier turns computed."""
    computed = [
        TraceRequest(r.index, r.arrival_ms, r.prompt_length, r.tokens[: final_end(r)], r.continues) for r in requests
    ]
    shared = infinite_cache_bound(computed).shared_tokens
    lengths = np.array([r.prompt_length for r in requests], dtype=np.int64)
    return np.minimum(shared, np.maximum(lengths - 1, 0))


class _Keys:
    """Prefix keys of one token array under ``keyer`` (block i ends at (i+1)*B)."""

    def __init__(self, keyer: BlockKeyer, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.block = keyer.block_size
        self.keys = keyer.extend(Sequence(tokens)).copy() if tokens.size >= self.block else np.zeros(0, np.uint64)

    def position(self, step: int) -> Position:
        anchor = anchor_step(step, self.block)
        key = int(self.keys[anchor // self.block - 1]) if anchor else 0
        return step, key, hash(self.tokens[anchor:step].tobytes())


@dataclass
class Foresight:
    """The whole trace's future (module doc) and the request being served."""

    requests: tuple[TraceRequest, ...]
    block_size: int
    resume: np.ndarray = field(init=False)
    plan: tuple[tuple[int, ...], ...] = field(init=False)
    uses: dict[Position, list[int]] = field(init=False)  # resume position -> requests resuming there
    now: int = -1
    states: list["OracleState"] = field(default_factory=list)
    _keys: list[_Keys] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.requests:
            raise InvalidArgumentError("the oracle needs a non-empty trace")
        keyer = BlockKeyer.deterministic(self.block_size)
        self.resume = resume_points(self.requests)
        self._keys = [_Keys(keyer, r.tokens[: final_end(r)]) for r in self.requests]
        self.uses = {}
        for q, point in enumerate(self.resume.tolist()):
            if point > 0:
                self.uses.setdefault(self._keys[q].position(point), []).append(q)
        self.plan = self._plan(self._keys)

    def _plan(self, keys: list[_Keys]) -> tuple[tuple[int, ...], ...]:
        """For each request, the steps some later request resumes from exactly."""
        by_anchor: dict[int, list[tuple[Position, int]]] = {}
        for position, users in self.uses.items():
            by_anchor.setdefault(position[1], []).append((position, users[-1]))
        anchors = np.array(sorted(k for k in by_anchor if k), dtype=np.uint64)
        plan = []
        for r, own in enumerate(keys):
            found = np.flatnonzero(np.isin(own.keys, anchors)).tolist() if anchors.size else []
            candidates = [entry for i in found for entry in by_anchor[int(own.keys[i])]]
            candidates += by_anchor.get(0, [])
            limit = own.tokens.size
            steps = {
                position[0] for position, last in candidates
                if last > r and position[0] <= limit and own.position(position[0]) == position
            }
            plan.append(tuple(sorted(steps)))
        return tuple(plan)

    def position_of(self, step: int) -> Position:
        """The identity of ``step`` in the request being served."""
        return self._keys[self.now].position(step)

    def worth_saving(self, steps: tuple[int, ...]) -> tuple[int, ...]:
        """The ``steps`` of the request being served that every cache bound to this foresight
        would keep: among its held states and these, the ones needed soonest that fit its
        checkpoint budget (a held state wins a tie)."""
        needed = {step: self.next_use(self.uses.get(self.position_of(step))) for step in steps}
        kept = set(steps)
        for state in self.states:
            held, budget = state.held_next_uses()
            ranked = sorted([(t, 0, -1) for t in held] + [(t, 1, step) for step, t in needed.items()])
            kept &= {step for _, new, step in ranked[:budget] if new}
        return tuple(step for step in steps if step in kept)

    def next_use(self, users: list[int] | None) -> int:
        """The first of ``users`` after the request being served; ``len(requests)`` for never."""
        if users:
            at = bisect.bisect_right(users, self.now)
            if at < len(users):
                return users[at]
        return len(self.requests)

    def check_invariants(self) -> None:
        count = len(self.requests)
        assert len(self.plan) == count == self.resume.size == len(self._keys) and -1 <= self.now < count
        for users in self.uses.values():
            assert users and all(a < b for a, b in zip(users, users[1:])), "use lists are strictly increasing"
        for number, steps in enumerate(self.plan):
            assert all(0 < step <= final_end(self.requests[number]) for step in steps)

    def advance(self, number: int) -> None:
        """The replay is about to serve request ``number``: what the previous one used passed."""
        if not 0 <= number < len(self.requests) or number <= self.now:
            raise InvalidArgumentError(f"request {number} is not after {self.now}")
        if self.now >= 0:
            for state in self.states:
                state.passed(self.now)
        self.now = number


@dataclass(frozen=True)
class OracleAdmission:
    """Saves where a later request resumes (module doc); unusable before ``foresee``."""

    foresight: Foresight | None = None
    name: str = "oracle"

    def save_steps(self, view) -> tuple[int, ...]:
        if self.foresight is None:
            raise LifecycleError("the oracle needs the whole trace first (hybridcache replay binds it)")
        return self.foresight.worth_saving(view.inside(self.foresight.plan[self.foresight.now]))

    def chunk_tokens(self) -> int:
        return 0

    def fitted(self, kv_tokens: int, checkpoint_slots: int) -> "OracleAdmission":
        return self

    def for_state_weight(self, state_tokens: float) -> "OracleAdmission":
        checked_state_weight(state_tokens)
        return self

    def checkpoint_spacing(self, mean_prompt: float) -> float:
        return mean_prompt / 2  # about one resume point per request, as Marconi's two per turn


@dataclass(frozen=True)
class OracleEviction:
    foresight: Foresight | None = None
    name: str = "oracle"

    def new_state(self, profile: ModelProfile | None) -> "OracleState":
        if self.foresight is None:
            raise LifecycleError("the oracle needs the whole trace first (hybridcache replay binds it)")
        return OracleState(self.foresight)


class OracleState:
    """One cache's Belady order: next uses of its KV blocks (its keyer's keys) and checkpoints."""

    states_with_leaves = True  # a state goes with its anchor leaf

    def __init__(self, foresight: Foresight) -> None:
        self.foresight = foresight
        self._view: EvictionView | None = None
        self._keys = np.zeros(0, np.uint64)
        self._times = np.zeros(0, np.int64)
        self._used_by: list[np.ndarray] = []
        self._positions: dict[int, Position] = {}

    def bind(self, view: EvictionView) -> None:
        if self._view is not None:
            raise LifecycleError("an eviction policy state serves one cache")
        self._view = view
        foresight, block = self.foresight, view.block_size
        for q, request in enumerate(foresight.requests):
            blocks = int(foresight.resume[q]) // block
            prompt = request.prompt[: blocks * block]
            self._used_by.append(view.prefix_keys(prompt) if blocks else np.zeros(0, np.uint64))
        counts = [used.size for used in self._used_by]
        keys = np.concatenate(self._used_by) if self._used_by else np.zeros(0, np.uint64)
        times = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        order = np.lexsort((times, keys))
        self._keys, self._times = keys[order], times[order]
        foresight.states.append(self)

    def check_invariants(self) -> None:
        assert len(self._used_by) == len(self.foresight.requests) and self._keys.size == self._times.size
        assert np.all(self._keys[:-1] <= self._keys[1:]), "next-use keys are sorted"
        self.foresight.check_invariants()

    def note_save(self, record: CheckpointRecord, parent_step: int, kind: str) -> None:
        if kind not in KINDS:
            raise InvalidArgumentError(f"kind must be one of {KINDS}, got {kind!r}")
        self._positions[record.record_id] = self.foresight.position_of(record.step)

    def note_admitted(self, seq, restore: CheckpointRecord | None) -> None:
        """The oracle knows every request already."""

    def admits(self, seq, step: int, kind: str) -> bool:
        """The oracle's admission already saves only what is used."""
        return True

    def _block_next_use(self, key: int) -> int:
        keys, now = self._keys, self.foresight.now
        low, high = np.searchsorted(keys, np.uint64(key), "left"), np.searchsorted(keys, np.uint64(key), "right")
        at = low + int(np.searchsorted(self._times[low:high], now, "right"))
        return int(self._times[at]) if at < high else len(self.foresight.requests)

    def kv_score(self, slot: int) -> tuple[int, int]:
        view = self._view
        return -self._block_next_use(view.key(slot)), view.stamp(slot)

    def checkpoint_score(self, record: CheckpointRecord) -> tuple[int, int]:
        position = self._positions.get(record.record_id)
        users = None if position is None else self.foresight.uses.get(position)
        return -self.foresight.next_use(users), record.stamp

    def held_next_uses(self) -> tuple[list[int], int]:
        """The next use of every published checkpoint, and the checkpoint budget."""
        view = self._view
        return [-self.checkpoint_score(r)[0] for r in view.published_records()], view.checkpoint_budget

    def passed(self, served: int) -> None:
        """Request ``served`` used its blocks: file the deepest cached one again when it is a leaf
        (its score dropped; ancestors are not candidates while it is attached)."""
        used = self._used_by[served]
        for depth in range(used.size, 0, -1):
            if self._view.rescore_leaf(int(used[depth - 1]), depth):
                return


def foresee(policy: Policy, requests: SequenceLike[TraceRequest], block_size: int) -> tuple[Policy, Foresight | None]:
    """``policy`` with its oracle parts bound to ``requests`` (unchanged when it has none)."""
    oracle_parts = isinstance(policy.admission, OracleAdmission) or isinstance(policy.eviction, OracleEviction)
    if not oracle_parts:
        return policy, None
    foresight = Foresight(tuple(requests), block_size)
    admission = replace(policy.admission, foresight=foresight) if isinstance(policy.admission, OracleAdmission) else policy.admission
    eviction = replace(policy.eviction, foresight=foresight) if isinstance(policy.eviction, OracleEviction) else policy.eviction
    return replace(policy, admission=admission, eviction=eviction), foresight
