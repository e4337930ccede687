"""Whether what ``hybridcache serve`` is asked to hold fits the machine it runs on.

Owns nothing. The host tier and the disk tier fill up lazily, so a size the machine cannot hold
(``--host-bytes 10PB``) would start and fail hours later; it is refused at startup instead,
against the machine's physical memory and the disk tier's file system. The device pools are
allocated at once: an allocation that fails becomes one ``ResourceExhaustedError`` naming the
options to lower, not the allocator's traceback.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hybridcache.errors import HybridCacheError, InvalidConfigError, ResourceExhaustedError


def check_tier_sizes(host_bytes: int, disk_bytes: int, disk_root: str | os.PathLike | None) -> None:
    """Raise ``InvalidConfigError`` when a tier is larger than what could ever hold it."""
    memory = physical_memory_bytes()
    if host_bytes and memory is not None and host_bytes > memory:
        raise InvalidConfigError(f"the host tier (--host-bytes) of {_bytes(host_bytes)} is more than this "
                                 f"machine's memory, {_bytes(memory)}")
    if disk_bytes and disk_root is not None:
        total = shutil.disk_usage(_existing_ancestor(Path(disk_root))).total
        if disk_bytes > total:
            raise InvalidConfigError(f"the disk tier (--disk-bytes) of {_bytes(disk_bytes)} is more than its file "
                                     f"system holds, {_bytes(total)} (at {disk_root})")


def physical_memory_bytes() -> int | None:
    """The machine's RAM, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def is_allocation_failure(error: BaseException) -> bool:
    """torch reports a failed CPU allocation as a RuntimeError ("can't allocate memory") and a
    GPU one as ``OutOfMemoryError`` (a RuntimeError); Python's own as MemoryError."""
    if isinstance(error, HybridCacheError):  # ResourceExhaustedError is a MemoryError too: already ours
        return False
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("allocate" in text or "out of memory" in text)


def pools_do_not_fit(num_kv_blocks: int, num_state_slots: int) -> ResourceExhaustedError:
    return ResourceExhaustedError(f"the engine's pools ({num_kv_blocks:,} KV blocks, {num_state_slots:,} state "
                                  "slots) do not fit in memory; lower --num-kv-blocks / --num-state-slots")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _bytes(count: int) -> str:
    return f"{count:,} bytes ({count / 2**30:,.1f} GiB)"
