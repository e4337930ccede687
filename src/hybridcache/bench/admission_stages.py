"""Where the time of a hit goes, over what it cannot avoid.

``measure_admission_stages``: where the time of one ``CacheProtocol.admit_many`` admission
goes, on the ``admit-many`` workload (every request hits an aligned checkpoint at its prompt's
last block boundary), broken down by the stages ``admit_many`` calls (the remembered hits' ``admit_remembered``
and ``take_remembered_hits``, and the deferred admissions' ``defer`` and ``take``, broken
down one level further, as ``defer › ...``).

Two passes over the same prepared batch: one unprofiled (wall and CPU time per request, the
true cost), one under ``cProfile`` (how many Python calls each stage makes per request, and
its share of the time). The profiler inflates every call alike, so shares are reported as
fractions of the profiled total and scaled to the unprofiled CPU time. The argued floor is
``calls per request × the cost of an empty call`` (``unit_costs``): Python cannot make those
calls for less, whatever they do.

``measure_identity_stages``: the identity work of a hit (``kv-match`` / ``match``) split into
the exact comparison as the trie makes it and the bookkeeping around it, with the Python
calls per request and the functions that take the most of it.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import numpy as np

from hybridcache.bench.impl import HybridcacheImpl
from hybridcache.bench.scenarios import ADMIT_BUDGET, Case, admission_protocol, cache_with_checkpoint, gc_paused, with_suffix
from hybridcache.bench.workload import distinct_prompts
from hybridcache.errors import BenchmarkSetupError
from hybridcache.protocol import CacheProtocol
from hybridcache.sequence import Sequence

STAGE_FUNCTION = "admit_many"
# stages shown by their callees: the deferred admissions', and the remembered hits' (nested)
EXPANDED_STAGES = ("admit_batch", "defer", "take", "admit_remembered", "take_remembered_hits")


def _prepared_batch(protocol: CacheProtocol, prompts: list, round_index: int) -> list[Sequence]:
    requests = [Sequence(tokens) for tokens in with_suffix(prompts, round_index)]
    for seq in requests:
        protocol.prepare(seq)
    return requests


def _free_all(protocol: CacheProtocol, requests: list[Sequence], admitted: list) -> None:
    for seq, admission in zip(requests, admitted):
        protocol.free(seq, admission.runtime_slot)


def _timed_rounds(protocol: CacheProtocol, prompts: list, rounds: int) -> tuple[float, float]:
    """Best wall and CPU seconds of one ``admit_many`` over the batch (GC paused inside)."""
    best_wall = best_cpu = float("inf")
    for round_index in range(rounds):
        requests = _prepared_batch(protocol, prompts, round_index + 1)
        with gc_paused():
            wall, cpu = time.perf_counter(), time.process_time()
            admitted = protocol.admit_many(requests, ADMIT_BUDGET)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        _free_all(protocol, requests, admitted)
        best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
    return best_wall, best_cpu


def _profiled_stats(protocol: CacheProtocol, prompts: list, round_index: int) -> pstats.Stats:
    requests = _prepared_batch(protocol, prompts, round_index)
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    admitted = protocol.admit_many(requests, ADMIT_BUDGET)
    profiler.disable()
    _free_all(protocol, requests, admitted)
    return pstats.Stats(profiler)


def _stages(stats: pstats.Stats, batch: int) -> tuple[list[dict], int, int]:
    """Per direct callee of ``admit_many`` (those in ``EXPANDED_STAGES`` replaced by their
    own callees): calls made inside it per request and its share of the profiled time; also
    all calls per request and those of C functions among them."""
    table = stats.stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    admit_many = next(key for key in table if key[2] == STAGE_FUNCTION)
    profiled_total = table[admit_many][3]
    inner_calls = _calls_below(table)
    expanded = _expanded_stages(table, admit_many)
    stages = []
    for key, (_, _, self_time, _, callers) in table.items():
        for caller in [admit_many, *expanded]:
            if caller not in callers or key in expanded:
                continue
            _, calls, _, cumulative = callers[caller]
            name = key[2] if caller == admit_many else f"{caller[2]} › {key[2]}"
            stages.append({"stage": name, "calls_per_request": calls / batch,
                           "python_calls_per_request": inner_calls.get(key, 0) / batch * _share(calls, table[key][1]) + calls / batch,
                           "share": cumulative / profiled_total if profiled_total else 0.0})
    for key in expanded:  # what the expanded stage does itself, outside its callees
        stages.append({"stage": f"{key[2]} (itself)", "calls_per_request": table[key][1] / batch,
                       "python_calls_per_request": table[key][1] / batch,
                       "share": table[key][2] / profiled_total if profiled_total else 0.0})
    stages.append({"stage": f"{STAGE_FUNCTION} (itself)", "calls_per_request": 1 / batch, "python_calls_per_request": 1 / batch,
                   "share": table[admit_many][2] / profiled_total if profiled_total else 0.0})
    stages.sort(key=lambda stage: -stage["share"])
    total_calls = sum(entry[1] for entry in table.values()) / batch
    # cProfile names C functions (builtins, NumPy's C entry points) with the file "~".
    builtin_calls = sum(entry[1] for key, entry in table.items() if key[0] == "~") / batch
    return stages, round(total_calls), round(builtin_calls)


def _expanded_stages(table: dict, admit_many: tuple) -> set:
    """The functions of ``EXPANDED_STAGES`` called by ``admit_many`` or by another of them."""
    expanded: set = set()
    parents = {admit_many}
    grown = True
    while grown:
        grown = False
        for key, entry in table.items():
            if key[2] in EXPANDED_STAGES and key not in expanded and parents & entry[4].keys():
                expanded.add(key)
                parents.add(key)
                grown = True
    return expanded


def _share(calls: int, all_calls: int) -> float:
    return calls / all_calls if all_calls else 0.0


def _calls_below(table: dict) -> dict:
    """Calls made (transitively) beneath each function: the sum over its callees' calls from
    it, followed down the call graph once (admission has no recursion)."""
    callees: dict = {}
    for key, (_, _, _, _, callers) in table.items():
        for caller, (_, calls, _, _) in callers.items():
            callees.setdefault(caller, []).append((key, calls, table[key][1]))
    memo: dict = {}

    def below(key, depth=0) -> float:
        if key in memo or depth > 64:
            return memo.get(key, 0.0)
        total = 0.0
        for callee, calls, callee_calls in callees.get(key, ()):
            # The callee's own subtree, pro rata to the calls that came from this caller.
            total += calls + below(callee, depth + 1) * (calls / callee_calls if callee_calls else 0)
        memo[key] = total
        return total

    return {key: below(key) for key in table}


def measure_admission_stages(case: Case) -> dict:
    """The breakdown of ``admit_many`` at ``case`` (batch, context, block size)."""
    protocol = admission_protocol(case)
    prompts = distinct_prompts(case.batch, case.context)
    for prompt in prompts:
        cache_with_checkpoint(protocol, prompt)
    wall, cpu = _timed_rounds(protocol, prompts, case.rounds)
    stages, calls, builtin_calls = _stages(_profiled_stats(protocol, prompts, case.rounds + 1), case.batch)
    cpu_us = cpu * 1e6 / case.batch
    for stage in stages:
        stage["cpu_us_per_request"] = stage["share"] * cpu_us
    return {"batch": case.batch, "context": case.context, "wall_us_per_request": wall * 1e6 / case.batch,
            "cpu_us_per_request": cpu_us, "python_calls_per_request": calls, "builtin_calls_per_request": builtin_calls, "stages": stages}


# --- identity work of a hit (kv-match / match): where the time over the floor goes ----------


def _cached_impl(case: Case, hybrid: bool) -> tuple[HybridcacheImpl, list]:
    """The ``kv-match`` (attention-only) or ``match`` (hybrid, aligned checkpoint at the
    prompt's end) workload: ``case.batch`` distinct prompts cached, each as one run."""
    impl = HybridcacheImpl()
    impl.setup(num_blocks=case.batch * (case.context // case.block_size + 4) + 64, num_checkpoints=case.batch,
               block_size=case.block_size, hybrid=hybrid)
    prompts = distinct_prompts(case.batch, case.context)
    for prompt in prompts:
        impl.prefill(prompt, (case.context,) if hybrid else ())
    return impl, prompts


def _identity_round(impl: HybridcacheImpl, prompts: list, case: Case, round_index: int) -> dict:
    """CPU seconds of one round, each part on fresh requests (their tokens not in cache):
    ingest, match, the floor (``np.array_equal`` per request) and the exact comparison as
    the trie makes it (``TokenStore.equals`` of the cached run against the request)."""
    tokens = with_suffix(prompts, round_index)
    requests = impl.new_requests(tokens)
    with gc_paused():
        started = time.process_time()
        impl.ingest(requests)
        ingested = time.process_time()
        handles = impl.match(requests)
        matched = time.process_time()
        [np.array_equal(t[: case.context], p) for t, p in zip(tokens, prompts)]
        floor = time.process_time()
    impl.rollback(requests, handles)
    blocks = case.context // case.block_size
    lasts = [seq.prefix_state.trie.verified for seq in requests]  # each prompt's cached run ends there
    fresh = impl.new_requests(with_suffix(prompts, round_index + 1000))
    equals = impl.trie.tokens.equals
    with gc_paused():
        compared = time.process_time()
        same = [equals(last - blocks + 1, last, seq, 0) for seq, last in zip(fresh, lasts)]
        compared = time.process_time() - compared
    if not all(same):
        raise BenchmarkSetupError("a request's cached run is not one run of consecutive slots")
    return {"ingest": ingested - started, "match": matched - ingested, "floor": floor - matched, "comparison": compared}


def measure_identity_stages(case: Case, hybrid: bool, top: int = 14) -> dict:
    """Per request, best of ``case.rounds`` (CPU µs): ingest, match, the floor and the exact
    comparison inside them; the rest is bookkeeping. Then one profiled round: Python calls
    per request (all, and C functions among them) and the functions with the largest own
    time, as shares scaled to the unprofiled ingest + match."""
    impl, prompts = _cached_impl(case, hybrid)
    best: dict = {}
    for round_index in range(case.rounds):
        for part, seconds in _identity_round(impl, prompts, case, round_index + 1).items():
            best[part] = min(best.get(part, seconds), seconds)
    per_request = {part: seconds * 1e6 / case.batch for part, seconds in best.items()}
    requests = impl.new_requests(with_suffix(prompts, case.rounds + 1))
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    impl.ingest(requests)
    handles = impl.match(requests)
    profiler.disable()
    impl.rollback(requests, handles)
    table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    profiled = sum(entry[2] for entry in table.values()) or 1.0
    work_us = per_request["ingest"] + per_request["match"]
    functions = sorted(table.items(), key=lambda item: -item[1][2])[:top]
    return {
        "scenario": "match" if hybrid else "kv-match", "batch": case.batch, "context": case.context,
        **{f"{part}_us_per_request": value for part, value in per_request.items()},
        "bookkeeping_us_per_request": work_us - per_request["comparison"],
        "total_over_floor": work_us / per_request["floor"],
        "python_calls_per_request": sum(entry[1] for entry in table.values()) / case.batch,
        "builtin_calls_per_request": sum(entry[1] for key, entry in table.items() if key[0] == "~") / case.batch,
        "functions": [{"function": key[2], "calls_per_request": entry[1] / case.batch,
                       "own_us_per_request": entry[2] / profiled * work_us} for key, entry in functions],
    }
