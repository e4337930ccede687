"""The narrow, batch-first object-store interface every tier implements.

Owns, per store: whether it is closed, its default timeout, and (for network stores) the
:class:`DeadlineRunner` whose worker threads carry the calls. Subclasses own their contents.

Contract (tested against every backend by one suite):

* keys are portable strings (``[A-Za-z0-9._:-]``, 1..250 characters); values are non-empty bytes;
* ``put_if_absent`` never overwrites: an existing object is left as it is (``PRESENT``), a
  refused one (larger than the store, store full) is ``REJECTED``; the store keeps its own copy;
* ``get`` returns ``None`` for a missing object; ``get_into`` fills caller buffers and returns
  the object sizes (``None``: missing, or larger than its buffer: never a usable object);
* every call finishes or raises :class:`StoreTimeoutError` within its timeout (``None``: the
  store's default); a store failure raises :class:`StoreUnavailableError` or
  :class:`StoreError`, and a call on a closed store :class:`StoreClosedError` (a
  ``StoreUnavailableError``). Bad arguments raise their ``hybridcache.errors``
  class; any other exception a backend or its client raises (``MemoryError``, a client's
  ``UnicodeDecodeError``) is wrapped into :class:`StoreError` here, so none escapes.
"""

from __future__ import annotations

import concurrent.futures
import enum
import math
import numbers
import re
from abc import ABC, abstractmethod
from typing import Callable, Sequence, TypeVar

import numpy as np

from hybridcache.errors import (
    HybridCacheError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidTypeError,
    StoreClosedError,
    StoreError,
    StoreTimeoutError,
)

DEFAULT_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 86_400.0  # one day: longer is a mistake, and C socket timeouts overflow
MAX_KEY_CHARS = 250
_KEY = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_KEY_CHARS}}}")
_T = TypeVar("_T")

BytesLike = bytes | bytearray | memoryview


class PutOutcome(enum.Enum):
    """What ``put_if_absent`` did with one item."""

    STORED = "stored"
    PRESENT = "present"  # an object under the key already existed; it was left unchanged
    REJECTED = "rejected"  # the store declined it (too large, or full and unable to evict)


