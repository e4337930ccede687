"""The router's per-replica index, built from real streams on loopback, answers what each
replica's cache answers, through gaps, restarts and a router restart."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.engine import Request
from hybridcache.router.policy import choose
from hybridcache.router.request_key import RequestKey
from hybridcache.sequence import Sequence
from tests.router.replicas import LossyForwarder, conversation_prompts, engine, feed_for, streams, sync


def _cached(built, prompt) -> tuple[int, int]:
    return built.prefix_cache.cached_prefix(Sequence(prompt))


def _assert_index_matches(feed, built, prompts) -> int:
    """The index's (restorable, KV) equals the cache's for every prompt; returns the hits seen."""
    hits = 0
    for prompt in prompts:
        depths = feed.index.depths(RequestKey(prompt.tolist()))
        assert (depths.restorable, depths.kv_tokens) == _cached(built, prompt)
        hits += depths.restorable > 0
    feed.index.check_invariants()
    return hits


def _serve_turns(built, prompts, turns: int = 2) -> list[np.ndarray]:
    """Multi-turn: each turn extends the previous prompt by its output and a new message."""
    rng = np.random.default_rng(5)
    seen = list(prompts)
    current = list(prompts)
    for _ in range(turns):
        results = built.generate([Request(p, max_new_tokens=4) for p in current])
        current = [np.concatenate([p, r.tokens, rng.integers(0, 100, 5)]) for p, r in zip(current, results)]
        seen.extend(current)
    return seen


@pytest.fixture
def replica():
    built = engine()
    feed = feed_for(built)
    yield built, feed
    feed.close()
    built.close()


def test_index_equals_the_replicas_cached_prefix_under_eviction(replica):
    built, feed = replica
    prompts = conversation_prompts(np.random.default_rng(0), built.model.layout.vocab_size, 16)
    seen = _serve_turns(built, prompts, turns=3)
    sync(feed, built)
    assert built.stats()["evicted_blocks"] > 0
    assert _assert_index_matches(feed, built, seen) > 0


def test_predicted_depth_equals_reported_cached_tokens(replica):
    built, feed = replica
    rng = np.random.default_rng(1)
    prompts = conversation_prompts(rng, built.model.layout.vocab_size, 6)
    current, checked, equal = prompts, 0, 0
    for _ in range(3):
        results, predicted = [], []
        for prompt in current:  # one request at a time, predicted with everything before it announced
            sync(feed, built)
            predicted.append(feed.index.depths(RequestKey(prompt.tolist())).restorable)
            results.append(built.generate([Request(prompt, max_new_tokens=3)])[0])
        checked += len(results)
        equal += sum(r.cached_tokens == p for r, p in zip(results, predicted))
        current = [np.concatenate([p, r.tokens, rng.integers(0, 100, 4)]) for p, r in zip(current, results)]
    assert equal == checked


def test_a_gap_on_the_kv_socket_is_filled_from_replay():
    built = engine()
    forwarder = LossyForwarder(built.events.kv.endpoint, drop=lambda seq: seq % 3 == 1)
    kv, _ = streams(built)
    feed = feed_for(built, kv=type(kv)(forwarder.endpoint, kv.replay_endpoint, kv.topic))
    try:
        prompts = conversation_prompts(np.random.default_rng(2), built.model.layout.vocab_size, 10)
        seen = []
        for prompt in prompts:  # one step per request: many batches, every third one lost
            seen.extend(_serve_turns(built, [prompt], turns=1))
        sync(feed, built)
        assert forwarder.dropped > 0 and feed._kv.replays > 0
        _assert_index_matches(feed, built, seen)
    finally:
        feed.close()
        forwarder.close()
        built.close()


def test_a_replica_restarted_empty_is_cleared_then_rebuilt(replica):
    built, feed = replica
    prompts = conversation_prompts(np.random.default_rng(3), built.model.layout.vocab_size, 6)
    _serve_turns(built, prompts, turns=1)
    sync(feed, built)
    assert feed.index.depths(RequestKey(prompts[0].tolist())).kv_tokens > 0
    endpoints = built.events.describe()
    built.close()
    restarted = engine(endpoints["kv"]["endpoint"], endpoints["kv"]["replay_endpoint"],
                       endpoints["state"]["endpoint"], endpoints["state"]["replay_endpoint"])
    try:
        fresh = conversation_prompts(np.random.default_rng(4), restarted.model.layout.vocab_size, 48)
        seen = []
        for prompt in fresh:  # until a live batch reaches the reconnected subscriber (bounded)
            seen.extend(_serve_turns(restarted, [prompt], turns=1))
            feed.poll(100)
            if feed.resets:
                break
        sync(feed, restarted)
        assert feed.resets >= 1
        _assert_index_matches(feed, restarted, seen + prompts)  # the old prompts: gone from both
    finally:
        restarted.close()


def test_a_restarted_router_rebuilds_from_replay(replica):
    built, feed = replica
    seen = _serve_turns(built, conversation_prompts(np.random.default_rng(6), built.model.layout.vocab_size, 5))
    sync(feed, built)
    second = feed_for(built)
    try:
        second.catch_up()
        _assert_index_matches(second, built, seen)
    finally:
        second.close()


def test_routing_sends_a_conversation_where_its_state_is():
    first, second = engine(), engine()
    feeds = [feed_for(first), feed_for(second)]
    try:
        prompt = np.arange(1, 40)
        result = first.generate([Request(prompt, max_new_tokens=4)])[0]
        for feed, built in zip(feeds, (first, second)):
            sync(feed, built)
        follow_up = np.concatenate([prompt, result.tokens, np.arange(50, 60)])
        key = RequestKey(follow_up.tolist())
        depths = [feed.index.depths(key) for feed in feeds]
        for number in range(4):
            decision = choose("restorable", len(follow_up), depths, [0, 0], number)
            assert decision.index == 0 and decision.predicted_tokens == depths[0].restorable > 0
        assert first.generate([Request(follow_up, max_new_tokens=1)])[0].cached_tokens == depths[0].restorable
    finally:
        for feed in feeds:
            feed.close()
        first.close()
        second.close()
