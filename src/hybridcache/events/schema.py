"""The wire schema of both event streams, as msgspec structs (nothing mutable).

The KV stream is byte-compatible with vLLM's (``vllm/distributed/kv_events.py`` after the
switch to map-encoded events): an envelope encoded as the positional array ``[ts, events,
data_parallel_rank]`` whose events are maps tagged ``"type"`` with the class name, fields in
vLLM's declaration order, fields equal to their default omitted and required fields always
present (nil included). Hashes are unsigned 64-bit ints. The checkpoint stream uses the same
envelope with its own three event types; it travels on its own sockets, because KV consumers
(llm-d, Dynamo) drop a whole batch that carries an unknown event type. docs/events.md is the
reference.
"""

from __future__ import annotations

from typing import Union

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
FULL_ATTENTION = "full_attention"

ExtraKeys = Union[list[Union[list, None]], None]  # one entry per block (msgpack has no tuple)


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the KV-stream events (tag = class name, under ``"type"``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: ExtraKeys = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class StateEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the checkpoint-stream events."""


class CheckpointStored(StateEvent):
    """A recurrent-state checkpoint after ``position`` tokens: the prefix up to the last full
    block at or before ``position`` is the chain ending in ``anchor_block_hash`` (as announced
    on the KV stream; None when ``position < block_size``), ``tail_token_ids`` the tokens from
    there to ``position``."""

    checkpoint_id: int
    position: int
    anchor_block_hash: int | None
    tail_token_ids: list[int]
    block_size: int
    medium: str | None
    lora_name: str | None
    extra_keys: ExtraKeys = None
    state_bytes: int | None = None


class CheckpointRemoved(StateEvent):
    checkpoint_ids: list[int]
    medium: str | None


class AllCheckpointsCleared(StateEvent):
    pass


AnyKVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
AnyStateEvent = Union[CheckpointStored, CheckpointRemoved, AllCheckpointsCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[AnyKVEvent]
    data_parallel_rank: int | None = None


class StateEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[AnyStateEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_KV_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_STATE_DECODER = msgspec.msgpack.Decoder(StateEventBatch)


def encode_batch(batch: KVEventBatch | StateEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_kv_batch(payload: bytes) -> KVEventBatch:
    """Decode a KV-stream payload (unknown fields are ignored; raises ``msgspec.DecodeError``
    or ``msgspec.ValidationError`` on anything else)."""
    return _KV_DECODER.decode(payload)


def decode_state_batch(payload: bytes) -> StateEventBatch:
    return _STATE_DECODER.decode(payload)
