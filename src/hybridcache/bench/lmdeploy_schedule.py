"""``hybridcache bench lmdeploy-schedule``: one prefill ``Scheduler.schedule()`` step of
lmdeploy 0.16.0 with lmdeploy's own ``BlockTrie`` and with hybridcache's adapter
(``hybridcache.integrations.lmdeploy``), on the same prompts, interleaved round by round.

Owns nothing between runs. Set-up (untimed), per implementation: a real lmdeploy ``Scheduler``
of a hybrid model (one dummy state shape: the trie matches published checkpoints) with
``batch`` runtime state rows and ``batch`` checkpoint rows; ``batch`` distinct prompts of
``context`` tokens are cached the way lmdeploy's engine leaves them (blocks allocated and
attached, a checkpoint reserved and published at the prompt end, the sequence ended). Timed:
``schedule(is_prefill=True)`` admitting ``batch`` new requests, each its prompt plus 16 new
tokens, so every one is an aligned checkpoint hit at ``context`` (matched, restore pinned,
suffix block allocated and attached, runtime state taken). Between rounds the requests end
(restore pins released, blocks freed; the trie keeps its cache).

Also timed, each round: the requests' arrival (``add_sequence`` of the batch, where lmdeploy
copies each prompt into its sequence and the adapter builds its shadow: ``ingest``), arrival
and step together (``total``), and the step less the time spent inside the trie's own calls
(``floor``: the scheduler's own work, what the step would cost with a trie that cost nothing;
both tries are counted the same way). ``bound_p50`` / ``bound_p99`` on lmdeploy's record: its
step over its floor, the most any trie could gain on lmdeploy's Scheduler.

CPU time (the thread's, ``time.thread_time``) is taken beside the wall time of the step
(``cpu``) and of arrival plus step (``cpu_total``): on a shared, loaded host the wall clock also
counts the time other processes hold the core, the thread's CPU time does not. Our record
carries ``cpu_speedup_p50`` / ``cpu_speedup_p99`` (lmdeploy's step CPU over ours) and
``cpu_total_speedup_p50`` (the same for arrival plus step).

Needs lmdeploy 0.16.0 importable (``make lmdeploy-env``; run with ``.venv-lmdeploy/bin/python``).
"""

from __future__ import annotations

import importlib
import time

import numpy as np

from hybridcache.bench.scenarios import SUFFIX_TOKENS, Case, percentiles, timed, with_suffix
from hybridcache.bench.workload import distinct_prompts
from hybridcache.errors import BenchmarkSetupError, InvalidConfigError

IMPLEMENTATIONS = ("lmdeploy", "hybridcache")


def _lmdeploy():
    try:
        return dict(
            torch=importlib.import_module("torch"),
            config=importlib.import_module("lmdeploy.pytorch.config"),
            messages=importlib.import_module("lmdeploy.pytorch.messages"),
            scheduler=importlib.import_module("lmdeploy.pytorch.paging.scheduler"),
            strategy=importlib.import_module("lmdeploy.pytorch.strategies.ar.sequence"),
            adapter=importlib.import_module("hybridcache.integrations.lmdeploy"),
        )
    except ImportError as error:
        raise InvalidConfigError(f"lmdeploy is not importable ({error}): run make lmdeploy-env and use .venv-lmdeploy") from None


