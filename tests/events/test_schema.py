"""The KV stream's bytes decode as vLLM's consumers decode them, field for field."""

from __future__ import annotations

import msgspec

from hybridcache.events.hashing import block_hash, chain_hashes
from hybridcache.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CheckpointStored,
    KVEventBatch,
    StateEventBatch,
    decode_kv_batch,
    decode_state_batch,
    encode_batch,
)

BIG_HASH = 15760518052499183552  # above 2**63: must travel as msgpack uint64


def _stored(**changes) -> BlockStored:
    fields = dict(
        block_hashes=[BIG_HASH], parent_block_hash=None, token_ids=list(range(16)), block_size=16, lora_id=None,
        medium="GPU", lora_name=None, extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention",
    )
    fields.update(changes)
    return BlockStored(**fields)


def test_envelope_is_a_three_element_array_and_events_are_maps_in_vllm_field_order():
    payload = encode_batch(KVEventBatch(1789095808.83, [_stored()], 0))
    decoded = msgspec.msgpack.decode(payload)
    assert decoded == [
        1789095808.83,
        [{"type": "BlockStored", "block_hashes": [BIG_HASH], "parent_block_hash": None, "token_ids": list(range(16)),
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None], "group_idx": 0,
          "kv_cache_spec_kind": "full_attention"}],
        0,
    ]
    assert list(decoded[1][0]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]


def test_bytes_follow_the_msgpack_layout_vllm_consumers_parse():
    payload = encode_batch(KVEventBatch(0.5, [BlockRemoved([BIG_HASH], "GPU")]))
    assert payload[:10] == b"\x93\xcb" + bytes.fromhex("3fe0000000000000")  # a 3-array, ts as float64
    assert payload[10:11] == b"\x91"  # one event
    body = msgspec.msgpack.decode(payload[11:-1])
    assert body == {"type": "BlockRemoved", "block_hashes": [BIG_HASH], "medium": "GPU"}
    assert b"\xcf" + BIG_HASH.to_bytes(8, "big") in payload  # the hash as uint64
    assert payload[-1:] == b"\xc0"  # data_parallel_rank present as nil


def test_required_fields_stay_even_when_nil_and_defaults_are_omitted():
    decoded = msgspec.msgpack.decode(encode_batch(KVEventBatch(0.0, [_stored(extra_keys=None, group_idx=None, kv_cache_spec_kind=None)])))
    event = decoded[1][0]
    assert {"parent_block_hash", "lora_id", "medium", "lora_name"} <= set(event)
    assert "extra_keys" not in event and "group_idx" not in event and "kv_cache_spec_sliding_window" not in event


def test_decoder_ignores_unknown_fields_and_reads_maps_in_any_order():
    raw = [0.0, [{"medium": "CPU", "locality": "LOCAL", "type": "BlockRemoved", "block_hashes": [1], "ownership": "x"},
                 {"type": "AllBlocksCleared"}], None]
    batch = decode_kv_batch(msgspec.msgpack.encode(raw))
    assert batch.events == [BlockRemoved([1], "CPU"), AllBlocksCleared()]


def test_checkpoint_events_round_trip_on_their_own_envelope():
    event = CheckpointStored(7, 40, BIG_HASH, [1, 2, 3, 4, 5, 6, 7, 8], 16, "GPU", None, None, 4096)
    batch = decode_state_batch(encode_batch(StateEventBatch(2.0, [event], 0)))
    assert batch.events == [event]
    decoded = msgspec.msgpack.decode(encode_batch(StateEventBatch(2.0, [event])))
    assert decoded[1][0]["type"] == "CheckpointStored" and "extra_keys" not in decoded[1][0]


def test_hashes_are_unsigned_64_bit_and_determined_by_content_and_namespace():
    tokens = list(range(48))
    chain = chain_hashes(tokens, 16)
    assert len(chain) == 3 and all(0 <= h < 2**64 for h in chain)
    assert chain == chain_hashes(tokens + [1, 2, 3], 16)  # a partial tail adds nothing
    assert chain[1] == block_hash(chain[0], tokens[16:32])
    assert chain_hashes(tokens, 16, lora_name="a") != chain
    assert chain_hashes(tokens, 16, cache_salt="s")[0] != chain[0]
    assert chain_hashes([9] + tokens[1:], 16)[2] != chain[2]  # each hash covers the whole prefix
