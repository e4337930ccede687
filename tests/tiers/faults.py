"""Test machinery of the tiers: a fault-injecting wrapper around any object store, for testing
what callers do on failure; a batch read verified object by object; a server paused by pid.

A ``FaultInjectingStore`` owns its fault rules (with their remaining counts), a seeded random generator for rules that
fire with a probability, the log of faults it applied, and the lock guarding them. It borrows
the wrapped store: closing the wrapper leaves the inner store open.

Faults model what shared stores really do: a put acknowledged but never visible (``DROP``), a
slow or hung store (``DELAY``), a flipped byte (``CORRUPT``), one part of a logical entry evicted
on its own (``EVICT``), another key's object returned (``SUBSTITUTE``) and a failing store
(``FAIL``).
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import random
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hybridcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from hybridcache.tiers.backends.base import ObjectStore, PutOutcome, check_key
from hybridcache.tiers.keys import Expectation
from hybridcache.tiers.local_servers import Server
from hybridcache.tiers.verify import FetchMiss, FetchVerdict, verify


class Operation(enum.Enum):
    EXISTS = "exists"
    PUT = "put"
    GET = "get"
    REMOVE = "remove"


class FaultKind(enum.Enum):
    DROP = "drop"
    DELAY = "delay"
    CORRUPT = "corrupt"
    EVICT = "evict"
    SUBSTITUTE = "substitute"
    FAIL = "fail"


_ALLOWED = {
    FaultKind.DROP: {Operation.PUT, Operation.GET, Operation.EXISTS},
    FaultKind.DELAY: set(Operation),
    FaultKind.CORRUPT: {Operation.GET},
    FaultKind.EVICT: set(Operation),
    FaultKind.SUBSTITUTE: {Operation.GET},
    FaultKind.FAIL: set(Operation),
}


@dataclass(frozen=True)
class Fault:
    """One rule: ``kind`` on ``operation`` for ``keys`` (``None``: any key), at most ``times``
    times (``None``: always), each time with ``probability``. Build with the class methods."""

    kind: FaultKind
    operation: Operation
    keys: frozenset[str] | None = None
    times: int | None = 1
    probability: float = 1.0
    seconds: float = 0.0  # DELAY: how long the store stalls
    offset: int = -1  # CORRUPT: the byte flipped (negative counts from the end)
    replacement: str | None = None  # SUBSTITUTE: whose object is returned instead

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind) or not isinstance(self.operation, Operation):
            raise InvalidTypeError("kind must be a FaultKind and operation an Operation")
        if self.operation not in _ALLOWED[self.kind]:
            raise InvalidArgumentError(f"{self.kind.value} does not apply to {self.operation.value}")
        if self.keys is not None:
            object.__setattr__(self, "keys", frozenset(check_key(key) for key in self.keys))
        if self.times is not None and (isinstance(self.times, bool) or not isinstance(self.times, int) or self.times < 1):
            raise InvalidArgumentError("times must be None or a positive int")
        if not isinstance(self.probability, (int, float)) or not 0 < self.probability <= 1:
            raise InvalidArgumentError("probability must lie in (0, 1]")
        if not isinstance(self.seconds, (int, float)) or not math.isfinite(self.seconds) or self.seconds < 0:
            raise InvalidArgumentError("seconds must be finite and non-negative")
        if self.kind is FaultKind.SUBSTITUTE:
            check_key(self.replacement)

    @classmethod
    def drop(cls, operation: Operation = Operation.PUT, keys=None, times: int | None = 1) -> Fault:
        """PUT: acknowledged as stored, never written. GET / EXISTS: reported missing."""
        return cls(FaultKind.DROP, operation, _keyset(keys), times)

    @classmethod
    def delay(cls, operation: Operation, seconds: float, keys=None, times: int | None = 1) -> Fault:
        """The call stalls ``seconds``; past its timeout it raises StoreTimeoutError."""
        return cls(FaultKind.DELAY, operation, _keyset(keys), times, seconds=seconds)

    @classmethod
    def corrupt(cls, keys=None, offset: int = -1, times: int | None = 1) -> Fault:
        """A GET returns the object with the byte at ``offset`` flipped."""
        return cls(FaultKind.CORRUPT, Operation.GET, _keyset(keys), times, offset=offset)

    @classmethod
    def evict(cls, keys, operation: Operation = Operation.GET, times: int | None = 1) -> Fault:
        """The inner store loses ``keys`` just before an operation touches them."""
        return cls(FaultKind.EVICT, operation, _keyset(keys), times)

    @classmethod
    def substitute(cls, key: str, replacement: str, times: int | None = 1) -> Fault:
        """A GET of ``key`` returns the object stored under ``replacement``."""
        return cls(FaultKind.SUBSTITUTE, Operation.GET, _keyset([key]), times, replacement=replacement)

    @classmethod
    def fail(cls, operation: Operation, keys=None, times: int | None = 1) -> Fault:
        """The call raises StoreUnavailableError."""
        return cls(FaultKind.FAIL, operation, _keyset(keys), times)


def _keyset(keys: object) -> frozenset[str] | None:
    if keys is None:
        return None
    if isinstance(keys, str):
        return frozenset([keys])
    return frozenset(keys)


@dataclass(frozen=True)
class AppliedFault:
    """One entry of the wrapper's log: which rule fired, on which operation and key."""

    kind: FaultKind
    operation: Operation
    key: str | None


