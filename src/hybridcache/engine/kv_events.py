"""The engine's event streams: what its cache announces to routers, after every step.

Owns: the KV publisher and the checkpoint publisher (``hybridcache.events.publisher``) and the
random ``instance_id`` that names this run of them (``describe``), the
``Announcer`` that turns the cache's changes into events, and, when the engine has host or disk
tiers, the ``TierAnnouncer`` of their contents (medium ``CPU`` / ``DISK``) with the tier events
waiting for the next batch (a tier reports from whichever thread called it: one lock). Each
engine step that changed the cache or its tiers publishes at most two batches per stream (what
its schedule evicted, before the forward runs; what the forward computed, as the step ends;
docs/events.md), built from ``CacheProtocol.take_changes`` and what the tiers reported since.
"""

from __future__ import annotations

import secrets
import threading
import time

from hybridcache.events.announcer import Announcer
from hybridcache.events.config import KVEventsConfig
from hybridcache.events.publisher import EventPublisher
from hybridcache.events.schema import KVEventBatch, StateEventBatch
from hybridcache.events.tier_announcer import TierAnnouncer, TierPublish
from hybridcache.protocol import CacheProtocol


class EngineEvents:
    def __init__(self, config: KVEventsConfig, cache: CacheProtocol, *, block_size: int, state_bytes: int | None,
                 tiers=None) -> None:
        """``tiers``: the engine's ``TierClient`` (None: it has none); their host and disk
        contents are announced too."""
        self._config = config
        self._cache = cache
        # names this run of the streams: a restarted replica's seqs start from 0 again, but may
        # pass the old ones before a router looks, so only a new id tells the runs apart
        self.instance_id = secrets.token_hex(8)
        self._block_size = block_size
        self._announcer = Announcer(block_size, state_bytes)
        self._tier_announcer = TierAnnouncer(block_size, state_bytes)
        self._tier_lock = threading.Lock()
        self._tier_events: tuple[list, list] = ([], [])
        self.kv = _publisher(config, config.endpoint, config.replay_endpoint, config.topic)
        self.state = None
        if config.state_endpoint is not None:
            try:
                self.state = _publisher(config, config.state_endpoint, config.state_replay_endpoint, config.state_topic)
            except Exception:
                self.kv.close()
                raise
        cache.record_changes()
        if tiers is not None:
            tiers.listen_publishes(self._tier_published)
            tiers.store.listen_changes(self._tier_moved)

    def _tier_published(self, seq, step: int, chain, report) -> None:
        if seq.spans_overlapping(0, step):
            return  # multimodal blocks hash their content ids, which the tiers' chunks do not carry
        namespace = seq.namespace
        publish = TierPublish(seq.tokens[:step].tolist(), namespace.adapter, namespace.cache_salt, step,
                              [chain.chunk_key(i).name for i in range(step // chain.chunk_size)], chain.checkpoint_key(step).name)
        with self._tier_lock:
            for tier in report.checkpoint_stored:
                self._queue_tier_events(self._tier_announcer.published(tier, publish))

    def _tier_moved(self, tier: str, stored: list[str], removed: list[str]) -> None:
        with self._tier_lock:
            self._queue_tier_events(self._tier_announcer.moved(tier, stored, removed))

    def _queue_tier_events(self, events: tuple[list, list]) -> None:
        self._tier_events[0].extend(events[0])
        self._tier_events[1].extend(events[1])

    def publish_changes(self) -> None:
        """Announce what the cache and its tiers changed since the last call (nothing when nothing did)."""
        kv_events, state_events = self._announcer.announce(self._cache.take_changes())
        with self._tier_lock:
            (tier_kv, tier_state), self._tier_events = self._tier_events, ([], [])
        kv_events, state_events = kv_events + tier_kv, state_events + tier_state
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
            "instance_id": self.instance_id,
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
