"""Allocating an engine's cache tensors: sized against this machine before anything is allocated.

Owns nothing: ``zeros_within_memory`` returns fresh tensors. A pool larger than the machine's
memory is refused up front (``InvalidConfigError``, naming the bytes) instead of surfacing as
torch's builtin ``RuntimeError`` from its allocator, or, with overcommit, as the kernel killing
the process when the zero pages are first touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybridcache import machine
from hybridcache.errors import InvalidConfigError, ResourceExhaustedError

Shape = tuple[int, ...]


def zeros_within_memory(shapes: Sequence[tuple[Shape, torch.dtype]], what: str) -> list[torch.Tensor]:
    """Zeroed tensors of ``shapes`` (shape, dtype pairs), refused whole when together they need
    more than this machine's memory; an allocator failure is a ``ResourceExhaustedError``."""
    needed = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in shapes)
    available = machine.host_memory_bytes()
    if needed > available:
        raise InvalidConfigError(
            f"{what}: {needed / 2**30:,.2f} GiB needed, this machine has {available / 2**30:,.2f} GiB of memory"
        )
    try:
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes]
    except (RuntimeError, MemoryError) as error:  # torch's allocator reports exhaustion as RuntimeError
        raise ResourceExhaustedError(f"cannot allocate {what} ({needed:,} bytes): {error}") from error
