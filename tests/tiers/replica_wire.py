"""Framing and store addressing shared by the test, the replica hub and the engine workers.

A frame is a little-endian u64 length and that many bytes (a pickled message). Readers work
on raw file descriptors so a deadline can bound every wait (``select`` sees bytes a buffered
reader would hide). ``StoreSpec`` names the shared store every process of one cluster opens;
this module imports no engine code, so the hub starts without loading torch.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
from dataclasses import dataclass

from hybridcache.tiers.backends import MooncakeStore, ObjectStore, RedisStore

FRAME_LENGTH = struct.Struct("<Q")
STORE_TIMEOUT_S = 5.0


class FrameTimeout(TimeoutError):
    """The peer sent no complete frame before the deadline."""


def write_frame(fd: int, body: bytes) -> None:
    data = memoryview(FRAME_LENGTH.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data) :]


def read_frame(fd: int, deadline: float | None) -> bytes | None:
    """One frame from ``fd``; None on end of file (the peer exited). ``deadline`` is a
    ``time.monotonic()`` value; None waits for as long as the peer lives, which only the
    serving loops do (their parent's exit closes the pipe and ends the wait)."""
    head = _read_exactly(fd, FRAME_LENGTH.size, deadline)
    if head is None:
        return None
    return _read_exactly(fd, FRAME_LENGTH.unpack(head)[0], deadline)


def _read_exactly(fd: int, count: int, deadline: float | None) -> bytes | None:
    parts, missing = [], count
    while missing:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise FrameTimeout(f"no complete frame within the deadline ({count - missing}/{count} bytes)")
        chunk = os.read(fd, missing)
        if not chunk:
            return None
        parts.append(chunk)
        missing -= len(chunk)
    return b"".join(parts)


def send(fd: int, message: object) -> None:
    write_frame(fd, pickle.dumps(message))


def receive(fd: int, deadline: float | None) -> object | None:
    body = read_frame(fd, deadline)
    return None if body is None else pickle.loads(body)


@dataclass(frozen=True)
class StoreSpec:
    """The shared store of one cluster: Redis at ``address`` (a URL) with every key under
    ``key_prefix``, or Mooncake with its master at ``address`` and its HTTP metadata server."""

    backend: str
    address: str
    key_prefix: str = ""
    metadata_server: str = ""

    def open(self) -> ObjectStore:
        if self.backend == "redis":
            return RedisStore(self.address, key_prefix=self.key_prefix, default_timeout=STORE_TIMEOUT_S)
        if self.backend == "mooncake":
            return MooncakeStore(self.address, self.metadata_server, default_timeout=STORE_TIMEOUT_S)
        raise ValueError(f"unknown shared store backend {self.backend!r}")
