"""``hybridcache serve``'s HTTP connections: uvicorn's h11 protocol with a bound on how long a
client may keep the server waiting.

Owns, per connection, since when it has waited on its client (reset whenever the client makes
progress: sends bytes, takes bytes the server had queued, has an answer completed) and the
timer that checks it once a period. uvicorn alone waits forever for a client that connects and
sends nothing, leaves its headers or body unfinished, or stops reading a stream (the answer's
``send`` then blocks on a full buffer and holds its request in the engine); here such a
connection is aborted once it has waited on its client, with no progress, for between one and
two ``client_timeout_s`` periods, which for a request in the engine reads as the client going
away (the request is cancelled). Bytes received count as progress only when they complete a
request's head or add up to ``BODY_PROGRESS_BYTES`` of its body, so a client trickling its
headers or body a byte at a time (slowloris) is held to the same bound as a silent one. A connection the server is busy on (a prefill before the
first token, a long answer the client is reading) is never timed out. Past ``max_connections``
connections at once a new one is answered 503 (``too_many_connections``) as it opens, read and
dropped until its client closes, and aborted after ``REFUSAL_S``, so a flood holds at most a
second of each descriptor past the bound. Built on the internals of ``uvicorn==0.54.0`` (the
version the ``serve`` extra pins): ``conn``, ``flow``, ``transport``, ``loop``, ``connections``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridcache.errors import InvalidConfigError
from hybridcache.serving.api_errors import too_many_connections
from hybridcache.types import is_positive_finite


UNSENT_BYTES = 128 * 1024  # what the kernel may queue for a client beyond what is in flight
BODY_PROGRESS_BYTES = 1024  # a body's bytes that reset the wait on its client
REFUSAL_S = 1.0  # the most a turned-away connection is kept open for its client to read the 503


class ClientTimeoutProtocol(H11Protocol):
    client_timeout_s = 60.0
    max_connections = 1024
    refusal = b""
    _turned_away = False
    _body_bytes = 0  # of the body being received, since the wait on the client was last reset

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waited_from: float | None = self.loop.time()  # None: not waiting on the client at the last check
        if len(self.connections) > self.max_connections:
            self._turn_away()
            return
        _bound_unsent(transport)
        self._watch: asyncio.TimerHandle | None = self.loop.call_later(self.client_timeout_s, self._check)

    def _turn_away(self) -> None:
        """Answer 503 and half-close; what the client still sends is dropped until it closes
        (closing on unread bytes would reset the connection before the client read the answer)."""
        self._turned_away = True
        self._watch = self.loop.call_later(REFUSAL_S, self.transport.abort)
        self.transport.write(self.refusal)
        if self.transport.can_write_eof():
            self.transport.write_eof()

    def data_received(self, data: bytes) -> None:
        if self._turned_away:
            return
        receiving_head = self.conn.their_state is h11.IDLE
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY and not receiving_head:
            self._body_bytes += len(data)
            if self._body_bytes < BODY_PROGRESS_BYTES:
                return
        elif receiving_head and self.conn.their_state is h11.IDLE:
            return  # still inside a head: a whole head must come within a period
        self._progressed()

    def pause_writing(self) -> None:
        self._progressed()  # a stalled reader's period starts when its buffer fills
        super().pause_writing()

    def resume_writing(self) -> None:
        self._progressed()
        super().resume_writing()

    def on_response_complete(self) -> None:
        self._progressed()  # the client's next request gets a whole period
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        super().connection_lost(exc)

    def _progressed(self) -> None:
        self._body_bytes = 0
        if self._waited_from is not None:
            self._waited_from = self.loop.time()

    def _waiting_on_client(self) -> bool:
        """Whether the connection can only go on when its client acts: it owes the server a
        request or the rest of one (and the server is not holding its reads back), or it has
        stopped reading what the server wrote."""
        if self.flow.write_paused:
            return True
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.flow.read_paused

    def _check(self) -> None:
        """Every period: abort a connection that has waited on its client, without progress,
        since before the last check (so between one and two periods); a wait first seen now
        starts its period now."""
        self._watch = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if not self._waiting_on_client():
            self._waited_from = None
        elif self._waited_from is None:
            self._waited_from = now
        elif now - self._waited_from >= self.client_timeout_s:
            self.transport.abort()  # not close(): a client that stopped reading would never let it flush
            return
        due = now if self._waited_from is None else self._waited_from
        self._watch = self.loop.call_later(max(0.0, due + self.client_timeout_s - now), self._check)


def _bound_unsent(transport: asyncio.Transport) -> None:
    """Let the kernel hold at most ``UNSENT_BYTES`` the client has not taken (``TCP_NOTSENT_LOWAT``,
    where the platform has it): past that, writes wait in the transport, which pauses the
    answer, so a client that stops reading is seen as one within a period, where Linux would
    otherwise grow the socket's buffer to megabytes first. Bytes in flight are not bounded,
    so a distant client's throughput is not either."""
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is None or option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_BYTES)


def connection_protocol(client_timeout_s: float, max_connections: int) -> type[ClientTimeoutProtocol]:
    """The protocol class uvicorn builds each connection with, waiting at most
    ``client_timeout_s`` seconds on a client and holding at most ``max_connections`` (a count
    ``ServeConfig`` checked against the descriptor limit)."""
    if not is_positive_finite(client_timeout_s):
        raise InvalidConfigError(f"client_timeout_s must be a positive number of seconds, got {client_timeout_s!r}")
    status, body = too_many_connections(max_connections)
    data = json.dumps(body).encode()
    refusal = (b"HTTP/1.1 %d Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (status, len(data), data))
    return type("ClientTimeoutProtocol", (ClientTimeoutProtocol,),
                {"client_timeout_s": float(client_timeout_s), "max_connections": max_connections, "refusal": refusal})
