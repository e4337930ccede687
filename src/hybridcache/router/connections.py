"""The router's listening socket: a threading HTTP server that serves a bounded number of
clients at once.

Owns the two counts of connection threads: those serving a client (at most
``max_connections``) and those turning one away past that bound (at most
``REFUSING_THREADS``). A client past the bound is answered 503 with an error object and its
connection closed within ``REFUSAL_S``; past both bounds a connection is closed at once,
unanswered. Without the bound a flood of connections would hold a thread and a descriptor each
until its client timeout, and a router out of descriptors cannot open a connection to any
replica: it would mark every replica dead.

``PacedRequestHandler`` owns, per connection, the deadline its client must meet: a request's
head must arrive whole within one ``timeout`` (bytes of it do not push the deadline back), and
its body must bring ``BODY_PROGRESS_BYTES`` a period, so a client trickling a request a byte at
a time (slowloris) holds its slot no longer than a silent one.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hybridcache.error_objects import error_object


MAX_CONNECTIONS = 256  # clients served at once by default (each also holds one replica connection)
DESCRIPTORS_EACH = 2  # the client's socket and the replica's
REFUSING_THREADS = 8
REFUSAL_S = 1.0  # the most a turned-away client holds a refusing thread
BODY_PROGRESS_BYTES = 1024  # a body's bytes that push its client's deadline back a period


def error_body(status: int, code: str, message: str) -> bytes:
    """An OpenAI-style error object, as the replicas send theirs."""
    kind = "invalid_request_error" if status < 500 else "server_overloaded"
    return json.dumps(error_object(message, kind, code)).encode()


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int,
                 on_refused: Callable[[], None]) -> None:
        super().__init__(address, handler)
        self._serving = threading.BoundedSemaphore(max_connections)
        self._refusing = threading.BoundedSemaphore(REFUSING_THREADS)
        self._on_refused = on_refused
        message = f"the router serves at most {max_connections:,} connections at once; try again"
        body = error_body(503, "too_many_connections", message)
        self._refusal = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def process_request(self, request: socket.socket, client_address) -> None:
        if self._serving.acquire(blocking=False):
            return self._start(self.process_request_thread, self._serving, request, client_address)
        self._on_refused()
        if self._refusing.acquire(blocking=False):
            return self._start(self._turn_away, self._refusing, request, client_address)
        self.shutdown_request(request)

    def _start(self, work: Callable, slot: threading.BoundedSemaphore, request: socket.socket, client_address) -> None:
        try:
            threading.Thread(target=self._run, args=(work, slot, request, client_address), daemon=True).start()
        except RuntimeError:  # no thread to be had: this client loses its connection, the server goes on
            slot.release()
            self.shutdown_request(request)

    @staticmethod
    def _run(work: Callable, slot: threading.BoundedSemaphore, request: socket.socket, client_address) -> None:
        try:
            work(request, client_address)
        finally:
            slot.release()

    def _turn_away(self, request: socket.socket, client_address) -> None:
        """Answer 503, then read what the client still sends until it closes (closing on unread
        bytes would reset the connection, and the client could lose the answer), for at most
        ``REFUSAL_S``."""
        deadline = time.monotonic() + REFUSAL_S
        try:
            request.settimeout(REFUSAL_S)
            request.sendall(self._refusal)
            request.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                request.settimeout(left)
                if not request.recv(65536):
                    break
        except OSError:
            pass
        finally:
            self.shutdown_request(request)


class _PacedReader(io.RawIOBase):
    """A client's socket read against a deadline: each receive waits at most what is left of
    it; while ``counting`` (a body), every ``BODY_PROGRESS_BYTES`` received push it back."""

    def __init__(self, sock: socket.socket, period_s: float) -> None:
        self._sock, self._period_s = sock, period_s
        self.counting = False
        self.restart()

    def restart(self) -> None:
        self._deadline, self._received = time.monotonic() + self._period_s, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client sent too little within its timeout")
        self._sock.settimeout(left)
        try:
            count = self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._period_s)  # writes keep the whole period
        if self.counting:
            self._received += count
            if self._received >= BODY_PROGRESS_BYTES:
                self.restart()
        return count


class PacedRequestHandler(BaseHTTPRequestHandler):
    """A request handler whose client must send a request's head within one ``timeout`` and
    its body at ``BODY_PROGRESS_BYTES`` a ``timeout`` (a miss ends the connection, as a silent
    client's does)."""

    def setup(self) -> None:
        super().setup()
        self._paced = _PacedReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self._paced)

    def handle_one_request(self) -> None:
        self._paced.counting = False
        self._paced.restart()
        super().handle_one_request()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self._paced.counting = True  # the head is in: its body, if any, is read at a pace
        self._paced.restart()
        return parsed
