"""Where a hit's identity work goes, stage by stage, without a profiler. Owns nothing.

``measure_hit_chain`` times the calls a hit makes (``kv-match``: attention-only, every prompt
cached as one run; ``match``: hybrid, an aligned checkpoint at the prompt's end) one level at a
time, each on its own batch of fresh requests (tokens not in cache, as in the scenarios), in
CPU time, best of ``case.rounds`` rounds, GC paused. A stage's *own* time is its time less the
stages measured inside it, so the rows add up to the measured ingest and match with no
profiler overhead to scale away (``measure_identity_stages`` gives the call counts).

Every call timed here is one the trie makes on the way (its methods, called with the
arguments the trie passes), in the state it makes them in: the nested stages of ingest run on
requests claimed by the trie, those of match on requests ingested just before.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import numpy as np

from hybridcache.bench.admission_stages import _cached_impl
from hybridcache.bench.impl import HybridcacheImpl
from hybridcache.bench.scenarios import Case, gc_paused, with_suffix
from hybridcache.errors import BenchmarkSetupError
from hybridcache.prefix_cache.match_txn import MatchTxn
from hybridcache.sequence import Sequence


Stage = tuple[Callable, Callable, Callable]  # untimed preparation -> its value, timed call, untimed clean-up


def _cpu_us(impl: HybridcacheImpl, prompts: list, round_index: int, stage: Stage) -> float:
    """CPU µs per request of a stage's call over a fresh batch (tokens not in cache)."""
    prepare, action, clean_up = stage
    requests = impl.new_requests(with_suffix(prompts, round_index))
    prepared = [prepare(seq) for seq in requests]
    with gc_paused():
        started = time.process_time()
        results = [action(seq, value) for seq, value in zip(requests, prepared)]
        spent = time.process_time() - started
    for seq, result in zip(requests, results):
        clean_up(seq, result)
    return spent * 1e6 / len(requests)


def _nothing(*_: object) -> None:
    return None


def _must_match(seq: Sequence, same: bool) -> None:
    """Clean-up of a comparison stage: it must have compared a cached run equal to the request."""
    if not same:
        raise BenchmarkSetupError("a request's cached run is not one run of consecutive slots")


def _kv_stages(impl: HybridcacheImpl, case: Case) -> dict[str, Stage]:
    """Stage -> (preparation, call, clean-up) of an attention-only hit, as the trie calls it.
    Nested ingest stages run on requests the trie has claimed (``_claim``: no token read)."""
    trie, size = impl.trie, case.block_size
    lookup, keyer, tokens = trie.lookup, trie.keyer, trie.tokens
    blocks = case.context // size
    root = lookup.root(Sequence([0]).namespace)

    def claimed(seq: Sequence) -> None:
        trie._claim(seq)  # what ``prepare`` does first; it reads no token
        keyer.identity(seq)

    def first_child(seq: Sequence) -> int:
        claimed(seq)
        return lookup._run_child(seq, root, 0)

    ingest_stages = {
        "› verify_from_root (the descent from the root as one chain)": (
            claimed, lambda seq, _: lookup.verify_from_root(seq, blocks), _nothing),
        "› › the run from the root (_along_run)": (claimed, lambda seq, _: lookup._along_run(seq, root, 0, blocks), _nothing),
        "› › › comparison of the run (memcmp)": (
            first_child, lambda seq, child: tokens.equals(child, child + blocks - 1, seq, 0), _must_match),
        "› › › the root's child by the first block (the memo)": (
            claimed, lambda seq, _: lookup._run_child(seq, root, 0), _nothing),
    }
    return _around_ingest_and_match(trie, ingest_stages, {
        "› the path ingest verified, checked (_remembered_whole)": lambda seq: trie.matcher._remembered_whole(seq, 0)})


def _hybrid_stages(impl: HybridcacheImpl, case: Case) -> dict[str, Stage]:
    """Stage -> (preparation, call, clean-up) of a hybrid hit (an aligned checkpoint at the
    prompt's end), as the trie calls it; nested ingest stages run on claimed requests."""
    trie, size = impl.trie, case.block_size
    keyer, tokens, index = trie.keyer, trie.tokens, trie.index
    blocks = case.context // size
    step = blocks * size
    namespace = Sequence([0]).namespace

    def claimed(seq: Sequence) -> None:
        trie._claim(seq)  # what ``prepare`` does first; it reads no token
        keyer.identity(seq)

    def probed(seq: Sequence) -> tuple:
        claimed(seq)
        key = (step, keyer.value_of(seq, blocks - 1))
        return key, index.bucket(namespace, key)[0]

    def anchor_run(seq: Sequence) -> tuple[int, int]:
        claimed(seq)
        return probed(seq)[1].anchor_path.runs[0]

    ingest_stages = {
        "› candidate steps": (
            claimed, lambda seq, _: index.candidate_steps(namespace, 0, seq.num_valid - 1), _nothing),
        "› probe value (one block hashed)": (claimed, lambda seq, _: keyer.value_of(seq, blocks - 1), _nothing),
        "› bucket": (probed, lambda seq, probe: index.bucket(namespace, probe[0]), _nothing),
        "› record verification": (probed, lambda seq, probe: index.verify(probe[1], probe[0], seq), _nothing),
        "› comparison of the anchor's path (memcmp)": (
            anchor_run, lambda seq, run: tokens.equals(run[0], run[1], seq, 0), _must_match),
    }
    return _around_ingest_and_match(trie, ingest_stages, {"› the remembered search (matcher.find)": trie.matcher.find})


def _around_ingest_and_match(trie, ingest_stages: dict[str, Stage], match_steps: dict) -> dict[str, Stage]:
    """Both hits' stages in order: ingest, its nested ``ingest_stages``, then match and its
    nested stages (``match_steps``: name -> a call on an ingested request, then the two both
    hits share)."""
    def ingested(seq: Sequence) -> None:
        trie.prepare(seq)

    def rolled_back(seq: Sequence, txn: MatchTxn) -> None:
        trie.rollback(txn)

    match_steps = {**match_steps, "› resume point": trie.lookup.resume_point, "› MatchTxn(seq)": MatchTxn}
    return {
        "ingest (trie.prepare)": (_nothing, lambda seq, _: trie.prepare(seq), _nothing),
        **ingest_stages,
        "match (trie.match)": (ingested, lambda seq, _: trie.match(seq), rolled_back),
        **{name: (ingested, lambda seq, _, call=call: call(seq), _nothing) for name, call in match_steps.items()},
    }


def measure_hit_chain(case: Case, hybrid: bool) -> dict:
    """Per request, CPU µs of each stage of a ``kv-match`` (attention-only) or ``match``
    (hybrid) hit and of the floor (one ``np.array_equal`` per request), best of
    ``case.rounds``; nested stages are measured in their parent's state."""
    impl, prompts = _cached_impl(case, hybrid)
    stages = (_hybrid_stages if hybrid else _kv_stages)(impl, case)
    in_order = itertools.cycle(prompts)  # a round prepares one request per prompt, in order
    stages["floor (np.array_equal)"] = (
        lambda seq: next(in_order), lambda seq, prompt: np.array_equal(seq.token_view(0, case.context), prompt), _nothing)
    best: dict[str, float] = {}
    for round_index in range(case.rounds):
        for offset, (name, stage) in enumerate(stages.items()):
            spent = _cpu_us(impl, prompts, 1000 * (round_index + 1) + offset, stage)
            best[name] = min(best.get(name, spent), spent)
    return {"scenario": "match" if hybrid else "kv-match", "batch": case.batch, "context": case.context,
            "stages_us_per_request": best}