class FaultInjectingStore(ObjectStore):
    """Wraps ``inner`` and applies the added :class:`Fault` rules, in the order they were added."""

    def __init__(self, inner: ObjectStore, *, seed: int = 0) -> None:
        if not isinstance(inner, ObjectStore):
            raise InvalidTypeError("inner must be an ObjectStore")
        super().__init__(default_timeout=inner.default_timeout)
        self.inner = inner
        self._rules: list[list] = []  # [fault, remaining count or None]
        self._random = random.Random(seed)
        self._log: list[AppliedFault] = []
        self._lock = threading.Lock()

    def add(self, fault: Fault) -> None:
        if not isinstance(fault, Fault):
            raise InvalidTypeError("fault must be a Fault")
        with self._lock:
            self._rules.append([fault, fault.times])

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    @property
    def log(self) -> tuple[AppliedFault, ...]:
        with self._lock:
            return tuple(self._log)

    # --- rule matching ---------------------------------------------------------------------------

    def _fire(self, kind: FaultKind, operation: Operation, key: str | None) -> Fault | None:
        """The first live rule of ``kind`` for ``operation`` matching ``key``, consumed once."""
        with self._lock:
            for rule in self._rules:
                fault, remaining = rule
                if fault.kind is not kind or fault.operation is not operation or remaining == 0:
                    continue
                if key is not None and fault.keys is not None and key not in fault.keys:
                    continue
                if fault.probability < 1 and self._random.random() >= fault.probability:
                    continue
                if remaining is not None:
                    rule[1] = remaining - 1
                self._log.append(AppliedFault(kind, operation, key))
                return fault
        return None

    def _first(self, kind: FaultKind, operation: Operation, keys: list[str | None]) -> Fault | None:
        for key in keys:
            fault = self._fire(kind, operation, key)
            if fault is not None:
                return fault
        return None

    def _before(self, operation: Operation, keys: list[str], timeout: float) -> None:
        """Call-level faults (fail, delay) and evictions, applied before the inner call."""
        batch = self._once(keys)
        if self._first(FaultKind.FAIL, operation, batch):
            raise StoreUnavailableError(f"injected failure of {operation.value}")
        delay = self._first(FaultKind.DELAY, operation, batch)
        if delay is not None:
            time.sleep(min(delay.seconds, timeout))
            if delay.seconds >= timeout:
                raise StoreTimeoutError(f"injected {delay.seconds:g} s stall of {operation.value}")
        evicted = [key for key in dict.fromkeys(keys) if self._fire(FaultKind.EVICT, operation, key)]
        if evicted:
            self.inner.remove(evicted)

    @staticmethod
    def _once(keys: list[str]) -> list[str | None]:
        # A call-level rule with a key filter fires when any key of the batch matches.
        return list(dict.fromkeys(keys)) or [None]

    # --- operations ------------------------------------------------------------------------------

    def _exists(self, keys: list[str], timeout: float) -> list[bool]:
        self._before(Operation.EXISTS, keys, timeout)
        found = self.inner.exists(keys, timeout)
        return [here and not self._fire(FaultKind.DROP, Operation.EXISTS, key) for key, here in zip(keys, found)]

    def _put_if_absent(self, items: list[tuple[str, bytes]], timeout: float) -> list[PutOutcome]:
        self._before(Operation.PUT, [key for key, _ in items], timeout)
        dropped = {key for key, _ in items if self._fire(FaultKind.DROP, Operation.PUT, key)}
        kept = [(key, value) for key, value in items if key not in dropped]
        outcomes = dict(zip((key for key, _ in kept), self.inner.put_if_absent(kept, timeout) if kept else []))
        return [outcomes.get(key, PutOutcome.STORED) for key, _ in items]

    def _get(self, keys: list[str], timeout: float) -> list[bytes | None]:
        self._before(Operation.GET, keys, timeout)
        sources = [self._source(key) for key in keys]
        unique = list(dict.fromkeys(sources))
        fetched = dict(zip(unique, self.inner.get(unique, timeout)))
        return [self._after_get(key, fetched[source]) for key, source in zip(keys, sources)]

    def _source(self, key: str) -> str:
        fault = self._fire(FaultKind.SUBSTITUTE, Operation.GET, key)
        return key if fault is None else fault.replacement

    def _after_get(self, key: str, data: bytes | None) -> bytes | None:
        if data is None or self._fire(FaultKind.DROP, Operation.GET, key):
            return None
        fault = self._fire(FaultKind.CORRUPT, Operation.GET, key)
        if fault is None:
            return data
        flipped = bytearray(data)
        flipped[fault.offset % len(flipped)] ^= 0xFF
        return bytes(flipped)

    def _remove(self, keys: list[str], timeout: float) -> list[bool]:
        self._before(Operation.REMOVE, keys, timeout)
        return self.inner.remove(keys, timeout)

    def _close(self) -> None:
        self.clear()


