"""The subscriber's ordering rules: duplicates skipped, gaps filled by replay, resets seen."""

from __future__ import annotations

import pytest
import zmq

from hybridcache.events.publisher import EventPublisher, seq_frame
from hybridcache.events.schema import KVEventBatch, decode_kv_batch, encode_batch
from hybridcache.events.subscriber import RESET, StreamSubscriber
from tests.events.streams import LOOPBACK_ANY_PORT, receive_until, wait_connected


@pytest.fixture
def stream():
    pub = EventPublisher(LOOPBACK_ANY_PORT, LOOPBACK_ANY_PORT, "kv@p@m")
    sub = StreamSubscriber(pub.endpoint, pub.replay_endpoint, "kv@")
    wait_connected(pub, sub)
    yield pub, sub
    sub.close()
    pub.close()


def _ts(items):
    return [None if item is RESET else decode_kv_batch(item.payload).ts for item in items]


def test_batches_arrive_once_in_order(stream):
    pub, sub = stream
    for ts in (1.0, 2.0, 3.0):
        pub.publish(KVEventBatch(ts, []))
    items = receive_until(sub, 3)
    assert _ts(items) == [1.0, 2.0, 3.0]
    assert [item.seq for item in items] == [sub.last_delivered - 2, sub.last_delivered - 1, sub.last_delivered]


def test_a_gap_is_filled_from_the_replay_socket_before_the_batch_that_revealed_it(stream):
    pub, sub = stream
    assert pub.flush()
    before, replays = sub.last_delivered, sub.replays
    # Batches the subscriber never sees live: written into the buffer directly, as a dropped
    # message leaves them (the PUB socket's loss, not the publisher's).
    pub._buffer.extend((before + 1 + i, encode_batch(KVEventBatch(10.0 + i, []))) for i in range(2))
    pub._next_seq = before + 3
    pub.publish(KVEventBatch(12.0, []))
    items = receive_until(sub, 3)
    assert _ts(items) == [10.0, 11.0, 12.0]
    assert sub.replays == replays + 1 and sub.failed_replays == 0


def test_a_seq_going_backwards_is_a_reset_followed_by_the_new_publishers_buffer(stream):
    pub, sub = stream
    pub.publish(KVEventBatch(1.0, []))
    receive_until(sub, 1)
    assert pub.flush()
    pub._next_seq = 0  # a restarted publisher counts from 0 again
    pub._buffer.clear()
    pub.publish(KVEventBatch(2.0, []))
    items = receive_until(sub, 2)
    assert _ts(items) == [None, 2.0]
    assert sub.resets == 1 and sub.last_delivered == 0


def test_duplicates_are_skipped():
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(LOOPBACK_ANY_PORT)
    sub = StreamSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        payload = encode_batch(KVEventBatch(1.0, []))
        for _ in range(200):
            pub.send_multipart([b"", seq_frame(0), payload])
            if sub.receive(20):
                break
        for seq in (0, 0, 1, 1):
            pub.send_multipart([b"", seq_frame(seq), payload])
        items = receive_until(sub, 1, timeout_s=1.0)
    finally:
        sub.close()
        pub.close()
        context.term()
    assert [item.seq for item in items] == [1]


def test_a_replay_socket_that_never_answers_ends_in_a_reset_within_its_timeout():
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(LOOPBACK_ANY_PORT)
    silent = context.socket(zmq.ROUTER)  # bound, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(LOOPBACK_ANY_PORT)
    sub = StreamSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT), silent.getsockopt_string(zmq.LAST_ENDPOINT), replay_timeout_s=0.3)
    try:
        payload = encode_batch(KVEventBatch(1.0, []))
        items = []
        for _ in range(200):
            pub.send_multipart([b"", seq_frame(5), payload])  # joins mid-stream: replay from 0
            items = sub.receive(20)
            if items:
                break
    finally:
        sub.close()
        pub.close()
        silent.close()
        context.term()
    assert items[0] is RESET and items[1].seq == 5
    assert sub.failed_replays == 1


def test_a_restart_known_from_the_other_stream_rebuilds_from_the_new_buffer(stream):
    pub, sub = stream
    for ts in (1.0, 2.0, 3.0):
        pub.publish(KVEventBatch(ts, []))
    receive_until(sub, 3)
    assert pub.flush()
    # The restarted publisher's batches, all sent before the subscriber reconnected: only in
    # its buffer, below the old seqs, so neither a live batch nor a catch-up would show them.
    pub._buffer.clear()
    pub._buffer.extend((i, encode_batch(KVEventBatch(10.0 + i, []))) for i in range(2))
    pub._next_seq = 2
    assert sub.catch_up() == []
    items = sub.restart()
    assert _ts(items) == [None, 10.0, 11.0]
    assert sub.resets == 1 and sub.last_delivered == 1


