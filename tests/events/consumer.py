"""A KV-event consumer written from docs/events.md alone, decoding as llm-d and Dynamo do.

The payload is decoded without hybridcache's structs: an array envelope of at least two
elements, events as maps tagged by ``"type"`` (unknown keys ignored), hashes as any unsigned
64-bit int. A batch holding an unknown event type is dropped whole (llm-d's and Dynamo's
behaviour), and counted, so a test can assert that none ever arrives.
"""

from __future__ import annotations

import msgspec

KNOWN = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


class ConformanceConsumer:
    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}  # hash -> copies
        self.dropped_batches = 0
        self.types_seen: set[str] = set()

    def apply_payload(self, payload: bytes) -> None:
        envelope = msgspec.msgpack.decode(payload)
        assert isinstance(envelope, list) and len(envelope) >= 2
        events = envelope[1]
        types = [event.get("type") for event in events]
        self.types_seen.update(types)
        if any(kind not in KNOWN for kind in types):
            self.dropped_batches += 1
            return
        for event in events:
            getattr(self, "_" + event["type"])(event)

    def _BlockStored(self, event: dict) -> None:
        hashes, tokens, size = event["block_hashes"], event["token_ids"], event["block_size"]
        assert len(tokens) == len(hashes) * size, "non-dense BlockStored"
        assert event.get("kv_cache_spec_kind", "full_attention") == "full_attention"
        for block_hash in hashes:
            assert isinstance(block_hash, int) and 0 <= block_hash < 2**64
            self.blocks[block_hash] = self.blocks.get(block_hash, 0) + 1

    def _BlockRemoved(self, event: dict) -> None:
        for block_hash in event["block_hashes"]:
            if block_hash in self.blocks:
                self.blocks[block_hash] -= 1
                if not self.blocks[block_hash]:
                    del self.blocks[block_hash]

    def _AllBlocksCleared(self, event: dict) -> None:
        self.blocks.clear()

    def matched_blocks(self, chain: list[int]) -> int:
        for depth, block_hash in enumerate(chain):
            if block_hash not in self.blocks:
                return depth
        return len(chain)
