"""The engine loop: one thread that owns the engine and bridges HTTP requests to its scheduler.

Owns: the engine (no other thread touches it once the loop runs), the inbox of submissions and
cancellations, the live tickets (one per request in the server, with where its updates go),
and, once the loop ended on a bug, why (``failure``).
The HTTP event loop only calls ``submit`` and ``cancel``, which take a lock for a few
microseconds and never wait for the engine; the loop thread calls each ticket's ``listener``
with an ``Update`` once the engine accepted the request (no tokens yet), after every engine
step that gave it new tokens, and once more when it ends.

A ticket ends when the engine finishes it, when it generates one of its stop token ids (the
tokens stop before it and the engine request is cancelled, freeing its blocks), when it is
cancelled (its client left, or a stop string matched), or when the engine refuses it. At most
``capacity`` tickets are in the server; ``submit`` refuses one more with
``ServerOverloadedError`` instead of queueing without bound.

A forward that raises fails the requests it carried and the loop goes on. Anything else that
raises on the loop thread (an observer, a delivery: a bug) ends the loop: every request in the
server gets a ``RequestFailedError``, ``submit`` refuses new ones (``ServerOverloadedError``) and
``failure`` says why, so ``/health`` and ``/metrics`` turn a router away instead of leaving
requests waiting for a thread that is gone.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from hybridcache.engine import Engine, Request, Result
from hybridcache.errors import HybridCacheError, RequestFailedError, ServerOverloadedError

log = logging.getLogger("hybridcache.serving")

IDLE_WAIT_S = 0.5  # how often an idle loop wakes to refresh the observers' snapshot


@dataclass
class Update:
    """What a request has so far: every token generated (before any stop token), its restored
    depth and miss reason (the tiers' when they served less than expected, else the cache's);
    ``finish_reason`` ("stop", "length") or ``error`` on the last one."""

    tokens: list[int]
    cached_tokens: int = 0
    miss_reason: str | None = None
    finish_reason: str | None = None
    error: BaseException | None = None
    next_seq: dict[str, int | None] | None = None  # the event streams' next_seq once the answer ended

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class _Ticket:
    request: Request
    stop_ids: frozenset[int]
    listener: Callable[[Update], None]
    engine_id: int | None = None
    sent: int = 0


@dataclass
class _Inbox:
    submitted: deque = field(default_factory=deque)
    cancelled: deque = field(default_factory=deque)


class EngineLoop:
    def __init__(self, engine: Engine, *, capacity: int, observe: Callable[[Engine], None]) -> None:
        """``observe(engine)`` runs on the loop thread after each step, before the step's
        answers are sent (so the metrics snapshot already counts what a client received), and
        when idle."""
        self._engine = engine
        self._capacity = capacity
        self._observe = observe
        self._lock = threading.Condition()
        self._inbox = _Inbox()
        self._tickets: dict[int, _Ticket] = {}  # every ticket in the server, by ticket id
        self._by_engine_id: dict[int, int] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._drain_deadline = 0.0
        self.failure: RequestFailedError | None = None  # set once, by the loop thread, if it ended on a bug
        self._thread = threading.Thread(target=self._run, name="hybridcache-engine-loop", daemon=True)

    # --- the HTTP side (any thread) -----------------------------------------------------------

    def submit(self, request: Request, stop_ids: frozenset[int], listener: Callable[[Update], None]) -> int:
        """Queue ``request``; returns its ticket id. Raises ``ServerOverloadedError`` when the
        server already holds ``capacity`` requests or is shutting down."""
        with self._lock:
            if self.failure is not None:
                raise ServerOverloadedError("this server's engine loop stopped on an error; it takes no requests")
            if self._stopping:
                raise ServerOverloadedError("the server is shutting down")
            if len(self._tickets) >= self._capacity:
                raise ServerOverloadedError(f"the server holds {self._capacity} requests; retry shortly")
            ticket_id = next(self._ids)
            self._tickets[ticket_id] = _Ticket(request, stop_ids, listener)
            self._inbox.submitted.append(ticket_id)
            self._lock.notify()
        return ticket_id

    def cancel(self, ticket_id: int) -> None:
        """Stop serving a ticket (nothing is sent to its listener any more). Unknown or ended
        tickets are ignored: a client may leave after its request ended."""
        with self._lock:
            self._inbox.cancelled.append(ticket_id)
            self._lock.notify()

    def start(self) -> None:
        self._thread.start()

    def stop(self, drain_s: float) -> None:
        """Refuse new requests, let the ones in the server finish for up to ``drain_s`` seconds,
        cancel the rest (their listeners get an error) and end the thread."""
        with self._lock:
            self._stopping = True
            self._drain_deadline = time.monotonic() + drain_s
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join()

    def check_invariants(self) -> None:
        """Every engine request in flight belongs to a live ticket (none leaks), and the engine's own."""
        with self._lock:
            live = {ticket.engine_id for ticket in self._tickets.values() if ticket.engine_id is not None}
        assert set(self._by_engine_id) <= live, "an engine request outlived its ticket"
        self._engine.check_invariants()

    # --- the loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as error:
            log.exception("the engine loop stopped; this server fails its requests and takes no more")
            failure = RequestFailedError(f"the engine loop stopped: {type(error).__name__}: {error}")
            failure.__cause__ = error
            with self._lock:
                self.failure = failure
            self._end_all(failure)

    def _serve(self) -> None:
        while True:
            submitted, cancelled, stopping = self._take_inbox()
            for ticket_id in cancelled:
                self._drop(ticket_id)
            for ticket_id in submitted:
                self._add(ticket_id)
            if self._by_engine_id:
                self._step()
            else:
                self._observe(self._engine)
            if stopping and (not self._by_engine_id or time.monotonic() >= self._drain_deadline):
                self._end_all(ServerOverloadedError("the server shut down before this request finished"))
                return

    def _take_inbox(self) -> tuple[list[int], list[int], bool]:
        with self._lock:
            inbox = self._inbox
            if not (inbox.submitted or inbox.cancelled or self._by_engine_id or self._stopping):
                self._lock.wait(IDLE_WAIT_S)
            submitted, cancelled = list(inbox.submitted), list(inbox.cancelled)
            inbox.submitted.clear()
            inbox.cancelled.clear()
            return submitted, cancelled, self._stopping

    def _add(self, ticket_id: int) -> None:
        ticket = self._ticket(ticket_id)
        if ticket is None:
            return
        try:
            ticket.engine_id = self._engine.add_request(ticket.request)
        except HybridCacheError as error:
            self._finish(ticket_id, Update([], error=error))
            return
        self._by_engine_id[ticket.engine_id] = ticket_id
        _notify(ticket, Update([]))  # accepted: the engine validated it and queued it

    def _step(self) -> None:
        try:
            finished = self._engine.step()
        except Exception as error:  # a bug below must not kill the loop: fail what it carried
            self._end_all(error)
            return
        self._observe(self._engine)
        for result in finished:
            ticket_id = self._by_engine_id.pop(result.request_id, None)
            if ticket_id is not None:
                self._deliver(ticket_id, result, done=True)
        for engine_id, ticket_id in list(self._by_engine_id.items()):
            progress = self._engine.progress(engine_id)
            if progress is not None:
                self._deliver(ticket_id, progress, done=False)

    def _deliver(self, ticket_id: int, result: Result, *, done: bool) -> None:
        ticket = self._ticket(ticket_id)
        if ticket is None or (not done and len(result.tokens) == ticket.sent):
            return
        tokens, finish = result.tokens, "length" if done else None
        for index in range(ticket.sent, len(tokens)):
            if tokens[index] in ticket.stop_ids:
                tokens, finish = tokens[:index], "stop"
                break
        if finish == "stop" and not done:
            self._release_engine_request(ticket)
        error = result.error if done else None
        # The tiers' reason first: they were expected to serve deeper than the device cache did.
        miss = result.tier_miss_reason or result.miss_reason
        update = Update(tokens, result.cached_tokens, miss, None if error else finish, error)
        ticket.sent = len(tokens)
        if update.final:
            # What a router waits for before the conversation's next turn: this step's events,
            # and a stop token's release (published now, not at the next step).
            if self._engine.events is not None:
                self._engine.events.publish_changes()
                update.next_seq = self._engine.events.next_seqs()
            self._finish(ticket_id, update)
        else:
            _notify(ticket, update)

    def _drop(self, ticket_id: int) -> None:
        with self._lock:
            ticket = self._tickets.pop(ticket_id, None)
        if ticket is not None:
            self._release_engine_request(ticket)

    def _release_engine_request(self, ticket: _Ticket) -> None:
        """Cancel the ticket's engine request if it is still running (frees its blocks)."""
        if ticket.engine_id is not None and self._by_engine_id.pop(ticket.engine_id, None) is not None:
            self._engine.cancel(ticket.engine_id)

    def _finish(self, ticket_id: int, update: Update) -> None:
        with self._lock:
            ticket = self._tickets.pop(ticket_id, None)
        if ticket is not None:
            _notify(ticket, update)

    def _end_all(self, error: BaseException) -> None:
        with self._lock:
            ticket_ids = list(self._tickets)
        for ticket_id in ticket_ids:
            ticket = self._ticket(ticket_id)
            if ticket is not None:
                self._release_engine_request(ticket)
            self._finish(ticket_id, Update([], error=error))

    def _ticket(self, ticket_id: int) -> _Ticket | None:
        with self._lock:
            return self._tickets.get(ticket_id)


def _notify(ticket: _Ticket, update: Update) -> None:
    try:
        ticket.listener(update)
    except Exception:  # a listener whose event loop has closed: its client is gone
        pass
