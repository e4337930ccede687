"""A seq the replica announced but whose batch never arrived live (a lost last message: no later
batch reveals the gap) is fetched from the replay socket before the router relies on it: at an
answer's settle, and at the next route after a health check read the replica's next_seq. Real
engines publishing on loopback, the checkpoint stream through a forwarder that drops batches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hybridcache.engine import Request
from hybridcache.router.discovery import Continuity, next_seqs_from
from hybridcache.router.feed import ReplicaFeed, StreamInfo
from hybridcache.router.fleet import Fleet
from hybridcache.router.replica_index import ReplicaIndex
from hybridcache.router.request_key import RequestKey
from hybridcache.sequence import Sequence
from tests.router.replicas import BLOCK, LossyForwarder, engine, streams, sync


@pytest.fixture
def lossy_replica():
    """(engine, fleet, its one replica, the switch that makes the checkpoint stream drop every batch)."""
    built = engine()
    losing = threading.Event()
    forwarder = LossyForwarder(built.events.state.endpoint, drop=lambda seq: losing.is_set())
    kv, state = streams(built)
    feed = ReplicaFeed(ReplicaIndex(BLOCK), kv, StreamInfo(forwarder.endpoint, state.replay_endpoint, state.topic),
                       replay_timeout_s=10.0)
    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    replica.feed, replica.index, replica.healthy = feed, feed.index, True
    try:
        yield built, fleet, replica, losing
    finally:
        feed.close()
        forwarder.close()
        built.close()


def _turns(built, losing: threading.Event) -> tuple[list[int], list[int]]:
    """A warm-up request applied in full, then one whose checkpoint batches are all lost live;
    returns that request's prompt and its next turn's."""
    rng = np.random.default_rng(11)
    vocab = built.model.layout.vocab_size
    built.generate([Request(rng.integers(0, vocab, 30), max_new_tokens=2)])
    losing.set()
    prompt = rng.integers(0, vocab, 45)
    result = built.generate([Request(prompt, max_new_tokens=4)])[0]
    built.events.flush()
    follow_up = np.concatenate([prompt, result.tokens, rng.integers(0, vocab, 7)])
    return prompt.tolist(), follow_up.tolist()


def _restorable_now(built, prompt: list[int]) -> int:
    return built.prefix_cache.cached_prefix(Sequence(np.asarray(prompt)))[0]


def test_settle_fetches_a_lost_last_batch_from_replay(lossy_replica):
    built, fleet, replica, losing = lossy_replica
    sync(replica.feed, built)
    _, follow_up = _turns(built, losing)
    announced = next_seqs_from(built.events.next_seqs())
    assert fleet.settle(replica, expected=announced)  # before: waited 0.2 s for a batch that never came
    routed = fleet.route(RequestKey(follow_up), len(follow_up))
    assert routed is not None and routed[1].predicted_tokens == _restorable_now(built, follow_up) > 0
    assert replica.catch_ups == 1


def test_a_route_fetches_what_the_last_health_check_read_was_published(lossy_replica, monkeypatch):
    import hybridcache.router.fleet as fleet_module

    built, fleet, replica, losing = lossy_replica
    sync(replica.feed, built)
    _, follow_up = _turns(built, losing)
    monkeypatch.setattr(fleet_module, "read_continuity",
                        lambda url, timeout: Continuity(None, next_seqs_from(built.events.next_seqs())))
    fleet._check_continuity(replica)  # the replica's /kv_events: later seqs than the feed applied, same run
    assert replica.feed is not None
    routed = fleet.route(RequestKey(follow_up), len(follow_up))
    assert routed is not None and routed[1].predicted_tokens == _restorable_now(built, follow_up) > 0
    assert replica.catch_ups == 1
    fleet.route(RequestKey(follow_up), len(follow_up))
    assert replica.catch_ups == 1  # asked once per announcement, not at every route
