"""A replica's streams are input the router does not control: any batch that decodes, however
wrong its values (unknown parents, removals of what was never stored, block sizes and positions
that disagree with the router's, huge or negative ids, tails longer than a block), only changes
what the index believes; applying it and answering a request never raise, and the answers stay
within the request."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.events.schema import (
    AllBlocksCleared,
    AllCheckpointsCleared,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
    KVCacheEvent,
    KVEventBatch,
    StateEvent,
    StateEventBatch,
    decode_kv_batch,
    decode_state_batch,
    encode_batch,
)
from hybridcache.router.replica_index import ReplicaIndex
from hybridcache.router.request_key import RequestKey

BLOCK = 2
# Small values collide with the requests' tokens; extreme ones test the bounds.
INTS = st.integers(-3, 12) | st.integers(-(2**63), 2**64 - 1)
LABEL = st.none() | st.sampled_from(["GPU", "CPU", "DISK", "", "lora"]) | st.text(max_size=4)
EXTRA_KEYS = st.none() | st.lists(
    st.none() | st.lists(st.integers(-2, 2) | st.text(max_size=3) | st.none(), max_size=3), max_size=4
)
REQUESTS = st.lists(
    st.builds(
        RequestKey, st.lists(st.integers(0, 12), max_size=12), st.none() | st.sampled_from(["lora", ""]),
        st.none() | st.sampled_from(["salt", ""]),
    ),
    min_size=1, max_size=4,
)


@st.composite
def about(draw, requests: list[RequestKey]) -> tuple:
    """One request's facts as an event would state them, each perhaps replaced by a value no
    replica would send: (block hashes from one depth, the parent before them, an anchor, the
    tokens from that anchor, a position near the request's end, its LoRA name)."""
    key = draw(st.sampled_from(requests))
    chain, tokens = key.chain(BLOCK), key.token_ids
    depth = draw(st.integers(0, len(chain)))
    position = draw(st.integers(depth * BLOCK - 1, len(tokens) + 2) | INTS)
    return (
        draw(st.just(chain[depth : depth + 2]) | st.lists(INTS, max_size=4)),
        draw(st.just(chain[depth - 1] if depth else None) | st.none() | INTS),
        draw(st.just(chain[depth - 1] if depth else None) | st.none() | INTS),
        draw(st.just(tokens[depth * BLOCK : max(position, 0)]) | st.lists(INTS, max_size=9)),
        position,
        draw(st.just(key.lora_name) | LABEL),
    )


@st.composite
def hostile_batches(draw, requests: list[RequestKey]) -> list:
    def event(facts: tuple) -> object:
        hashes, parent, anchor, tokens, position, lora = facts
        kind = draw(st.sampled_from(["stored", "removed", "cleared", "checkpoint", "dropped", "all dropped"]))
        if kind == "stored":
            return BlockStored(hashes, parent, tokens, draw(st.just(BLOCK) | INTS), draw(st.none() | INTS),
                               draw(LABEL), lora, draw(EXTRA_KEYS))
        if kind == "removed":
            return BlockRemoved(hashes, draw(LABEL))
        if kind == "checkpoint":
            return CheckpointStored(draw(st.integers(0, 5) | INTS), position, anchor, tokens,
                                    draw(st.just(BLOCK) | INTS), draw(LABEL), lora, draw(EXTRA_KEYS))
        if kind == "dropped":
            return CheckpointRemoved(draw(st.lists(st.integers(0, 5) | INTS, max_size=3)), draw(LABEL))
        return AllBlocksCleared() if kind == "cleared" else AllCheckpointsCleared()

    events = [event(draw(about(requests))) for _ in range(draw(st.integers(0, 24)))]
    batches, at = [], 0
    while at < len(events):  # each stream keeps its own events in order, batched as they come
        size = draw(st.integers(1, 4))
        group = events[at : at + size]
        batches += [KVEventBatch(0.0, [e for e in group if isinstance(e, KVCacheEvent)]),
                    StateEventBatch(0.0, [e for e in group if isinstance(e, StateEvent)])]
        at += size
    return batches


@settings(max_examples=200, deadline=None)
@given(st.data(), REQUESTS)
def test_any_decodable_batch_only_changes_what_the_index_believes(data, requests):
    index = ReplicaIndex(BLOCK)
    for batch in data.draw(hostile_batches(requests)):
        payload = encode_batch(batch)  # what arrives is bytes: decode as the router's feed does
        if isinstance(batch, KVEventBatch):
            index.apply_kv(decode_kv_batch(payload).events)
        else:
            index.apply_state(decode_state_batch(payload).events)
        index.check_invariants()
        for key in requests:
            depths = index.depths(key)
            prompt = len(key.token_ids)
            assert 0 <= depths.kv_tokens <= prompt // BLOCK * BLOCK
            assert 0 <= depths.restorable <= max(prompt - 1, 0)
