"""A store speaking RESP that answers what no Redis would: an announced bulk far past Redis's
largest string, a value dripped a byte at a time. Each call costs a store error or its timeout,
and the client stops reading that connection, so the process's memory is not the store's to
fill. The fake store is a thread on a loopback free port, closed by the test."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hybridcache.errors import InvalidConfigError, StoreError, StoreTimeoutError
from hybridcache.tiers.backends import RedisStore
from hybridcache.tiers.backends.redis_store import MAX_BULK_BYTES

DEADLINE_S = 30  # our bound on waiting for the client to let go: a deadline, not a measurement


class HostileStore:
    """Answers the first command on each connection with ``head``, then sends ``drip`` one byte
    every ``pause_s`` until the client closes; ``closed`` is set when it has."""

    def __init__(self, head: bytes, drip: bytes = b"", pause_s: float = 0.05) -> None:
        self.head, self.drip, self.pause_s = head, drip, pause_s
        self.closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            connection, _ = self._listener.accept()
        except OSError:
            return
        with connection:
            try:
                connection.recv(65536)
                connection.sendall(self.head)
                for byte in self.drip:
                    time.sleep(self.pause_s)
                    connection.sendall(bytes([byte]))
                connection.settimeout(DEADLINE_S)
                while connection.recv(65536):
                    pass
            except OSError:
                pass
            self.closed.set()

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def hostile(request):
    store = HostileStore(*request.param)
    yield store
    store.close()


def _client(hostile: HostileStore) -> RedisStore:
    return RedisStore(f"redis://127.0.0.1:{hostile.port}/0", default_timeout=2)


@pytest.mark.parametrize("hostile", [(b"$%d\r\n" % (8 * 2**30), b"x" * 1000, 0.0)], indirect=True)
def test_a_bulk_past_redis_largest_string_is_refused_before_it_is_read(hostile):
    store = _client(hostile)
    try:
        with pytest.raises(StoreError, match="announced"):
            store.get(["k"])
        assert hostile.closed.wait(DEADLINE_S)  # the client dropped the connection
    finally:
        store.close()


# the drips last twice DEADLINE_S: a client reading on after its call was given up would miss the deadline
@pytest.mark.parametrize("hostile", [(b"*1\r\n$%d\r\n" % MAX_BULK_BYTES, b"v" * 600, 0.1),
                                     (b"*1\r\n$1000000\r\n", b"v" * 600, 0.1)], indirect=True)
def test_a_reply_dripped_past_the_call_deadline_is_given_up_and_its_reading_stops(hostile):
    store = _client(hostile)
    try:
        with pytest.raises(StoreTimeoutError):
            store.get(["k"], timeout=0.3)
        # the worker thread the call was abandoned on stops at its deadline, not after the drip
        assert hostile.closed.wait(DEADLINE_S)
    finally:
        store.close()


def test_a_url_asking_for_resp3_is_refused():
    with pytest.raises(InvalidConfigError, match="protocol"):
        RedisStore("redis://127.0.0.1:1/0?protocol=3")
