"""``hybridcache router``: an OpenAI-compatible HTTP proxy choosing a replica per request.

Owns: the HTTP server (standard library, one thread per connection), the ``Fleet`` it routes
over and the ``RouterMetrics``. A ``POST /v1/completions`` or ``/v1/chat/completions`` is
read whole, its prompt tokens found (a completions ``prompt`` of token ids as it is;
otherwise the replica's ``POST /tokenize``, as vLLM serves it; without tokens the request is
routed by load and round robin), scored on every healthy replica, and forwarded to the chosen
one; the answer (a JSON body, or an event stream relayed chunk by chunk as it arrives) goes
back unchanged. A connection that fails before the first byte of the answer reaches the client
(refused, reset, a head that is not HTTP, a body short of its Content-Length, chunked framing
that does not decode) marks the replica dead and is retried once on the next choice, else
answered 503 ``no_replica``; after the first byte a failure ends the answer and the client's
connection. The router buffers at most ``MAX_BODY`` (64 MiB) of an answer: one declaring more
is relayed as it arrives, settled from its ``x-hybridcache-next-seq`` header alone (its body's
usage is not read).
A request is not sent beside a prefill of its own prefix that this router sent the chosen
replica before it: it waits until that answer starts and is routed again
(``Fleet.route_after_prefills``). Before the end of an answer to a request routed by its cache reaches the client (the body, or
the stream's ``[DONE]``), the router applies the replica's events up to its ``next_seq``
(bounded, ``Fleet.settle``), so a turn that follows at once is routed with them: the answer
carries it (``x-hybridcache-next-seq``, ``hybridcache.next_seq`` in the body or the usage
event); only an answer without it costs a ``GET /kv_events``.
``GET /metrics`` gives the router's own counters, ``GET /health`` its liveness, and other
``GET``s (``/v1/models``) go to any healthy replica.

Exposed to any client: a request the router cannot read (a ``Content-Length`` that is not a
count, a body past 64 MiB, a chunked upload it does not decode, a body that is not a JSON
object) is refused with an OpenAI-style error object and, when its body was left unread, the
connection closed; a client silent for ``client_timeout_s`` on one read or write (an idle
keep-alive, a stalled upload, a reader that stopped reading) loses its connection, so no
client holds a thread for longer; past ``max_connections`` clients at once a new one is answered
503 (``too_many_connections``) and closed (``router.connections``). A replica silent for ``timeout_s`` between two reads of one
answer is given up as a failed connection.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

from hybridcache.errors import InvalidArgumentError
from hybridcache.machine import connection_bound
from hybridcache.router.connections import (
    DESCRIPTORS_EACH,
    MAX_CONNECTIONS,
    BoundedHTTPServer,
    PacedRequestHandler,
    error_body,
)
from hybridcache.router.answers import MAX_BODY, UPSTREAM_FAILURES, last_usage_event, only_role, reported_cached_tokens
from hybridcache.router.discovery import answer_next_seqs
from hybridcache.router.fleet import PREFILL_WAIT_S, Fleet, Relay, Replica
from hybridcache.router.keys import connect, key_for
from hybridcache.router.metrics import RouterMetrics
from hybridcache.router.policy import Decision
from hybridcache.router.request_key import RequestKey
from hybridcache.types import is_positive_finite

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
_CHUNK = 64 * 1024
_STREAM_END = b"data: [DONE]"
NEXT_SEQ_HEADER = "x-hybridcache-next-seq"  # the replica's event next_seq as its answer ended (JSON)
UPSTREAM_TIMEOUT_S = 600.0  # a replica may think this long before its next byte (a long prefill)
CLIENT_TIMEOUT_S = 60.0  # a client may stay silent this long on one read or write


class RouterServer:
    def __init__(self, fleet: Fleet, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = UPSTREAM_TIMEOUT_S,
                 client_timeout_s: float = CLIENT_TIMEOUT_S, max_connections: int | None = None) -> None:
        """``timeout_s``: the most a replica may stay silent within one answer;
        ``client_timeout_s``: the most a client may stay silent on one read or write;
        ``max_connections``: clients served at once (None: ``MAX_CONNECTIONS``, or what the
        descriptor limit allows)."""
        for name, value in (("timeout_s", timeout_s), ("client_timeout_s", client_timeout_s)):
            if not is_positive_finite(value):
                raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {value!r}")
        max_connections = connection_bound(max_connections, MAX_CONNECTIONS, DESCRIPTORS_EACH, InvalidArgumentError)
        self.fleet = fleet
        self.metrics = RouterMetrics()
        self.timeout_s = float(timeout_s)
        handler = type("RouterHandler", (_Handler,), {"router": self, "timeout": float(client_timeout_s)})
        self._server = BoundedHTTPServer((host, port), handler, max_connections,
                                         on_refused=lambda: self.metrics.count("connections_refused"))
        self.host, self.port = self._server.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start the fleet's thread and serve in a background thread."""
        self.fleet.start()
        self._thread = threading.Thread(target=self._server.serve_forever, name="hybridcache-router", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        self.fleet.start()
        try:
            self._server.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(10)
            self._thread = None
        self._server.server_close()
        self.fleet.close()

    # --- one request ---------------------------------------------------------------------------

    def key_for(self, path: str, body: dict) -> RequestKey | None:
        """The request's prompt tokens and namespace, or None when they cannot be had (see
        ``router.keys.key_for``)."""
        return key_for(self.fleet, path, body)


class _Handler(PacedRequestHandler):
    protocol_version = "HTTP/1.1"
    router: RouterServer

    def log_message(self, format: str, *args) -> None:  # quiet: the metrics count requests
        return

    def do_GET(self) -> None:
        router = self.router
        if self.path == "/health":
            return self._reply(200, b"ok", "text/plain")
        if self.path == "/metrics":
            return self._reply(200, router.metrics.render(router.fleet.status()).encode(), "text/plain; version=0.0.4")
        self._forward(None, None, 0)

    def do_POST(self) -> None:
        length = self._body_length()
        if length is None:
            return
        raw = self.rfile.read(length)
        if len(raw) < length:  # the client closed its side before the whole body came
            self.close_connection = True
            return
        body = None
        if self.path in ROUTED_PATHS:
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                return self._refuse(400, "malformed_body", "the body is not JSON")
            if not isinstance(body, dict):
                return self._refuse(400, "malformed_body", "the body is not a JSON object")
        key = self.router.key_for(self.path, body) if body is not None else None
        self._forward(raw, key, 0 if key is None else len(key.token_ids))

    def _body_length(self) -> int | None:
        """The body's length as the request declares it; None once a refusal was sent (and the
        connection marked to close: the unread body cannot be told from a next request)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            refusal = (411, "length_required", "a request body needs a Content-Length (chunked uploads are not read)")
        else:
            declared = self.headers.get("Content-Length", "0").strip()
            if not declared.isdigit() or not declared.isascii():
                refusal = (400, "malformed_body", "Content-Length is not a count of bytes")
            elif int(declared) > MAX_BODY:
                refusal = (413, "body_too_large", f"the body is over {MAX_BODY:,} bytes")
            else:
                return int(declared)
        self.close_connection = True
        self._refuse(*refusal)
        return None

    def _forward(self, raw: bytes | None, key: RequestKey | None, prompt_tokens: int) -> None:
        router = self.router
        router.metrics.count("requests")
        tried: tuple[Replica, ...] = ()
        waits_end = time.monotonic() + PREFILL_WAIT_S  # one bound for the waits of both attempts
        for attempt in range(2):
            routed = router.fleet.route_after_prefills(key, prompt_tokens, router.metrics, tried, waits_end)
            if routed is None:
                break
            replica, decision = routed
            router.metrics.decided(replica.url, decision.reason)
            relay = router.fleet.started(replica, prompt_tokens - decision.predicted_tokens, key)
            try:
                answered = self._exchange(replica, raw, relay, decision if key is not None else None)
            finally:
                router.fleet.ended(relay)
            if answered:
                return
            router.fleet.mark_dead(replica)
            if attempt == 0:
                router.metrics.count("retries")
            tried += (replica,)
        router.metrics.count("no_replica")
        self._refuse(503, "no_replica", "no replica could take the request")

    def _exchange(self, replica: Replica, raw: bytes | None, relay: Relay, predicted: Decision | None) -> bool:
        """Send the request to ``replica`` and relay its answer; False when it failed before a
        byte of the answer reached the client (a failed connection: the caller retries)."""
        connection = connect(replica.url, self.router.timeout_s)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            try:
                connection.request(self.command, self.path, body=raw, headers=headers)
                response = connection.getresponse()
            except UPSTREAM_FAILURES:
                return False
            return self._relay(response, relay, predicted)
        finally:
            connection.close()

    def _relay(self, response: http.client.HTTPResponse, relay: Relay, predicted: Decision | None) -> bool:
        """Relay the answer; ``predicted``: the decision that routed a request by its cache
        (None: not by cache). False when the replica failed before the client got a byte; a
        failure after that ends the answer (and the client's connection)."""
        try:
            if response.chunked or response.length is None:
                return self._relay_stream(response, relay, predicted)
            if response.length > MAX_BODY:
                return self._relay_pieces(response, relay, predicted)
            return self._relay_whole(response, relay, predicted)
        except UPSTREAM_FAILURES:  # raised past the first byte: the client sees a cut answer
            self.close_connection = True
            return True

    def _relay_whole(self, response: http.client.HTTPResponse, relay: Relay, predicted: Decision | None) -> bool:
        """A Content-Length answer up to ``MAX_BODY``, read whole: settled and checked first."""
        try:
            data = response.read()
        except UPSTREAM_FAILURES:
            return False
        self._settle(relay, predicted, answer_next_seqs(response.getheader(NEXT_SEQ_HEADER), data))
        self._check_prediction(data, predicted)
        self._start_answer(response, "Content-Length", str(len(data)))
        self.wfile.write(data)
        return True

    def _relay_pieces(self, response: http.client.HTTPResponse, relay: Relay, predicted: Decision | None) -> bool:
        """A Content-Length answer past ``MAX_BODY``, relayed as it arrives (never buffered):
        settled from its header alone, its prediction not checked. One that ends short of its
        length ends the client's connection."""
        declared = response.length
        try:
            piece = response.read1(_CHUNK)
        except UPSTREAM_FAILURES:
            return False
        if not piece:
            return False
        self._settle(relay, predicted, answer_next_seqs(response.getheader(NEXT_SEQ_HEADER), None))
        self._start_answer(response, "Content-Length", str(declared))
        sent = 0
        while piece:
            self.wfile.write(piece)
            sent += len(piece)
            piece = response.read1(_CHUNK) if sent < declared else b""
        self.close_connection = self.close_connection or sent < declared
        return True

    def _relay_stream(self, response: http.client.HTTPResponse, relay: Relay, predicted: Decision | None) -> bool:
        """A chunked answer (or one ending with its connection), relayed chunk by chunk as it
        arrives; settled and checked as its ``[DONE]`` passes."""
        try:
            chunk = response.read1(_CHUNK)
        except UPSTREAM_FAILURES:
            return False
        self._start_answer(response, "Transfer-Encoding", "chunked")
        tail, ended = b"", False
        while chunk:
            if not only_role(chunk):  # a chat stream's role chunk is sent before the prefill
                self.router.fleet.answering(relay)
            tail = (tail + chunk)[-_CHUNK:]
            if _STREAM_END in chunk and not ended:  # settled and counted before the client sees the end
                ended = True
                usage_event = last_usage_event(tail)
                self._settle(relay, predicted, answer_next_seqs(None, usage_event))
                self._check_prediction(usage_event, predicted)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            chunk = response.read1(_CHUNK)
        if not ended:
            self._check_prediction(last_usage_event(tail), predicted)
        self.wfile.write(b"0\r\n\r\n")
        return True

    def _start_answer(self, response: http.client.HTTPResponse, framing: str, value: str) -> None:
        self.send_response(response.status)
        for name, header in response.getheaders():
            if name.lower() not in _HOP_HEADERS:
                self.send_header(name, header)
        self.send_header(framing, value)
        self.end_headers()

    def _settle(self, relay: Relay, predicted: Decision | None, next_seqs: tuple[int | None, int | None] | None) -> None:
        """Before the client sees the answer end: a request routed by its cache waits (bounded)
        for its replica's events up to the ``next_seqs`` its answer carried (read from the
        replica when it carried none), so the conversation's next turn finds this turn's
        checkpoint."""
        if predicted is not None:
            self.router.metrics.count("settles_from_answer" if next_seqs is not None else "settles_read")
            if not self.router.fleet.settle(relay.replica, expected=next_seqs):
                self.router.metrics.count("settles_unapplied")

    def _check_prediction(self, data: bytes | None, predicted: Decision | None) -> None:
        cached = None if predicted is None else reported_cached_tokens(data)
        if cached is not None:
            self.router.metrics.reported(predicted, cached)

    def _refuse(self, status: int, code: str, message: str) -> None:
        self._reply(status, error_body(status, code, message))

    def _reply(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