class ObjectStore(ABC):
    """Batch-first store of immutable objects; see the module docstring for the contract."""

    def __init__(self, *, default_timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.default_timeout = checked_timeout(default_timeout)
        self._closed = False

    # --- public boundary: validate, then delegate --------------------------------------------

    def exists(self, keys: Sequence[str], timeout: float | None = None) -> list[bool]:
        keys = self._prepare(keys)
        return self._guarded("exists", lambda: self._exists(keys, self._timeout(timeout))) if keys else []

    def put_if_absent(
        self, items: Sequence[tuple[str, BytesLike]], timeout: float | None = None
    ) -> list[PutOutcome]:
        pairs = self._prepare_items(items)
        return self._guarded("put", lambda: self._put_if_absent(pairs, self._timeout(timeout))) if pairs else []

    def get(self, keys: Sequence[str], timeout: float | None = None) -> list[bytes | None]:
        keys = self._prepare(keys)
        return self._guarded("get", lambda: self._get(keys, self._timeout(timeout))) if keys else []

    def get_into(
        self, keys: Sequence[str], buffers: Sequence[object], timeout: float | None = None
    ) -> list[int | None]:
        keys = self._prepare(keys)
        views = _writable_views(buffers, len(keys))
        return self._guarded("get", lambda: self._get_into(keys, views, self._timeout(timeout))) if keys else []

    def remove(self, keys: Sequence[str], timeout: float | None = None) -> list[bool]:
        keys = self._prepare(keys)
        return self._guarded("remove", lambda: self._remove(keys, self._timeout(timeout))) if keys else []

    def _guarded(self, what: str, call: Callable[[], _T]) -> _T:
        """Run one backend operation; whatever it raises that is not ours becomes a StoreError."""
        try:
            return call()
        except HybridCacheError:
            raise
        except Exception as error:  # a backend or client bug, MemoryError, a decode error: a failed store
            raise StoreError(f"{type(self).__name__} {what} failed: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Release connections and workers; idempotent. Later calls raise StoreClosedError."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- what a backend implements -----------------------------------------------------------

    @abstractmethod
    def _exists(self, keys: list[str], timeout: float) -> list[bool]: ...

    @abstractmethod
    def _put_if_absent(self, items: list[tuple[str, bytes]], timeout: float) -> list[PutOutcome]: ...

    @abstractmethod
    def _get(self, keys: list[str], timeout: float) -> list[bytes | None]: ...

    @abstractmethod
    def _remove(self, keys: list[str], timeout: float) -> list[bool]: ...

    @abstractmethod
    def _close(self) -> None: ...

    def _get_into(self, keys: list[str], buffers: list[memoryview], timeout: float) -> list[int | None]:
        """Default: one batch get, then a copy; a backend with a zero-copy read overrides it."""
        sizes: list[int | None] = []
        for data, buffer in zip(self._get(keys, timeout), buffers):
            if data is None or len(data) > len(buffer):
                sizes.append(None)
                continue
            buffer[: len(data)] = data
            sizes.append(len(data))
        return sizes

    # --- validation ----------------------------------------------------------------------------

    def _prepare(self, keys: object) -> list[str]:
        self._check_open()
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidTypeError("keys must be a list or tuple of str")
        keys = list(keys)
        for key in keys:
            check_key(key)
        return keys

    def _prepare_items(self, items: object) -> list[tuple[str, bytes]]:
        self._check_open()
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise InvalidTypeError("items must be a list or tuple of (key, bytes) pairs")
        pairs = [_checked_item(item) for item in items]
        if len({key for key, _ in pairs}) != len(pairs):
            raise InvalidArgumentError("a put batch names the same key twice")
        return pairs

    def _timeout(self, timeout: object) -> float:
        return self.default_timeout if timeout is None else checked_timeout(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{type(self).__name__} is closed")


def check_key(key: object) -> str:
    """Validate one key: portable characters only, so every backend stores it as it is."""
    if not isinstance(key, str):
        raise InvalidTypeError(f"keys must be str, got {type(key).__name__}")
    if not _KEY.fullmatch(key):
        raise InvalidKeyError(f"key must match [A-Za-z0-9._:-]{{1,{MAX_KEY_CHARS}}}, got {key[:60]!r}")
    return key


def _checked_item(item: object) -> tuple[str, bytes]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise InvalidTypeError("each put item must be a (key, bytes) tuple")
    key, value = item
    check_key(key)
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"value for {key!r} must be bytes-like, got {type(value).__name__}")
    value = bytes(value)  # the store keeps its own immutable copy
    if not value:
        raise InvalidArgumentError(f"value for {key!r} is empty")
    return key, value

def checked_timeout(timeout: object) -> float:
    """A timeout in seconds: a real number (NumPy's too, never a bool), positive, finite and at
    most ``MAX_TIMEOUT_S`` (clients turn it into C timeouts: 1e10 s overflows in every call)."""
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, numbers.Real):
        raise InvalidTypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise InvalidArgumentError(f"timeout must be positive and finite, got {timeout}")
    if timeout > MAX_TIMEOUT_S:
        raise InvalidArgumentError(f"timeout must be at most {MAX_TIMEOUT_S} s (one day), got {timeout}")
    return float(timeout)


def _writable_views(buffers: object, count: int) -> list[memoryview]:
    if isinstance(buffers, (str, bytes)) or not isinstance(buffers, Sequence):
        raise InvalidTypeError("buffers must be a list or tuple of writable buffers")
    if len(buffers) != count:
        raise InvalidArgumentError(f"{len(buffers)} buffers for {count} keys")
    views = []
    for buffer in buffers:
        try:
            view = memoryview(buffer)
        except TypeError as error:
            raise InvalidTypeError(f"buffer of type {type(buffer).__name__} is not a buffer") from error
        if view.readonly or not view.contiguous:
            raise InvalidArgumentError("buffers must be writable and contiguous")
        views.append(view.cast("B"))
    return views


class DeadlineRunner:
    """Runs blocking client calls on worker threads and waits at most their timeout.

    Owns its thread pool. A call that overruns is abandoned, not killed: its thread finishes
    when the client's own socket or RPC timeout fires, and the caller has already got
    :class:`StoreTimeoutError`. Calls that queue behind abandoned ones time out too, so a hung
    store makes every caller fall back instead of waiting.
    """

    def __init__(self, name: str, workers: int = 4) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def run(self, call: Callable[[], _T], timeout: float, what: str) -> _T:
        future = self._pool.submit(call)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as error:
            future.cancel()
            raise StoreTimeoutError(f"{what} did not finish within {timeout:g} s") from error

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
