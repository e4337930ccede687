"""The publisher's frames, counter and replay socket, read with raw ZMQ sockets on loopback."""

from __future__ import annotations

import queue

import pytest
import zmq

from hybridcache.errors import EventStreamError
from hybridcache.events.publisher import END_SEQ, EventPublisher
from hybridcache.events.schema import BlockRemoved, KVEventBatch, decode_kv_batch
from tests.events.streams import LOOPBACK_ANY_PORT


@pytest.fixture
def publisher():
    pub = EventPublisher(LOOPBACK_ANY_PORT, LOOPBACK_ANY_PORT, "kv@pod@tiny", buffer_steps=3)
    yield pub
    pub.close()


def _raw_sub(context, endpoint):
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(endpoint)
    return sub


def _next_frames(sub, publisher, probe_until_connected=True):
    for _ in range(200):
        if probe_until_connected:
            publisher.publish(KVEventBatch(0.0, []))
        if sub.poll(25):
            return sub.recv_multipart()
    raise AssertionError("nothing arrived")


def test_frames_are_topic_seq_payload_and_seq_grows_by_one_per_batch(publisher):
    context = zmq.Context()
    sub = _raw_sub(context, publisher.endpoint)
    try:
        first = _next_frames(sub, publisher)
        assert publisher.flush()
        while sub.poll(100):
            sub.recv_multipart()  # the other probes
        publisher.publish(KVEventBatch(1.0, [BlockRemoved([5], "GPU")]))
        frames = _next_frames(sub, publisher, probe_until_connected=False)
    finally:
        sub.close()
        context.term()
    assert len(first) == 3 and first[0] == b"kv@pod@tiny" and len(first[1]) == 8
    topic, seq, payload = frames
    assert topic == b"kv@pod@tiny"
    assert int.from_bytes(seq, "big") == publisher.published - 1 > int.from_bytes(first[1], "big")
    assert decode_kv_batch(payload).events == [BlockRemoved([5], "GPU")]


def test_replay_serves_the_last_buffer_steps_batches_then_the_end_marker(publisher):
    for ts in range(5):
        publisher.publish(KVEventBatch(float(ts), []))
    assert publisher.flush()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    replies = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(2000):
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[-1] == b"":
                break
    finally:
        dealer.close()
        context.term()
    data, end = replies[:-1], replies[-1]
    assert [int.from_bytes(f[2], "big") for f in data] == [2, 3, 4]  # buffer_steps=3
    assert all(f[0] == b"" and f[1] == b"kv@pod@tiny" for f in data)
    assert [decode_kv_batch(f[3]).ts for f in data] == [2.0, 3.0, 4.0]
    assert end == [b"", b"", END_SEQ, b""]


def test_replay_from_a_later_seq_sends_only_what_follows(publisher):
    for ts in range(3):
        publisher.publish(KVEventBatch(float(ts), []))
    assert publisher.flush()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    seqs = []
    try:
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        while dealer.poll(2000):
            frames = dealer.recv_multipart()
            if frames[-1] == b"":
                break
            seqs.append(int.from_bytes(frames[2], "big"))
    finally:
        dealer.close(linger=0)
        context.term()
    assert seqs == [2]


def test_a_taken_port_and_a_closed_publisher_raise_event_stream_errors(publisher):
    with pytest.raises(EventStreamError):
        EventPublisher(publisher.endpoint)
    publisher.close()
    with pytest.raises(EventStreamError):
        publisher.publish(KVEventBatch(0.0, []))
    publisher.close()  # closing twice is harmless


def test_a_batch_is_sent_before_publish_returns(publisher):
    # A router reading a request's answer must already have the events of the step that
    # finished it: the batch is on the socket, with its seq, when publish returns.
    for expected in range(1, 4):
        assert publisher.publish(KVEventBatch(0.0, []))
        assert publisher.published == publisher.accepted == expected


class _RecordingSocket:
    """Stands in for the PUB socket: notes the publisher's ``accepted`` as each batch goes out."""

    def __init__(self, publisher):
        self._publisher, self._socket, self.seen = publisher, publisher._pub, []

    def send_multipart(self, frames, copy=True):
        self.seen.append((int.from_bytes(frames[1], "big"), self._publisher.accepted))
        return self._socket.send_multipart(frames, copy=copy)


def test_accepted_passes_a_batchs_seq_before_the_batch_is_on_the_wire(publisher):
    # ``accepted`` is the next_seq /kv_events reports from another thread; seen at or below a seq
    # a router already applied, it reads as a restart and the router forgets the index.
    recording = _RecordingSocket(publisher)
    publisher._pub = recording
    try:
        for _ in range(3):
            publisher.publish(KVEventBatch(0.0, []))
    finally:
        publisher._pub = recording._socket
    assert recording.seen and all(accepted > seq for seq, accepted in recording.seen)


def test_batches_queued_behind_a_busy_socket_keep_their_order_and_a_full_queue_drops():
    pub = EventPublisher(LOOPBACK_ANY_PORT, LOOPBACK_ANY_PORT, max_queue_size=1)
    try:
        with pub._sending:  # the socket busy on another thread: publish must queue, not wait
            accepted = [pub.publish(KVEventBatch(float(ts), [])) for ts in range(200)]
            assert pub.published == 0
        assert pub.flush()
        assert pub.publish(KVEventBatch(999.0, []))
        replayed = _replayed_timestamps(pub)
    finally:
        pub.close()
    assert accepted[0] and pub.dropped == accepted.count(False) > 0 and pub.accepted == accepted.count(True) + 1
    # the queued batches went first, in order, then the one sent at once
    assert replayed == [float(ts) for ts, ok in enumerate(accepted) if ok] + [999.0]


def _replayed_timestamps(pub) -> list[float]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        stamps = []
        while dealer.poll(5000):
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return stamps
            stamps.append(decode_kv_batch(payload).ts)
        raise AssertionError("the replay never ended")
    finally:
        dealer.close()
        context.term()


class _RecordingQueue(queue.Queue):
    """The publisher's queue, noting the publisher's ``accepted`` as each batch is offered."""

    def __init__(self, publisher, maxsize):
        super().__init__(maxsize)
        self._publisher, self.seen = publisher, []

    def put_nowait(self, item):
        self.seen.append(self._publisher.accepted)
        return super().put_nowait(item)


def test_accepted_never_names_a_seq_no_batch_will_carry():
    # ``accepted`` is the next_seq /kv_events reports: read while a dropped batch had raised it,
    # a settle waited its full timeout for a seq never published.
    pub = EventPublisher(LOOPBACK_ANY_PORT, LOOPBACK_ANY_PORT, max_queue_size=1)
    try:
        recording = pub._queue = _RecordingQueue(pub, 1)
        with pub._sending:  # the socket busy: the first batch is queued, the others dropped
            sent = [pub.publish(KVEventBatch(float(ts), [])) for ts in range(3)]
        assert pub.flush()
    finally:
        pub.close()
    assert sent == [True, False, False] and pub.dropped == 2
    assert recording.seen and max(recording.seen) <= pub.published == pub.accepted == 1
