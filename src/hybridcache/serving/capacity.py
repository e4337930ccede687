"""Whether what ``hybridcache serve`` is asked to hold fits the machine it runs on.

Owns nothing. The host tier and the disk tier fill up lazily, so a size the machine cannot hold
(``--host-bytes 10PB``) would start and fail hours later; it is refused at startup instead,
against the machine's memory (``hybridcache.machine``, the engine's pools are sized against the
same figure) and the disk tier's file system.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hybridcache import machine
from hybridcache.errors import InvalidConfigError


def check_tier_sizes(host_bytes: int, disk_bytes: int, disk_root: str | os.PathLike | None) -> None:
    """Raise ``InvalidConfigError`` when a tier is larger than what could ever hold it."""
    memory = machine.host_memory_bytes()
    if host_bytes and host_bytes > memory:
        raise InvalidConfigError(f"the host tier (--host-bytes) of {_bytes(host_bytes)} is more than this "
                                 f"machine's memory, {_bytes(memory)}")
    if disk_bytes and disk_root is not None:
        total = shutil.disk_usage(_existing_ancestor(Path(disk_root))).total
        if disk_bytes > total:
            raise InvalidConfigError(f"the disk tier (--disk-bytes) of {_bytes(disk_bytes)} is more than its file "
                                     f"system holds, {_bytes(total)} (at {disk_root})")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _bytes(count: int) -> str:
    return f"{count:,} bytes ({count / 2**30:,.1f} GiB)"
