"""The replay's shared tier (``hybridcache.tiers.shared_setup``), with the signals a replay
ends on.

Owns, inside one ``open_shared_tier`` context, the process's SIGTERM and SIGHUP handlers (on the
main thread); the store and the servers are ``shared_setup``'s. Both are closed and stopped (by
pid) when the context ends: on errors, Ctrl-C, SIGTERM and SIGHUP alike (the two signals end the
command as ``SystemExit(128 + signal)``, which unwinds the context as Ctrl-C does).

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

from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.shared_setup import SHARED_TIERS, check_shared_tier, only_loopback, open_shared_store

__all__ = ["SHARED_TIERS", "check_shared_tier", "only_loopback", "open_shared_tier", "terminating_signals_unwind"]

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
    """The shared store of the command (None for ``none``), reachable (probed) on entry;
    SIGTERM and SIGHUP unwind the context."""
    check_shared_tier(kind, url)
    if kind == "none":
        yield None
        return
    with terminating_signals_unwind(), open_shared_store(kind, url, workdir) as store:
        yield store
