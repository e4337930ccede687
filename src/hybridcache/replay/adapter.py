"""The one place the replay calls the cache library, through its engine-facing protocol only
(``CacheProtocol`` and ``Sequence``; nothing of the trie or the pools is read here).

Owns: the cache of one replay (a ``CacheProtocol`` over the components ``build_cache`` made,
with the eviction policy state their heaps score with) and the sequence of the turn being
served. Every call below is one the reference engine or its scheduler makes, in the same
order, with the forward itself left out:

  __init__     CacheProtocol(build_cache(CacheConfig(hybrid=True), track_pending=True))
                                                                           (engine: __init__)
  start_turn   Sequence(prompt) -> prepare -> branch_point                 (engine: add_request)
  admit        admit                                                       (scheduler: _admit)
  grow         swap_computed_duplicates -> extend                          (scheduler: _continue)
  forward      run_forwards: per chunk, grow, reserve_save -> forward_queued   (engine: _prepare)
               -> [no model] -> set_computed -> forward_done               (scheduler: complete)
  append       Sequence.append_tokens                                      (scheduler: complete)
  finish       free                                                        (scheduler: _release)
  cached_prefix  cached_prefix       (a tier restore before the turn starts, a router; changes nothing)
  adopt        adopt, writing nothing                          (engine: TierClient.adopt_prefix)

The last two, with ``payloads`` (the stand-ins a publish reads), make the adapter the device side
the tier client borrows (``tiers.device.TierDevice``), as ``engine.tiering`` is the engine's. A
tier restore (``cached_prefix``, then ``adopt``) comes before ``start_turn``, as the engine
adopts before it queues a request.

  stats        stats, released_checkpoints (the releases by cause the protocol reports)

One turn is served at a time (no batching), so nothing but the current turn is ever pinned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridcache.cache import build_cache
from hybridcache.config import CacheConfig
from hybridcache.protocol import CacheProtocol
from hybridcache.replay.tiering import STAND_INS
from hybridcache.sequence import Sequence
from hybridcache.tiers.device import DeviceAdoption
from hybridcache.tiers.payload import StandInPayloads
from hybridcache.tiers.restore import Restore
from hybridcache.types import NO_SLOT


@dataclass(frozen=True)
class PoolGeometry:
    """Library block size, KV blocks and checkpoint slots (one runtime slot comes on top)."""

    block_size: int
    kv_blocks: int
    checkpoint_slots: int


@dataclass
class Turn:
    """A request in progress: its sequence, runtime slot, and the tokens its admission reused."""

    seq: Sequence
    runtime_slot: int = NO_SLOT
    hit_tokens: int = 0
    branch: int = 0  # whole-block tokens the cache held as KV when the turn was prepared

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


class CacheAdapter:
    def __init__(self, geometry: PoolGeometry, eviction: object | None = None) -> None:
        """``eviction``: the eviction policy state the trie's heaps score with (None = LRU)."""
        self.geometry = geometry
        config = CacheConfig(
            block_size=geometry.block_size,
            num_kv_blocks=geometry.kv_blocks,
            # slot 0 is reserved; one runtime slot for the turn being served; the rest checkpoints
            num_state_slots=geometry.checkpoint_slots + 2,
            checkpoint_budget=geometry.checkpoint_slots,
            hybrid=True,
        )
        self.cache = CacheProtocol(build_cache(config, track_pending=True, eviction=eviction))  # as the engine does
        self.eviction = eviction

    def start_turn(self, prompt: np.ndarray) -> Turn:
        seq = Sequence(prompt)
        self.cache.prepare(seq)
        return Turn(seq, branch=self.cache.branch_point(seq))

    # --- the tier client's device side (``tiers.device.TierDevice``) ---------------------------

    def cached_prefix(self, scratch: Sequence) -> tuple[int, int]:
        """What this cache holds for ``scratch`` (a sequence holding no blocks, which may have been
        probed against another replica's cache): its checkpoint step and whole-block KV tokens."""
        return self.cache.cached_prefix(scratch)

    def adopt(self, prefix: Sequence, restore: Restore) -> DeviceAdoption:
        """Cache ``prefix`` (``restore.step`` tokens) with a checkpoint at its end, restored from a
        tier: the replay has no tensors, so the write fills nothing and succeeds."""
        return DeviceAdoption(self.cache.adopt(prefix, restore.step, lambda adoption: True).gained)

    def payloads(self, seq: Sequence, slot: int) -> StandInPayloads:
        """What a publish reads: the one-byte stand-in every replay object carries."""
        return STAND_INS

    def admit(self, turn: Turn, chunk_tokens: int, stop_at=None) -> int | None:
        """Admit the turn for a first chunk of at most ``chunk_tokens``, ended earlier where
        ``stop_at(start)`` says; its end, or None when the pools cannot hold it even after
        eviction."""
        admitted = self.cache.admit(turn.seq, chunk_tokens, stop_at)
        if not admitted.admitted:
            return None
        turn.runtime_slot, turn.hit_tokens = admitted.runtime_slot, admitted.hit_tokens
        return admitted.end

    def grow(self, turn: Turn, end: int) -> bool:
        """Blocks for the next chunk ``[computed, end)``; False when they cannot be freed."""
        self.cache.swap_computed_duplicates(turn.seq)
        return self.cache.extend(turn.seq, end)

    def forward(self, turn: Turn, ends: list[int], saves: dict[int, str], parent_step: int = 0) -> list[bool]:
        """Run the chunks ending at each of ``ends`` (the first one's blocks allocated), saving
        a checkpoint at each end ``saves`` names a reason for (the cache tells its eviction
        policy, which may decline one, computed from the last published save, else
        ``parent_step``). Per chunk run, whether a checkpoint was published; shorter than
        ``ends`` when a chunk's blocks could not be freed."""
        return self.cache.run_forwards(turn.seq, ends, saves, parent_step).published

    def append(self, turn: Turn, tokens: np.ndarray) -> None:
        turn.seq.append_tokens(tokens)

    def finish(self, turn: Turn) -> None:
        self.cache.free(turn.seq, turn.runtime_slot)
        turn.runtime_slot = NO_SLOT

    def stats(self) -> dict:
        """The cache's statistics, with the checkpoints released for a save's state slot and
        over an anchor's cap, which its trie counters do not include."""
        stats = self.cache.stats()
        released = self.cache.released_checkpoints()
        stats["evicted_checkpoints_for_state_slots"] = released.save_slots
        stats["released_checkpoints_over_anchor_cap"] = released.anchor_cap
        return stats

    def check_invariants(self, live: list[Turn] = ()) -> None:
        self.cache.check_invariants([turn.seq for turn in live])
