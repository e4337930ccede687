"""T2: one file per object in a local directory, size-bounded, least recently used evicted first.

Owns the directory while open (an exclusive ``flock`` on ``<root>/lock``; a shared one in
read-only mode), the in-memory index of object sizes in recency order, the bytes it holds and
the lock guarding both.

The root is the store's own: a new or empty directory is marked (``<root>/hybridcache-disk-tier``,
written first), and a non-empty directory without that marker is refused
(:class:`NotAStoreRootError`), so a store never deletes or overwrites files it did not create.

A put writes ``<root>/scratch/<pid>-<n>.tmp``, fsyncs it, then hard-links it to its final name
``<root>/objects/<shard>/<key>.obj`` (a link never replaces an existing file, so it is an atomic
put-if-absent), fsyncs the directory and unlinks the temporary name. A crash at any point leaves
either no object or the complete one; leftover scratch files (only names of that form) are
deleted on the next open. Recency survives a restart through file modification times,
refreshed on every read when the directory is writable.

Every per-object call runs relative to its shard directory, opened without following links
(``disk_root.DiskRoot``, which owns the layout and the file operations): a shard or
``objects/``/``scratch/`` replaced by a link to somewhere else, even after the store opened,
costs a miss or a rejected put, never a file read or written outside the root.

Reads trust nothing about the file under an object name: it is opened without following links
and without blocking, and used only when it is a regular file of the size the index recorded
(else it is forgotten, a miss). A store opened with ``read_only=True`` never writes: its puts
are ``REJECTED``, removals and evictions do nothing, and a warm cache on a read-only disk serves.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from hybridcache.errors import InvalidArgumentError, InvalidTypeError, LifecycleError, StoreError
from hybridcache.tiers.backends.base import DEFAULT_TIMEOUT_S, ObjectStore, PutOutcome
from hybridcache.tiers.backends.disk_root import MARKER_NAME, DiskRoot

__all__ = ["MARKER_NAME", "DiskStore"]


class DiskStore(ObjectStore):
    """Objects as files under ``root``; see the module docstring for the write protocol."""

    def __init__(
        self,
        root: str | os.PathLike,
        capacity_bytes: int,
        *,
        default_timeout: float = DEFAULT_TIMEOUT_S,
        charge: Callable[[str, int], int] | None = None,
        read_only: bool = False,
    ) -> None:
        """``charge(key, size)``: the bytes an object counts against the budget (None: its
        size); a caller whose objects stand in for larger ones (the replay) charges those.
        ``read_only``: serve an existing store without writing anything (it must be marked)."""
        super().__init__(default_timeout=default_timeout)
        if charge is not None and not callable(charge):
            raise InvalidTypeError("charge must be callable")
        self._charge = (lambda key, size: size) if charge is None else charge
        if not isinstance(root, (str, os.PathLike)):
            raise InvalidTypeError("root must be a path")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidTypeError("capacity_bytes must be an int")
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not isinstance(read_only, bool):
            raise InvalidTypeError("read_only must be a bool")
        self.capacity_bytes = capacity_bytes
        self.read_only = read_only
        self.root = Path(root)
        self._files = DiskRoot(self.root)
        self._lock = threading.Lock()
        self._names = itertools.count()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> charged bytes, oldest first
        self._sizes: dict[str, int] = {}  # key -> the file's size in bytes
        self._used = 0
        self._evictions = 0
        self._on_evict: Callable[[str], None] | None = None
        self._evicted: list[str] = []  # evicted by the put in progress, reported once the lock is released
        self._lock_fd = self._files.open_read_only() if read_only else self._files.open_exclusively()
        try:
            self._recover()
        except BaseException:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def evictions(self) -> int:
        return self._evictions

    # --- opening -------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Delete this store's interrupted writes, then index the complete objects, oldest first."""
        self._files.check_folders()
        try:
            if not self.read_only:
                self._files.remove_interrupted_writes()
            found = self._files.stored_objects(self.capacity_bytes)
        except OSError as error:
            raise StoreError(f"cannot scan disk tier at {self.root}: {error}") from error
        for _, key, size in found:
            self._index[key] = self._charge(key, size)
            self._sizes[key] = size
            self._used += self._index[key]
        self._evict_until_fits(0)
        self._evicted.clear()  # before anyone listens: nothing was announced of them

    # --- operations ----------------------------------------------------------------------------

    def _exists(self, keys: list[str], timeout: float) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def listen_evictions(self, on_evict: Callable[[str], None]) -> None:
        """Install the one eviction callback: called with each key evicted to make room (after
        the put that evicted it released the store), so the tier's contents can be announced."""
        if not callable(on_evict):
            raise InvalidTypeError("on_evict must be callable")
        if self._on_evict is not None:
            raise LifecycleError("this disk store already reports its evictions to another listener")
        self._on_evict = on_evict

    def _put_if_absent(self, items: list[tuple[str, bytes]], timeout: float) -> list[PutOutcome]:
        with self._lock:
            outcomes = [self._put_one(key, value) for key, value in items]
            evicted, self._evicted = self._evicted, []
        if self._on_evict is not None:
            for key in evicted:
                self._on_evict(key)
        return outcomes

    def _put_one(self, key: str, value: bytes) -> PutOutcome:
        if key in self._index:
            return PutOutcome.PRESENT
        size = self._charge(key, len(value))
        if self.read_only or size > self.capacity_bytes:
            return PutOutcome.REJECTED
        self._evict_until_fits(size)
        outcome = self._files.write(key, value, f"{os.getpid()}-{next(self._names)}.tmp")
        if outcome is not PutOutcome.STORED:
            return outcome
        self._index[key] = size
        self._sizes[key] = len(value)
        self._used += size
        return PutOutcome.STORED

    def _get(self, keys: list[str], timeout: float) -> list[bytes | None]:
        with self._lock:
            return [self._read_one(key) for key in keys]

    def _read_one(self, key: str) -> bytes | None:
        if key not in self._index:
            return None
        data = self._files.read(key, self._sizes[key], refresh=not self.read_only)
        if data is None:
            self._forget(key)
            return None
        self._index.move_to_end(key)
        return data

    def _forget(self, key: str) -> None:
        self._used -= self._index.pop(key)
        self._sizes.pop(key, None)

    def _remove(self, keys: list[str], timeout: float) -> list[bool]:
        with self._lock:
            return [self._remove_one(key) for key in keys]

    def _remove_one(self, key: str) -> bool:
        if self.read_only or key not in self._index:
            return False
        self._forget(key)
        self._files.unlink(key)
        return True

    def _evict_until_fits(self, incoming: int) -> None:
        while not self.read_only and self._index and self._used + incoming > self.capacity_bytes:
            oldest = next(iter(self._index))
            self._remove_one(oldest)
            self._evictions += 1
            self._evicted.append(oldest)

    def _close(self) -> None:
        with self._lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # closing the descriptor releases the flock
