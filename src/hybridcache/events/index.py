"""What a consumer knows from one replica's streams: the indexes built from its events.

``AnnouncedBlocks`` owns the KV blocks a stream announced and did not remove: hash -> copies
per medium (vLLM does not deduplicate physical copies, so a removal takes one copy away) and
each block's parent hash. ``AnnouncedCheckpoints`` owns the checkpoints announced and not
removed, by id and by anchor hash. Both apply events as they come and know nothing about
sockets or ordering (``subscriber.StreamSubscriber`` does that); a reset is ``clear``.

Both are bounded, since a replica's stream is another process's word: at most
``MAX_ANNOUNCED_BLOCKS`` hashes (each in at most ``MAX_MEDIA`` media) and
``MAX_ANNOUNCED_CHECKPOINTS`` checkpoints; a store past a bound, or of blocks of another size
than the stream's, is skipped and counted (``skipped``), as an event not indexable is. A skipped
block only costs the router a prediction, never a wrong route to data: the replica checks
every hit itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridcache.events.schema import (
    FULL_ATTENTION,
    AllBlocksCleared,
    AllCheckpointsCleared,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
)

_DEFAULT_MEDIUM = "GPU"
MAX_ANNOUNCED_BLOCKS = 2**20  # 16 M tokens of 16-token blocks, a few hundred MB of index at most
MAX_MEDIA = 8  # GPU, CPU, disk and the like: a medium is a tier's name
MAX_ANNOUNCED_CHECKPOINTS = 2**20


class AnnouncedBlocks:
    def __init__(self, block_size: int | None = None, max_blocks: int = MAX_ANNOUNCED_BLOCKS) -> None:
        """``block_size``: the stream's (None: any); ``max_blocks``: the most hashes indexed."""
        self._copies: dict[int, dict[str, int]] = {}
        self._parent: dict[int, int | None] = {}
        self._block_size = block_size
        self._max_blocks = max_blocks
        self.skipped = 0  # events not indexable as dense full-attention KV, or past a bound

    def __len__(self) -> int:
        return len(self._copies)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._copies

    def media(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._copies.get(block_hash, ()))

    def apply(self, events: Iterable[object]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def _store(self, event: BlockStored) -> None:
        dense = event.block_size > 0 and len(event.token_ids) == len(event.block_hashes) * event.block_size
        kind_ok = event.kv_cache_spec_kind in (None, FULL_ATTENTION) and event.group_idx in (None, 0)
        sized = self._block_size is None or event.block_size == self._block_size
        if not dense or not kind_ok or not sized:
            self.skipped += 1
            return
        medium = event.medium or _DEFAULT_MEDIUM
        parent = event.parent_block_hash
        for block_hash in event.block_hashes:
            copies = self._copies.get(block_hash)
            if copies is None and len(self._copies) >= self._max_blocks or copies is not None and (
                    medium not in copies and len(copies) >= MAX_MEDIA):
                self.skipped += 1  # the rest of the event's chain hangs below this block: not indexed
                return
            if copies is None:
                copies = self._copies[block_hash] = {}
            copies[medium] = copies.get(medium, 0) + 1
            self._parent[block_hash] = parent
            parent = block_hash

    def _remove(self, event: BlockRemoved) -> None:
        if event.group_idx not in (None, 0):
            self.skipped += 1
            return
        medium = event.medium or _DEFAULT_MEDIUM
        for block_hash in event.block_hashes:
            copies = self._copies.get(block_hash)
            if copies is None or medium not in copies:
                continue
            copies[medium] -= 1
            if not copies[medium]:
                del copies[medium]
            if not copies:
                del self._copies[block_hash]
                del self._parent[block_hash]

    def clear(self) -> None:
        self._copies.clear()
        self._parent.clear()

    def matched_blocks(self, chain: list[int]) -> int:
        """How many leading blocks of a request's hash chain are announced."""
        copies = self._copies
        for depth, block_hash in enumerate(chain):
            if block_hash not in copies:
                return depth
        return len(chain)

    def check_invariants(self) -> None:
        assert self._copies.keys() == self._parent.keys(), "a block without its parent record"
        for copies in self._copies.values():
            assert copies and all(count > 0 for count in copies.values()), "an empty copy count"


class AnnouncedCheckpoints:
    def __init__(self, max_checkpoints: int = MAX_ANNOUNCED_CHECKPOINTS) -> None:
        self._by_id: dict[int, CheckpointStored] = {}
        self._by_anchor: dict[int | None, dict[int, CheckpointStored]] = {}
        self._max_checkpoints = max_checkpoints
        self.skipped = 0  # stores past the bound

    def __len__(self) -> int:
        return len(self._by_id)

    def apply(self, events: Iterable[object]) -> None:
        for event in events:
            if isinstance(event, CheckpointStored):
                self._forget(event.checkpoint_id)
                if len(self._by_id) >= self._max_checkpoints:
                    self.skipped += 1
                    continue
                self._by_id[event.checkpoint_id] = event
                self._by_anchor.setdefault(event.anchor_block_hash, {})[event.checkpoint_id] = event
            elif isinstance(event, CheckpointRemoved):
                for checkpoint_id in event.checkpoint_ids:
                    self._forget(checkpoint_id)
            elif isinstance(event, AllCheckpointsCleared):
                self.clear()

    def _forget(self, checkpoint_id: int) -> None:
        event = self._by_id.pop(checkpoint_id, None)
        if event is None:
            return
        siblings = self._by_anchor[event.anchor_block_hash]
        del siblings[checkpoint_id]
        if not siblings:
            del self._by_anchor[event.anchor_block_hash]

    def at_anchor(self, anchor_block_hash: int | None) -> Iterable[CheckpointStored]:
        """Checkpoints whose anchor is this block (None: those before the first full block)."""
        return self._by_anchor.get(anchor_block_hash, {}).values()

    def clear(self) -> None:
        self._by_id.clear()
        self._by_anchor.clear()

    def check_invariants(self) -> None:
        indexed = {cid for group in self._by_anchor.values() for cid in group}
        assert indexed == set(self._by_id), "the anchor index differs from the checkpoints"
        assert all(self._by_anchor.values()), "an empty anchor group"
