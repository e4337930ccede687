"""A command's shared tier: a Redis or Mooncake store at a URL, or a local server started on
free loopback ports for the command (``hybridcache.tiers.local_servers``). What ``hybridcache
replay --shared-tier`` and ``hybridcache serve --shared-tier`` open.

Owns, inside one ``open_shared_store`` context: the client store and the server processes it
started; the store is closed and the servers stopped (by pid) when the context ends. A server
started here also dies with the thread that started it if its process is killed outright
(``local_servers``: the parent-death signal). Signals are the caller's business.

The local servers are sized for a working set, not for a long-lived deployment: a Redis of
``LOCAL_REDIS_MAXMEMORY`` (evicting least recently used keys past it), a Mooncake segment of
``LOCAL_MOONCAKE_SEGMENT``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from hybridcache.errors import InvalidArgumentError, InvalidConfigError
from hybridcache.tiers import local_servers
from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.backends.mooncake_store import MooncakeStore, master_host_port, metadata_host_port
from hybridcache.tiers.backends.redis_store import RedisStore

SHARED_TIERS = ("none", "redis", "mooncake")
LOCAL_REDIS_MAXMEMORY = "4gb"
LOCAL_MOONCAKE_SEGMENT = "2GB"
_PROBE_KEY = "hybridcache-shared-tier-probe"


def check_shared_tier(kind: object, url: object) -> None:
    if kind not in SHARED_TIERS:
        raise InvalidArgumentError(f"unknown shared tier {kind!r}; choose one of {', '.join(SHARED_TIERS)}")
    if url is not None and kind == "none":
        raise InvalidArgumentError("--store-url needs --shared-tier redis or mooncake")
    if url is not None and not isinstance(url, str):
        raise InvalidArgumentError("the store url must be a string")
    if kind == "mooncake" and url is not None:
        mooncake_address(url)


def mooncake_address(url: str) -> tuple[str, str]:
    """``mooncake://HOST:PORT?metadata=http://HOST:PORT/metadata`` -> (master, metadata server),
    both checked whole (a bad bracket or port is an :class:`InvalidConfigError`, never urllib's
    ``ValueError``)."""
    usage = "use mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata"
    try:
        parts = urlsplit(url)
    except ValueError as error:
        raise InvalidConfigError(f"bad Mooncake store url {url!r} ({error}); {usage}") from error
    query = parse_qs(parts.query, keep_blank_values=True)
    metadata = query.get("metadata", [])
    if (
        parts.scheme != "mooncake" or not parts.netloc or parts.path not in ("", "/") or parts.fragment
        or len(metadata) != 1 or set(query) != {"metadata"}
    ):
        raise InvalidConfigError(f"bad Mooncake store url {url!r}; {usage}")
    master_host_port(parts.netloc, "the Mooncake master in the store url")
    metadata_host_port(metadata[0])
    return parts.netloc, metadata[0]


def only_loopback() -> bool:
    """True inside a network namespace whose only interface is loopback (``unshare -n``).
    Read from ``/proc/self/net/dev``, which follows the process's namespace (``/sys/class/net``
    follows the namespace sysfs was mounted in)."""
    try:
        lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    return {line.split(":", 1)[0].strip() for line in lines} <= {"lo"}


@contextlib.contextmanager
def open_shared_store(kind: str, url: str | None, workdir: Path) -> Iterator[ObjectStore | None]:
    """The shared store (None for ``none``), reachable (probed) on entry; a local server is
    started under ``workdir`` when ``url`` is None."""
    check_shared_tier(kind, url)
    if kind == "none":
        yield None
        return
    with contextlib.ExitStack() as stack:
        store = _redis(url, workdir, stack) if kind == "redis" else _mooncake(url, workdir, stack)
        stack.callback(store.close)
        store.exists([_PROBE_KEY])  # an unreachable store fails here, with its reason, not as misses
        yield store


def _redis(url: str | None, workdir: Path, stack: contextlib.ExitStack) -> ObjectStore:
    if url is None:
        server = local_servers.start_redis(workdir, maxmemory=LOCAL_REDIS_MAXMEMORY)
        stack.callback(server.stop)
        url = f"redis://127.0.0.1:{server.port}/0"
    return RedisStore(url)


def _mooncake(url: str | None, workdir: Path, stack: contextlib.ExitStack) -> ObjectStore:
    if url is not None:
        return MooncakeStore(*mooncake_address(url))
    if not only_loopback():
        raise InvalidArgumentError(
            "a local Mooncake Store binds every network interface: run the command inside a private "
            "network namespace (unshare -n sh -c 'ip link set lo up && hybridcache ...') or give --store-url"
        )
    cluster = local_servers.start_mooncake(workdir, segment=LOCAL_MOONCAKE_SEGMENT)
    stack.callback(cluster.stop)
    return MooncakeStore(cluster.master_address, cluster.metadata_server)
