"""T3 on Mooncake Store: objects in the memory segments of a Mooncake cluster.

Owns one ``MooncakeDistributedStore`` client and its :class:`DeadlineRunner`. The client is an
extra (``pip install hybridcache[mooncake]``, package ``mooncake-transfer-engine-non-cuda``)
imported when a store is created.

The cluster is a ``mooncake_master`` (with its HTTP metadata server, so no etcd) and one or
more client processes that mount memory segments (``mooncake_client``, or this store itself
with ``segment_bytes > 0``). Mooncake's ``put`` keeps an existing object, so put-if-absent is
``batch_is_exist`` followed by ``put_batch`` of the absent items; two writers racing on one key
both get ``STORED`` and the store keeps one of two identical objects (keys are content
addresses). Removal is forced: a read lease would otherwise block it for the lease time.

Mooncake's own setup retries for about 90 s while holding the GIL, so no thread can enforce a
timeout on it. The store therefore probes first, within ``setup_timeout``: a TCP connection to
the master's RPC port and one HTTP request to the metadata server (a paused master accepts the
connection but never answers). Setup starts only when both answered. Mooncake's native log is
limited to errors (``MC_LOG_LEVEL=ERROR``) unless the caller set ``MC_LOG_LEVEL`` first.
"""

from __future__ import annotations

import functools
import http.client
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, TypeVar
from urllib.parse import urlsplit

from hybridcache import machine
from hybridcache.errors import InvalidConfigError, InvalidTypeError, StoreError, StoreUnavailableError
from hybridcache.tiers.backends.base import DEFAULT_TIMEOUT_S, DeadlineRunner, ObjectStore, PutOutcome, checked_timeout

_T = TypeVar("_T")
# Mooncake status codes (mooncake-store types.h) this store tells apart.
_NO_AVAILABLE_HANDLE = -200  # no segment space, even after eviction
_OBJECT_NOT_FOUND = -704
_RPC_FAIL = -900
DEFAULT_SETUP_TIMEOUT_S = 30.0


def _import_store_class():
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read when the library loads
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        raise InvalidConfigError(
            "MooncakeStore needs Mooncake: pip install 'hybridcache[mooncake]' (and libibverbs1)"
        ) from error
    return MooncakeDistributedStore


@dataclass(frozen=True)
class MooncakeLocal:
    """This process's side of the cluster: the ``hostname`` it advertises to its peers, the
    memory it mounts as a segment of the cluster (``segment_bytes``, 0: none) and stages every
    transfer through (``local_buffer_bytes``, the largest object it can move), and the threads
    its calls run on (``workers``). Checked when built; both sizes are allocated in this process,
    so neither may exceed this machine's memory."""

    hostname: str = "127.0.0.1"
    segment_bytes: int = 0
    local_buffer_bytes: int = 64 << 20
    workers: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.hostname, str):
            raise InvalidTypeError(f"hostname must be a str, got {type(self.hostname).__name__}")
        if not self.hostname:
            raise InvalidConfigError("hostname must not be empty: peers reach this process by it")
        sizes = (("segment_bytes", self.segment_bytes), ("local_buffer_bytes", self.local_buffer_bytes))
        for name, value in sizes:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidConfigError(f"{name} must be a non-negative int")
        if self.local_buffer_bytes == 0:
            raise InvalidConfigError("local_buffer_bytes must be positive: every transfer stages through it")
        memory = machine.host_memory_bytes()
        for name, value in sizes:
            if value > memory:
                raise InvalidConfigError(f"{name} {value:,} is more than this machine's memory ({memory:,} bytes)")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise InvalidConfigError(f"workers must be a positive int, got {self.workers!r}")


