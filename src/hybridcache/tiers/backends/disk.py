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

Every per-object call (open, link, unlink, stat, utime) runs relative to its shard directory,
opened with ``O_DIRECTORY | O_NOFOLLOW`` (through ``objects/``, opened the same way): a shard or
``objects/``/``scratch/`` replaced by a link to somewhere else, even after the store opened,
costs a miss or a rejected put, never a file read or written outside the root.

Reads trust nothing about the file under an object name: it is opened without following links
and without blocking, and used only when it is a regular file of the size the index recorded
(else it is forgotten, a miss). A store opened with ``read_only=True`` never writes: its puts
are ``REJECTED``, removals and evictions do nothing, and a warm cache on a read-only disk serves.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import os
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterator

from hybridcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    LifecycleError,
    NotAStoreRootError,
    StoreError,
    StoreLockedError,
)
from hybridcache.tiers.backends.base import DEFAULT_TIMEOUT_S, ObjectStore, PutOutcome, check_key

_SUFFIX = ".obj"
MARKER_NAME = "hybridcache-disk-tier"
_MARKER_TEXT = b"hybridcache disk tier, layout 2: objects/<shard>/<key>.obj, scratch/<pid>-<n>.tmp\n"
_SCRATCH_NAME = re.compile(r"[0-9]+-[0-9]+\.tmp")
_OWN_NAMES = {MARKER_NAME, "lock", "objects", "scratch"}
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_NOT_OUR_DIRECTORY = (errno.ELOOP, errno.ENOTDIR)  # a link, or a file, where a directory belongs


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
        self._objects_dir = self.root / "objects"
        self._scratch_dir = self.root / "scratch"
        self._lock = threading.Lock()
        self._names = itertools.count()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> charged bytes, oldest first
        self._sizes: dict[str, int] = {}  # key -> the file's size in bytes
        self._used = 0
        self._evictions = 0
        self._on_evict: Callable[[str], None] | None = None
        self._evicted: list[str] = []  # evicted by the put in progress, reported once the lock is released
        self._lock_fd = self._open_read_only() if read_only else self._open_exclusively()
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

    def _claim_root(self) -> None:
        """Mark a new or empty root as this store's; refuse one holding anything else."""
        marker = self.root / MARKER_NAME
        if marker.is_file():
            return
        if self.root.is_dir() and any(self.root.iterdir()):
            raise NotAStoreRootError(
                f"{self.root} is not empty and has no {MARKER_NAME} marker: not a disk tier; "
                "give a new or empty directory"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return  # another store marked it first
        try:
            _write_all(fd, _MARKER_TEXT)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_directory(self.root)

    def _open_exclusively(self) -> int:
        try:
            self._claim_root()
            self._objects_dir.mkdir(exist_ok=True)
            self._scratch_dir.mkdir(exist_ok=True)
            fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            raise StoreError(f"cannot open disk tier at {self.root}: {error}") from error
        return self._flocked(fd, fcntl.LOCK_EX)

    def _open_read_only(self) -> int | None:
        """A shared lock when the lock file can be read (a writer holds it exclusively);
        None when it cannot, on a medium where no writer can run anyway."""
        if not (self.root / MARKER_NAME).is_file():
            raise NotAStoreRootError(f"{self.root} has no {MARKER_NAME} marker: not a disk tier to read")
        try:
            fd = os.open(self.root / "lock", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        return self._flocked(fd, fcntl.LOCK_SH)

    def _flocked(self, fd: int, mode: int) -> int:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(f"{self.root} is already open in another store") from error
            raise StoreError(f"cannot lock {self.root}: {error}") from error
        return fd

    def _recover(self) -> None:
        """Delete this store's interrupted writes, then index the complete objects, oldest first."""
        for folder in (self._objects_dir, self._scratch_dir):
            if folder.is_symlink():  # its files would be someone else's
                raise NotAStoreRootError(f"{folder} is a symbolic link: a disk tier keeps its files in its own root")
        try:
            if not self.read_only:
                for leftover in self._scratch_dir.iterdir():
                    if _SCRATCH_NAME.fullmatch(leftover.name) and leftover.is_file():
                        leftover.unlink(missing_ok=True)
            found = [entry for entry in map(self._indexable, self._object_files()) if entry is not None]
        except OSError as error:
            raise StoreError(f"cannot scan disk tier at {self.root}: {error}") from error
        for _, key, size in sorted(found):
            self._index[key] = self._charge(key, size)
            self._sizes[key] = size
            self._used += self._index[key]
        self._evict_until_fits(0)
        self._evicted.clear()  # before anyone listens: nothing was announced of them

    def _object_files(self) -> list[Path]:
        return list(self._objects_dir.glob(f"*/*{_SUFFIX}")) if self._objects_dir.is_dir() else []

    def _indexable(self, path: Path) -> tuple[int, str, int] | None:
        """(mtime, key, size) of a regular object file at its own key's path, else None."""
        key = path.name[: -len(_SUFFIX)]
        try:
            check_key(key)
        except InvalidArgumentError:
            return None
        if path.parent.is_symlink():
            return None
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or not 0 < info.st_size <= self.capacity_bytes or self._path(key) != path:
            return None
        return info.st_mtime_ns, key, info.st_size

    # --- operations ----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self._objects_dir / _shard_name(key) / _object_name(key)

    @contextlib.contextmanager
    def _shard(self, key: str, *, create: bool = False) -> Iterator[int | None]:
        """A descriptor of ``key``'s shard directory, opened without following links (None when
        it is missing, or is not a real directory of this root: a planted link is a miss)."""
        with _directory(self._objects_dir) as objects:
            if objects is None:
                yield None
                return
            name = _shard_name(key)
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=objects)
                    os.fsync(objects)  # the new shard's entry must survive a crash
                except FileExistsError:
                    pass
            with _directory(name, dir_fd=objects) as shard:
                yield shard

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
        outcome = self._write_atomically(key, value)
        if outcome is not PutOutcome.STORED:
            return outcome
        self._index[key] = size
        self._sizes[key] = len(value)
        self._used += size
        return PutOutcome.STORED

    def _write_atomically(self, key: str, value: bytes) -> PutOutcome:
        """Write, fsync, link into place: ``PRESENT`` when an object already sits under the
        key's name, ``REJECTED`` when its shard or the scratch folder is not this root's own."""
        temporary = f"{os.getpid()}-{next(self._names)}.tmp"
        try:
            with _directory(self._scratch_dir) as scratch:
                if scratch is None:
                    return PutOutcome.REJECTED
                try:
                    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=scratch)
                    try:
                        _write_all(fd, value)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    return self._link_into_shard(key, scratch, temporary)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temporary, dir_fd=scratch)
        except OSError as error:
            raise StoreError(f"cannot write {_object_name(key)}: {error}") from error

    def _link_into_shard(self, key: str, scratch: int, temporary: str) -> PutOutcome:
        with self._shard(key, create=True) as shard:
            if shard is None:
                return PutOutcome.REJECTED
            try:
                os.link(temporary, _object_name(key), src_dir_fd=scratch, dst_dir_fd=shard, follow_symlinks=False)
            except FileExistsError:
                return PutOutcome.PRESENT
            os.fsync(shard)
            return PutOutcome.STORED

    def _get(self, keys: list[str], timeout: float) -> list[bytes | None]:
        with self._lock:
            return [self._read_one(key) for key in keys]

    def _read_one(self, key: str) -> bytes | None:
        if key not in self._index:
            return None
        try:
            with self._shard(key) as shard:
                data = None if shard is None else self._read_regular(shard, _object_name(key), self._sizes[key])
        except FileNotFoundError:  # removed behind our back: forget it
            data = None
        except OSError as error:
            raise StoreError(f"cannot read {_object_name(key)}: {error}") from error
        if data is None:
            self._forget(key)
            return None
        self._index.move_to_end(key)
        return data

    def _read_regular(self, shard: int, name: str, size: int) -> bytes | None:
        """The bytes of ``name`` in the ``shard`` directory when it is a regular file of ``size``
        bytes (None otherwise: a link, a FIFO, a device, or a file that changed size is not the
        object that was stored)."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=shard)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK):
                return None  # a symbolic link, or a FIFO or socket with nothing behind it
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                return None
            data = _read_exactly(fd, size)
            if data is not None and not self.read_only:
                try:
                    os.utime(fd)  # persists recency for the next open, on the very file read
                except OSError:
                    pass  # recency is a hint; a read that succeeded stays a hit
        finally:
            os.close(fd)
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
        try:
            with self._shard(key) as shard:
                if shard is not None:  # a planted link: nothing of ours to remove behind it
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(_object_name(key), dir_fd=shard)
        except OSError as error:
            raise StoreError(f"cannot remove {key}: {error}") from error
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


def _write_all(fd: int, value: bytes) -> None:
    view = memoryview(value)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[written:]


def _read_exactly(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``, or None when the file ends early or holds more."""
    parts, left = [], size
    while left:
        piece = os.read(fd, min(left, 1 << 24))
        if not piece:
            return None
        parts.append(piece)
        left -= len(piece)
    return None if os.read(fd, 1) else b"".join(parts)


def _shard_name(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()


def _object_name(key: str) -> str:
    return f"{key}{_SUFFIX}"


@contextlib.contextmanager
def _directory(path: str | Path, *, dir_fd: int | None = None) -> Iterator[int | None]:
    """A descriptor of the directory at ``path`` (relative to ``dir_fd``), never through a link;
    None when it is missing, a link or not a directory."""
    try:
        fd = os.open(path, _DIRECTORY_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        fd = None
    except OSError as error:
        if error.errno not in _NOT_OUR_DIRECTORY:
            raise
        fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
