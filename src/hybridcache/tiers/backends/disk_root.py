"""The directory a disk tier keeps its objects in, and the link-safe file operations on it.

Owns nothing mutable: a ``DiskRoot`` is the root's layout (its marker, lock file, ``objects/``
shards and ``scratch/`` folder) and the calls that read and write it; every descriptor it
opens is closed before the call returns, except the lock descriptor it hands to its store.

Every per-object call (open, link, unlink, stat, utime) runs relative to its shard directory,
opened with ``O_DIRECTORY | O_NOFOLLOW`` (through ``objects/``, opened the same way), so a
shard or folder replaced by a link to somewhere else costs a miss or a rejected put, never a
file read or written outside the root. The index, the budget and the store's lock are
``disk.DiskStore``'s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Iterator

from hybridcache.errors import InvalidArgumentError, NotAStoreRootError, StoreError, StoreLockedError
from hybridcache.tiers.backends.base import PutOutcome, check_key

SUFFIX = ".obj"
MARKER_NAME = "hybridcache-disk-tier"
_MARKER_TEXT = b"hybridcache disk tier, layout 2: objects/<shard>/<key>.obj, scratch/<pid>-<n>.tmp\n"
_SCRATCH_NAME = re.compile(r"[0-9]+-[0-9]+\.tmp")
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
_NOT_OUR_DIRECTORY = (errno.ELOOP, errno.ENOTDIR)  # a link, or a file, where a directory belongs


class DiskRoot:
    """One disk tier's directory: ``<root>/objects/<shard>/<key>.obj`` and ``<root>/scratch``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = root / "objects"
        self.scratch = root / "scratch"

    # --- opening -------------------------------------------------------------------------------

    def open_exclusively(self) -> int:
        """Claim the root (marked, its folders made) and lock it exclusively: the lock's descriptor."""
        try:
            self._claim()
            self.objects.mkdir(exist_ok=True)
            self.scratch.mkdir(exist_ok=True)
            fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            raise StoreError(f"cannot open disk tier at {self.root}: {error}") from error
        return self._flocked(fd, fcntl.LOCK_EX)

    def open_read_only(self) -> int | None:
        """A shared lock when the lock file can be read (a writer holds it exclusively);
        None when it cannot, on a medium where no writer can run anyway."""
        if not (self.root / MARKER_NAME).is_file():
            raise NotAStoreRootError(f"{self.root} has no {MARKER_NAME} marker: not a disk tier to read")
        try:
            fd = os.open(self.root / "lock", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        return self._flocked(fd, fcntl.LOCK_SH)

    def _claim(self) -> None:
        """Mark a new or empty root as a store's; refuse one holding anything else."""
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
            fd = os.open(marker, _NEW_FILE_FLAGS, 0o644)
        except FileExistsError:
            return  # another store marked it first
        try:
            _write_all(fd, _MARKER_TEXT)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_directory(self.root)

    def _flocked(self, fd: int, mode: int) -> int:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(f"{self.root} is already open in another store") from error
            raise StoreError(f"cannot lock {self.root}: {error}") from error
        return fd

    def check_folders(self) -> None:
        for folder in (self.objects, self.scratch):
            if folder.is_symlink():  # its files would be someone else's
                raise NotAStoreRootError(f"{folder} is a symbolic link: a disk tier keeps its files in its own root")

    def remove_interrupted_writes(self) -> None:
        """Delete leftover scratch files (only names of the form a put writes)."""
        for leftover in self.scratch.iterdir():
            if _SCRATCH_NAME.fullmatch(leftover.name) and leftover.is_file():
                leftover.unlink(missing_ok=True)

    def stored_objects(self, max_bytes: int) -> list[tuple[int, str, int]]:
        """(mtime, key, size) of every regular object file at its own key's path, at most
        ``max_bytes`` long, oldest first."""
        files = list(self.objects.glob(f"*/*{SUFFIX}")) if self.objects.is_dir() else []
        return sorted(entry for entry in (self._indexable(path, max_bytes) for path in files) if entry is not None)

    def _indexable(self, path: Path, max_bytes: int) -> tuple[int, str, int] | None:
        key = path.name[: -len(SUFFIX)]
        try:
            check_key(key)
        except InvalidArgumentError:
            return None
        if path.parent.is_symlink():
            return None
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or not 0 < info.st_size <= max_bytes or self.path(key) != path:
            return None
        return info.st_mtime_ns, key, info.st_size

    # --- objects -------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        return self.objects / shard_name(key) / object_name(key)

    @contextlib.contextmanager
    def _shard(self, key: str, *, create: bool = False) -> Iterator[int | None]:
        """A descriptor of ``key``'s shard directory, opened without following links (None when
        it is missing, or is not a real directory of this root: a planted link is a miss)."""
        with _directory(self.objects) as objects:
            if objects is None:
                yield None
                return
            name = shard_name(key)
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=objects)
                    os.fsync(objects)  # the new shard's entry must survive a crash
                except FileExistsError:
                    pass
            with _directory(name, dir_fd=objects) as shard:
                yield shard

    def write(self, key: str, value: bytes, temporary: str) -> PutOutcome:
        """Write ``scratch/<temporary>``, fsync, link into place: ``PRESENT`` when an object
        already sits under the key's name, ``REJECTED`` when its shard or the scratch folder is
        not this root's own."""
        try:
            with _directory(self.scratch) as scratch:
                if scratch is None:
                    return PutOutcome.REJECTED
                try:
                    fd = os.open(temporary, _NEW_FILE_FLAGS, 0o644, dir_fd=scratch)
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
            raise StoreError(f"cannot write {object_name(key)}: {error}") from error

    def _link_into_shard(self, key: str, scratch: int, temporary: str) -> PutOutcome:
        with self._shard(key, create=True) as shard:
            if shard is None:
                return PutOutcome.REJECTED
            try:
                os.link(temporary, object_name(key), src_dir_fd=scratch, dst_dir_fd=shard, follow_symlinks=False)
            except FileExistsError:
                return PutOutcome.PRESENT
            os.fsync(shard)
            return PutOutcome.STORED

    def read(self, key: str, size: int, refresh: bool) -> bytes | None:
        """The object's bytes when its file is a regular file of ``size`` bytes (None otherwise:
        missing, a link, a FIFO, a device, or a file that changed size is not the object that
        was stored); ``refresh``: touch the file read, so that recency survives a restart."""
        try:
            with self._shard(key) as shard:
                return None if shard is None else _read_regular(shard, object_name(key), size, refresh)
        except FileNotFoundError:  # removed behind the store's back
            return None
        except OSError as error:
            raise StoreError(f"cannot read {object_name(key)}: {error}") from error

    def unlink(self, key: str) -> None:
        try:
            with self._shard(key) as shard:
                if shard is not None:  # a planted link: nothing of ours to remove behind it
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(object_name(key), dir_fd=shard)
        except OSError as error:
            raise StoreError(f"cannot remove {key}: {error}") from error


def _read_regular(shard: int, name: str, size: int, refresh: bool) -> bytes | None:
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
        if data is not None and refresh:
            try:
                os.utime(fd)  # persists recency for the next open, on the very file read
            except OSError:
                pass  # recency is a hint; a read that succeeded stays a hit
    finally:
        os.close(fd)
    return data


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


def shard_name(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()


def object_name(key: str) -> str:
    return f"{key}{SUFFIX}"


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
