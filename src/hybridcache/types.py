"""Leaf values and validators shared by every layer of hybridcache.

Owns no mutable state. Everything here depends only on NumPy and ``hybridcache.errors``, so
any module may import it without creating a cycle.

The validators are the public boundary's rules, written once: an int is a Python ``int`` or a
NumPy integer scalar, never a ``bool``; a name (adapter, cache salt, modality) is a non-empty
``str`` that encodes to UTF-8 (a lone surrogate, which decoding JSON can produce, does not);
a collection of names is an ordered sequence, never a bare string.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

import numpy as np

from hybridcache.errors import HybridCacheError, InvalidArgumentError, InvalidNamespaceError, InvalidTypeError


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for a positive denominator, in integers."""
    return -(-numerator // denominator)


def is_int(value: object) -> bool:
    """True for Python and NumPy integers; False for bools, which are ints to Python only."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


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
