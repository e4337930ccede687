"""The engine's event streams: what its cache announces to routers, after every step.

Owns: the KV publisher and the checkpoint publisher (``hybridcache.events.publisher``) and the
``Announcer`` that turns the cache's changes into events. Each engine step that changed the
cache publishes at most one batch per stream, built from ``CacheProtocol.take_changes``.
"""

from __future__ import annotations

import time

from hybridcache.events.announcer import Announcer
from hybridcache.events.config import KVEventsConfig
from hybridcache.events.publisher import EventPublisher
from hybridcache.events.schema import KVEventBatch, StateEventBatch
from hybridcache.protocol import CacheProtocol


class EngineEvents:
    def __init__(self, config: KVEventsConfig, cache: CacheProtocol, *, block_size: int, state_bytes: int | None) -> None:
        self._config = config
        self._cache = cache
        self._block_size = block_size
        self._announcer = Announcer(block_size, state_bytes)
        self.kv = _publisher(config, config.endpoint, config.replay_endpoint, config.topic)
        self.state = None
        if config.state_endpoint is not None:
            try:
                self.state = _publisher(config, config.state_endpoint, config.state_replay_endpoint, config.state_topic)
            except Exception:
                self.kv.close()
                raise
        cache.record_changes()

    def publish_changes(self) -> None:
        """Announce what the cache changed since the last call (nothing when nothing did)."""
        kv_events, state_events = self._announcer.announce(self._cache.take_changes())
        now, rank = time.time(), self._config.data_parallel_rank
        if kv_events:
            self.kv.publish(KVEventBatch(now, kv_events, rank))
        if state_events and self.state is not None:
            self.state.publish(StateEventBatch(now, state_events, rank))

    def describe(self) -> dict:
        """The streams, for a server's ``GET /kv_events``."""
        streams = {"kv": self.kv, "state": self.state}
        return {
            "block_size": self._block_size,
            "data_parallel_rank": self._config.data_parallel_rank,
            **{
                name: None if pub is None else {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": pub.topic}
                for name, pub in streams.items()
            },
        }

    def next_seqs(self) -> dict[str, int | None]:
        """Each stream's seq once what is queued is sent: a subscriber that has applied seq
        ``next_seqs()[name] - 1`` knows every change made so far (None: no such stream)."""
        return {name: None if pub is None else pub.accepted for name, pub in (("kv", self.kv), ("state", self.state))}

    def flush(self) -> None:
        for publisher in (self.kv, self.state):
            if publisher is not None:
                publisher.flush()

    def close(self) -> None:
        for publisher in (self.kv, self.state):
            if publisher is not None:
                publisher.close()


def _publisher(config: KVEventsConfig, endpoint: str, replay: str | None, topic: str) -> EventPublisher:
    return EventPublisher(
        endpoint, replay, topic, binds=config.binds(endpoint), buffer_steps=config.buffer_steps, hwm=config.hwm,
        max_queue_size=config.max_queue_size,
    )
