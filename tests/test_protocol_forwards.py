"""Several forwards of one sequence in one call (``run_forwards``): the same decisions and the
same records as the one-by-one boundaries, over random schedules under pool pressure, with and
without an eviction policy state that learns from the producer (told and asked alike)."""

from __future__ import annotations

from dataclasses import astuple

import numpy as np
import pytest

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import InvalidArgumentError, InvalidStepError, InvalidTypeError
from hybridcache.policies.admission import KINDS
from hybridcache.policies.eviction import LeafLRUState
from hybridcache.protocol import CacheProtocol

B = 8


class RecordingNotes(LeafLRUState):
    """A producer-notes policy state: declines the saves at multiples of 5, records every note
    with the structures checked whole at that moment (mid-``run_forwards`` too)."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[tuple] = []
        self.cache: CacheProtocol | None = None
        self.live: list[Sequence] = []

    def admits(self, seq, step: int, kind: str) -> bool:
        return step % 5 != 0

    def note_save(self, record, parent_step: int, kind: str) -> None:
        super().note_save(record, parent_step, kind)
        self.cache.check_invariants(self.live)
        self.notes.append(("save", record.step, parent_step, kind))

    def note_admitted(self, seq, restore) -> None:
        self.notes.append(("admitted", seq.num_computed, None if restore is None else restore.step))


def protocol(blocks: int, slots: int, notes: RecordingNotes | None = None) -> CacheProtocol:
    config = CacheConfig(block_size=B, num_kv_blocks=blocks, num_state_slots=slots + 2, checkpoint_budget=slots, hybrid=True)
    cache = CacheProtocol(build_cache(config, track_pending=True, eviction=notes))
    if notes is not None:
        notes.cache = cache
    return cache


def kind_of(end: int) -> str:
    return KINDS[end % len(KINDS)]


def one_by_one(cache: CacheProtocol, seq: Sequence, ends: list[int], saves: set[int]) -> list[bool]:
    """The reference path: each forward through the single-step boundaries, invariants checked
    after every call; each save told its reason and the step it is computed from."""
    published = []
    parent = seq.num_computed
    for index, end in enumerate(ends):
        if index:
            cache.swap_computed_duplicates(seq)
            if not cache.extend(seq, end):
                break
            cache.check_invariants([seq])
        record = cache.reserve_save(seq, end, kind_of(end), parent).record if end in saves else None
        cache.check_invariants([seq])
        cache.forward_queued(seq)
        queued_published = record is not None and record.is_published
        cache.check_invariants([seq])
        start = seq.num_computed
        seq.set_computed(end)
        landed = cache.forward_done(seq, start)
        assert landed.published == queued_published and landed.save is (record if queued_published else None)
        published.append(landed.published)
        parent = end if landed.published else parent
        cache.check_invariants([seq])
    return published


def batched(cache: CacheProtocol, seq: Sequence, ends: list[int], saves: set[int]) -> list[bool]:
    before = astuple(cache.released_checkpoints())
    run = cache.run_forwards(seq, ends, {end: kind_of(end) for end in saves}, seq.num_computed)
    cache.check_invariants([seq])
    after = astuple(cache.released_checkpoints())
    assert astuple(run.released) == tuple(b - a for a, b in zip(before, after))  # the run reports every release
    return run.published


def fingerprint(cache: CacheProtocol, seqs: list[Sequence]) -> tuple:
    records = sorted(
        (r.step, r.anchor, r.slot, r.frozen_block, r.state.value, r.stamp, r.hits, r.pin_count, r.ready)
        for r in cache.checkpoints.live_records()
    )
    stats = cache.stats()
    return records, stats, cache.released_checkpoints(), [(s.block_table.tolist(), s.num_computed) for s in seqs]


def schedule(rng: np.random.Generator, prompt_length: int, start: int) -> tuple[list[int], set[int]]:
    cuts = rng.choice(np.arange(start + 1, prompt_length + 1), size=min(prompt_length - start, int(rng.integers(1, 9))), replace=False)
    ends = sorted({int(cut) for cut in cuts} | {prompt_length})
    saves = {end for end in ends if rng.random() < 0.7}
    return ends, saves


def serve(cache: CacheProtocol, tokens: np.ndarray, chunk: int, rng: np.random.Generator, path, notes=None) -> tuple:
    seq = Sequence(tokens)
    if notes is not None:
        notes.live = [seq]
    cache.prepare(seq)
    admission = cache.admit(seq, chunk)
    cache.check_invariants([seq])
    if not admission.admitted:
        cache.free(seq)
        return (admission.refused,)
    ends, saves = schedule(rng, len(tokens), admission.end)
    ends = [admission.end] + [end for end in ends if end > admission.end]
    published = path(cache, seq, ends, saves)
    result = (admission.start, admission.end, ends, sorted(saves), published, fingerprint(cache, [seq]))
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants()
    return result


def prompts(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    stems = [rng.integers(1, 50, size=int(rng.integers(4, 40))) for _ in range(4)]
    return [
        np.concatenate([stems[int(rng.integers(0, 4))], rng.integers(1, 50, size=int(rng.integers(1, 60)))])
        for _ in range(count)
    ]


@pytest.mark.parametrize("learns", [False, True])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("blocks,slots", [(8, 2), (24, 3), (64, 6), (400, 40)])
def test_batched_forwards_make_the_same_decisions_and_records_as_one_by_one(seed, blocks, slots, learns):
    trace = prompts(np.random.default_rng(seed), 40)
    notes = {path: RecordingNotes() if learns else None for path in (one_by_one, batched)}
    caches = {path: protocol(blocks, slots, notes[path]) for path in (one_by_one, batched)}
    results = {}
    for path, cache in caches.items():
        rng = np.random.default_rng(1000 + seed)  # the same schedules for both paths
        results[path] = [serve(cache, tokens, int(rng.integers(1, 30)), rng, path, notes[path]) for tokens in trace]
    assert results[batched] == results[one_by_one]
    assert fingerprint(caches[batched], []) == fingerprint(caches[one_by_one], [])
    if learns:  # told the same notes in the same order, a declined save never reserved
        assert notes[batched].notes == notes[one_by_one].notes
        saved = [note for note in notes[batched].notes if note[0] == "save"]
        assert saved and all(step % 5 and parent < step for _, step, parent, _ in saved)
        assert any(note[0] == "admitted" for note in notes[batched].notes)
    released = caches[batched].released_checkpoints()
    # the trie's eviction counter is exactly the releases under state-slot and KV pressure
    assert caches[batched].stats()["evicted_checkpoints"] == released.state_slots + released.kv_blocks
    served = [r for r in results[batched] if len(r) > 1]
    assert any(any(r[4]) for r in served)  # saves were published
    if blocks == 8:  # and runs stopped where a forward's blocks could not be had
        assert any(len(r[4]) < len(r[2]) for r in served)


def test_bad_ends_raise_and_change_nothing():
    cache = protocol(32, 4)
    seq = Sequence(list(range(1, 40)))
    cache.prepare(seq)
    admission = cache.admit(seq, 16)
    before = fingerprint(cache, [seq])
    for ends, error in [
        ([8, 8], InvalidStepError),
        ([0], InvalidStepError),
        ([16, 60], InvalidStepError),
        ([24], InvalidStepError),  # the first forward's blocks are not held
        ("16", InvalidTypeError),
        ([16.5], InvalidTypeError),
    ]:
        with pytest.raises(error):
            cache.run_forwards(seq, ends, {16})
        assert fingerprint(cache, [seq]) == before
    with pytest.raises(InvalidTypeError):
        cache.run_forwards("seq", [16])
    for saves, parent_step, error in [
        ({16: "whim"}, 0, InvalidArgumentError),  # a reason the policies do not know
        ({16: 3}, 0, InvalidArgumentError),
        ({16: KINDS[0]}, -1, InvalidArgumentError),
        ({16: KINDS[0]}, 1.5, InvalidTypeError),
        (16, 0, InvalidTypeError),
    ]:
        with pytest.raises(error):
            cache.run_forwards(seq, [16], saves, parent_step)
        assert fingerprint(cache, [seq]) == before
    for kind, parent_step, error in [("whim", 0, InvalidArgumentError), (KINDS[0], -1, InvalidArgumentError)]:
        with pytest.raises(error):
            cache.reserve_save(seq, 16, kind, parent_step)
        assert fingerprint(cache, [seq]) == before
    run = cache.run_forwards(seq, [16, 39], {16, 39})
    assert run.published == [True, True] and run.completed == 2
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants()
