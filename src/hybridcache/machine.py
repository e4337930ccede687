"""What this machine can hold: its memory, or its container's limit when lower, and how many
connections a server process can keep open.

Owns nothing: pure reads of the operating system, done when asked (a container's limit can be
changed while a process runs).
"""

from __future__ import annotations

import os
import resource

from hybridcache.errors import HybridCacheError
from hybridcache.types import as_int

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_UNREPORTED_BYTES = 16 * 2**30  # a platform that does not say: assume a small machine
SPARE_DESCRIPTORS = 64  # a server's own: its listening socket, store and replica connections, files, logs


def host_memory_bytes() -> int:
    """Physical memory, or the container's limit when lower (cgroup v2 or v1)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = _UNREPORTED_BYTES
    for path in _CGROUP_LIMITS:
        try:
            with open(path, encoding="ascii") as limit:
                text = limit.read(32).strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def descriptor_limit() -> int:
    """The file descriptors this process may open (its soft limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2**20 if soft == resource.RLIM_INFINITY else soft


def connection_bound(value: object, default: int, descriptors_each: int, error: type[HybridCacheError]) -> int:
    """How many clients a server may hold at once: ``value``, or (None) ``default`` lowered to
    what the descriptor limit allows; a ``value`` the process could not hold, each connection
    taking ``descriptors_each`` descriptors beside ``SPARE_DESCRIPTORS``, raises ``error``."""
    allowed = (descriptor_limit() - SPARE_DESCRIPTORS) // descriptors_each
    if value is None:
        return max(1, min(default, allowed))
    value = as_int("max_connections", value, 1, error=error)
    if value > allowed:
        raise error(f"max_connections {value:,} needs {descriptors_each * value + SPARE_DESCRIPTORS:,} file descriptors; "
                    f"this process may open {descriptor_limit():,} (raise `ulimit -n` or lower it)")
    return value
