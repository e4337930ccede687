"""Copy plans built from real scheduled chunks: zeroing for fresh sequences, state (and frozen
block) restores for aligned and mid-block checkpoint hits, state (and frozen block) saves,
and the shared-write guard refusing a restore into a block the sequence does not own alone."""

from __future__ import annotations

import pytest

from hybridcache.engine.copy_plan import CopyPlan, build_copy_plan
from hybridcache.errors import SharedWriteError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.scheduler import Scheduler, SchedulerConfig, ServingSequence
from hybridcache.sequence import Sequence
from hybridcache.cache import CacheComponents
from hybridcache.protocol import CacheProtocol

B = 8
TOKEN = 7


class Rig:
    def __init__(self, num_blocks=32, hybrid=True):
        self.pool = BlockPool(num_blocks)
        self.states = StatePool(8, checkpoint_budget=3)
        self.trie = BlockTrie(self.pool, B, state_pool=self.states if hybrid else None, track_pending=True)
        config = SchedulerConfig(max_batch_tokens=256, max_running=4, prefill_chunk=64, checkpoint_chunk_ends=False)
        self.sched = Scheduler(config, CacheProtocol(CacheComponents(self.pool, self.states, self.trie)))
        self.ids = 0

    def add(self, tokens, max_new_tokens=1):
        entry = ServingSequence(self.ids, Sequence(list(tokens)), max_new_tokens)
        self.ids += 1
        self.sched.add(entry)
        return entry

    def run(self, batch):
        for chunk in batch.chunks:
            self.sched.cache.forward_queued(chunk.entry.seq)
        for chunk in batch.chunks:
            self.sched.complete(chunk, TOKEN, None)
        self.trie.check_invariants(self.sched.live_sequences())

    def finish(self):
        while self.sched.has_work:
            self.run(self.sched.schedule())


def prompt(n, start=1):
    return list(range(start, start + n))


def test_fresh_sequence_zeroes_its_runtime_slot_and_saves_mid_block():
    rig = Rig()
    entry = rig.add(prompt(13))
    batch = rig.sched.schedule()
    chunk = batch.chunks[0]
    plan = build_copy_plan(batch.chunks, rig.sched.cache, guard=True)
    save = chunk.save
    assert save is not None and save.step == 13 and save.is_partial
    table = entry.seq.block_table
    assert plan == CopyPlan(
        zero_states=(entry.runtime_slot,),
        save_states=((entry.runtime_slot,), (save.slot,)),
        save_blocks=((int(table[1]),), (save.frozen_block,)),
    )
    rig.run(batch)


def test_aligned_save_copies_only_the_state():
    rig = Rig()
    entry = rig.add(prompt(16))
    batch = rig.sched.schedule()
    plan = build_copy_plan(batch.chunks, rig.sched.cache, guard=True)
    save = batch.chunks[0].save
    assert save is not None and save.step == 16 and not save.is_partial
    assert plan.save_states == ((entry.runtime_slot,), (save.slot,))
    assert plan.save_blocks == ((), ())
    rig.run(batch)


def test_aligned_restore_copies_only_the_state():
    rig = Rig()
    rig.add(prompt(16))
    rig.finish()
    entry = rig.add(prompt(16) + [TOKEN, 50, 51])
    batch = rig.sched.schedule()
    chunk = batch.chunks[0]
    record = chunk.restore
    assert record is not None and record.step == 16 and not record.is_partial and not chunk.zero_state
    plan = build_copy_plan(batch.chunks, rig.sched.cache, guard=True)
    assert plan.zero_states == ()
    assert plan.restore_states == ((record.slot,), (entry.runtime_slot,))
    assert plan.restore_blocks == ((), ())
    rig.run(batch)


def test_mid_block_restore_copies_the_frozen_block_into_a_private_block():
    rig = Rig()
    rig.add(prompt(13))
    rig.finish()
    entry = rig.add(prompt(13) + [TOKEN, 50, 51, 52])
    batch = rig.sched.schedule()
    record = batch.chunks[0].restore
    assert record is not None and record.step == 13 and record.is_partial
    plan = build_copy_plan(batch.chunks, rig.sched.cache, guard=True)
    destination = int(entry.seq.block_table[1])
    assert plan.restore_states == ((record.slot,), (entry.runtime_slot,))
    assert plan.restore_blocks == ((record.frozen_block,), (destination,))
    assert destination != record.frozen_block
    # the sequence's own block: held by it alone, or also by the pending trie node it attached
    assert destination in rig.trie.exclusive_blocks(entry.seq, 13, 14)
    # the request's own finish checkpoint at 17 (mid-block) is saved from the same block
    save = batch.chunks[0].save
    assert save is not None and save.step == 17
    assert plan.save_blocks == ((int(entry.seq.block_table[2]),), (save.frozen_block,))
    rig.run(batch)


def test_guard_refuses_a_restore_into_a_shared_block():
    rig = Rig()
    rig.add(prompt(13))
    rig.finish()
    entry = rig.add(prompt(13) + [TOKEN, 50])
    batch = rig.sched.schedule()
    destination = int(entry.seq.block_table[1])
    rig.pool.ref([destination])  # another holder now shares the block the restore would write
    try:
        with pytest.raises(SharedWriteError):
            build_copy_plan(batch.chunks, rig.sched.cache, guard=True)
        unguarded = build_copy_plan(batch.chunks, rig.sched.cache, guard=False)
        assert unguarded.restore_blocks[1] == (destination,)
    finally:
        rig.pool.unref([destination])
    assert build_copy_plan(batch.chunks, rig.sched.cache, guard=True).restore_blocks[1] == (destination,)
    rig.run(batch)


def test_plan_of_several_chunks_keeps_chunk_order():
    rig = Rig()
    rig.add(prompt(13))
    rig.finish()
    hit = rig.add(prompt(13) + [TOKEN, 50])
    fresh_a = rig.add(prompt(5, start=300))
    fresh_b = rig.add(prompt(9, start=400))
    batch = rig.sched.schedule()
    assert [c.entry for c in batch.chunks] == [hit, fresh_a, fresh_b]
    plan = build_copy_plan(batch.chunks, rig.sched.cache, guard=True)
    assert plan.zero_states == (fresh_a.runtime_slot, fresh_b.runtime_slot)
    assert plan.restore_states[1] == (hit.runtime_slot,)
    saves = [c.save for c in batch.chunks]
    assert plan.save_states == (
        (hit.runtime_slot, fresh_a.runtime_slot, fresh_b.runtime_slot),
        tuple(s.slot for s in saves),
    )
    slots = set(plan.save_states[0]) | set(plan.save_states[1]) | set(plan.restore_states[0]) | set(plan.zero_states)
    assert 0 not in slots  # the reserved padding row is never a copy source or target
    rig.run(batch)


def test_attention_only_plans_are_empty():
    rig = Rig(hybrid=False)
    rig.add(prompt(17))
    rig.finish()
    entry = rig.add(prompt(17) + [TOKEN, 50])
    batch = rig.sched.schedule()
    assert batch.chunks[0].start == 16
    plan = build_copy_plan(batch.chunks, rig.sched.cache, guard=True)
    assert plan.restore_states == plan.restore_blocks == plan.save_states == plan.save_blocks == ((), ())
    assert plan.zero_states == (entry.runtime_slot,)  # no checkpoint: the state starts at zero
    rig.run(batch)
