"""The consumer side of one event stream: live batches in order, recovered through replay.

Owns: one SUB socket, the ordering state of the stream (the last seq seen live, the last seq
delivered, the live batch held back until the replay before it arrives, and whether a replay
is awaited), and the count of catch-up requests in flight (``request_catch_up`` runs on any
thread, each on its own DEALER; the context is terminated once the last one ends after
``close``). Batches are handed out once, in seq order, following the rules llm-d's
subscriber applies: a seq equal to or below the last one delivered is a duplicate; a seq
below the last one seen live is a restarted publisher (a ``RESET`` is delivered, then
everything its replay buffer holds from seq 0); a seq beyond the next one is a gap, filled
from the replay socket before the batch that revealed it. A replay that does not end within
its timeout, or answers with frames that are not a replay answer, delivers ``RESET``: the
consumer's view of that stream is no longer complete and must start over.

``receive`` waits on the replay socket itself. ``receive_ready`` never waits on the network
beyond the live socket's ``timeout_ms``: at a gap it stops and holds the batch that revealed
it (``awaiting_replay``) until a ``request_catch_up`` fetched anywhere (without the caller's
locks) is handed to ``deliver_catch_up``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import zmq

from hybridcache.errors import EventStreamError

RESET = None  # delivered in place of a batch: forget everything this stream said
MAX_REPLAY_BATCHES = 1_000_000  # a replay answer longer than any publisher's buffer is garbage


@dataclass(frozen=True)
class Delivered:
    seq: int
    payload: bytes


@dataclass(frozen=True)
class CatchUp:
    """A replay answer fetched by ``request_catch_up``, not yet delivered: asked from ``start``
    while the stream had seen ``resets`` restarts and held ``awaited`` (the batch that revealed
    the gap it fills; None: none was held), ``replies`` None when the replay did not end in
    time or was not a replay answer."""

    start: int
    resets: int
    replies: list[tuple[int, bytes]] | None
    awaited: Delivered | None = None


@contextlib.contextmanager
def _as_stream_errors(what: str):
    try:
        yield
    except zmq.ZMQError as error:
        raise EventStreamError(f"{what}: {error}") from None


class StreamSubscriber:
    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *, binds: bool = False,
        replay_timeout_s: float = 2.0,
    ) -> None:
        """``topic``: the prefix filter; ``binds``: bind the SUB socket (the publishers then
        connect to it) instead of connecting to a bound publisher. An endpoint zmq cannot
        use raises ``EventStreamError`` here, not at the first replay."""
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        try:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            (self._sub.bind if binds else self._sub.connect)(endpoint)
            if replay_endpoint is not None:
                self._connected_dealer(replay_endpoint).close()
        except (zmq.ZMQError, TypeError, UnicodeError) as error:
            self._sub.close()
            self._context.term()
            raise EventStreamError(f"cannot subscribe at {endpoint!r} (replay {replay_endpoint!r}): {error}") from None
        self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT) if binds else endpoint
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_s = replay_timeout_s
        self.last_live: int | None = None
        self.last_delivered: int | None = None
        self._held: Delivered | None = None  # the live batch that revealed a gap, until the replay before it
        self._replay_wanted = False  # a gap, or a restart known from the other stream, waits for a replay
        self.replays = 0
        self.failed_replays = 0
        self.resets = 0
        self._requests = threading.Lock()  # guards the two below
        self._requests_in_flight = 0
        self._closed = False

    @property
    def awaiting_replay(self) -> bool:
        """Whether live batches wait for a replay answer (``request_catch_up``, then
        ``deliver_catch_up``) before more can be delivered."""
        return self._replay_wanted

    def receive(self, timeout_ms: int = 0) -> list[Delivered | None]:
        """Every batch that arrived (waiting at most ``timeout_ms`` for the first), in order,
        gaps filled (each waiting on the replay socket, bounded by its timeout); ``RESET``
        where the stream restarted or could not be recovered."""
        out: list[Delivered | None] = []
        self._drain(timeout_ms, None, out)
        while self._replay_wanted and self._fill(out):
            self._drain(0, None, out)
        return out

    def receive_ready(self, timeout_ms: int = 0, max_batches: int | None = None) -> list[Delivered | None]:
        """Like ``receive``, reading at most ``max_batches`` live messages and never waiting
        on the replay socket: at a gap it stops with what came before it delivered
        (``awaiting_replay``), and reads nothing more until a catch-up is delivered."""
        out: list[Delivered | None] = []
        self._drain(timeout_ms, max_batches, out)
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
        resets, awaited = self.resets, self._held  # read first: a restart between the reads makes the answer stale
        start = self._next_seq()
        try:
            with _as_stream_errors(f"replay from {self._replay_endpoint}"):
                dealer = self._connected_dealer(self._replay_endpoint)
                try:
                    return CatchUp(start, resets, self._ask(dealer, start), awaited)
                finally:
                    dealer.close()
        finally:
            self._end_request()

    def deliver_catch_up(self, fetched: CatchUp | None) -> list[Delivered | None]:
        """The batches of a fetched replay answer not delivered since, then the live batch held
        at the gap it was asked for (a restart seen since it was asked makes it stale: nothing)."""
        out: list[Delivered | None] = []
        self._deliver(fetched, out)
        return out

    def note_restart(self) -> list[Delivered | None]:
        """The publisher is known to have restarted (its other stream said so; the two count
        from 0 together): ``RESET``; the new run's replay buffer from seq 0 is then awaited
        (``awaiting_replay``). Without this a stream whose new batches were all published
        before the subscriber reconnected waits for a live batch below its old seq, and a
        catch-up asks for seqs past its old last one, which the new run has not reached."""
        self.resets += 1
        out: list[Delivered | None] = []
        self._reset(out)
        self.last_live = None
        self._held = None
        self._replay_wanted = self._replay_endpoint is not None
        return out

    def restart(self) -> list[Delivered | None]:
        """``note_restart``, then the new run's buffer from seq 0, waiting on the replay socket."""
        out = self.note_restart()
        while self._replay_wanted and self._fill(out):
            pass
        return out

    def _drain(self, timeout_ms: int, max_batches: int | None, out: list) -> None:
        wait, read = timeout_ms, 0
        with _as_stream_errors(f"receive from {self.endpoint}"):
            while not self._replay_wanted and (max_batches is None or read < max_batches) and self._sub.poll(wait, zmq.POLLIN):
                wait, read = 0, read + 1
                frames = self._sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue  # not an event message: dropped, as llm-d does
                self._accept(int.from_bytes(frames[1], "big"), frames[2], out)

    def _fill(self, out: list) -> bool:
        """Fetch and deliver one replay answer here; False when none can be asked."""
        fetched = self.request_catch_up()
        self._deliver(fetched, out)
        return fetched is not None

    def _accept(self, seq: int, payload: bytes, out: list) -> None:
        if self.last_live is not None and seq < self.last_live:
            self.resets += 1
            self._reset(out)
        self.last_live = seq
        if seq < self._next_seq():
            return  # already delivered (by a replay)
        if seq > self._next_seq() and self._replay_endpoint is not None:
            self._held, self._replay_wanted = Delivered(seq, payload), True
            return
        out.append(Delivered(seq, payload))  # without a replay socket a gap is accepted as it is
        self.last_delivered = seq

    def _deliver(self, fetched: CatchUp | None, out: list) -> None:
        if fetched is None or fetched.resets != self.resets:
            return
        self.replays += 1
        self._deliver_replies(fetched.start, fetched.replies, out)
        if self._held is None:
            self._replay_wanted = False  # a restart's buffer from seq 0: this answer was asked after it
        else:
            self._release_held(fetched.awaited is self._held, out)

    def _release_held(self, asked_for_it: bool, out: list) -> None:
        """Deliver the batch held at a gap once a replay answer asked after the gap was seen
        came (an earlier one may predate the batches missing), or one covered the gap."""
        held = self._held
        if held.seq > self._next_seq() and not asked_for_it:
            return
        self._held, self._replay_wanted = None, False
        if held.seq < self._next_seq():
            return  # the replay delivered it
        if held.seq > self._next_seq():
            self._reset(out)  # the buffer no longer holds the gap: start over from here
        out.append(held)
        self.last_delivered = held.seq

    def _next_seq(self) -> int:
        return 0 if self.last_delivered is None else self.last_delivered + 1

    def _reset(self, out: list) -> None:
        if not out or out[-1] is not RESET:
            out.append(RESET)
        self.last_delivered = None

    def _deliver_replies(self, start: int, replies: list[tuple[int, bytes]] | None, out: list) -> None:
        if replies is None:
            self.failed_replays += 1
            self._reset(out)
            return
        for seq, payload in replies:
            if seq == self._next_seq() or (self.last_delivered is None and seq >= start):
                out.append(Delivered(seq, payload))
                self.last_delivered = seq

    def _connected_dealer(self, endpoint: str) -> zmq.Socket:
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
        except BaseException:
            dealer.close()
            raise
        return dealer

    def _ask(self, dealer: zmq.Socket, start: int) -> list[tuple[int, bytes]] | None:
        """The replay answer for ``start``: None when it did not end in time, or a message is
        not ``[b"", topic, seq (8 bytes), payload]`` (the end: an empty payload)."""
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        replies: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self._replay_timeout_s
        while len(replies) <= MAX_REPLAY_BATCHES:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms, zmq.POLLIN):
                return None
            frames = dealer.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                return None
            if frames[3] == b"":
                return replies
            replies.append((int.from_bytes(frames[2], "big", signed=True), frames[3]))
        return None

    def _end_request(self) -> None:
        with self._requests:
            self._requests_in_flight -= 1
            last_after_close = self._closed and not self._requests_in_flight
        if last_after_close:
            self._context.term()

    def close(self) -> None:
        """Close the socket; the context ends now, or as the last catch-up request in flight ends."""
        with self._requests:
            self._closed = True
            last = not self._requests_in_flight
        self._sub.close()
        if last:
            self._context.term()
