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

Needs lmdeploy 0.16.0 importable (``make lmdeploy-env``; run with ``.venv-lmdeploy/bin/python``).
"""

from __future__ import annotations

import importlib

import numpy as np

from hybridcache.bench.scenarios import SUFFIX_TOKENS, Case, _percentiles, _timed, _with_suffix
from hybridcache.bench.workload import distinct_prompts
from hybridcache.errors import InvalidConfigError

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
            raise RuntimeError("the set-up could not publish a checkpoint")
        session.remove_sequence(seq)


def _one_round(scheduler, requests: list[np.ndarray], context: int, torch) -> float:
    session = scheduler.add_session(len(scheduler.sessions) + 1)
    seqs = [session.add_sequence(torch.from_numpy(tokens.astype(np.int64))) for tokens in requests]
    output, elapsed_ms = _timed(lambda: scheduler.schedule(is_prefill=True))
    if len(output.running) != len(seqs) or any(seq.num_history_ids != context for seq in seqs):
        raise RuntimeError("a request was not admitted with its aligned hit")
    scheduler.block_trie.state_checkpoints.unpin_restores(output.running)
    scheduler.end_session(session.session_id)
    return elapsed_ms


def bench_lmdeploy_schedule(case: Case, progress=lambda: None) -> list[dict]:
    lm = _lmdeploy()
    torch = lm["torch"]
    prompts = distinct_prompts(case.batch, case.context, seed=7)
    schedulers = {name: _scheduler(lm, case, name == "hybridcache") for name in IMPLEMENTATIONS}
    for scheduler in schedulers.values():
        _cache_prompts(scheduler, prompts, torch)
        progress()
    samples: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for round_index in range(case.rounds):
        requests = _with_suffix(prompts, round_index + 1)
        for name, scheduler in schedulers.items():
            elapsed = _one_round(scheduler, requests, case.context, torch)
            if round_index >= case.warmups:
                samples[name].append(elapsed)
        progress()
    records = []
    for name in IMPLEMENTATIONS:
        record = dict(scenario="lmdeploy-schedule", impl=name, batch=case.batch, context=case.context, block_size=case.block_size)
        record.update(_percentiles(samples[name]), samples_ms=samples[name])
        record["per_request_us"] = record["p50_ms"] * 1000 / case.batch
        records.append(record)
    return records
