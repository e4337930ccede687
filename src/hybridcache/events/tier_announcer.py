"""The host and disk tiers' contents as events: medium ``CPU`` for the host tier, ``DISK`` for the disk.

Owns: for every tier object this engine published (a KV chunk or a checkpoint, by object
name), the events that announce it, and per medium the names announced there. An engine's
tiers store chunk-aligned prefixes: a KV chunk is ``chunk_size // block_size`` whole blocks,
announced as one ``BlockStored`` chain with the same content-determined hashes the device
cache announces (so a router matches it on the same chain); a checkpoint sits at a chunk
boundary, so its anchor is the chunk's last block and its tail is empty. The same object on
two media is two announcements (a ``CheckpointStored`` id per medium: the consumer indexes
checkpoints by id), each removed on its own medium when that tier lets it go.

``moved`` takes what a tier reports it stored and let go, as it happens (a publish's puts, a
host eviction, its demotion to disk, a disk eviction, an object removed as rejected);
``published`` the publish those puts belonged to, which says what the names hold. A name this
engine did not publish (a promotion read from below, another process's object) is not
announced: nothing here knows its tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from msgspec.structs import replace

from hybridcache.events.hashing import chain_hashes, first_block_extra
from hybridcache.events.schema import (
    FULL_ATTENTION,
    MEDIUM_CPU,
    MEDIUM_DISK,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
)

TIER_MEDIA = {"host": MEDIUM_CPU, "disk": MEDIUM_DISK}
_TIER_ID_BIT = 1 << 63  # tier checkpoint ids: above every device checkpoint id (a counter)


@dataclass(frozen=True)
class TierPublish:
    """One confirmed publish: the prompt prefix ``tokens[:step]`` in its namespace, and the
    object names of its chunks (in order) and of its checkpoint at ``step``."""

    tokens: list[int]
    adapter: str | None
    cache_salt: str | None
    step: int
    chunk_names: list[str]
    checkpoint_name: str


class TierAnnouncer:
    def __init__(self, block_size: int, state_bytes: int | None = None) -> None:
        self._block_size = block_size
        self._state_bytes = state_bytes
        self._objects: dict[str, BlockStored | CheckpointStored] = {}  # name -> its announcement (medium unset)
        self._announced: dict[str, set[str]] = {medium: set() for medium in TIER_MEDIA.values()}
        # names a tier reported stored before their publish described them (the tier reports
        # during the publish, the engine after it); a name let go in between leaves here
        self._undescribed: dict[str, set[str]] = {medium: set() for medium in TIER_MEDIA.values()}

    def published(self, tier: str, publish: TierPublish) -> tuple[list, list]:
        """The events of a publish: what ``tier`` reported storing of it (``moved``) and holds."""
        medium = TIER_MEDIA.get(tier)
        if medium is None:
            return [], []
        self._describe(publish)
        waiting = self._undescribed[medium]
        held = [name for name in (*publish.chunk_names, publish.checkpoint_name) if name in waiting]
        waiting.difference_update(held)
        return self._stored(medium, held)

    def moved(self, tier: str, stored: list[str], removed: list[str]) -> tuple[list, list]:
        """The events of what ``tier`` stored (by a publish, or a demotion) and let go."""
        medium = TIER_MEDIA.get(tier)
        if medium is None:
            return [], []
        self._undescribed[medium].update(name for name in stored if name not in self._objects)
        kv, state = self._stored(medium, [name for name in stored if name in self._objects])
        more_kv, more_state = self._removed(medium, removed)
        return kv + more_kv, state + more_state

    def _describe(self, publish: TierPublish) -> None:
        size = self._block_size
        per_chunk = publish.step // len(publish.chunk_names) // size
        hashes = chain_hashes(publish.tokens[: publish.step], size, publish.adapter, publish.cache_salt)
        salt = first_block_extra(publish.cache_salt)
        for index, name in enumerate(publish.chunk_names):
            first, end = index * per_chunk, (index + 1) * per_chunk
            self._objects.setdefault(name, BlockStored(
                block_hashes=hashes[first:end], parent_block_hash=hashes[first - 1] if first else None,
                token_ids=publish.tokens[first * size : end * size], block_size=size, lora_id=None, medium=None,
                lora_name=publish.adapter, extra_keys=[salt if b == 0 else None for b in range(first, end)],
                group_idx=0, kv_cache_spec_kind=FULL_ATTENTION,
            ))
        self._objects.setdefault(publish.checkpoint_name, CheckpointStored(
            checkpoint_id=0, position=publish.step, anchor_block_hash=hashes[publish.step // size - 1], tail_token_ids=[],
            block_size=size, medium=None, lora_name=publish.adapter, extra_keys=None if salt is None else [salt],
            state_bytes=self._state_bytes,
        ))

    def _stored(self, medium: str, names: list[str]) -> tuple[list, list]:
        kv, state = [], []
        for name in names:
            event = self._objects.get(name)
            if event is None or name in self._announced[medium]:
                continue
            self._announced[medium].add(name)
            if isinstance(event, BlockStored):
                kv.append(replace(event, medium=medium))
            else:
                state.append(replace(event, checkpoint_id=_tier_checkpoint_id(name, medium), medium=medium))
        return kv, state

    def _removed(self, medium: str, names: list[str]) -> tuple[list, list]:
        blocks, checkpoints = [], []
        for name in names:
            if name not in self._announced[medium]:
                self._undescribed[medium].discard(name)
                continue
            self._announced[medium].discard(name)
            event = self._objects[name]
            if isinstance(event, BlockStored):
                blocks.extend(event.block_hashes)
            else:
                checkpoints.append(_tier_checkpoint_id(name, medium))
            if not any(name in names_there for names_there in self._announced.values()):
                del self._objects[name]
        kv = [BlockRemoved(blocks, medium, group_idx=0)] if blocks else []
        return kv, [CheckpointRemoved(checkpoints, medium)] if checkpoints else []

    def check_invariants(self) -> None:
        for medium, names in self._announced.items():
            assert names <= self._objects.keys(), "an announced tier object without its description"
            assert not names & self._undescribed[medium], "a tier object both announced and waiting"


def _tier_checkpoint_id(name: str, medium: str) -> int:
    """A checkpoint id for one tier object on one medium: equal for every announcement of it."""
    digest = hashlib.blake2b(f"{medium}:{name}".encode(), digest_size=8).digest()
    return _TIER_ID_BIT | (int.from_bytes(digest, "big") >> 1)
