"""Checkpoint admission policies: where a turn's recurrent state is checkpointed.

Owns no mutable state: an admission policy is a frozen description. Given what the cache
already holds for a turn (``TurnView``), ``save_steps`` names the positions whose state is
saved; the replay ends its virtual chunks there and the scheduler ends a prefill chunk there, so
a checkpoint the policy asks for exists in the engine too.

Positions are token counts: a checkpoint at step s holds the state after the first s tokens.
A turn is processed up to ``final_end`` = prompt length + generated tokens - 1 (the forward of
the token emitted last never runs), so the turn end checkpoint sits there.

* ``reference``: today's rule: every prefill chunk end (chunks of ``prefill_chunk`` tokens from
  the resume point), the prompt end, the turn end.
* ``interval:N``: every multiple of N, in the prompt and in the output (vLLM-style aligned
  states); nothing at unaligned ends.
* ``marconi``: Marconi's two reuse classes. Input reuse: the branch point found when the request
  is prepared, i.e. the deepest position its prompt shares with a cached KV path, when no
  checkpoint sits there (the match resumed before it). Input+output reuse: the turn end.
* ``auto``: Marconi's two plus what the first reuse of a shared prefix needs: speculative
  checkpoints on an aligned grid (``auto:G``, default every 2,048 tokens; aligned, so every request
  over one prefix writes the same positions and the first reuse finds a state at most G-1 tokens
  before the prefix ends), the last block boundary before the prompt end (an identical prompt
  sent again hits up to its last token), and the prompt end (a later prompt extending this one
  without its output). ``fitted`` spaces the grid to what the pools hold (sparse mode: grid,
  branch point and turn end only) when checkpoint slots are scarce against the KV pool, and
  ``for_state_weight`` coarsens the grid of plain ``auto`` to twice what a state weighs in KV
  tokens, so the states on a cached prefix never cost more than half its KV. Its eviction side (``eviction.AutoEviction``) drops the speculative ones
  that never served first, and its learner (``policies.reuse``) declines the grid saves of a
  grid level that has stopped paying.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridcache.errors import InvalidArgumentError
from hybridcache.types import as_int, finite_float

SPECULATIVE, BRANCH, PROMPT_END, TURN_END = "speculative", "branch", "prompt_end", "turn_end"
KINDS = (SPECULATIVE, BRANCH, PROMPT_END, TURN_END)


def checked_kind(kind: str) -> str:
    """``kind`` when it is one of ``KINDS``; else ``InvalidArgumentError``."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise InvalidArgumentError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind
DEFAULT_GRID = 2048  # tokens between ``auto``'s speculative saves before ``fitted`` spaces them


def checked_state_weight(state_tokens: float) -> float:
    """How many KV tokens one checkpoint weighs: a number >= 0, infinite when KV is free (a
    pure recurrent model), 0 when unknown."""
    if isinstance(state_tokens, float) and state_tokens == math.inf:
        return state_tokens
    weight = finite_float(state_tokens)
    if weight is None or weight < 0:
        raise InvalidArgumentError(f"state_tokens must be a number >= 0 (or inf), got {state_tokens!r}")
    return weight


@dataclass(frozen=True)
class TurnView:
    """What an admission policy sees of one turn when it is admitted.

    ``start``: the resume point (tokens restored from a checkpoint, 0 on a miss).
    ``prompt_length``: the prompt's tokens. ``final_end``: the last position the turn processes
    (``prompt_length`` when nothing is decoded in the same forward stream; the replay, which
    knows the output, passes prompt + output - 1). ``branch``: whole-block tokens of the prompt
    the cache holds as exactly verified KV (``BlockTrie.cached_prefix_tokens``) when prepared.
    """

    start: int
    prompt_length: int
    final_end: int
    branch: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("start", "prompt_length", "final_end", "branch", "block_size"):
            as_int(name, getattr(self, name), 0)
        if not self.start <= self.prompt_length <= self.final_end or self.block_size < 1:
            raise InvalidArgumentError(f"inconsistent turn view {self}")

    def inside(self, steps) -> tuple[int, ...]:
        """``steps`` restricted to (start, final_end], sorted, without duplicates."""
        return tuple(sorted({int(s) for s in steps if self.start < s <= self.final_end}))


@dataclass(frozen=True)
class ReferenceAdmission:
    prefill_chunk: int = 2048
    name: str = "reference"

    def save_steps(self, view: TurnView) -> tuple[int, ...]:
        ends = list(range(view.start + self.prefill_chunk, view.prompt_length, self.prefill_chunk))
        return view.inside([*ends, view.prompt_length, view.final_end])

    def chunk_tokens(self) -> int:
        return self.prefill_chunk

    def fitted(self, kv_tokens: int, checkpoint_slots: int) -> "ReferenceAdmission":
        return self

    def for_state_weight(self, state_tokens: float) -> "ReferenceAdmission":
        checked_state_weight(state_tokens)
        return self

    def checkpoint_spacing(self, mean_prompt: float) -> float:
        return mean_prompt / (math.ceil(mean_prompt / self.prefill_chunk) + 1)


