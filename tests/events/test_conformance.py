"""A consumer built from the published schema indexes an engine's KV stream exactly, and never
sees a checkpoint event, even subscribed to every topic of the KV socket (as Dynamo's relay is)."""

from __future__ import annotations

import numpy as np
import zmq

from hybridcache.engine import Engine, EngineConfig, Request
from hybridcache.events.config import KVEventsConfig
from hybridcache.events.hashing import chain_hashes
from hybridcache.sequence import Sequence
from tests.events.consumer import ConformanceConsumer

LOOPBACK = "tcp://127.0.0.1:*"


def _engine(**overrides) -> Engine:
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=LOOPBACK, replay_endpoint=LOOPBACK, topic="kv@pod@tiny",
        state_endpoint=LOOPBACK, state_replay_endpoint=LOOPBACK, state_topic="hcstate@pod@tiny",
    )
    base = dict(block_size=8, num_kv_blocks=48, num_state_slots=8, checkpoint_budget=4, max_batch_tokens=64,
                max_running=4, prefill_chunk=32, kv_events=events)
    base.update(overrides)
    return Engine(EngineConfig(**base))


def _replay_all(endpoint: str) -> list[bytes]:
    """Every payload the replay socket holds, read with a raw DEALER (bounded wait)."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    payloads = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if frames[-1] == b"":
                break
            assert len(frames) == 4 and frames[1] == b"kv@pod@tiny"
            payloads.append(frames[3])
    finally:
        dealer.close()
        context.term()
    return payloads


def _workload(rng, vocab: int):
    systems = [rng.integers(0, vocab, 20) for _ in range(3)]
    prompts = []
    for turn in range(12):
        base = systems[turn % 3]
        prompts.append(np.concatenate([base, rng.integers(0, vocab, int(rng.integers(3, 30)))]))
    return prompts


def test_consumer_indexes_exactly_what_the_engine_caches_and_no_checkpoint_event():
    engine = _engine()
    rng = np.random.default_rng(3)
    vocab = engine.model.layout.vocab_size
    try:
        prompts = _workload(rng, vocab)
        for salt in (None, "tenant"):
            for start in range(0, len(prompts), 3):
                results = engine.generate([Request(p, max_new_tokens=5, cache_salt=salt) for p in prompts[start : start + 3]])
                prompts.extend(np.concatenate([p, r.tokens]) for p, r in zip(prompts[start : start + 3], results))
        engine.check_invariants()
        assert engine.stats()["evicted_blocks"] > 0  # removals were exercised
        assert engine.events.kv.flush()
        consumer = ConformanceConsumer()
        for payload in _replay_all(engine.events.kv.replay_endpoint):
            consumer.apply_payload(payload)
        assert consumer.dropped_batches == 0 and consumer.types_seen <= {"BlockStored", "BlockRemoved"}
        checked = 0
        for prompt in prompts:
            for salt in (None, "tenant"):
                seq = Sequence(prompt, cache_salt=salt)
                _, kv_tokens = engine.prefix_cache.cached_prefix(seq)
                chain = chain_hashes(prompt[: seq.num_valid].tolist(), 8, cache_salt=salt)
                assert consumer.matched_blocks(chain) * 8 == kv_tokens
                checked += kv_tokens > 0
        assert checked > 10
    finally:
        engine.close()
