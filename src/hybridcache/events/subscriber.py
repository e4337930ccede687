"""The consumer side of one event stream: live batches in order, recovered through replay.

Owns: one SUB socket, one replay DEALER socket, and the ordering state of the stream (the
last seq seen live and the last seq delivered), and the count of catch-up requests in flight
(``request_catch_up`` runs on any thread, each on its own DEALER; the context is terminated
once the last one ends after ``close``). ``receive`` hands out each batch once, in seq
order, following the rules llm-d's subscriber applies: a seq equal to or below the last one
delivered is a duplicate; a seq below the last one seen live is a restarted publisher (a
``RESET`` is delivered, then everything its replay buffer holds from seq 0); a seq beyond the
next one is a gap, filled from the replay socket before the batch that revealed it. A replay
that does not end within its timeout delivers ``RESET`` with nothing after it: the consumer's
view of that stream is no longer complete and must start over.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import zmq

from hybridcache.errors import EventStreamError

RESET = None  # delivered in place of a batch: forget everything this stream said


@dataclass(frozen=True)
class Delivered:
    seq: int
    payload: bytes


@dataclass(frozen=True)
class CatchUp:
    """A replay answer fetched by ``request_catch_up``, not yet delivered: asked from ``start``
    while the stream had seen ``resets`` restarts (None: the replay did not end in time)."""

    start: int
    resets: int
    replies: list[tuple[int, bytes]] | None


class StreamSubscriber:
    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *, binds: bool = False,
        replay_timeout_s: float = 2.0,
    ) -> None:
        """``topic``: the prefix filter; ``binds``: bind the SUB socket (the publishers then
        connect to it) instead of connecting to a bound publisher."""
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            (self._sub.bind if binds else self._sub.connect)(endpoint)
        except zmq.ZMQError as error:
            self._sub.close()
            self._context.term()
            raise EventStreamError(f"cannot subscribe at {endpoint}: {error}") from None
        self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT) if binds else endpoint
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_s = replay_timeout_s
        self._dealer: zmq.Socket | None = None
        self.last_live: int | None = None
        self.last_delivered: int | None = None
        self.replays = 0
        self.failed_replays = 0
        self.resets = 0
        self._requests = threading.Lock()  # guards the two below
        self._requests_in_flight = 0
        self._closed = False

    def receive(self, timeout_ms: int = 0) -> list[Delivered | None]:
        """Every batch that arrived (waiting at most ``timeout_ms`` for the first), in order,
        gaps filled; ``RESET`` where the stream restarted or could not be recovered."""
        out: list[Delivered | None] = []
        wait = timeout_ms
        while self._sub.poll(wait, zmq.POLLIN):
            wait = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue  # not an event message: dropped, as llm-d does
            self._accept(int.from_bytes(frames[1], "big"), frames[2], out)
        return out

    def catch_up(self) -> list[Delivered | None]:
        """Ask the replay socket for everything after the last delivered batch (a consumer
        joining mid-stream, or restarted, calls this once before ``receive``)."""
        return self.deliver_catch_up(self.request_catch_up())

    def request_catch_up(self) -> CatchUp | None:
        """The replay socket's answer from the next seq to deliver, fetched on its own socket:
        callable on any thread, concurrently with ``receive`` and with each other (the wait,
        bounded by the replay timeout, holds nothing of the stream's); ``deliver_catch_up``
        then delivers it. None without a replay socket or once closed."""
        with self._requests:
            if self._replay_endpoint is None or self._closed:
                return None
            self._requests_in_flight += 1
        resets = self.resets  # read first: a restart between the two reads makes the answer stale
        start = self._next_seq()
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self._replay_endpoint)
            return CatchUp(start, resets, self._ask(dealer, start))
        finally:
            dealer.close()
            with self._requests:
                self._requests_in_flight -= 1
                last_after_close = self._closed and not self._requests_in_flight
            if last_after_close:
                self._context.term()

    def deliver_catch_up(self, fetched: CatchUp | None) -> list[Delivered | None]:
        """The batches of a fetched replay answer not delivered since (a restart seen since it
        was asked makes it stale: nothing)."""
        out: list[Delivered | None] = []
        if fetched is None or fetched.resets != self.resets:
            return out
        self.replays += 1
        self._deliver_replies(fetched.start, fetched.replies, out)
        return out

    def restart(self) -> list[Delivered | None]:
        """The publisher is known to have restarted (its other stream said so; the two count
        from 0 together): ``RESET``, then everything its replay buffer holds from seq 0. Without
        this a stream whose new batches were all published before the subscriber reconnected
        waits for a live batch below its old seq, and a catch-up asks for seqs past its old
        last one, which the new run has not reached."""
        self.resets += 1
        out: list[Delivered | None] = []
        self._reset(out)
        self.last_live = None
        self._replay_from(0, out)
        return out

    def _accept(self, seq: int, payload: bytes, out: list) -> None:
        if self.last_live is not None and seq < self.last_live:
            self.resets += 1
            self._reset(out)
        self.last_live = seq
        if seq < self._next_seq():
            return  # already delivered (by a replay)
        if seq > self._next_seq():
            self._replay_from(self._next_seq(), out, until=seq)
            if seq != self._next_seq() and self._replay_endpoint is not None:
                self._reset(out)  # the buffer no longer holds the gap: start over from here
        out.append(Delivered(seq, payload))
        self.last_delivered = seq

    def _next_seq(self) -> int:
        return 0 if self.last_delivered is None else self.last_delivered + 1

    def _reset(self, out: list) -> None:
        if not out or out[-1] is not RESET:
            out.append(RESET)
        self.last_delivered = None

    def _replay_from(self, start: int, out: list, until: int | None = None) -> None:
        """Deliver buffered batches from ``start`` (below ``until`` when given). Without a
        replay socket a gap is accepted as it is."""
        if self._replay_endpoint is None:
            return
        self.replays += 1
        self._deliver_replies(start, self._request_replay(start), out, until)

    def _deliver_replies(self, start: int, replies: list[tuple[int, bytes]] | None, out: list,
                         until: int | None = None) -> None:
        if replies is None:
            self.failed_replays += 1
            self._reset(out)
            return
        for seq, payload in replies:
            if until is not None and seq >= until:
                break
            if seq == self._next_seq() or (self.last_delivered is None and seq >= start):
                out.append(Delivered(seq, payload))
                self.last_delivered = seq

    def _request_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The replay socket's answer for ``start``, or None when it did not end in time."""
        if self._dealer is None:
            self._dealer = self._context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self._replay_endpoint)
        replies = self._ask(self._dealer, start)
        if replies is None:
            self._dealer.close()  # late replies must not answer the next request
            self._dealer = None
        return replies

    def _ask(self, dealer: zmq.Socket, start: int) -> list[tuple[int, bytes]] | None:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        replies: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self._replay_timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms, zmq.POLLIN):
                return None
            frames = dealer.recv_multipart()[1:]  # the empty delimiter first
            if not frames or frames[-1] == b"":
                return replies
            seq_frame, payload = frames[-2], frames[-1]
            replies.append((int.from_bytes(seq_frame, "big", signed=True), payload))

    def close(self) -> None:
        """Close the sockets; the context ends now, or as the last catch-up request in flight ends."""
        with self._requests:
            self._closed = True
            last = not self._requests_in_flight
        self._sub.close()
        if self._dealer is not None:
            self._dealer.close()
        if last:
            self._context.term()
