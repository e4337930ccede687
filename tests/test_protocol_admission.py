"""Admission as a transaction (``CacheProtocol.admit``) with the real cache components: a
successful admission takes exactly what its first chunk needs; a failed one, whatever the
reason, leaves the sequence, the pools, the pins, the trie and the match statistics as they
were (evictions it performed are real and stay counted)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.cache import CacheComponents
from hybridcache.protocol import Admission, CacheProtocol
from hybridcache.sequence import Sequence

from tests.scheduler.test_scheduler import TOKEN, World, prompt

B = 8


def protocol_of(w) -> CacheProtocol:
    return CacheProtocol(CacheComponents(w.pool, w.states, w.trie))


def admit_within(seq, trie, pool, states, token_budget, chunk_limit):
    """The protocol's admission for a budget and a chunk limit: the Admission, or None when it
    changed nothing."""
    admitted = CacheProtocol(CacheComponents(pool, states, trie)).admit(seq, min(token_budget, chunk_limit))
    return admitted if admitted.admitted else None


# the protocol fields of ``prefix_state`` a rollback restores (not the caches of facts about the
# tokens: block keys, the verified node and its path)
RESTORED_FIELDS = (
    "trie.cursor",
    "trie.cursor_generation",
    "trie.experts_cached_blocks",
    "overlap.fresh_range",
    "overlap.trie_block_map",
    "suppress_stats",
    "checkpoints.restore",
    "checkpoints.restore_pinned",
    "checkpoints.pending_save",
    "checkpoints.producer_pin",
    "checkpoints.decode_checkpoint",
    "checkpoints.records_missing_experts",
)


def _field(state, dotted: str):
    for name in dotted.split("."):
        state = getattr(state, name)
    return state


def _plain(value):
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "record_id"):
        return ("record", value.record_id)
    return value


def seq_image(seq: Sequence):
    """Everything a rollback restores on a sequence (not the cached keys of its tokens)."""
    state = {k: _plain(_field(seq.prefix_state, k)) for k in RESTORED_FIELDS}
    experts = seq.routed_experts
    return (
        seq.tokens.tolist(),
        seq.num_computed,
        seq.block_table.tolist(),
        [] if experts is None else experts.tolist(),
        tuple(sorted(state.items())),
    )


def world_image(pool: BlockPool, states: StatePool, trie: BlockTrie, *seqs: Sequence):
    """The observable cache state (recency stamps excluded: a failed admission may refresh the
    checkpoint it tried to restore)."""
    blocks = np.arange(pool.num_blocks)
    nodes = trie.nodes
    attached = nodes.attached_slots()
    image = {
        "refcounts": pool.refcounts(blocks).tolist(),
        "num_free": pool.num_free,
        "roles": [int(states.role_of(s)) for s in range(states.num_slots)],
        "runtime": states.num_runtime,
        "state_free": states.num_free,
        "stats": trie.stats.as_dict(),
        "nodes": [
            (int(s), int(nodes.generation[s]), int(nodes.block[s]), bool(nodes.pending[s]), int(nodes.parent[s]))
            for s in attached.tolist()
        ],
        "seqs": [seq_image(seq) for seq in seqs],
    }
    if trie.is_hybrid:
        image["records"] = sorted(
            (r.record_id, r.state.value, r.step, r.slot, r.frozen_block, r.restore_pins, r.producer_pins, r.ready)
            for r in trie.checkpoints.live_records()
        )
        image["index"] = sorted((key, r.record_id) for key, r in trie.index.entries())
    return image


def cached_world(prompt_len=13, hybrid=True, num_blocks=8, **kwargs):
    """A world whose cache holds one finished request of ``prompt_len`` tokens generating one
    token: its complete blocks and, in hybrid mode, one checkpoint at the prompt end."""
    w = World(num_blocks=num_blocks, hybrid=hybrid, max_batch_tokens=64, max_running=4, prefill_chunk=64, **kwargs)
    w.add(prompt(prompt_len), max_new_tokens=1)
    w.drain()
    return w


def follow_up(prompt_len=13, extra=6):
    return Sequence(prompt(prompt_len) + [TOKEN] + list(range(400, 400 + extra)))


def take_all_free(pool: BlockPool) -> Sequence:
    """Another holder (a sequence outside the scheduler) takes every free block."""
    hog = Sequence([0])
    hog.write_blocks(0, pool.allocate(pool.num_free))
    return hog


def check(w: World, *seqs: Sequence) -> None:
    w.trie.check_invariants([*w.sched.live_sequences(), *seqs])
    w.states.check_invariants()


# --- helpers ------------------------------------------------------------------------------------


def test_blocks_needed_counts_only_missing_blocks():
    seq = Sequence(prompt(20))
    pool = BlockPool(4)
    cache = CacheProtocol(CacheComponents(pool, StatePool(2), BlockTrie(pool, B)))
    assert cache.blocks_needed(seq, 20) == 3
    assert cache.blocks_needed(seq, 0) == 0
    pool.grow_table(seq, 9, B)
    assert cache.blocks_needed(seq, 9) == 0 and cache.blocks_needed(seq, 17) == 1 and cache.blocks_needed(seq, 20) == 1
    pool.release_table(seq)


def test_make_block_room_evicts_cached_leaves_only_as_needed():
    w = World(num_blocks=6, hybrid=False, max_batch_tokens=64, max_running=4, prefill_chunk=64)
    w.add(prompt(33), max_new_tokens=1)
    w.drain()
    assert w.pool.num_free == 2 and w.trie.nodes.num_attached == 4
    assert protocol_of(w).make_block_room(2) and w.pool.num_free == 2  # nothing evicted
    assert protocol_of(w).make_block_room(3) and w.pool.num_free == 3
    assert w.trie.stats.evicted_blocks == 1
    assert not protocol_of(w).make_block_room(7)  # more than the pool: nothing evicted for it
    assert w.pool.num_free == 3 and w.trie.nodes.num_attached == 3
    assert protocol_of(w).make_block_room(6)
    assert w.pool.num_free == 6 and w.trie.nodes.num_attached == 0
    check(w)


# --- successful admissions ---------------------------------------------------------------------


def test_admit_fresh_sequence_takes_its_first_chunk():
    w = World(num_blocks=16)
    seq = Sequence(prompt(30))
    free = w.pool.num_free
    admitted = admit_within(seq, w.trie, w.pool, w.states, token_budget=100, chunk_limit=20)
    assert isinstance(admitted, Admission)
    assert (admitted.start, admitted.end, admitted.hit_tokens, admitted.restore) == (0, 20, 0, None)
    assert w.states.role_of(admitted.runtime_slot).name == "RUNTIME"
    assert seq.num_blocks == 3 and w.pool.num_free == free - 3
    assert w.trie.nodes.num_attached == 2 and w.trie.nodes.pending[w.trie.nodes.attached_slots()].all()
    check(w, seq)
    w.states.free_runtime(admitted.runtime_slot)
    w.trie.free_sequence(seq)
    check(w)


def test_admit_with_hit_pins_the_restore():
    w = cached_world()
    seq = follow_up()
    admitted = admit_within(seq, w.trie, w.pool, w.states, token_budget=100, chunk_limit=100)
    assert admitted is not None
    record = admitted.restore
    assert record is not None and record.step == 13 and record.restore_pins == 1
    assert (admitted.start, admitted.end, admitted.hit_tokens) == (13, 20, 13)
    assert seq.prefix_state.checkpoints.restore_pinned and seq.num_computed == 13
    assert w.trie.stats.match.hits == 1
    check(w, seq)


def test_attention_only_hit_is_block_aligned():
    w = cached_world(prompt_len=19, hybrid=False)
    seq = follow_up(prompt_len=19)
    admitted = admit_within(seq, w.trie, w.pool, w.states, token_budget=100, chunk_limit=100)
    assert admitted is not None and admitted.restore is None
    assert admitted.hit_tokens == 16 and admitted.start == 16
    check(w, seq)


# --- failed admissions are exact rollbacks -------------------------------------------------------


def _fail_exactly(w: World, seq: Sequence, *others: Sequence, **limits):
    before = world_image(w.pool, w.states, w.trie, seq)
    stats = w.trie.stats.snapshot()
    assert admit_within(seq, w.trie, w.pool, w.states, **limits) is None
    assert world_image(w.pool, w.states, w.trie, seq) == before
    assert w.trie.stats.snapshot() == stats
    assert not seq.prefix_state.checkpoints.restore_pinned and seq.prefix_state.checkpoints.restore is None
    assert seq.num_computed == 0 and seq.num_blocks == 0
    check(w, seq, *others)
    return True


@pytest.mark.parametrize("hybrid", [True, False])
def test_zero_budget_after_a_hit_rolls_back_exactly(hybrid):
    w = cached_world(prompt_len=19, hybrid=hybrid)
    assert _fail_exactly(w, follow_up(prompt_len=19), token_budget=0, chunk_limit=100)


@pytest.mark.parametrize("hybrid", [True, False])
def test_no_block_room_after_a_hit_rolls_back_exactly(hybrid):
    w = cached_world(prompt_len=19, hybrid=hybrid)
    hog = take_all_free(w.pool)
    # nothing is evictable: the only cached blocks are on the matched path (and the checkpoint
    # being restored is pinned)
    assert _fail_exactly(w, follow_up(prompt_len=19), hog, token_budget=100, chunk_limit=100)
    w.pool.release_table(hog)
    check(w)


def test_no_runtime_slot_rolls_back_exactly():
    w = cached_world(num_slots=4, budget=1)  # runtime cap 2, one checkpoint
    assert w.states.num_checkpoint == 1
    taken = [w.states.allocate_runtime() for _ in range(w.states.runtime_cap)]
    try:
        # the only checkpoint is the one being restored: pinned, so no slot can be freed
        _fail_exactly(w, follow_up(), token_budget=100, chunk_limit=100)
    finally:
        for slot in taken:
            w.states.free_runtime(slot)


def test_restore_that_cannot_be_pinned_rolls_back_exactly(monkeypatch):
    w = cached_world()
    calls = []
    monkeypatch.setattr(w.trie.checkpoints, "pin_restore", lambda seq: calls.append(seq) or False)
    _fail_exactly(w, follow_up(), token_budget=100, chunk_limit=100)
    assert len(calls) == 2  # retried once after a fresh match


def test_failed_admissions_never_leak_and_a_later_admission_hits():
    w = cached_world(prompt_len=19)
    seq = follow_up(prompt_len=19)
    hog = take_all_free(w.pool)
    before = world_image(w.pool, w.states, w.trie, seq)
    for budget in (100, 0, 50, 0, 100) * 4:
        assert admit_within(seq, w.trie, w.pool, w.states, token_budget=budget, chunk_limit=64) is None
    assert world_image(w.pool, w.states, w.trie, seq) == before
    check(w, seq, hog)
    w.pool.release_table(hog)
    admitted = admit_within(seq, w.trie, w.pool, w.states, token_budget=100, chunk_limit=64)
    assert admitted is not None and admitted.hit_tokens == 19 and admitted.restore.step == 19
    assert w.trie.stats.match.matches == 2 and w.trie.stats.match.hits == 1  # the failures left no trace
    check(w, seq)


def test_evictions_during_a_failed_admission_stay_done():
    w = World(num_blocks=8, hybrid=False, max_batch_tokens=64, max_running=4, prefill_chunk=64)
    w.add(prompt(17), max_new_tokens=1)  # 2 cached blocks on the path of the next request
    w.add(prompt(9, start=300), max_new_tokens=1)  # 1 unrelated cached block
    w.drain()
    hog = take_all_free(w.pool)
    # 2 blocks beyond the hit: eviction could free that many (3 cached) but frees only the
    # unrelated one (the hit's path is borrowed); a need beyond every cached block evicts nothing
    seq = Sequence(prompt(17) + [TOKEN] + list(range(500, 514)))
    image = seq_image(seq)
    stats = w.trie.stats.snapshot()
    assert admit_within(seq, w.trie, w.pool, w.states, token_budget=100, chunk_limit=100) is None
    assert seq_image(seq) == image and w.trie.stats.snapshot() == stats  # the match is undone
    assert w.trie.stats.evicted_blocks == 1 and w.pool.num_free == 1  # the eviction is not
    check(w, seq, hog)
    w.pool.release_table(hog)
    admitted = admit_within(seq, w.trie, w.pool, w.states, token_budget=100, chunk_limit=100)
    assert admitted is not None and admitted.hit_tokens == 16  # the path it matched survived
    check(w, seq)


def test_scheduler_keeps_a_rejected_request_at_the_front():
    w = cached_world(prompt_len=19, num_blocks=5)
    hog = take_all_free(w.pool)
    entry = w.add(follow_up(prompt_len=19).tokens.tolist(), max_new_tokens=2)
    pins = w.sched.arrival_pins
    assert len(pins) == 1  # what it would restore, pinned on arrival
    batch = w.sched.schedule()
    assert batch.chunks == [] and list(w.sched.waiting) == [entry]
    assert len(pins) == 0  # released for its match; nothing runs that could free room, so not taken again
    before = world_image(w.pool, w.states, w.trie, entry.seq)
    assert w.sched.schedule().chunks == [] and list(w.sched.waiting) == [entry]
    assert entry.admissions == 0 and entry.cached_tokens == 0
    assert world_image(w.pool, w.states, w.trie, entry.seq) == before  # the refused admission is undone
    w.sched.check_invariants()
    check(w, hog)
    w.pool.release_table(hog)
    w.drain()
    assert entry.cached_tokens == 19 and entry.generated == 2
