"""What the cache protocol's forward boundaries accept, checked before anything changes.

Owns no state: each function turns a caller's argument into the validated, immutable form the
protocol works on, or raises the specific ``hybridcache.errors`` exception; ``called_back`` runs
a caller's callback so that its failure is undone first and raised as one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from collections.abc import Sequence as SequenceLike
from typing import TypeVar

from hybridcache.errors import (
    DoubleFreeError,
    HybridCacheError,
    InvalidStepError,
    InvalidTypeError,
    LifecycleError,
    WrongRoleError,
)
from hybridcache.memory.protocols import StateSlotAllocator
from hybridcache.memory.state_pool import SlotRole
from hybridcache.policies.admission import checked_kind
from hybridcache.sequence import Sequence
from hybridcache.types import NO_SLOT, as_int, ceil_div

_T = TypeVar("_T")


def require_sequence(seq: object) -> None:
    if not isinstance(seq, Sequence):
        raise InvalidTypeError(f"expected a Sequence, got {type(seq).__name__}")


def require_not_in_flight(seq: object, action: str) -> None:
    """Refuse a sequence that still holds the table its in-flight forward is writing
    (``forward_queued`` without ``forward_done`` or ``forward_failed``: its save published
    pinned and not ready): admitting it again would match over that table and leave blocks
    held after the sequence is freed. Once the trie freed its table (a preemption) it may be
    admitted again, the pin released when its forward lands; a save pinned at a boundary
    (ready, released by ``unpin_save``) is not in flight."""
    require_sequence(seq)
    pin = seq.prefix_state.checkpoints.producer_pin  # type: ignore[union-attr]
    if pin is not None and not pin.ready and seq.num_blocks:  # type: ignore[union-attr]
        raise LifecycleError(f"the sequence's forward is in flight: call forward_done or forward_failed before {action}")


def require_unpinned_save(seq: object) -> None:
    """Refuse to free a sequence that still holds its save's producer pin (in flight, or at a
    boundary): that save would stay pinned with nobody left to release it."""
    require_sequence(seq)
    if seq.prefix_state.checkpoints.producer_pin is not None:  # type: ignore[union-attr]
        raise LifecycleError("the sequence's forward is in flight: call forward_done or forward_failed before free")


def token_count(name: str, value: object) -> int:
    """A count of tokens (a chunk's end, a table's coverage): a non-negative int."""
    value = as_int(name, value)
    if value < 0:
        raise InvalidStepError(f"{name} must be >= 0, got {value}")
    return value


def runtime_slot_of(states: StateSlotAllocator, slot: object) -> int:
    """``free``'s runtime slot: ``NO_SLOT``, or a slot of ``states`` that holds a runtime state."""
    slot = as_int("runtime_slot", slot)
    if slot != NO_SLOT:
        role = states.role_of(slot)  # a slot outside the pool raises InvalidBlockIdError
        if role != SlotRole.RUNTIME:
            error = DoubleFreeError if role == SlotRole.FREE else WrongRoleError
            raise error(f"slot {slot} holds no runtime state ({role.name.lower()})")
    return slot


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


def called_back(call: Callable[[], _T], wrap_as: type[HybridCacheError], what: str, undo: Callable[[], None]) -> _T:
    """``call()``, a caller's callback: when it raises, ``undo()`` first, then its error
    propagates (a non-hybridcache one as ``wrap_as``, chained)."""
    try:
        return call()
    except BaseException as error:
        undo()
        if isinstance(error, HybridCacheError) or not isinstance(error, Exception):
            raise
        raise wrap_as(f"{what} raised {type(error).__name__}: {error}") from error
