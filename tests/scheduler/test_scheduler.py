"""Scheduler unit tests with the real cache components (block pool, state pool, hybrid or
attention-only trie with pending tracking). Forwards are simulated: the engine's protocol
(publish the reserved save, drop the restore pin, then unpin the save and ``complete`` each
chunk) without any model."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import InvalidConfigError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.scheduler import Phase, ScheduledBatch, Scheduler, SchedulerConfig, ServingSequence
from hybridcache.scheduler.arrival_pins import TURN_HOLD_SCHEDULES
from hybridcache.scheduler.scheduler import NO_SLOT
from hybridcache.sequence import Sequence
from hybridcache.cache import CacheComponents
from hybridcache.protocol import CacheProtocol

B = 8
TOKEN = 7  # every simulated forward "generates" this token


class World:
    """A scheduler wired to real cache components, with a simulated model."""

    def __init__(self, *, num_blocks=64, num_slots=8, budget=2, block_size=B, hybrid=True, enabled=True, **config):
        self.pool = BlockPool(num_blocks)
        self.states = StatePool(num_slots, checkpoint_budget=budget)
        self.trie = BlockTrie(
            self.pool, block_size, enabled=enabled, state_pool=self.states if hybrid else None, track_pending=True
        )
        self.sched = Scheduler(SchedulerConfig(**config), CacheProtocol(CacheComponents(self.pool, self.states, self.trie)))
        self.ids = 0

    def add(self, prompt, max_new_tokens=4, **seq_kwargs) -> ServingSequence:
        entry = ServingSequence(self.ids, Sequence(list(prompt), **seq_kwargs), max_new_tokens)
        self.ids += 1
        self.sched.add(entry)
        return entry

    def check(self) -> None:
        self.sched.check_invariants()
        self.trie.check_invariants(self.sched.live_sequences())
        self.states.check_invariants()

    def schedule(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        self.check_batch(batch)
        return batch

    def check_batch(self, batch: ScheduledBatch) -> None:
        """Every scheduled chunk belongs to a running sequence that holds what it needs."""
        cfg = self.sched.config
        assert batch.num_tokens <= cfg.max_batch_tokens
        assert len(self.sched.running) <= cfg.max_running
        seen = set()
        for chunk in batch.chunks:
            entry, seq = chunk.entry, chunk.entry.seq
            assert id(entry) not in seen, "a sequence is scheduled twice in one batch"
            seen.add(id(entry))
            assert entry.phase is Phase.RUNNING and entry in self.sched.running
            assert entry.runtime_slot != NO_SLOT
            assert entry.in_flight
            assert chunk.start == seq.num_computed < chunk.end <= seq.num_tokens
            assert chunk.end - chunk.start <= cfg.prefill_chunk
            assert seq.num_blocks * self.trie.block_size >= chunk.end, "blocks do not cover the chunk"

    def run(self, batch: ScheduledBatch) -> list[ServingSequence]:
        """Simulated forward of ``batch`` (the engine's queue/output protocol)."""
        for chunk in batch.chunks:
            self.sched.cache.forward_queued(chunk.entry.seq)
        finished = []
        for chunk in batch.chunks:
            if self.sched.complete(chunk, TOKEN, None):
                finished.append(chunk.entry)
        self.check()
        return finished

    def step(self) -> tuple[ScheduledBatch, list[ServingSequence]]:
        batch = self.schedule()
        return batch, self.run(batch)

    def drain(self, limit=1000) -> list[ScheduledBatch]:
        batches = []
        for _ in range(limit):
            if not self.sched.has_work:
                return batches
            batch, _ = self.step()
            assert batch.chunks, "the scheduler made no progress"
            batches.append(batch)
        raise AssertionError("did not finish")


def prompt(n, start=1):
    return list(range(start, start + n))


# --- budgets and caps -------------------------------------------------------------------------


@pytest.mark.parametrize("hybrid", [True, False])
def test_token_budget_is_respected_every_step(hybrid):
    w = World(hybrid=hybrid, max_batch_tokens=20, max_running=8, prefill_chunk=12)
    entries = [w.add(prompt(30 + i, start=100 * i), max_new_tokens=3) for i in range(4)]
    batches = w.drain()
    assert max(b.num_tokens for b in batches) == 20  # the budget is used up, never exceeded
    assert all(e.phase is Phase.FINISHED and e.generated == 3 for e in entries)
    assert all(e.seq.tokens.tolist()[-3:] == [TOKEN] * 3 for e in entries)


def test_max_running_caps_admissions():
    w = World(max_batch_tokens=256, max_running=2, prefill_chunk=64)
    entries = [w.add(prompt(10, start=50 * i), max_new_tokens=3) for i in range(5)]
    batch = w.schedule()
    assert [c.entry for c in batch.chunks] == entries[:2]
    assert list(w.sched.waiting) == entries[2:]
    w.run(batch)
    for batch in w.drain():
        assert len(batch.chunks) <= 2
    assert all(e.phase is Phase.FINISHED for e in entries)
    assert w.states.num_runtime == 0 and not w.sched.running


def test_chunked_prefill_then_one_token_decode_chunks():
    w = World(max_batch_tokens=256, max_running=4, prefill_chunk=16)
    entry = w.add(prompt(50), max_new_tokens=4)
    spans = [(c.start, c.end) for b in w.drain() for c in b.chunks]
    assert spans == [(0, 16), (16, 32), (32, 48), (48, 50), (50, 51), (51, 52), (52, 53)]
    assert entry.generated == 4 and entry.seq.num_tokens == 54


def test_budget_smaller_than_chunk_splits_prefill():
    w = World(max_batch_tokens=5, max_running=4, prefill_chunk=16)
    w.add(prompt(12), max_new_tokens=1)
    spans = [(c.start, c.end) for b in w.drain() for c in b.chunks]
    assert spans == [(0, 5), (5, 10), (10, 12)]


def test_decode_and_prefill_share_a_batch():
    w = World(max_batch_tokens=10, max_running=4, prefill_chunk=8)
    a = w.add(prompt(4), max_new_tokens=5)
    w.step()  # a's prompt
    b = w.add(prompt(30, start=200), max_new_tokens=1)
    batch, _ = w.step()
    assert [(c.entry, c.end - c.start) for c in batch.chunks] == [(a, 1), (b, 8)]
    assert batch.num_tokens == 9


def test_in_flight_sequence_is_not_rescheduled():
    w = World(max_batch_tokens=64, max_running=4, prefill_chunk=64)
    a = w.add(prompt(10), max_new_tokens=3)
    first = w.schedule()
    second = w.schedule()  # async engine: the first forward is still queued
    assert [c.entry for c in first.chunks] == [a]
    assert second.chunks == []
    w.run(first)
    third = w.schedule()
    assert [(c.entry, c.start, c.end) for c in third.chunks] == [(a, 10, 11)]
    w.run(third)


# --- preemption --------------------------------------------------------------------------------


@pytest.mark.parametrize("hybrid", [True, False])
def test_preemption_by_recompute_when_decode_runs_out_of_blocks(hybrid):
    # 4 blocks: two prompts of 15 tokens take all of them; a's third block preempts b.
    w = World(num_blocks=4, hybrid=hybrid, max_batch_tokens=64, max_running=2, prefill_chunk=64)
    a = w.add(prompt(15), max_new_tokens=4)
    b = w.add(prompt(15, start=300), max_new_tokens=4)
    w.step()  # both prompts
    w.step()  # decode to 17 tokens each, 16 computed
    assert w.sched.preemptions == 0
    batch = w.schedule()
    assert w.sched.preemptions == 1
    assert [c.entry for c in batch.chunks] == [a]
    assert w.sched.waiting[0] is b
    assert b.phase is Phase.WAITING and b.runtime_slot == NO_SLOT
    assert b.seq.num_blocks == 0 and b.seq.num_computed == 0
    assert b not in w.sched.running and not b.in_flight
    assert b.generated == 2  # generated tokens stay part of the sequence and are recomputed
    w.check()
    w.run(batch)
    w.drain()
    assert a.phase is Phase.FINISHED and b.phase is Phase.FINISHED
    assert b.seq.num_tokens == 15 + 4 and b.generated == 4
    assert b.admissions >= 2
    assert w.pool.num_free + w.trie.nodes.num_attached + len(w.trie.checkpoints.frozen_blocks() if hybrid else []) == 4


def test_victim_is_most_recently_admitted_idle_sequence():
    w = World(num_blocks=4, hybrid=False, max_batch_tokens=64, max_running=3, prefill_chunk=64)
    a = w.add(prompt(16), max_new_tokens=6)
    b = w.add(prompt(4, start=100), max_new_tokens=2)
    c = w.add(prompt(4, start=200), max_new_tokens=2)
    w.step()  # a: 2 blocks, b and c: 1 block each; the pool is full
    batch = w.schedule()  # a's next decode needs a third block
    assert w.sched.preemptions == 1
    assert w.sched.waiting[0] is c  # the most recently admitted idle sequence goes
    assert c.seq.num_blocks == 0 and c.runtime_slot == NO_SLOT
    assert [chunk.entry for chunk in batch.chunks] == [a, b]
    w.run(batch)
    w.drain()
    assert all(e.phase is Phase.FINISHED for e in (a, b, c))


def test_scheduled_sequence_is_never_preempted_by_a_later_chunk_of_the_same_batch():
    # Regression: b needs a new block and the only other running sequence (a) was already
    # scheduled in this batch. a must keep running with its blocks (its chunk is in the batch);
    # b waits for the next step, holding what it has.
    w = World(num_blocks=4, max_batch_tokens=64, max_running=2, prefill_chunk=64)
    a = w.add(prompt(10), max_new_tokens=8)
    b = w.add(prompt(15, start=300), max_new_tokens=8)
    w.step()
    w.step()  # a: 12 tokens (2 blocks), b: 17 tokens with 16 computed
    batch = w.schedule()  # check_batch: every chunk's sequence still runs and holds its blocks
    assert [c.entry for c in batch.chunks] == [a]
    assert a.phase is Phase.RUNNING and a.seq.num_blocks == 2
    assert b.phase is Phase.RUNNING and b.seq.num_blocks == 2 and not b.in_flight
    assert w.sched.preemptions == 0
    w.run(batch)
    w.drain()
    assert a.phase is Phase.FINISHED and b.phase is Phase.FINISHED


def drain_overlapped(w: World, limit=2000) -> int:
    """Serve like an engine with one forward in flight: the next batch is scheduled before the
    previous one's output is in. Returns the number of steps."""
    queue = []
    for steps in range(1, limit):
        batch = w.schedule()
        if batch.chunks:
            queue.append(batch)
        while queue and (len(queue) > 1 or not batch.chunks):
            w.run(queue.pop(0))
        if not w.sched.has_work and not queue:
            return steps
    raise AssertionError(f"no progress after {limit} steps ({w.sched.preemptions} preemptions)")


@pytest.mark.parametrize("hybrid", [True, False])
def test_two_sequences_that_cannot_fit_together_finish_with_overlapped_forwards(hybrid):
    # Regression (livelock): with a forward in flight, the sequence that needed a block used to
    # preempt itself (the in-flight one cannot be a victim) and was re-admitted at once, losing
    # its progress each time while the other one did the same.
    w = World(num_blocks=5, num_slots=5, budget=2, hybrid=hybrid, max_batch_tokens=10, max_running=2,
              prefill_chunk=11, decode_checkpoint_interval=B)
    a = w.add(prompt(32), max_new_tokens=5)
    b = w.add(prompt(30, start=50), max_new_tokens=3)
    steps = drain_overlapped(w)
    assert a.phase is Phase.FINISHED and b.phase is Phase.FINISHED
    assert steps < 100


def test_private_duplicates_are_settled_before_deciding_room():
    # Regression (livelock): a hybrid miss recomputes cached blocks into private duplicates.
    # Once computed they must be swapped for the canonical trie blocks before the next chunk
    # asks for room; otherwise the request preempts itself and is re-admitted forever.
    w = World(num_blocks=7, num_slots=2, budget=0, max_batch_tokens=64, max_running=2, prefill_chunk=64)
    w.add(prompt(16), max_new_tokens=1)
    w.drain()
    assert w.trie.nodes.num_attached == 2 and w.states.num_checkpoint == 0  # blocks, no checkpoint
    b = w.add(prompt(16) + prompt(24, start=200), max_new_tokens=8)
    w.step()  # no checkpoint: recomputed from 0 into 5 blocks, 2 of them private duplicates
    assert b.cached_tokens == 0 and w.pool.num_free == 0
    w.drain(limit=50)
    assert b.phase is Phase.FINISHED and w.sched.preemptions == 0


def test_sequence_that_cannot_fit_preempts_itself():
    w = World(num_blocks=2, hybrid=False, max_batch_tokens=64, max_running=1, prefill_chunk=64)
    a = w.add(prompt(15), max_new_tokens=4)
    w.step()  # 16 tokens, 15 computed
    w.step()  # 17 tokens, 16 computed: the next decode needs a third block
    batch = w.schedule()
    assert batch.chunks == [] or all(c.entry is not a for c in batch.chunks)
    assert w.sched.waiting[0] is a and a.seq.num_blocks == 0 and a.runtime_slot == NO_SLOT
    w.check()


def test_cached_tokens_come_from_the_first_admission_only():
    w = World(num_blocks=64, max_batch_tokens=64, max_running=2, prefill_chunk=64)
    first = w.add(prompt(20), max_new_tokens=1)
    w.drain()
    second = w.add(prompt(20) + [TOKEN, 3, 4, 5], max_new_tokens=2)
    batch = w.schedule()
    assert second.cached_tokens == 20  # the prompt-end checkpoint of the first request
    assert batch.chunks[0].restore is not None and batch.chunks[0].start == 20
    w.run(batch)
    w.sched.preempt(second)
    w.check()
    w.drain()
    assert second.cached_tokens == 20 and second.admissions == 2
    assert first.cached_tokens == 0


# --- checkpoint saves ------------------------------------------------------------------------


def _saves(batches):
    return [(c.start, c.end, None if c.save is None else c.save.step) for b in batches for c in b.chunks]


def test_saves_at_chunk_ends_prompt_end_and_finish():
    w = World(max_batch_tokens=256, max_running=4, prefill_chunk=8, checkpoint_chunk_ends=True)
    w.add(prompt(20), max_new_tokens=4)
    assert _saves(w.drain()) == [
        (0, 8, 8),  # chunk end
        (8, 16, 16),
        (16, 20, 20),  # prompt end
        (20, 21, None),
        (21, 22, None),
        (22, 23, 23),  # the forward that finishes the request: its last position
    ]


def test_no_chunk_end_saves_when_disabled():
    w = World(max_batch_tokens=256, max_running=4, prefill_chunk=8, checkpoint_chunk_ends=False)
    w.add(prompt(20), max_new_tokens=2)
    assert _saves(w.drain()) == [(0, 8, None), (8, 16, None), (16, 20, 20), (20, 21, 21)]


def test_decode_interval_saves():
    w = World(max_batch_tokens=256, max_running=4, prefill_chunk=64, decode_checkpoint_interval=B)
    w.add(prompt(5), max_new_tokens=14)
    saves = _saves(w.drain())
    assert saves[0] == (0, 5, 5)
    decode_saves = [step for start, end, step in saves[1:-1] if step is not None]
    assert decode_saves == [8, 16]  # every interval, block aligned
    assert saves[-1] == (17, 18, 18)


def test_saves_are_published_only_after_the_forward():
    w = World(max_batch_tokens=256, max_running=4, prefill_chunk=64)
    w.add(prompt(12), max_new_tokens=2)
    batch = w.schedule()
    record = batch.chunks[0].save
    assert record is not None and record.state is CheckpointState.RESERVED
    w.run(batch)
    assert record.state is CheckpointState.PUBLISHED and record.ready and record.pin_count == 0


@pytest.mark.parametrize("kind", ["attention_only", "disabled"])
def test_no_saves_without_a_hybrid_enabled_cache(kind):
    w = World(hybrid=kind != "attention_only", enabled=kind != "disabled", prefill_chunk=8)
    w.add(prompt(20), max_new_tokens=3)
    assert all(step is None for _, _, step in _saves(w.drain()))
    assert w.states.num_checkpoint == 0


def test_second_request_restores_prompt_end_checkpoint_and_finishes():
    w = World(max_batch_tokens=256, max_running=4, prefill_chunk=64)
    a = w.add(prompt(13), max_new_tokens=3)
    w.drain()
    # a computed 15 tokens; its finish checkpoint is at 15 (mid-block)
    follow = prompt(13) + a.seq.tokens.tolist()[13:] + [40, 41]
    b = w.add(follow, max_new_tokens=2)
    batch = w.schedule()
    chunk = batch.chunks[0]
    assert chunk.restore is not None and chunk.restore.step == 15 and chunk.start == 15
    assert not chunk.zero_state
    assert b.cached_tokens == 15
    w.run(batch)
    w.drain()
    assert b.phase is Phase.FINISHED


def test_everything_is_released_after_all_requests_finish():
    w = World(num_blocks=12, num_slots=6, budget=2, max_batch_tokens=24, max_running=3, prefill_chunk=10,
              decode_checkpoint_interval=B)
    entries = [w.add(prompt(9 + 5 * i, start=7 * i), max_new_tokens=2 + i) for i in range(5)]
    w.drain()
    assert all(e.phase is Phase.FINISHED and e.runtime_slot == NO_SLOT and e.seq.num_blocks == 0 for e in entries)
    assert w.states.num_runtime == 0
    w.trie.clear()
    w.check()
    assert w.pool.num_free == 12
    assert w.states.num_free == 5


# --- arrival pins ------------------------------------------------------------------------------


def _waiting_behind_saves(pin: bool):
    """A waits behind R (one running at a time), whose chunk-end saves need the checkpoint
    slot A's prompt-end checkpoint holds; B, waiting, would restore that checkpoint."""
    w = World(num_slots=4, budget=1, max_batch_tokens=64, max_running=1, prefill_chunk=8)
    w.add(prompt(20), max_new_tokens=1)
    w.drain()
    running = w.add(prompt(40, start=100), max_new_tokens=2)
    w.step()
    waiting = w.add(prompt(20) + [TOKEN, 3, 4, 5], max_new_tokens=1)
    if not pin:
        assert w.sched.arrival_pins.release(waiting.seq) is not None
        w.check()
    return w, running, waiting


def test_an_arrival_pin_keeps_what_a_waiting_request_would_restore():
    w, running, waiting = _waiting_behind_saves(pin=True)
    assert len(w.sched.arrival_pins) == 1
    w.drain()
    assert waiting.cached_tokens == 20 and running.phase is Phase.FINISHED
    assert len(w.sched.arrival_pins) == 0


def test_without_the_arrival_pin_the_saves_beside_it_evict_it():
    w, _, waiting = _waiting_behind_saves(pin=False)
    w.drain()
    assert waiting.cached_tokens == 0  # what the test above shows the pin preventing


def test_a_cancelled_waiting_request_releases_its_arrival_pin():
    w, _, waiting = _waiting_behind_saves(pin=True)
    record = waiting.seq.prefix_state.checkpoints.restore
    assert record is not None and record.restore_pins == 1
    w.sched.cancel(waiting)
    w.check()
    assert record.restore_pins == 0 and len(w.sched.arrival_pins) == 0
    w.drain()


def test_an_arrival_pin_counts_no_hit_of_its_own():
    w, _, waiting = _waiting_behind_saves(pin=True)
    record = waiting.seq.prefix_state.checkpoints.restore
    hits = record.hits
    w.drain()
    assert waiting.cached_tokens == 20 and record.hits == hits + 1  # the admission's, once


def test_arrival_pins_never_keep_requests_from_finishing():
    """Small pools, shared prefixes, requests arriving while others run: every request
    finishes and the pins stay consistent at every step (``check``)."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        w = World(num_blocks=12, num_slots=4, budget=2, max_batch_tokens=24, max_running=2, prefill_chunk=8)
        prefixes = [prompt(16, start=1), prompt(16, start=300)]
        entries = []
        for _ in range(40):
            if rng.random() < 0.6:
                head = prefixes[int(rng.integers(2))]
                entries.append(w.add(head + rng.integers(500, 600, int(rng.integers(1, 12))).tolist(),
                                     max_new_tokens=int(rng.integers(1, 4))))
            if w.sched.has_work:
                w.step()
        w.drain()
        assert all(e.phase is Phase.FINISHED for e in entries)
        assert len(w.sched.arrival_pins) == 0
        assert sum(e.cached_tokens > 0 for e in entries) > 0


def _turn_ended_beside_saves(hold: bool):
    """A ends its turn while R runs (checkpoint budget 1): R's prompt-end saves in the next two
    schedules need the slot A's turn-end checkpoint holds; A's next turn arrives after them."""
    w = World(num_slots=4, budget=1, max_batch_tokens=64, max_running=2, prefill_chunk=8)
    first = w.add(prompt(16), max_new_tokens=2)
    running = w.add(prompt(40, start=100), max_new_tokens=2)
    while first.phase is not Phase.FINISHED:
        w.step()
    assert w.sched.arrival_pins.holders() == [first.seq]
    if not hold:
        assert w.sched.arrival_pins.release_holds() == 1
        w.check()
    for _ in range(TURN_HOLD_SCHEDULES):
        w.step()
    next_turn = w.add(first.seq.tokens.tolist() + [3, 4, 5], max_new_tokens=1)
    w.drain()
    assert running.phase is Phase.FINISHED and next_turn.phase is Phase.FINISHED
    return first, next_turn


def test_a_turn_end_hold_keeps_the_state_a_next_turn_on_its_way_restores():
    first, next_turn = _turn_ended_beside_saves(hold=True)
    assert next_turn.cached_tokens == first.seq.num_tokens - 1  # the turn's last state, at its last input


def test_without_the_turn_end_hold_the_saves_after_the_turn_evict_it():
    _, next_turn = _turn_ended_beside_saves(hold=False)
    assert next_turn.cached_tokens == 0  # what the test above shows the hold preventing


def test_a_turn_end_hold_lasts_its_schedules_then_unpins():
    w = World(num_slots=6, budget=3, max_batch_tokens=64, max_running=2, prefill_chunk=8)
    first = w.add(prompt(16), max_new_tokens=2)
    w.add(prompt(80, start=100), max_new_tokens=2)
    while first.phase is not Phase.FINISHED:
        w.step()
    record = first.seq.prefix_state.checkpoints.restore
    assert record.restore_pins == 1
    for _ in range(TURN_HOLD_SCHEDULES):
        w.step()
        assert record.restore_pins == 1
    w.step()
    assert record.restore_pins == 0 and not w.sched.arrival_pins.holders()
    w.drain()


def test_a_request_finishing_alone_holds_nothing():
    """Nothing else runs or waits: no save can come before the next turn, which pins on arrival."""
    w = World(num_slots=4, budget=1, max_batch_tokens=64, max_running=2, prefill_chunk=8)
    w.add(prompt(16), max_new_tokens=2)
    w.drain()
    assert not w.sched.arrival_pins.holders()
    assert all(record.pin_count == 0 for record in w.trie.checkpoints.live_records())


@pytest.mark.parametrize("num_blocks, gives_way", [(7, True), (9, False)])
def test_an_arrival_pin_gives_way_to_a_running_request_that_needs_its_blocks(num_blocks, gives_way):
    """R runs alone (one at a time) and needs, at its decode, the blocks under the checkpoint B
    pinned on arrival: the pin gives way (B restores nothing), R is not preempted for it."""
    w = World(num_blocks=num_blocks, num_slots=4, budget=1, max_batch_tokens=64, max_running=1, prefill_chunk=8)
    w.add(prompt(16), max_new_tokens=1)
    w.drain()
    running = w.add(prompt(40, start=100), max_new_tokens=3)
    w.step()
    waiting = w.add(prompt(16) + [TOKEN, 3, 4], max_new_tokens=1)
    assert len(w.sched.arrival_pins) == 1
    w.drain()
    assert running.phase is Phase.FINISHED and waiting.phase is Phase.FINISHED and w.sched.preemptions == 0
    assert w.sched.arrival_pins.given_way == int(gives_way)
    assert waiting.cached_tokens == (0 if gives_way else 16)


def test_no_admission_is_tried_at_the_runtime_slot_cap():
    """Two runtime slots (4 slots, checkpoint budget 1) held by running requests, cap on running
    sequences 4: the waiting request is not admitted while the runtime slots are taken, and
    restores the checkpoint it pinned on arrival once they are free."""
    w = World(num_slots=4, budget=1, max_batch_tokens=64, max_running=4, prefill_chunk=8)
    w.add(prompt(20), max_new_tokens=1)
    w.drain()
    running = [w.add(prompt(30, start=100 * (i + 1)), max_new_tokens=3) for i in range(2)]
    waiting = w.add(prompt(20) + [TOKEN, 3, 4, 5], max_new_tokens=1)
    assert len(w.sched.arrival_pins) == 1
    batch, _ = w.step()
    assert waiting not in [chunk.entry for chunk in batch.chunks] and w.states.num_runtime == 2
    w.drain()
    assert all(entry.phase is Phase.FINISHED for entry in running)
    assert waiting.cached_tokens == 20


def test_auto_grid_follows_the_weight_of_a_state():
    """The engine says what a checkpoint weighs in KV tokens; ``auto`` plans no grid finer than
    twice that (as the replay does), so a heavy-state model's prefills end fewer chunks early.
    64 blocks of 8 tokens against 6 usable slots: 85 KV tokens per slot keeps the grid dense."""
    light = World(checkpoint_policy="auto:128", num_slots=8)
    assert light.sched.admission.grid == 128  # auto:G is taken as given
    heavy = World(checkpoint_policy="auto", num_slots=8, state_weight_tokens=3000.0)
    assert heavy.sched.admission.grid == 6144 and not heavy.sched.admission.sparse
    unknown = World(checkpoint_policy="auto", num_slots=8)
    assert unknown.sched.admission.grid == 2048


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "x"])
def test_a_bad_state_weight_is_refused_by_the_config(bad):
    with pytest.raises(InvalidConfigError, match="state_weight_tokens"):
        SchedulerConfig(checkpoint_policy="auto", state_weight_tokens=bad)
