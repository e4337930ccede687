"""The replay's shared tier: a Redis or Mooncake store at ``--store-url``, or a local server
started on free loopback ports for the command (``hybridcache.tiers.local_servers``).

Owns, inside one ``open_shared_tier`` context: the client store, the server processes it
started, and (on the main thread) the process's SIGTERM and SIGHUP handlers. Store and servers
are closed and stopped (by pid) when the context ends: on errors, Ctrl-C, SIGTERM and SIGHUP
alike (the two signals end the command as ``SystemExit(128 + signal)``, which unwinds the
context as Ctrl-C does). A server started here also dies with this process if it is killed
outright (``local_servers``: the parent-death signal).

The local servers are sized so a replay never fills them: the shared tier models a store sized
for the working set (what it would hold is reported as stored bytes). Their objects are stand-ins
(docs/tiers.md), so 2,000 requests of mooncake-synthetic put a few hundred MB of real bytes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from hybridcache.errors import InvalidArgumentError
from hybridcache.tiers import local_servers
from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.backends.mooncake_store import MooncakeStore
from hybridcache.tiers.backends.redis_store import RedisStore

SHARED_TIERS = ("none", "redis", "mooncake")
LOCAL_REDIS_MAXMEMORY = "4gb"
LOCAL_MOONCAKE_SEGMENT = "2GB"
_PROBE_KEY = "hybridcache-replay-probe"


def check_shared_tier(kind: object, url: object) -> None:
    if kind not in SHARED_TIERS:
        raise InvalidArgumentError(f"unknown shared tier {kind!r}; choose one of {', '.join(SHARED_TIERS)}")
    if url is not None and kind == "none":
        raise InvalidArgumentError("--store-url needs --shared-tier redis or mooncake")
    if kind == "mooncake" and url is not None:
        mooncake_address(url)


def mooncake_address(url: str) -> tuple[str, str]:
    """``mooncake://HOST:PORT?metadata=http://HOST:PORT/metadata`` -> (master, metadata server)."""
    parts = urlsplit(url)
    metadata = parse_qs(parts.query).get("metadata", [])
    if parts.scheme != "mooncake" or not parts.netloc or len(metadata) != 1:
        raise InvalidArgumentError(
            f"bad Mooncake store url {url!r}; use mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata"
        )
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


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def terminating_signals_unwind() -> Iterator[None]:
    """Inside the context, SIGTERM and SIGHUP raise ``SystemExit`` so that every cleanup runs
    (by default they end the process on the spot); the previous handlers come back on exit.
    A signal the process ignores stays ignored; off the main thread nothing changes (Python
    delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in TERMINATING_SIGNALS}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, _exit_on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def open_shared_tier(kind: str, url: str | None, workdir: Path) -> Iterator[ObjectStore | None]:
    """The shared store of the command (None for ``none``), reachable (probed) on entry."""
    check_shared_tier(kind, url)
    if kind == "none":
        yield None
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(terminating_signals_unwind())
        if kind == "redis":
            if url is None:
                server = local_servers.start_redis(workdir, maxmemory=LOCAL_REDIS_MAXMEMORY)
                stack.callback(server.stop)
                url = f"redis://127.0.0.1:{server.port}/0"
            store: ObjectStore = RedisStore(url)
        else:
            if url is None:
                if not only_loopback():
                    raise InvalidArgumentError(
                        "a local Mooncake Store binds every network interface: run the replay inside a private "
                        "network namespace (unshare -n sh -c 'ip link set lo up && hybridcache replay ...') "
                        "or give --store-url"
                    )
                cluster = local_servers.start_mooncake(workdir, segment=LOCAL_MOONCAKE_SEGMENT)
                stack.callback(cluster.stop)
                master, metadata = cluster.master_address, cluster.metadata_server
            else:
                master, metadata = mooncake_address(url)
            store = MooncakeStore(master, metadata)
        stack.callback(store.close)
        store.exists([_PROBE_KEY])  # an unreachable store fails here, with its reason, not as misses
        yield store