@dataclass(frozen=True)
class IntervalAdmission:
    interval: int

    @property
    def name(self) -> str:
        return f"interval:{self.interval}"

    def save_steps(self, view: TurnView) -> tuple[int, ...]:
        first = (view.start // self.interval + 1) * self.interval
        return view.inside(range(first, view.final_end + 1, self.interval))

    def chunk_tokens(self) -> int:
        return self.interval

    def fitted(self, kv_tokens: int, checkpoint_slots: int) -> "IntervalAdmission":
        return self

    def for_state_weight(self, state_tokens: float) -> "IntervalAdmission":
        checked_state_weight(state_tokens)
        return self

    def checkpoint_spacing(self, mean_prompt: float) -> float:
        return float(self.interval)


def branch_step(view: TurnView) -> int | None:
    """Marconi's branch point: where the prompt leaves the cached KV paths, when the match
    resumed before it (no checkpoint sits there) and it lies inside the prompt."""
    if view.start < view.branch <= view.prompt_length:
        return view.branch
    return None


def kind_of_step(view: TurnView, step: int) -> str:
    """Why a planned checkpoint is there (what an eviction policy may weigh)."""
    if step == branch_step(view):
        return BRANCH
    if step == view.final_end and step > view.prompt_length:
        return TURN_END
    if step == view.prompt_length:
        return PROMPT_END
    return SPECULATIVE


def first_end(steps: tuple[int, ...], view: TurnView) -> int:
    """Where the first chunk of a turn resumed at ``view.start`` ends: its first planned
    checkpoint, or the prompt end."""
    return steps[0] if steps and steps[0] < view.prompt_length else view.prompt_length


@dataclass(frozen=True)
class MarconiAdmission:
    name: str = "marconi"

    def save_steps(self, view: TurnView) -> tuple[int, ...]:
        branch = branch_step(view)
        return view.inside(([] if branch is None else [branch]) + [view.final_end])

    def chunk_tokens(self) -> int:
        return 0  # no chunk of its own: the planned steps end the chunks

    def checkpoint_spacing(self, mean_prompt: float) -> float:
        return mean_prompt / 2  # at most two states per turn (branch point, turn end)

    def fitted(self, kv_tokens: int, checkpoint_slots: int) -> "MarconiAdmission":
        return self

    def for_state_weight(self, state_tokens: float) -> "MarconiAdmission":
        checked_state_weight(state_tokens)
        return self


@dataclass(frozen=True)
class AutoAdmission:
    grid: int | None = DEFAULT_GRID  # None: no speculative grid (``for_state_weight`` where KV is free)
    sparse: bool = False  # set by ``fitted`` when state slots are scarce against the KV pool
    weighed: bool = True  # whether ``for_state_weight`` may coarsen the grid (not for ``auto:G``)
    kv_free: bool = False  # set by ``for_state_weight`` when KV costs nothing: never fitted sparse

    @property
    def name(self) -> str:
        return "auto" if self.grid in (AutoAdmission.grid, None) else f"auto:{self.grid}"

    def for_state_weight(self, state_tokens: float) -> "AutoAdmission":
        """The grid for checkpoints that each weigh ``state_tokens`` KV tokens: at least twice
        that, rounded up to a multiple of ``DEFAULT_GRID`` (so it stays aligned), so the grid's
        states on a cached prefix cost at most half its KV. Heavier states than a grid step
        saves would otherwise crowd out the KV their hits need (granite-4.0-h-small, 4,719
        tokens a state, lost to ``marconi`` on 7 of 10 cells at 2,048; docs/hitrate.md). As it
        is where the weight is unknown (0) and for an explicit ``auto:G``. Where KV is free (an
        infinite weight: a pure recurrent model) the same bound leaves no grid at all, and only
        the branch point and the turn end are saved (sparse); ``fitted`` then changes nothing,
        since a KV pool that costs nothing says nothing about how scarce the slots are (an
        explicit ``auto:G`` keeps its grid, unfitted)."""
        weight = checked_state_weight(state_tokens)
        if not math.isfinite(2 * weight):
            return replace(self, kv_free=True, **({"grid": None, "sparse": True} if self.weighed else {}))
        if not self.weighed:
            return self
        grid = max(self.grid, math.ceil(2 * weight / DEFAULT_GRID) * DEFAULT_GRID)
        return replace(self, grid=grid, weighed=False)

    def fitted(self, kv_tokens: int, checkpoint_slots: int) -> "AutoAdmission":
        """The grid the pools can hold: when the KV pool holds more tokens per checkpoint slot
        than the grid spacing, space the grid that far apart (rounded up to 512 tokens) and keep
        only the branch point and the turn end besides it (sparse), so speculative states never
        crowd out the ones that serve."""
        spacing = as_int("kv_tokens", kv_tokens, 0) / max(1, as_int("checkpoint_slots", checkpoint_slots, 0))
        if self.kv_free or self.grid is None or spacing <= self.grid:
            return self
        return AutoAdmission(int(math.ceil(spacing / 512) * 512), sparse=True, weighed=False)

    def save_steps(self, view: TurnView) -> tuple[int, ...]:
        steps = list(range(self.grid, view.prompt_length, self.grid)) if self.grid else []
        branch = branch_step(view)
        if branch is not None:
            steps.append(branch)
        if not self.sparse:
            last_boundary = (view.prompt_length - 1) // view.block_size * view.block_size
            steps += [last_boundary, view.prompt_length]
        steps.append(view.final_end)
        return view.inside(step for step in steps if step > 0)

    def chunk_tokens(self) -> int:
        return 0

    def checkpoint_spacing(self, mean_prompt: float) -> float:
        if self.grid is None:
            return mean_prompt / 2  # the branch point and the turn end, as ``marconi``
        return mean_prompt / (math.ceil(mean_prompt / self.grid) + 1)


AdmissionPolicy = ReferenceAdmission | IntervalAdmission | MarconiAdmission | AutoAdmission
