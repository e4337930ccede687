"""T1: objects in host RAM under a byte budget, least recently used evicted first.

Owns the object dictionary (in recency order), the bytes it holds and the lock that guards
both. Budgets per kind (KV chunks, checkpoints) are separate stores, one per budget. An
``on_evict`` callback sees each object evicted to make room (after the lock is released), which
is how a tier below it gets write-back demotions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from hybridcache import machine
from hybridcache.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError, LifecycleError
from hybridcache.tiers.backends.base import DEFAULT_TIMEOUT_S, ObjectStore, PutOutcome


class HostMemoryStore(ObjectStore):
    """Objects in process memory; a put that does not fit evicts the least recently used."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        default_timeout: float = DEFAULT_TIMEOUT_S,
        on_evict: Callable[[str, bytes], None] | None = None,
        charge: Callable[[str, int], int] | None = None,
    ) -> None:
        """``charge(key, size)``: the bytes an object counts against the budget (None: its
        size); a caller whose objects stand in for larger ones (the replay) charges those."""
        super().__init__(default_timeout=default_timeout)
        if on_evict is not None and not callable(on_evict):
            raise InvalidTypeError("on_evict must be callable")
        if charge is not None and not callable(charge):
            raise InvalidTypeError("charge must be callable")
        self._charge = charge
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidTypeError("capacity_bytes must be an int")
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"capacity_bytes must be positive, got {capacity_bytes}")
        memory = machine.host_memory_bytes()
        if charge is None and capacity_bytes > memory:  # charged budgets are nominal, not held here
            raise InvalidConfigError(
                f"capacity_bytes {capacity_bytes:,} is more than this machine's memory ({memory:,} bytes)"
            )
        self.capacity_bytes = capacity_bytes
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._lock = threading.Lock()
        self._on_evict = on_evict

    def listen_evictions(self, on_evict: Callable[[str, bytes], None]) -> None:
        """Install the one eviction callback (a tier below this one demoting into itself)."""
        if not callable(on_evict):
            raise InvalidTypeError("on_evict must be callable")
        if self._on_evict is not None:
            raise LifecycleError("this host store already reports its evictions to another listener")
        self._on_evict = on_evict

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def evictions(self) -> int:
        """Objects evicted to make room since the store was created."""
        return self._evictions

    def _exists(self, keys: list[str], timeout: float) -> list[bool]:
        with self._lock:
            return [key in self._objects for key in keys]

    def _put_if_absent(self, items: list[tuple[str, bytes]], timeout: float) -> list[PutOutcome]:
        evicted: list[tuple[str, bytes]] = []
        with self._lock:
            outcomes = [self._put_one(key, value, evicted) for key, value in items]
        if self._on_evict is not None:
            for key, value in evicted:
                self._on_evict(key, value)
        return outcomes

    def _charged(self, key: str, value: bytes) -> int:
        return len(value) if self._charge is None else self._charge(key, len(value))

    def _put_one(self, key: str, value: bytes, evicted: list[tuple[str, bytes]]) -> PutOutcome:
        if key in self._objects:
            return PutOutcome.PRESENT
        size = self._charged(key, value)
        if size > self.capacity_bytes:
            return PutOutcome.REJECTED
        while self._used + size > self.capacity_bytes:
            victim = self._objects.popitem(last=False)
            self._used -= self._charged(*victim)
            self._evictions += 1
            evicted.append(victim)
        self._objects[key] = value
        self._used += size
        return PutOutcome.STORED

    def _get(self, keys: list[str], timeout: float) -> list[bytes | None]:
        with self._lock:
            found = []
            for key in keys:
                data = self._objects.get(key)
                if data is not None:
                    self._objects.move_to_end(key)  # a read makes it the most recently used
                found.append(data)
            return found

    def _remove(self, keys: list[str], timeout: float) -> list[bool]:
        with self._lock:
            removed = []
            for key in keys:
                data = self._objects.pop(key, None)
                if data is not None:
                    self._used -= self._charged(key, data)
                removed.append(data is not None)
            return removed

    def _close(self) -> None:
        with self._lock:
            self._objects.clear()
            self._used = 0