def _scheduler(lm: dict, case: Case, hybridcache: bool):
    config, torch = lm["config"], lm["torch"]
    blocks = case.batch * (case.context // case.block_size + 4) + 64
    cache_config = config.CacheConfig(
        max_batches=case.batch,
        block_size=case.block_size,
        num_cpu_blocks=0,
        num_gpu_blocks=blocks,
        enable_prefix_caching=True,
        max_prefill_token_num=case.batch * (case.context + SUFFIX_TOKENS),
        num_state_caches=2 * case.batch + 1,
        prefix_cache_state_budget=case.batch,
        states_shapes=[((1,), torch.float32)],
    )
    scheduler_config = config.SchedulerConfig(
        max_batches=case.batch, max_session_len=case.context * 2, max_request_output_len=64, eviction_type="recompute"
    )
    seq_meta = lm["messages"].SequenceMeta(case.block_size, strategy=lm["strategy"].ARSequenceStrategy())
    if hybridcache:
        lm["adapter"].install()
    try:
        return lm["scheduler"].Scheduler(scheduler_config=scheduler_config, cache_config=cache_config, seq_meta=seq_meta)
    finally:
        lm["adapter"].uninstall()


def _cache_prompts(scheduler, prompts: list[np.ndarray], torch) -> None:
    session = scheduler.add_session(0)
    checkpoints = scheduler.block_trie.state_checkpoints
    for prompt in prompts:
        seq = session.add_sequence(torch.from_numpy(prompt.astype(np.int64)))
        scheduler.block_manager.allocate(seq)
        scheduler.block_trie.allocate(seq)
        if checkpoints.reserve_save(seq) < 0 or not checkpoints.publish_save(seq):
            raise BenchmarkSetupError("the set-up could not publish a checkpoint")
        session.remove_sequence(seq)


class _TrieClock:
    """Wall and thread CPU time spent inside a scheduler's trie: its calls and its
    ``state_checkpoints``' calls, each counted once however they nest (instance attributes
    wrap the bound methods)."""

    _TRIE_CALLS = ("match", "allocate", "evict", "cache_routed_experts", "cache_routed_experts_for_seq")

    def __init__(self, trie) -> None:
        self.elapsed_ns = 0
        self.cpu_ns = 0
        self._depth = 0
        for name in self._TRIE_CALLS:
            setattr(trie, name, self._counted(getattr(trie, name)))
        checkpoints = trie.state_checkpoints
        for name in [n for n in dir(checkpoints) if not n.startswith("_") and callable(getattr(checkpoints, n))]:
            setattr(checkpoints, name, self._counted(getattr(checkpoints, name)))

    def _counted(self, call):
        def counted(*args, **kwargs):
            self._depth += 1
            started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return call(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.elapsed_ns += time.perf_counter_ns() - started
                    self.cpu_ns += time.thread_time_ns() - started_cpu

        return counted

    def take_ms(self) -> tuple[float, float]:
        """(wall ms, CPU ms) inside the trie since the last take."""
        elapsed, cpu, self.elapsed_ns, self.cpu_ns = self.elapsed_ns, self.cpu_ns, 0, 0
        return elapsed / 1e6, cpu / 1e6


def _timed_with_cpu(action) -> tuple[object, float, float]:
    """``action``'s value, wall ms and this thread's CPU ms."""
    started = time.thread_time_ns()
    value, wall_ms = timed(action)
    return value, wall_ms, (time.thread_time_ns() - started) / 1e6


def _one_round(scheduler, clock: _TrieClock, requests: list, context: int) -> tuple[float, ...]:
    """(arrival ms, step ms, step ms inside the trie, arrival CPU ms, step CPU ms, step CPU
    ms inside the trie) of one round of ``requests`` (tensors)."""
    session = scheduler.add_session(len(scheduler.sessions) + 1)
    seqs, arrival_ms, arrival_cpu_ms = _timed_with_cpu(lambda: [session.add_sequence(tokens) for tokens in requests])
    clock.take_ms()
    output, step_ms, step_cpu_ms = _timed_with_cpu(lambda: scheduler.schedule(is_prefill=True))
    trie_ms, trie_cpu_ms = clock.take_ms()
    if len(output.running) != len(seqs) or any(seq.num_history_ids != context for seq in seqs):
        raise BenchmarkSetupError("a request was not admitted with its aligned hit")
    scheduler.block_trie.state_checkpoints.unpin_restores(output.running)
    scheduler.end_session(session.session_id)
    return arrival_ms, step_ms, trie_ms, arrival_cpu_ms, step_cpu_ms, trie_cpu_ms


def bench_lmdeploy_schedule(case: Case, progress=lambda: None) -> list[dict]:
    lm = _lmdeploy()
    torch = lm["torch"]
    prompts = distinct_prompts(case.batch, case.context, seed=7)
    schedulers = {name: _scheduler(lm, case, name == "hybridcache") for name in IMPLEMENTATIONS}
    for scheduler in schedulers.values():
        _cache_prompts(scheduler, prompts, torch)
        progress()
    clocks = {name: _TrieClock(scheduler.block_trie) for name, scheduler in schedulers.items()}
    samples: dict[str, list[tuple[float, ...]]] = {name: [] for name in IMPLEMENTATIONS}
    for round_index in range(case.rounds):
        requests = [torch.from_numpy(tokens.astype(np.int64)) for tokens in with_suffix(prompts, round_index + 1)]
        for name, scheduler in schedulers.items():
            timings = _one_round(scheduler, clocks[name], requests, case.context)
            if round_index >= case.warmups:
                samples[name].append(timings)
        progress()
    records = [_record(name, case, samples[name]) for name in IMPLEMENTATIONS]
    reference = records[0]
    reference["bound_p50"] = reference["p50_ms"] / reference["floor_p50_ms"]
    reference["bound_p99"] = reference["p99_ms"] / reference["floor_p99_ms"]
    ours = records[1]
    ours["cpu_speedup_p50"] = reference["cpu_p50_ms"] / ours["cpu_p50_ms"]
    ours["cpu_speedup_p99"] = reference["cpu_p99_ms"] / ours["cpu_p99_ms"]
    ours["cpu_total_speedup_p50"] = reference["cpu_total_p50_ms"] / ours["cpu_total_p50_ms"]
    ours["trie_cpu_speedup_p50"] = reference["trie_cpu_p50_ms"] / ours["trie_cpu_p50_ms"]
    ours["trie_cpu_speedup_p99"] = reference["trie_cpu_p99_ms"] / ours["trie_cpu_p99_ms"]
    for record in records:  # a trie costing nothing: the step at its floor
        record["cpu_bound_p50"] = reference["cpu_p50_ms"] / record["floor_cpu_p50_ms"]
    return records


def _record(name: str, case: Case, timings: list[tuple[float, ...]]) -> dict:
    arrival, step, inside, arrival_cpu, step_cpu, inside_cpu = (np.array(column) for column in zip(*timings))
    record = dict(scenario="lmdeploy-schedule", impl=name, batch=case.batch, context=case.context, block_size=case.block_size)
    record.update(percentiles(step.tolist()), samples_ms=step.tolist())
    record["per_request_us"] = record["p50_ms"] * 1000 / case.batch
    for label, values in (("ingest", arrival), ("total", arrival + step), ("floor", step - inside), ("trie", inside),
                          ("cpu", step_cpu), ("cpu_total", arrival_cpu + step_cpu), ("trie_cpu", inside_cpu),
                          ("floor_cpu", step_cpu - inside_cpu)):
        record[f"{label}_p50_ms"], record[f"{label}_p99_ms"] = percentiles(values.tolist()).values()
    record["trie_share_p50"] = float(np.median(inside_cpu / step_cpu))
    record["arrival_samples_ms"], record["trie_samples_ms"] = arrival.tolist(), inside.tolist()
    record["cpu_samples_ms"], record["trie_cpu_samples_ms"] = step_cpu.tolist(), inside_cpu.tolist()
    return record
