"""A Mooncake cluster and a MooncakeStore client inside a private network namespace.

Run by :class:`tiers.remote.RemoteStore` as
``unshare -n sh -c 'ip link set lo up; exec python -m tiers.mooncake_worker DIR'``.
It starts ``mooncake_master`` and a segment-holding ``mooncake_client`` on free ports of the
namespace's loopback, opens a :class:`MooncakeStore`, then serves length-prefixed pickled
requests on stdin, replying on the original stdout (the C++ logs go to stderr). On EOF or a
``shutdown`` request it closes the store and stops both servers by pid.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from pathlib import Path

from hybridcache.errors import HybridCacheError
from hybridcache.tiers.backends import MooncakeStore
from hybridcache.tiers import local_servers as servers

from .faults import pause, resume

_LENGTH = struct.Struct("<Q")


def read_message(stream) -> object | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    return pickle.loads(stream.read(_LENGTH.unpack(head)[0]))


def write_message(stream, message: object) -> None:
    body = pickle.dumps(message)
    stream.write(_LENGTH.pack(len(body)) + body)
    stream.flush()


def _answer(store: MooncakeStore, cluster: servers.MooncakeCluster, request: tuple) -> object:
    operation, args, kwargs = request
    controls = {
        "pause_master": lambda: pause(cluster.master),
        "resume_master": lambda: resume(cluster.master),
        "stop_master": cluster.master.stop,
        "stop_segment_holder": cluster.segment_holder.stop,
    }
    if operation in controls:
        return controls[operation]()
    if operation == "attribute":
        return getattr(store, args[0])
    if operation == "open_another":  # a second client of the same cluster, closed at once
        MooncakeStore(cluster.master_address, cluster.metadata_server, **kwargs).close()
        return None
    return getattr(store, operation)(*args, **kwargs)


def serve(workdir: Path, segment: str) -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the C++ side prints must not corrupt the reply stream
    requests = sys.stdin.buffer
    cluster = servers.start_mooncake(workdir, segment)
    try:
        store = MooncakeStore(cluster.master_address, cluster.metadata_server, default_timeout=5.0)
        write_message(replies, ("ready", None))
        while (request := read_message(requests)) is not None and request[0] != "shutdown":
            try:
                write_message(replies, ("ok", _answer(store, cluster, request)))
            except HybridCacheError as error:
                write_message(replies, ("error", (type(error), str(error))))
        try:
            store.close()
        except HybridCacheError:
            pass  # a stopped master cannot say goodbye; the servers are stopped below either way
    finally:
        cluster.stop()


if __name__ == "__main__":
    serve(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "64MB")
