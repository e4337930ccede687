"""Cache changes as events: what a replica announces, in either stream's schema.

Owns: the hashes of the blocks announced so far (by node handle, so a removal names what was
stored), the ids of the checkpoints announced, and the published checkpoints waiting for their
anchor's KV to be announced first (an anchor computed by a forward still in flight).

``announce`` takes one ``CacheProtocol.take_changes`` value (read by attribute: ``stored``,
``removed``, ``published``, ``released``; see ``prefix_cache.change_log``) and returns the KV
events and the checkpoint events it makes: removals first (a block evicted and stored again
in one step ends stored), then the new blocks, parents first, as ``BlockStored`` chains.
Hashes are content-determined (``hashing``), equal on every replica. A block below a block
that was never announced is not announced either (no consumer could place it).
"""

from __future__ import annotations

import itertools

from hybridcache.events.hashing import block_hash, first_block_extra
from hybridcache.events.schema import (
    FULL_ATTENTION,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
)

Handle = tuple[int, int]


class Announcer:
    def __init__(self, block_size: int, state_bytes: int | None = None, medium: str = MEDIUM_GPU) -> None:
        self._block_size = block_size
        self._state_bytes = state_bytes
        self._medium = medium
        self._hashes: dict[Handle, int] = {}
        self._announced_checkpoints: set[int] = set()
        self._waiting: dict[int, object] = {}

    def announce(self, changes) -> tuple[list, list]:
        """The KV events and the checkpoint events ``changes`` makes (either may be empty)."""
        return self._kv_events(changes), self._state_events(changes)

    def _kv_events(self, changes) -> list:
        removed = [self._hashes.pop(handle) for handle in changes.removed if handle in self._hashes]
        events: list = [BlockRemoved(removed, self._medium, group_idx=0)] if removed else []
        chains: list[list] = []
        open_tails: dict[Handle, list] = {}  # last node of a chain -> chain
        for block in changes.stored:  # parents first
            if block.parent is not None and block.parent not in self._hashes:
                continue  # below a block never announced: consumers could not place it either
            self._hashes[block.node] = self._hash_of(block)
            chain = open_tails.pop(block.parent, None) if block.parent is not None else None
            if chain is None:
                chain = []
                chains.append(chain)
            chain.append(block)
            open_tails[block.node] = chain
        return events + [self._stored(chain) for chain in chains]

    def _hash_of(self, block) -> int:
        parent = None if block.parent is None else self._hashes[block.parent]
        return block_hash(parent, block.token_ids, self._extra(block), block.namespace.adapter)

    @staticmethod
    def _extra(block) -> tuple | None:
        salt = first_block_extra(block.namespace.cache_salt) if block.parent is None else None
        if not block.content_ids:
            return salt
        return (salt, *block.content_ids) if salt else block.content_ids

    def _stored(self, chain: list) -> BlockStored:
        first = chain[0]
        return BlockStored(
            block_hashes=[self._hashes[block.node] for block in chain],
            parent_block_hash=None if first.parent is None else self._hashes[first.parent],
            token_ids=list(itertools.chain.from_iterable(block.token_ids for block in chain)),
            block_size=self._block_size,
            lora_id=None,
            medium=self._medium,
            lora_name=first.namespace.adapter,
            extra_keys=[self._extra(block) for block in chain],
            group_idx=0,
            kv_cache_spec_kind=FULL_ATTENTION,
        )

    def _state_events(self, changes) -> list:
        released = set(changes.released)
        for record in changes.published:
            self._waiting[record.checkpoint_id] = record
        gone = [cid for cid in changes.released if cid in self._announced_checkpoints]
        self._announced_checkpoints.difference_update(gone)
        events: list = [CheckpointRemoved(gone, self._medium)] if gone else []
        for checkpoint_id, record in list(self._waiting.items()):
            if checkpoint_id in released:
                del self._waiting[checkpoint_id]
            elif record.anchor is None or record.anchor in self._hashes:
                del self._waiting[checkpoint_id]
                self._announced_checkpoints.add(checkpoint_id)
                events.append(self._checkpoint(record))
        return events

    def _checkpoint(self, record) -> CheckpointStored:
        salt = first_block_extra(record.namespace.cache_salt)
        return CheckpointStored(
            checkpoint_id=record.checkpoint_id,
            position=record.step,
            anchor_block_hash=None if record.anchor is None else self._hashes[record.anchor],
            tail_token_ids=record.tail_token_ids.tolist(),
            block_size=self._block_size,
            medium=self._medium,
            lora_name=record.namespace.adapter,
            extra_keys=None if salt is None else [salt],
            state_bytes=self._state_bytes,
        )