def fetch_verified(
    store: ObjectStore, expectations: Sequence[Expectation], timeout: float | None = None, *, auth_key: bytes | None = None
) -> list[FetchVerdict]:
    """Read ``expectations`` from ``store`` in one batch and verify each object; a store
    failure is a ``TIMEOUT`` or ``UNAVAILABLE`` verdict for every object, not an exception."""
    expectations = list(expectations)
    if any(not isinstance(item, Expectation) for item in expectations):
        raise InvalidTypeError("expectations must be Expectation instances")
    try:
        found = store.get([item.key.name for item in expectations], timeout=timeout)
    except StoreTimeoutError as error:
        return [FetchVerdict(FetchMiss.TIMEOUT, str(error)) for _ in expectations]
    except StoreError as error:
        return [FetchVerdict(FetchMiss.UNAVAILABLE, str(error)) for _ in expectations]
    return [verify(data, item, auth_key=auth_key) for data, item in zip(found, expectations)]


def pause(server: Server) -> None:
    """Stop ``server`` by pid (SIGSTOP): it holds every request until resumed."""
    os.kill(server.process.pid, signal.SIGSTOP)


def resume(server: Server) -> None:
    os.kill(server.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(server: Server) -> Iterator[None]:
    """``server`` paused inside the context, resumed after it, also when the body raises."""
    pause(server)
    try:
        yield
    finally:
        resume(server)
