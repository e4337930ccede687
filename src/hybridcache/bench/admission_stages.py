"""Where the time of one admission goes: ``CacheProtocol.admit_many`` on the ``admit-many``
workload (every request hits an aligned checkpoint at its prompt's last block boundary),
broken down by the stages ``admit_many`` calls (the deferred admissions' ``defer`` and
``take`` broken down one level further, as ``defer › ...``).

Two passes over the same prepared batch: one unprofiled (wall and CPU time per request, the
true cost), one under ``cProfile`` (how many Python calls each stage makes per request, and
its share of the time). The profiler inflates every call alike, so shares are reported as
fractions of the profiled total and scaled to the unprofiled CPU time. The argued floor is
``calls per request × the cost of an empty call`` (``unit_costs``): Python cannot make those
calls for less, whatever they do.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import time

from hybridcache.bench.scenarios import ADMIT_BUDGET, Case, _admission_protocol, _cache_with_checkpoint, _with_suffix
from hybridcache.bench.workload import distinct_prompts
from hybridcache.protocol import CacheProtocol
from hybridcache.sequence import Sequence

STAGE_FUNCTION = "admit_many"
EXPANDED_STAGES = ("defer", "take")  # stages of the deferred (batched) admissions, shown by their callees


def _prepared_batch(protocol: CacheProtocol, prompts: list, round_index: int) -> list[Sequence]:
    requests = [Sequence(tokens) for tokens in _with_suffix(prompts, round_index)]
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
        gc.disable()
        wall, cpu = time.perf_counter(), time.process_time()
        admitted = protocol.admit_many(requests, ADMIT_BUDGET)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        gc.enable()
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
    expanded = {key for key, entry in table.items() if key[2] in EXPANDED_STAGES and admit_many in entry[4]}
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
    protocol = _admission_protocol(case)
    prompts = distinct_prompts(case.batch, case.context)
    for prompt in prompts:
        _cache_with_checkpoint(protocol, prompt)
    wall, cpu = _timed_rounds(protocol, prompts, case.rounds)
    stages, calls, builtin_calls = _stages(_profiled_stats(protocol, prompts, case.rounds + 1), case.batch)
    cpu_us = cpu * 1e6 / case.batch
    for stage in stages:
        stage["cpu_us_per_request"] = stage["share"] * cpu_us
    return {"batch": case.batch, "context": case.context, "wall_us_per_request": wall * 1e6 / case.batch,
            "cpu_us_per_request": cpu_us, "python_calls_per_request": calls, "builtin_calls_per_request": builtin_calls, "stages": stages}
