"""Leaf values and validators shared by every layer of hybridcache.

Owns no mutable state: leaf value types (namespaces, multimodal spans, node handles), the one
set of sentinels, and validators. Everything here depends only on NumPy and
``hybridcache.errors``, so any module may import it without creating a cycle.

The validators are the public boundary's rules, written once: an int is a Python ``int`` or a
NumPy integer scalar, never a ``bool``; a name (adapter, cache salt, modality) is a non-empty
``str`` that encodes to UTF-8 (a lone surrogate, which decoding JSON can produce, does not);
a collection of names is an ordered sequence, never a bare string.
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hybridcache.errors import (
    HybridCacheError,
    InvalidArgumentError,
    InvalidNamespaceError,
    InvalidSpanError,
    InvalidTypeError,
)

TOKEN_DTYPE = np.int32
EXPERT_DTYPE = np.int16

# One set of "none" sentinels for ids that are otherwise non-negative.
NO_NODE = -1  # a trie node slot
NO_SLOT = -1  # a state-pool slot
NO_BLOCK = -1  # a KV block
NO_SAVE = -1  # what a refused checkpoint reservation returns instead of a slot


class NodeHandle(NamedTuple):
    """A trie node as a cursor remembers it: its slot and the generation it had then. A node
    that was detached since (generation moved on) is recognized in O(1)."""

    slot: int
    generation: int


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for a positive denominator, in integers."""
    return -(-numerator // denominator)


def is_int(value: object) -> bool:
    """True for Python and NumPy integers; False for bools, which are ints to Python only."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def finite_float(value: object) -> float | None:
    """``value`` as a float when it is a Python int or float (not a bool) that is finite as a
    float; None otherwise (a string, NaN, an infinity, an int beyond a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def is_positive_finite(value: object) -> bool:
    """True for an int or float (not a bool) that is a finite float above 0 (a duration, a rate)."""
    number = finite_float(value)
    return number is not None and number > 0


def as_int(name: str, value: object, minimum: int | None = None, *, error: type[HybridCacheError] | None = None) -> int:
    """``value`` as a Python int. A non-int raises ``error`` (default ``InvalidTypeError``), one
    below ``minimum`` raises ``error`` (default ``InvalidArgumentError``)."""
    if not is_int(value):
        raise (error or InvalidTypeError)(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise (error or InvalidArgumentError)(f"{name} must be >= {minimum}, got {value}")
    return value


def as_bool(name: str, value: object, *, error: type[HybridCacheError] | None = None) -> bool:
    """``value`` when it is a bool (Python or NumPy); anything else raises ``error`` (default
    ``InvalidTypeError``)."""
    if not isinstance(value, (bool, np.bool_)):
        raise (error or InvalidTypeError)(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def as_name(name: str, value: object, error: type[HybridCacheError] = InvalidNamespaceError) -> str:
    """A non-empty str that encodes to UTF-8, returned as a plain ``str`` copy; anything else
    raises ``error``."""
    if not isinstance(value, str):
        raise error(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise error(f"{name} must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as reason:
        raise error(f"{name} is not valid Unicode text ({reason.reason})") from None
    return str(value)


def as_optional_name(name: str, value: object) -> str | None:
    return None if value is None else as_name(name, value)


def as_ordered(name: str, value: object) -> tuple:
    """An ordered iterable materialized as a tuple. Strings, bytes, sets and mappings are
    refused: their iteration is either not what the caller meant or has no defined order."""
    if isinstance(value, (str, bytes, bytearray, memoryview, Set, Mapping)) or not isinstance(value, Iterable):
        raise InvalidTypeError(f"{name} must be an ordered sequence, got {type(value).__name__}")
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise InvalidTypeError(f"{name} must be one-dimensional")
    return tuple(value)


def as_names(name: str, value: object) -> tuple[str, ...]:
    """An ordered sequence of distinct names (see ``as_name``) as a tuple."""
    names = tuple(as_name(f"{name}[{index}]", item) for index, item in enumerate(as_ordered(name, value)))
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"{name} lists a name twice")
    return names


@dataclass(frozen=True, order=True)
class MultimodalSpan:
    """Placeholder positions ``[start, end)`` whose embeddings come from ``content_id``'s data.

    ``content_id`` is the caller's content hash (for example a SHA-256 hex digest of the image
    bytes); equal ids are trusted to mean equal content.
    """

    start: int
    end: int
    modality: str
    content_id: str

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            if not is_int(getattr(self, name)):
                raise InvalidTypeError(f"span {name} must be an int")
        for name in ("modality", "content_id"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidTypeError(f"span {name} must be a str")
            object.__setattr__(self, name, as_name(f"span {name}", value, InvalidSpanError))
        if self.start < 0 or self.end <= self.start:
            raise InvalidSpanError(f"span [{self.start}, {self.end}) is empty or negative")
        object.__setattr__(self, "start", int(self.start))
        object.__setattr__(self, "end", int(self.end))


@dataclass(frozen=True)
class Namespace:
    """What selects a trie root: the adapter (``None`` = base model) and an optional tenant salt.

    Equal tokens in different namespaces never share a block or a checkpoint.
    """

    adapter: str | None = None
    cache_salt: str | None = None
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        for name in ("adapter", "cache_salt"):
            object.__setattr__(self, name, as_optional_name(name, getattr(self, name)))
        object.__setattr__(self, "_hash", hash((self.adapter, self.cache_salt)))

    def __hash__(self) -> int:  # looked up on every match: computed once
        return self._hash

    def __setstate__(self, state: dict) -> None:  # str hashes differ between processes
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash((self.adapter, self.cache_salt)))


BASE_NAMESPACE = Namespace()


def validated_spans(spans: object, num_tokens: int) -> tuple[MultimodalSpan, ...]:
    """Multimodal spans as a start-ordered tuple, each inside ``[0, num_tokens)``, none
    overlapping (a sequence's, a stored object's)."""
    if isinstance(spans, MultimodalSpan):
        raise InvalidTypeError("multimodal must be a sequence of MultimodalSpan")
    spans = as_ordered("multimodal", spans)
    if any(not isinstance(span, MultimodalSpan) for span in spans):
        raise InvalidTypeError("multimodal spans must be MultimodalSpan instances")
    ordered = tuple(sorted(spans))
    for span in ordered:
        if span.end > num_tokens:
            raise InvalidSpanError(f"span [{span.start}, {span.end}) ends beyond {num_tokens} tokens")
    for left, right in zip(ordered, ordered[1:]):
        if right.start < left.end:
            raise InvalidSpanError(f"spans {left} and {right} overlap")
    return ordered
