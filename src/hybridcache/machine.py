"""What this machine can hold: its memory, or its container's limit when lower.

Owns nothing: pure reads of the operating system, done when asked (a container's limit can be
changed while a process runs).
"""

from __future__ import annotations

import os

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_UNREPORTED_BYTES = 16 * 2**30  # a platform that does not say: assume a small machine


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
