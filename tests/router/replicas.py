"""In-process replicas for the router tests: engines publishing on loopback, feeds reading
them, a lossy forwarder, and bounded waits."""

from __future__ import annotations

import threading
import time

import numpy as np
import zmq

from hybridcache.engine import Engine, EngineConfig
from hybridcache.events.config import KVEventsConfig
from hybridcache.router.feed import ReplicaFeed, StreamInfo
from hybridcache.router.replica_index import ReplicaIndex

LOOPBACK = "tcp://127.0.0.1:*"
BLOCK = 8


def engine(kv_endpoint: str = LOOPBACK, kv_replay: str = LOOPBACK, state_endpoint: str = LOOPBACK,
           state_replay: str = LOOPBACK, **overrides) -> Engine:
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=kv_endpoint, replay_endpoint=kv_replay, topic="kv@r@tiny",
        state_endpoint=state_endpoint, state_replay_endpoint=state_replay, state_topic="hcstate@r@tiny",
        bind=True,
    )
    base = dict(block_size=BLOCK, num_kv_blocks=40, num_state_slots=6, checkpoint_budget=3, max_batch_tokens=64,
                max_running=4, prefill_chunk=32, kv_events=events)
    base.update(overrides)
    return Engine(EngineConfig(**base))


def streams(built: Engine) -> tuple[StreamInfo, StreamInfo]:
    kv, state = built.events.kv, built.events.state
    return (StreamInfo(kv.endpoint, kv.replay_endpoint, "kv@"), StreamInfo(state.endpoint, state.replay_endpoint, "hcstate@"))


def feed_for(built: Engine, kv: StreamInfo | None = None) -> ReplicaFeed:
    kv_info, state_info = streams(built)
    feed = ReplicaFeed(ReplicaIndex(BLOCK), kv or kv_info, state_info, replay_timeout_s=10.0)
    return feed


def sync(feed: ReplicaFeed, built: Engine, timeout_s: float = 60.0) -> None:
    """Poll ``feed`` until it applied every batch ``built`` published (bounded). A lost last
    message reveals no gap, so a feed that stalls asks the replay sockets, as the router's
    health loop does once per interval."""
    built.events.flush()
    wanted = (built.events.kv.published - 1, built.events.state.published - 1)
    deadline = time.monotonic() + timeout_s
    polls = 0
    while time.monotonic() < deadline:
        feed.poll(20)
        polls += 1
        kv, state = feed.last_seqs
        if (-1 if kv is None else kv, -1 if state is None else state) == wanted:
            return
        if feed.awaiting_replay or polls % 10 == 0:
            feed.catch_up()
    raise AssertionError(f"the feed reached {feed.last_seqs}, the replica published up to {wanted}")


def conversation_prompts(rng, vocab: int, count: int) -> list[np.ndarray]:
    systems = [rng.integers(0, vocab, 19) for _ in range(2)]
    return [np.concatenate([systems[i % 2], rng.integers(0, vocab, int(rng.integers(2, 25)))]) for i in range(count)]


class LossyForwarder:
    """A PUB socket on loopback re-publishing another PUB's messages, dropping those whose
    seq ``drop(seq)`` selects: an events socket that loses messages. Stopped by ``close``."""

    def __init__(self, upstream: str, drop) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(LOOPBACK)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._drop = drop
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(20):
                frames = self._sub.recv_multipart()
                if self._drop(int.from_bytes(frames[1], "big")):
                    self.dropped += 1
                    continue
                self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close()
        self._pub.close()
        self._context.term()
