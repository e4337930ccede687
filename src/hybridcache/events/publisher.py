"""The ZMQ publisher of one event stream, with its replay buffer, as vLLM's publisher works.

Owns: one PUB socket, its optional replay ROUTER socket, the buffer of the last
``buffer_steps`` batches, the batch counter ``seq``, the queue between the caller and the
socket thread, the lock that gives one thread at a time the PUB socket, buffer and counter,
and the lock that orders publishers (each decides send, queue or drop, and counts ``accepted``,
alone).

A batch is sent on the caller's thread when nothing is queued ahead of it and the lock is free
(the usual case), so it is on the wire before the engine step that made it returns: a router
that sees a request's answer then already has the events of the step that finished it (sent
from the socket thread, they raced the answer, and a turn that followed its predecessor at
once was routed without the checkpoint the predecessor saved). Otherwise it is queued, and the
socket thread sends it in order. The replay ROUTER socket is used by the socket thread only.

Frames on the PUB socket: ``[topic, seq as 8-byte big-endian, payload]``; ``seq`` starts at 0
and grows by one per batch. A replay request from a DEALER (``[b"", start seq]``, seen by
the ROUTER as ``[identity, b"", start seq]``) is answered with every buffered batch from that
seq on as ``[identity, b"", topic, seq, payload]`` and an end marker ``[identity, b"", b"",
seq -1, b""]``. ``publish`` never waits for the socket: with the queue full a batch is
dropped and counted in ``dropped``, and takes no seq: ``accepted`` (the next_seq a replica
reports) counts exactly the batches that are or will be on the wire, so nobody waits for a seq
never sent; consumers do not see the loss (as with vLLM's publisher, whose thread numbers the
batches it sends).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import zmq

from hybridcache.errors import EventStreamError
from hybridcache.events.schema import KVEventBatch, StateEventBatch, encode_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 20
_CLOSE_WAIT_S = 5.0


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class EventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        binds: bool = True,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
    ) -> None:
        """``binds``: bind the PUB socket at ``endpoint`` (else connect to a bound subscriber);
        the replay socket always binds. ``tcp://HOST:*`` picks a free port (see ``endpoint``)."""
        self._topic = topic.encode()
        self._sending = threading.Lock()
        self._accepting = threading.Lock()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._replay = None
        try:
            (self._pub.bind if binds else self._pub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise EventStreamError(f"cannot open event sockets at {endpoint} / {replay_endpoint}: {error}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if binds else endpoint
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queue_size)
        self._next_seq = 0
        self.accepted = 0
        self.dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hybridcache-events", daemon=True)
        self._thread.start()

    @property
    def topic(self) -> str:
        return self._topic.decode()

    def publish(self, batch: KVEventBatch | StateEventBatch) -> bool:
        """Send one batch, or queue it behind the ones queued; False (and counted in
        ``dropped``, with no seq) when it had to be queued and the queue is full."""
        if not isinstance(batch, (KVEventBatch, StateEventBatch)):
            raise EventStreamError(f"expected an event batch, got {type(batch).__name__}")
        payload = encode_batch(batch)
        # ``accepted`` is the next_seq a replica reports (``/kv_events``, read on another
        # thread). It is raised only once the batch is sure to be sent (a reader must never see
        # a seq that no batch will carry: a settle would wait for it), and before the batch can
        # be on the wire (a reader that saw it at or below a seq already sent and applied took
        # the replica for restarted). Only publishers add to the queue, all under this lock, so
        # a queue not full here takes the batch.
        with self._accepting:
            if self._closed:
                raise EventStreamError("the publisher is closed")
            if self._send_now(payload):
                return True
            if self._queue.full():
                self.dropped += 1
                return False
            self.accepted += 1
            self._queue.put_nowait(payload)
        return True

    def _send_now(self, payload: bytes) -> bool:
        """Send on this thread when nothing queued must go first and the lock is free."""
        if self._queue.unfinished_tasks or not self._sending.acquire(blocking=False):
            return False
        try:
            if self._queue.unfinished_tasks:  # queued while the lock was being taken
                return False
            self.accepted += 1
            self._send(payload)
            return True
        finally:
            self._sending.release()

    @property
    def published(self) -> int:
        """Batches sent so far (the next sent batch's seq); ``accepted`` counts the batches
        queued as well, the seq the stream reaches once the queue drains."""
        return self._next_seq

    def flush(self, timeout_s: float = _CLOSE_WAIT_S) -> bool:
        """Wait (bounded) until every queued batch is sent; True when it was."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        """Send what is queued, stop the thread (bounded wait) and close the sockets."""
        with self._accepting:  # no batch queued behind the end marker
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(_CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        with self._sending:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
            self._context.term()

    # --- the socket thread -------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and dict(poller.poll(0)):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            if payload is None:
                self._queue.task_done()
                return
            with self._sending:
                self._send(payload)
            self._queue.task_done()

    def _send(self, payload: bytes) -> None:
        """One batch on the PUB socket and into the buffer; the caller holds ``_sending``."""
        seq = self._next_seq
        self._pub.send_multipart((self._topic, seq_frame(seq), payload), copy=False)
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: ignored, as vLLM does
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        with self._sending:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for seq, payload in batches:
            self._replay.send_multipart((identity, b"", self._topic, seq_frame(seq), payload), copy=False)
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))
