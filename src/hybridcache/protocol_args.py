"""What the cache protocol's forward boundaries accept, checked before anything changes.

Owns no state: each function turns a caller's argument into the validated, immutable form the
protocol works on, or raises the specific ``hybridcache.errors`` exception.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from collections.abc import Sequence as SequenceLike

from hybridcache.errors import InvalidStepError, InvalidTypeError
from hybridcache.policies.admission import checked_kind
from hybridcache.sequence import Sequence
from hybridcache.types import as_int, ceil_div


def forward_ends(seq: Sequence, ends: SequenceLike[int], block_size: int) -> tuple[int, ...]:
    """``run_forwards``' ends: increasing from the sequence's computed tokens to at most its
    tokens, the first one's blocks held."""
    if not isinstance(seq, Sequence):
        raise InvalidTypeError(f"expected a Sequence, got {type(seq).__name__}")
    if isinstance(ends, (str, bytes)) or not isinstance(ends, SequenceLike):
        raise InvalidTypeError("ends must be a sequence of ints")
    ends = tuple(as_int("end", end) for end in ends)
    bounds = (seq.num_computed, *ends)
    if any(a >= b for a, b in zip(bounds, bounds[1:])) or (ends and ends[-1] > seq.num_tokens):
        raise InvalidStepError(f"ends must increase from {seq.num_computed} to at most {seq.num_tokens}")
    if ends and ceil_div(ends[0], block_size) > seq.num_blocks:
        raise InvalidStepError("the first forward's blocks are not held: admit or extend first")
    return ends


def forward_saves(saves: Collection[int] | Mapping[int, str], ends: tuple[int, ...]) -> dict[int, str | None]:
    """The saves among ``ends``, in their order, each with its reason (None for a collection of
    steps, which names none)."""
    if isinstance(saves, (str, bytes)) or not isinstance(saves, Collection):
        raise InvalidTypeError("saves must be a collection of steps or a mapping of steps to reasons")
    if isinstance(saves, Mapping):
        return {end: checked_kind(saves[end]) for end in ends if end in saves}
    return {end: None for end in ends if end in saves}