class MooncakeStore(ObjectStore):
    """A Mooncake Store client over TCP, registered with the master at ``master_address``.

    ``metadata_server`` is the master's HTTP metadata URL (``http://host:port/metadata``).
    ``local`` (a ``MooncakeLocal``) is this client's side of the cluster; Mooncake reads its
    bind address from the environment, so ``local.hostname`` is set there
    (``MC_TCP_BIND_ADDRESS``, and ``MC_FORCE_TCP`` for the TCP transport) unless the caller set
    them first.
    """

    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        *,
        local: MooncakeLocal | None = None,
        default_timeout: float = DEFAULT_TIMEOUT_S,
        setup_timeout: float = DEFAULT_SETUP_TIMEOUT_S,
    ) -> None:
        super().__init__(default_timeout=default_timeout)
        local = MooncakeLocal() if local is None else local
        if not isinstance(local, MooncakeLocal):
            raise InvalidTypeError(f"local must be a MooncakeLocal, got {type(local).__name__}")
        master_host_port(master_address)  # both addresses checked whole before anything runs
        metadata_host_port(metadata_server)
        self.max_object_bytes = local.local_buffer_bytes
        setup_timeout = checked_timeout(setup_timeout)
        _probe_cluster(master_address, metadata_server, setup_timeout)
        store_class = _import_store_class()
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local.hostname)
        os.environ.setdefault("MC_FORCE_TCP", "1")
        self._runner = DeadlineRunner("mooncake-store", workers=local.workers)
        self._store = store_class()
        setup = functools.partial(
            self._store.setup, local.hostname, metadata_server, local.segment_bytes, local.local_buffer_bytes,
            "tcp", "", master_address,
        )
        try:
            status = self._runner.run(setup, setup_timeout, "mooncake setup")
        except BaseException:
            self._runner.shutdown()
            raise
        if status != 0:
            self._runner.shutdown()
            raise StoreUnavailableError(f"mooncake setup with master {master_address} failed ({status})")

    def _call(self, action: Callable[[], _T], timeout: float, what: str) -> _T:
        return self._runner.run(action, timeout, f"mooncake {what}")

    def _existence(self, keys: list[str]) -> list[bool]:
        codes = self._store.batch_is_exist(keys)
        if any(code < 0 for code in codes):
            raise StoreUnavailableError(f"mooncake exists failed ({min(codes)})")
        return [code == 1 for code in codes]

    def _exists(self, keys: list[str], timeout: float) -> list[bool]:
        return self._call(lambda: self._existence(keys), timeout, "exists")

    def _put_if_absent(self, items: list[tuple[str, bytes]], timeout: float) -> list[PutOutcome]:
        return self._call(lambda: self._put_absent(items), timeout, "put")

    def _put_absent(self, items: list[tuple[str, bytes]]) -> list[PutOutcome]:
        present = self._existence([key for key, _ in items])
        outcomes = {key: PutOutcome.PRESENT for (key, _), here in zip(items, present) if here}
        fitting = []
        for (key, value), here in zip(items, present):
            if not here and len(value) > self.max_object_bytes:
                outcomes[key] = PutOutcome.REJECTED
            elif not here:
                fitting.append((key, value))
        if fitting:
            outcomes.update(self._put_batch(fitting))
        return [outcomes[key] for key, _ in items]

    def _put_batch(self, items: list[tuple[str, bytes]]) -> dict[str, PutOutcome]:
        keys = [key for key, _ in items]
        status = self._store.put_batch(keys, [value for _, value in items])
        if status == 0:
            return {key: PutOutcome.STORED for key in keys}
        if status == _RPC_FAIL:
            raise StoreUnavailableError(f"mooncake put failed ({status})")
        if status != _NO_AVAILABLE_HANDLE:
            raise StoreError(f"mooncake put failed ({status})")
        # Out of space: whatever made it in is stored, the rest was refused.
        stored = self._existence(keys)
        return {key: PutOutcome.STORED if here else PutOutcome.REJECTED for key, here in zip(keys, stored)}

    def _get(self, keys: list[str], timeout: float) -> list[bytes | None]:
        return self._call(lambda: self._read(keys), timeout, "get")

    def _read(self, keys: list[str]) -> list[bytes | None]:
        found = [data if data else None for data in self._store.get_batch(keys)]
        empty = [key for key, data in zip(keys, found) if data is None]
        if empty:
            self._existence(empty)  # tells a failing store (raises) from missing objects
        return found

    def _remove(self, keys: list[str], timeout: float) -> list[bool]:
        return self._call(lambda: self._delete(keys), timeout, "remove")

    def _delete(self, keys: list[str]) -> list[bool]:
        codes = self._store.batch_remove(keys, True)
        for code in codes:
            if code == _RPC_FAIL:
                raise StoreUnavailableError(f"mooncake remove failed ({code})")
            if code not in (0, _OBJECT_NOT_FOUND):
                raise StoreError(f"mooncake remove failed ({code})")
        return [code == 0 for code in codes]

    def _close(self) -> None:
        try:
            self._runner.run(self._store.close, self.default_timeout, "mooncake close")
        finally:
            self._runner.shutdown()


def master_host_port(address: object, what: str = "master_address") -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) -> (host, port); anything else, an unclosed
    bracket or a port outside 1..65535 included, raises :class:`InvalidConfigError`."""
    if not isinstance(address, str) or not address:
        raise InvalidTypeError(f"{what} must be a non-empty str")
    host, _, port = address.rpartition(":")
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
        host = inner if _is_ipv6(inner) else ""
    elif ":" in host:
        host = ""  # an IPv6 host must be bracketed, or its last group reads as the port
    if not host or any(c.isspace() or c in "/?#@[]" for c in host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidConfigError(f"{what} must be HOST:PORT ([IPV6]:PORT), got {address!r}")
    return host, int(port)


def metadata_host_port(url: object) -> tuple[str, int, str]:
    """``http://HOST[:PORT]/PATH`` -> (host, port, path); anything else raises
    :class:`InvalidConfigError` (urllib's own ``ValueError`` for a bad bracket or port included)."""
    if not isinstance(url, str) or not url:
        raise InvalidTypeError("metadata_server must be a non-empty str")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise InvalidConfigError(f"metadata_server {url!r} is not a valid URL: {error}") from error
    if parts.scheme != "http" or not parts.hostname or parts.username is not None or parts.fragment:
        raise InvalidConfigError(f"metadata_server must be an http://HOST:PORT/PATH URL, got {url!r}")
    if port == 0:
        raise InvalidConfigError(f"metadata_server {url!r} has port 0")
    return parts.hostname, port or 80, parts.path or "/"


def _is_ipv6(text: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6, text)
    except (OSError, ValueError):
        return False
    return True


def _probe_cluster(master_address: str, metadata_server: str, timeout: float) -> None:
    """Raise StoreUnavailableError unless the master accepts a connection and the metadata
    server answers an HTTP request, both within ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    master = master_host_port(master_address)
    host, port, path = metadata_host_port(metadata_server)
    try:
        with socket.create_connection(master, timeout=max(deadline - time.monotonic(), 1e-3)):
            pass
        connection = http.client.HTTPConnection(host, port, timeout=max(deadline - time.monotonic(), 1e-3))
        try:
            connection.request("GET", path + "?key=hybridcache-probe")
            connection.getresponse().read()  # any status: the server is there and answering
        finally:
            connection.close()
    except (OSError, http.client.HTTPException) as error:
        raise StoreUnavailableError(
            f"mooncake cluster at {master_address} (metadata {metadata_server}) did not answer within {timeout:g} s: {error}"
        ) from error
