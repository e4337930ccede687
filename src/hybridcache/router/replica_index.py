"""What one replica can serve from its cache, as its event streams announced it.

Owns: the replica's ``AnnouncedBlocks`` and ``AnnouncedCheckpoints`` (``hybridcache.events``)
and the block size its streams use. Applies decoded events and answers, for one request, the
whole-block KV tokens the replica holds and its restorable depth: the position of the deepest
checkpoint on the request's matched KV path whose tail tokens equal the request's there, no
further than one token before the prompt's end (the engine computes at least one token). A
hybrid replica can reuse nothing without such a checkpoint, whatever KV it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.events.hashing import SALT_KEY
from hybridcache.events.index import AnnouncedBlocks, AnnouncedCheckpoints
from hybridcache.router.request_key import RequestKey


@dataclass(frozen=True)
class Depths:
    kv_tokens: int  # whole-block KV tokens of the prompt the replica announced
    restorable: int  # tokens a hit restores (0: none)


class ReplicaIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = AnnouncedBlocks(block_size)
        self.checkpoints = AnnouncedCheckpoints()

    def apply_kv(self, events) -> None:
        self.blocks.apply(events)

    def apply_state(self, events) -> None:
        self.checkpoints.apply(events)

    def clear(self) -> None:
        """Forget everything (a reset, a failed replay, a replica gone)."""
        self.blocks.clear()
        self.checkpoints.clear()

    def depths(self, key: RequestKey) -> Depths:
        chain = key.chain(self.block_size)
        matched = self.blocks.matched_blocks(chain)
        return Depths(matched * self.block_size, self._restorable(key, chain, matched))

    def _restorable(self, key: RequestKey, chain: list[int], matched: int) -> int:
        """The deepest usable checkpoint, searched from the deepest matched anchor up."""
        size, tokens, limit = self.block_size, key.token_ids, len(key.token_ids) - 1
        for depth in range(min(matched, limit // size), -1, -1):
            anchor = chain[depth - 1] if depth else None
            best = 0
            start = depth * size
            for event in self.checkpoints.at_anchor(anchor):
                position = event.position
                if position <= best or position > limit or event.lora_name != key.lora_name:
                    continue
                if depth == 0 and _salt_of(event) != key.cache_salt:
                    continue
                if tokens[start:position] == event.tail_token_ids:
                    best = position
            if best:
                return best
        return 0

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        self.checkpoints.check_invariants()


def _salt_of(event) -> str | None:
    """The cache salt a root-anchored checkpoint names in its extra keys (None: none)."""
    for extra in event.extra_keys or ():
        if extra and len(extra) == 2 and extra[0] == SALT_KEY:
            return extra[1]
    return None
