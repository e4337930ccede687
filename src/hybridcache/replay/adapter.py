"""The one place the replay calls the cache library: pools, trie, admission, checkpoints.

Owns: the block pool, the state pool and the trie of one replay, the sequence of the turn being
served, and counters of the checkpoint releases the trie's statistics do not see (a checkpoint
evicted inside ``reserve_save`` to free a state slot; surplus records released when an anchor
holds too many). Every call below is one the reference engine or its scheduler makes, in the
same order, with the forward itself left out:

  __init__     build_cache(CacheConfig(hybrid=True), track_pending=True)   (engine: __init__)
  start_turn   Sequence(prompt) -> BlockTrie.prepare                       (engine: add_request)
  admit        admission.try_admit                                         (scheduler: _admit)
  grow         allocate(upto=computed) -> make_block_room -> grow_table -> allocate(upto=end)
                                                                           (scheduler: _continue)
  forward      reserve_save -> publish_save(pin, in_flight) -> unpin_restore (engine: _prepare)
               -> [no model] -> unpin_save -> set_computed -> mark_computed  (engine: _execute)
  append       Sequence.append_tokens                                      (scheduler: complete)
  finish       free_sequence -> free_runtime                               (scheduler: _release)

One turn is served at a time (no batching), so nothing but the current turn is ever pinned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridcache.cache import build_cache
from hybridcache.config import CacheConfig
from hybridcache.scheduler.admission import blocks_needed, make_block_room, try_admit
from hybridcache.sequence import Sequence

NO_SLOT = -1


@dataclass(frozen=True)
class PoolGeometry:
    """Library block size, KV blocks and checkpoint slots (one runtime slot comes on top)."""

    block_size: int
    kv_blocks: int
    checkpoint_slots: int


@dataclass
class Turn:
    """A request in progress: its sequence, runtime slot, and what its admission reused."""

    seq: Sequence
    runtime_slot: int = NO_SLOT
    hit_tokens: int = 0
    restored_from: int | None = None  # the producer sequence id of the restored checkpoint
    restored_step: int = 0
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
        components = build_cache(config, track_pending=True, eviction=eviction)  # as the engine does
        self.pool, self.states, self.trie = components.pool, components.states, components.trie
        self.checkpoints = self.trie.checkpoints
        self.eviction = eviction
        self.evicted_for_slots = 0
        self.released_over_anchor_cap = 0

    def start_turn(self, prompt: np.ndarray) -> Turn:
        seq = Sequence(prompt)
        self.trie.prepare(seq)
        return Turn(seq, branch=self.trie.cached_prefix_tokens(seq))

    def admit(self, turn: Turn, chunk_tokens: int, stop_at=None) -> int | None:
        """Admit the turn for a first chunk of at most ``chunk_tokens``, ended earlier where
        ``stop_at(start)`` says; its end, or None when the pools cannot hold it even after
        eviction."""
        admitted = try_admit(turn.seq, self.trie, self.pool, self.states, chunk_tokens, chunk_tokens, stop_at)
        if admitted is None:
            return None
        turn.runtime_slot, turn.hit_tokens = admitted.runtime_slot, admitted.hit_tokens
        if admitted.restore is not None:
            turn.restored_from, turn.restored_step = admitted.restore.producer_id, admitted.restore.step
        return admitted.end

    def grow(self, turn: Turn, end: int) -> bool:
        """Blocks for the next chunk ``[computed, end)``; False when they cannot be freed."""
        seq, trie = turn.seq, self.trie
        trie.allocate(seq, upto=seq.num_computed)  # settle private duplicates first (frees blocks)
        if not make_block_room(trie, self.pool, blocks_needed(seq, end, trie.block_size)):
            return False
        self.pool.grow_table(seq, end, trie.block_size)
        trie.allocate(seq, upto=end)
        return True

    def forward(self, turn: Turn, end: int, save: str | None, parent_step: int = 0) -> bool:
        """Run the chunk ending at ``end`` (blocks allocated), saving a checkpoint there when
        ``save`` names why (the eviction policy is told, with the step of the state it is
        computed from). Returns whether a checkpoint was published."""
        seq, checkpoints, states = turn.seq, self.checkpoints, self.states
        if save is not None:
            before = states.num_checkpoint
            slot = checkpoints.reserve_save(seq, end)
            self.evicted_for_slots += before - states.num_checkpoint + (slot >= 0)
            if slot >= 0 and self.eviction is not None:
                self.eviction.note_save(seq.prefix_state.pending_save, parent_step, save)
        published = checkpoints.publish_save(seq, pin=True, in_flight=True)
        checkpoints.unpin_restore(seq)
        before = states.num_checkpoint
        checkpoints.unpin_save(seq)
        self.released_over_anchor_cap += before - states.num_checkpoint
        start = seq.num_computed
        seq.set_computed(end)
        self.trie.mark_computed(seq, start)
        return published

    def append(self, turn: Turn, tokens: np.ndarray) -> None:
        turn.seq.append_tokens(tokens)

    def finish(self, turn: Turn) -> None:
        self.trie.free_sequence(turn.seq)
        if turn.runtime_slot != NO_SLOT:
            self.states.free_runtime(turn.runtime_slot)
            turn.runtime_slot = NO_SLOT

    def stats(self) -> dict:
        stats = self.trie.stats.as_dict()
        stats["evicted_checkpoints_for_state_slots"] = self.evicted_for_slots
        stats["released_checkpoints_over_anchor_cap"] = self.released_over_anchor_cap
        stats["live_checkpoints"] = self.states.num_checkpoint
        stats["free_kv_blocks"] = self.pool.num_free
        return stats

    def check_invariants(self, live: list[Turn] = ()) -> None:
        self.trie.check_invariants([turn.seq for turn in live])
        self.states.check_invariants()
        self.pool.check_invariants()
