"""Several forwards of one sequence in one call (``run_forwards``): the same decisions and the
same records as the one-by-one boundaries, over random schedules under pool pressure."""

from __future__ import annotations

from dataclasses import astuple

import numpy as np
import pytest

from hybridcache import CacheConfig, Sequence
from hybridcache.cache import build_cache
from hybridcache.errors import InvalidStepError, InvalidTypeError
from hybridcache.protocol import CacheProtocol

B = 8


def protocol(blocks: int, slots: int) -> CacheProtocol:
    config = CacheConfig(block_size=B, num_kv_blocks=blocks, num_state_slots=slots + 2, checkpoint_budget=slots, hybrid=True)
    return CacheProtocol(build_cache(config, track_pending=True))


def one_by_one(cache: CacheProtocol, seq: Sequence, ends: list[int], saves: set[int]) -> list[bool]:
    """The reference path: each forward through the single-step boundaries, invariants checked
    after every call."""
    published = []
    for index, end in enumerate(ends):
        if index:
            cache.swap_computed_duplicates(seq)
            if not cache.extend(seq, end):
                break
            cache.check_invariants([seq])
        record = cache.reserve_save(seq, end).record if end in saves else None
        cache.check_invariants([seq])
        cache.forward_queued(seq)
        queued_published = record is not None and record.is_published
        cache.check_invariants([seq])
        start = seq.num_computed
        seq.set_computed(end)
        landed = cache.forward_done(seq, start)
        assert landed.published == queued_published and landed.save is (record if queued_published else None)
        published.append(landed.published)
        cache.check_invariants([seq])
    return published


def batched(cache: CacheProtocol, seq: Sequence, ends: list[int], saves: set[int]) -> list[bool]:
    seen = []

    def on_save(record, last_published):
        cache.check_invariants([seq])  # every reserve leaves the structures whole mid-call
        seen.append((record.step, last_published))

    before = astuple(cache.released_checkpoints())
    run = cache.run_forwards(seq, ends, saves, on_save)
    cache.check_invariants([seq])
    after = astuple(cache.released_checkpoints())
    assert astuple(run.released) == tuple(b - a for a, b in zip(before, after))  # the run reports every release
    reserved = [step for step, _ in seen]
    assert reserved == sorted(reserved) and set(reserved) <= saves
    assert all(last < step for step, last in seen)
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


def serve(cache: CacheProtocol, tokens: np.ndarray, chunk: int, rng: np.random.Generator, path) -> tuple:
    seq = Sequence(tokens)
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


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("blocks,slots", [(8, 2), (24, 3), (64, 6), (400, 40)])
def test_batched_forwards_make_the_same_decisions_and_records_as_one_by_one(seed, blocks, slots):
    trace = prompts(np.random.default_rng(seed), 40)
    caches = {path: protocol(blocks, slots) for path in (one_by_one, batched)}
    results = {}
    for path, cache in caches.items():
        rng = np.random.default_rng(1000 + seed)  # the same schedules for both paths
        results[path] = [serve(cache, tokens, int(rng.integers(1, 30)), rng, path) for tokens in trace]
    assert results[batched] == results[one_by_one]
    assert fingerprint(caches[batched], []) == fingerprint(caches[one_by_one], [])
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
    run = cache.run_forwards(seq, [16, 39], {16, 39})
    assert run.published == [True, True] and run.completed == 2
    cache.free(seq, admission.runtime_slot)
    cache.check_invariants()
