"""One forward's cache copy plans, built from the sequences' protocol state.

Owns nothing: a plan is an immutable value made when a forward is queued and executed with it.
Restores run before the model (checkpoint slot -> runtime slot; frozen block -> the request's
private block at the checkpoint's partial position; a fresh sequence's runtime slot is
zeroed). Saves run after it (runtime slot -> checkpoint slot; the producer's partial block ->
the checkpoint's frozen block). Plans are never merged into later forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.errors import SharedWriteError
from hybridcache.protocol import CacheProtocol
from hybridcache.scheduler.scheduler import ScheduledChunk

Pairs = tuple[tuple[int, ...], tuple[int, ...]]
_NO_PAIRS: Pairs = ((), ())


def _pairs(items: list[tuple[int, int]]) -> Pairs:
    return (tuple(s for s, _ in items), tuple(d for _, d in items)) if items else _NO_PAIRS


@dataclass(frozen=True)
class CopyPlan:
    zero_states: tuple[int, ...] = ()
    restore_states: Pairs = _NO_PAIRS
    restore_blocks: Pairs = _NO_PAIRS
    save_states: Pairs = _NO_PAIRS
    save_blocks: Pairs = _NO_PAIRS


def build_copy_plan(chunks: list[ScheduledChunk], cache: CacheProtocol, guard: bool) -> CopyPlan:
    """``guard`` refuses a restore into a block the sequence does not own exclusively."""
    block_size = cache.block_size
    zero, restore_states, restore_blocks, save_states, save_blocks = [], [], [], [], []
    for chunk in chunks:
        seq, slot = chunk.entry.seq, chunk.entry.runtime_slot
        if chunk.restore is not None:
            record = chunk.restore
            restore_states.append((record.slot, slot))
            if record.is_partial:
                destination = int(seq.block_table[record.step // block_size])
                if guard and destination not in cache.writable_blocks(seq, record.step, record.step + 1):
                    raise SharedWriteError(f"restore into shared block {destination}")
                restore_blocks.append((record.frozen_block, destination))
        elif chunk.zero_state:
            zero.append(slot)
        if chunk.save is not None:
            record = chunk.save
            save_states.append((slot, record.slot))
            if record.is_partial:
                save_blocks.append((int(seq.block_table[record.step // block_size]), record.frozen_block))
    return CopyPlan(
        zero_states=tuple(zero),
        restore_states=_pairs(restore_states),
        restore_blocks=_pairs(restore_blocks),
        save_states=_pairs(save_states),
        save_blocks=_pairs(save_blocks),
    )
