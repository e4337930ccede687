"""T2: one file per object in a local directory, size-bounded, least recently used evicted first.

Owns the directory while open (an exclusive ``flock`` on ``<root>/lock``), the in-memory index
of object sizes in recency order, the bytes it holds and the lock guarding both.

A put writes ``<root>/tmp/<unique>.tmp``, fsyncs it, then hard-links it to its final name
``<root>/objects/<shard>/<key>.obj`` (a link never replaces an existing file, so it is an atomic
put-if-absent), fsyncs the directory and unlinks the temporary name. A crash at any point leaves
either no object or the complete one; leftover temporary files are deleted on the next open.
Recency survives a restart through file modification times, refreshed on every read.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from hybridcache.errors import InvalidArgumentError, InvalidTypeError, StoreError, StoreLockedError
from hybridcache.tiers.backends.base import DEFAULT_TIMEOUT_S, ObjectStore, PutOutcome

_SUFFIX = ".obj"


class DiskStore(ObjectStore):
    """Objects as files under ``root``; see the module docstring for the write protocol."""

    def __init__(
        self,
        root: str | os.PathLike,
        capacity_bytes: int,
        *,
        default_timeout: float = DEFAULT_TIMEOUT_S,
        charge: Callable[[str, int], int] | None = None,
    ) -> None:
        """``charge(key, size)``: the bytes an object counts against the budget (None: its
        size); a caller whose objects stand in for larger ones (the replay) charges those."""
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
        self.capacity_bytes = capacity_bytes
        self.root = Path(root)
        self._objects_dir = self.root / "objects"
        self._tmp_dir = self.root / "tmp"
        self._lock = threading.Lock()
        self._names = itertools.count()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._lock_fd = self._open_exclusively()
        try:
            self._recover()
        except BaseException:
            os.close(self._lock_fd)
            raise

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def evictions(self) -> int:
        return self._evictions

    # --- opening -------------------------------------------------------------------------------

    def _open_exclusively(self) -> int:
        try:
            self._objects_dir.mkdir(parents=True, exist_ok=True)
            self._tmp_dir.mkdir(exist_ok=True)
            fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise StoreError(f"cannot open disk tier at {self.root}: {error}") from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(f"{self.root} is already open in another store") from error
            raise StoreError(f"cannot lock {self.root}: {error}") from error
        return fd

    def _recover(self) -> None:
        """Delete interrupted writes, then index the complete objects, oldest first."""
        try:
            for leftover in self._tmp_dir.iterdir():
                leftover.unlink(missing_ok=True)
            found = []
            for path in self._objects_dir.glob(f"*/*{_SUFFIX}"):
                stat = path.stat()
                found.append((stat.st_mtime_ns, path.name[: -len(_SUFFIX)], stat.st_size))
        except OSError as error:
            raise StoreError(f"cannot scan disk tier at {self.root}: {error}") from error
        for _, key, size in sorted(found):
            self._index[key] = self._charge(key, size)
            self._used += self._index[key]
        self._evict_until_fits(0)

    # --- operations ----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        shard = hashlib.blake2b(key.encode(), digest_size=1).hexdigest()
        return self._objects_dir / shard / f"{key}{_SUFFIX}"

    def _exists(self, keys: list[str], timeout: float) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def _put_if_absent(self, items: list[tuple[str, bytes]], timeout: float) -> list[PutOutcome]:
        with self._lock:
            return [self._put_one(key, value) for key, value in items]

    def _put_one(self, key: str, value: bytes) -> PutOutcome:
        if key in self._index:
            return PutOutcome.PRESENT
        size = self._charge(key, len(value))
        if size > self.capacity_bytes:
            return PutOutcome.REJECTED
        self._evict_until_fits(size)
        if not self._write_atomically(self._path(key), value):
            return PutOutcome.PRESENT
        self._index[key] = size
        self._used += size
        return PutOutcome.STORED

    def _write_atomically(self, final: Path, value: bytes) -> bool:
        """Write, fsync, link into place; False when an object already sits at ``final``."""
        temporary = self._tmp_dir / f"{os.getpid()}-{next(self._names)}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, value)
                os.fsync(fd)
            finally:
                os.close(fd)
            if not final.parent.is_dir():
                final.parent.mkdir()
                _fsync_directory(self._objects_dir)  # the new shard's entry must survive a crash
            try:
                os.link(temporary, final)
            except FileExistsError:
                return False
            _fsync_directory(final.parent)
            return True
        except OSError as error:
            raise StoreError(f"cannot write {final.name}: {error}") from error
        finally:
            temporary.unlink(missing_ok=True)

    def _get(self, keys: list[str], timeout: float) -> list[bytes | None]:
        with self._lock:
            return [self._read_one(key) for key in keys]

    def _read_one(self, key: str) -> bytes | None:
        if key not in self._index:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
            os.utime(path)  # persists recency for the next open
        except FileNotFoundError:  # removed behind our back: forget it
            self._used -= self._index.pop(key)
            return None
        except OSError as error:
            raise StoreError(f"cannot read {path.name}: {error}") from error
        self._index.move_to_end(key)
        return data

    def _remove(self, keys: list[str], timeout: float) -> list[bool]:
        with self._lock:
            return [self._remove_one(key) for key in keys]

    def _remove_one(self, key: str) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as error:
            raise StoreError(f"cannot remove {key}: {error}") from error
        return True

    def _evict_until_fits(self, incoming: int) -> None:
        while self._index and self._used + incoming > self.capacity_bytes:
            oldest = next(iter(self._index))
            self._remove_one(oldest)
            self._evictions += 1

    def _close(self) -> None:
        with self._lock:
            os.close(self._lock_fd)  # closing the descriptor releases the flock


def _write_all(fd: int, value: bytes) -> None:
    view = memoryview(value)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[written:]


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