def test_a_catch_up_fetched_apart_delivers_only_what_was_not_delivered_since(stream):
    pub, sub = stream
    for ts in (1.0, 2.0):
        pub.publish(KVEventBatch(ts, []))
    assert pub.flush()
    fetched = sub.request_catch_up()  # another thread's ask, while this one keeps receiving
    pub.publish(KVEventBatch(3.0, []))
    live = receive_until(sub, 3)
    assert _ts(live) == [1.0, 2.0, 3.0]
    assert sub.deliver_catch_up(fetched) == []  # all of it was delivered live meanwhile


def test_a_catch_up_fetched_before_a_restart_is_stale(stream):
    pub, sub = stream
    pub.publish(KVEventBatch(1.0, []))
    receive_until(sub, 1)
    fetched = sub.request_catch_up()
    sub.restart()  # the publisher restarted: what was fetched is of its old run
    assert sub.deliver_catch_up(fetched) == []


def test_closing_while_a_catch_up_is_asked_ends_the_context_when_that_ask_ends():
    import threading

    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # bound, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(LOOPBACK_ANY_PORT)
    sub = StreamSubscriber("tcp://127.0.0.1:9", silent.getsockopt_string(zmq.LAST_ENDPOINT), replay_timeout_s=0.3)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(sub.request_catch_up()))
    try:
        asking.start()
        while not silent.poll(10):
            pass  # the ask is out
        sub.close()  # returns at once: the ask still holds its socket
        asking.join(30)
    finally:
        silent.close()
        context.term()
    assert answers[0].replies is None and sub._context.closed
    assert sub.request_catch_up() is None  # closed: nothing more is asked


def _hostile_replay(answer: list[bytes] | None):
    """A PUB socket and a ROUTER answering every replay request with ``answer`` after the
    requester's identity (None: never answering)."""
    import threading

    context = zmq.Context()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    for socket in (pub, replay):
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(LOOPBACK_ANY_PORT)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if replay.poll(20) and answer is not None:
                replay.send_multipart([replay.recv_multipart()[0], *answer])
            elif answer is None and replay.poll(0):
                replay.recv_multipart()

    server = threading.Thread(target=serve)
    server.start()
    return context, pub, replay, stop, server


def _until_held(pub, sub) -> None:
    """Publish seq 5 (a gap: a subscriber joining mid-stream) until ``sub`` holds it."""
    payload = encode_batch(KVEventBatch(1.0, []))
    for _ in range(200):
        pub.send_multipart([b"", seq_frame(5), payload])
        assert sub.receive_ready(20) == []  # never waits on the replay socket, delivers nothing past the gap
        if sub.awaiting_replay:
            return
    raise AssertionError("the subscriber never saw the gap")


@pytest.mark.parametrize("answer", [[b"", b"x"], [b"x"], [b"", b"t", b"short", b"p"], [b"", b"t", seq_frame(0), b"p", b"extra"]],
                         ids=["one frame", "no delimiter", "seq not 8 bytes", "five frames"])
def test_a_replay_answer_that_is_not_one_resets_the_stream(answer):
    context, pub, replay, stop, server = _hostile_replay(answer)
    sub = StreamSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT), replay.getsockopt_string(zmq.LAST_ENDPOINT), replay_timeout_s=30)
    try:
        _until_held(pub, sub)
        items = sub.receive(0)
    finally:
        stop.set()
        server.join(30)
        sub.close()
        pub.close()
        replay.close()
        context.term()
    assert items[0] is RESET and items[1].seq == 5 and len(items) == 2
    assert sub.failed_replays == 1 and not sub.awaiting_replay


def test_receive_ready_holds_a_gap_until_a_catch_up_fetched_apart_fills_it(stream):
    pub, sub = stream
    assert pub.flush()
    before, replays = sub.last_delivered, sub.replays
    pub._buffer.extend((before + 1 + i, encode_batch(KVEventBatch(10.0 + i, []))) for i in range(2))
    pub._next_seq = before + 3
    pub.publish(KVEventBatch(12.0, []))
    for _ in range(250):
        assert sub.receive_ready(20) == []
        if sub.awaiting_replay:
            break
    assert sub.awaiting_replay and sub.replays == replays  # the gap waits; nothing asked the replay socket
    fetched = sub.request_catch_up()
    assert _ts(sub.deliver_catch_up(fetched)) == [10.0, 11.0, 12.0]
    assert not sub.awaiting_replay and sub.last_delivered == before + 3


def test_receive_ready_reads_at_most_max_batches_messages(stream):
    pub, sub = stream
    for ts in range(1, 6):
        pub.publish(KVEventBatch(float(ts), []))
    assert pub.flush()
    first = []
    while not first:
        first = sub.receive_ready(50, max_batches=2)
    assert len(first) <= 2
    assert _ts(first + receive_until(sub, 5 - len(first))) == [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("replay_endpoint", ["bogus://nowhere", "tcp://", 5])
def test_an_endpoint_zmq_cannot_use_is_an_event_stream_error_at_once(replay_endpoint):
    from hybridcache.errors import EventStreamError

    with pytest.raises(EventStreamError):
        StreamSubscriber("tcp://127.0.0.1:9", replay_endpoint)
    with pytest.raises(EventStreamError):
        StreamSubscriber("bogus://nowhere")
