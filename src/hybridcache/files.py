"""Opening the input files a user names (traces, model configs): regular files only, opened
without blocking and read within a size bound.

Owns no state. A FIFO, a device (``/dev/zero``), a socket or a directory is refused before a
byte is read: reading one can block forever or never end. Links are followed (a link to a
trace is a trace); the check applies to the file actually opened, so a link to a device is
refused as the device is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from hybridcache.errors import HybridCacheError

MAX_CONFIG_BYTES = 16 * 2**20  # a model's config.json is a few KB

_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: Path, error: type[HybridCacheError]) -> BinaryIO:
    """``path`` opened for binary reading; ``error`` (naming the path) when it cannot be
    opened or is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as failure:
        raise error(f"cannot read {path}: {failure.strerror}") from None
    except ValueError as failure:  # a NUL byte, or text the file system cannot encode: no file has that name
        raise error(f"cannot read {str(path)!r}: {failure}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "a special file")
            raise error(f"{path}: not a regular file ({kind})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path, max_bytes: int, error: type[HybridCacheError]) -> bytes:
    """The whole of the regular file ``path``; ``error`` when it holds more than ``max_bytes``."""
    with open_regular(path, error) as handle:
        data = read_or_raise(handle, max_bytes + 1, path, error)
    if len(data) > max_bytes:
        raise error(f"{path}: larger than {max_bytes:,} bytes")
    return data


def read_or_raise(handle: BinaryIO, size: int, path: Path | str, error: type[HybridCacheError], line: bool = False) -> bytes:
    """Up to ``size`` bytes (a line's worth with ``line``); a failing read (``/proc/self/mem``
    is a regular file that cannot be read) raises ``error``."""
    try:
        return handle.readline(size) if line else handle.read(size)
    except OSError as failure:
        raise error(f"cannot read {path}: {failure.strerror}") from None
