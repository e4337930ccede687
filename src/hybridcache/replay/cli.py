"""``hybridcache replay TRACE``: hit rates of checkpoint policies on a request trace.

Owns no state between calls; during one, the scratch directory (disk tiers, local server logs)
and the shared tier (``shared_tier``), both removed or stopped at the end. Reads and
synthesizes the trace once, computes its infinite-cache bound once, then replays every
(policy, budget, replicas, routing) combination of the sweep, printing tables and optionally
writing JSON records and a hit-rate-vs-budget plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, TaskID

from hybridcache import cli_args
from hybridcache.errors import HybridCacheError, InvalidArgumentError
from hybridcache.profiles import PROFILE_NAMES, ModelProfile, load_profile
from hybridcache.replay.budgets import Budget, mean_prompt_tokens, split_budget
from hybridcache.replay.driver import replay
from hybridcache.replay.policies import ADMISSIONS, EVICTIONS, POLICIES, Policy, resolve_policy
from hybridcache.replay.record import TraceFacts
from hybridcache.replay.report import add_oracle_fractions, print_fleet
from hybridcache.replay.routing import ROUTINGS
from hybridcache.replay.run_config import DEFAULT_BLOCK_SIZE, DEFAULT_DEVICE_TFLOPS, DEFAULT_PREFILL_CHUNK, RunConfig
from hybridcache.replay.shared_tier import SHARED_TIERS, check_shared_tier, open_shared_tier
from hybridcache.replay.tiering import DEFAULT_TIER_CHUNK, TierSetup
from hybridcache.workloads import (
    FORMATS,
    HALVES,
    SHAPES,
    Bound,
    SynthesizedTrace,
    generate,
    half,
    infinite_cache_bound,
    read_trace,
    synthesize,
    write_trace,
)
from hybridcache.workloads.generator import DEFAULT_SESSIONS


MAX_BLOCK_SIZE = 2**16
MAX_REPLICAS = 1024
MAX_CHUNK_TOKENS = 2**24


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``hybridcache replay``, each checked by its converter as it is parsed
    (``hybridcache.cli_args``); the rules that join several options are in ``check_options``.
    A new option is one line here, plus a rule there when it depends on another."""
    parser.formatter_class = cli_args.DefaultsHelpFormatter
    add = parser.add_argument
    add("trace", nargs="?", help="a JSONL trace (Mooncake, Qwen-Bailian or explicit tokens), a regular file")
    add("--synthesize", choices=sorted(SHAPES), metavar="KIND",
        help=f"instead of a trace file, generate a multi-turn one (Mooncake format, seeded by --seed): {', '.join(SHAPES)}")
    add("--sessions", type=cli_args.int_in(1, 10**6), default=DEFAULT_SESSIONS, help="sessions of a --synthesize trace")
    add("--split", choices=HALVES, help="replay only this half of the trace, from an empty cache")
    add("--format", default="auto", choices=["auto", *FORMATS], help="the trace's format (auto: from its first line)")
    add("--model", default="marconi-7b", help=f"profile: {', '.join(PROFILE_NAMES)}, or a config.json path")
    add("--cache-bytes", type=cli_args.size_list, metavar="SIZES",
        help="combined budget(s), comma list = sweep (e.g. 400GB,800GB); required unless --kv-bytes and --state-bytes")
    add("--kv-bytes", type=cli_args.size_list, metavar="SIZES", help="KV budget(s); with --state-bytes (comma lists pair up)")
    add("--state-bytes", type=cli_args.size_list, metavar="SIZES", help="checkpoint budget(s); with --kv-bytes")
    add("--policy", default="reference",
        help=f"comma list = sweep: {', '.join(POLICIES)}, oracle (interval:N checkpoints every N tokens)")
    add("--admission", help=f"override the policies' admission part: {', '.join(ADMISSIONS)}")
    add("--eviction", help=f"override the policies' eviction part: {', '.join(EVICTIONS)}")
    add("--limit", type=cli_args.int_in(1), metavar="N", help="replay only the first N requests (default: all)")
    add("--block-size", type=cli_args.int_in(2, MAX_BLOCK_SIZE, even=True), default=DEFAULT_BLOCK_SIZE,
        help="library block size in tokens (even)")
    add("--prefill-chunk", type=cli_args.int_in(1, MAX_CHUNK_TOKENS), default=DEFAULT_PREFILL_CHUNK,
        help="prefill chunk of the reference rule")
    add("--device-tflops", type=cli_args.positive_float, default=DEFAULT_DEVICE_TFLOPS,
        help="sustained TFLOP/s of the TTFT estimate")
    add("--seed", type=cli_args.int_in(0, 2**32 - 1), default=0, help="token synthesis seed")
    add("--replicas", type=cli_args.int_list(1, MAX_REPLICAS), default="1", metavar="COUNTS",
        help="replicas, each with the whole budget; comma list = sweep")
    add("--routing", type=cli_args.name_list(ROUTINGS), default="round-robin", metavar="NAMES",
        help=f"comma list = sweep: {', '.join(ROUTINGS)}")
    add("--shared-tier", default="none", choices=SHARED_TIERS, help="store shared by the replicas")
    add("--store-url", help="the shared store (redis://HOST:PORT/DB, mooncake://MASTER?metadata=URL); "
        "without it a local server is started on a free loopback port")
    add("--host-bytes", type=cli_args.size, metavar="SIZE", help="T1 host memory per replica (nominal bytes, e.g. 200GB)")
    add("--disk-bytes", type=cli_args.size, metavar="SIZE", help="T2 local disk per replica (nominal bytes; needs --host-bytes)")
    add("--tier-chunk", type=cli_args.int_in(1, MAX_CHUNK_TOKENS), default=DEFAULT_TIER_CHUNK,
        help="tokens per stored KV chunk, a multiple of --block-size")
    add("--shared-bandwidth", type=cli_args.size, default="12.5GB", metavar="SIZE",
        help="bytes/s of a replica's link to the shared tier, for the cost model (12.5GB = 100 Gb/s)")
    add("--json", type=cli_args.output_path, metavar="PATH", help="write the records as JSON")
    add("--plot", type=cli_args.plot_path, metavar="PATH.png", help="write token hit rate vs budget, one curve per policy")


@dataclass(frozen=True)
class CheckedOptions:
    """What ``check_options`` derived from the parsed options, before the trace is read."""

    profile: ModelProfile
    policies: list[Policy]
    tier_options: dict


def check_options(args: argparse.Namespace) -> CheckedOptions:
    """The rules that join options, and the model profile: all checked before the trace is read."""
    if (args.trace is None) == (args.synthesize is None):
        raise InvalidArgumentError("give a trace file or --synthesize KIND, not both")
    if args.cache_bytes and (args.kv_bytes or args.state_bytes):
        raise InvalidArgumentError("give either --cache-bytes or --kv-bytes with --state-bytes, not both")
    if not args.cache_bytes and (not args.kv_bytes or len(args.kv_bytes) != len(args.state_bytes or [])):
        raise InvalidArgumentError("give --cache-bytes, or --kv-bytes and --state-bytes lists of equal length")
    names = [name for name in args.policy.split(",") if name.strip()]
    if not names:
        raise InvalidArgumentError("--policy names no policy")
    policies = [resolve_policy(name, args.admission, args.eviction, args.prefill_chunk) for name in names]
    return CheckedOptions(load_profile(args.model), policies, _tier_options(args))


def _budgets(args: argparse.Namespace, profile: ModelProfile, policy: Policy, mean_prompt: float) -> list[Budget]:
    if args.cache_bytes:
        return [split_budget(size, profile, policy, mean_prompt) for size in args.cache_bytes]
    return [Budget(k, s) for k, s in zip(args.kv_bytes, args.state_bytes)]


def _tier_options(args: argparse.Namespace) -> dict:
    """The tier options of every replica (``TierSetup`` checks them, before any server starts)."""
    check_shared_tier(args.shared_tier, args.store_url)
    host, disk = args.host_bytes or 0, args.disk_bytes or 0
    return {"chunk_size": args.tier_chunk, "host_bytes": host, "disk_bytes": disk,
            "shared_bandwidth": float(args.shared_bandwidth)}


def run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    """The command: tables on ``console``, progress and errors on ``errors`` (stderr)."""
    try:
        return _run(args, console, errors)
    except (HybridCacheError, OSError) as error:  # OSError: the machine failed (no scratch space), not the input
        errors.print(f"hybridcache replay: error: {escape(str(error))}", style="red", highlight=False, soft_wrap=True)
        return 2 if isinstance(error, HybridCacheError) else 1
    except KeyboardInterrupt:
        errors.print("hybridcache replay: interrupted (servers stopped, scratch removed)", style="red")
        return 130


class _RunProgress:
    """One run's progress bars: requests served, and Marconi's alpha tuning while it replays
    its window (which can take longer than the run's own requests)."""

    def __init__(self, progress: Progress, label: str, total: int) -> None:
        self.progress, self.label = progress, label
        self.task = progress.add_task(label, total=total)
        self.tuning: TaskID | None = None

    def advance(self) -> None:
        self.progress.advance(self.task)

    def tuned(self, done: int, total: int) -> None:
        if self.tuning is None:
            self.tuning = self.progress.add_task(f"  tuning alpha ({self.label})", total=total)
        self.progress.update(self.tuning, completed=done)
        if done >= total:
            self.progress.remove_task(self.tuning)
            self.tuning = None

    def close(self) -> None:
        self.progress.remove_task(self.task)
        if self.tuning is not None:
            self.progress.remove_task(self.tuning)


def _read(args: argparse.Namespace, console: Console) -> tuple[SynthesizedTrace, Bound]:
    """The trace read, synthesized and bounded, once for the whole sweep."""
    began = time.perf_counter()
    synthesized = synthesize(_trace(args), seed=args.seed)
    if args.split is not None:  # continuations are still counted over the whole trace
        synthesized = dataclasses.replace(synthesized, requests=half(synthesized.requests, args.split))
        args.trace = f"{args.trace} ({args.split} half)"
    bound = infinite_cache_bound(synthesized.requests)
    console.print(
        f"{escape(args.trace)}: {len(synthesized.requests)} requests, {bound.prompt_tokens:,} prompt tokens, "
        f"{synthesized.stats.continuations} continuations inferred, infinite-cache bound "
        f"{100 * bound.token_hit_rate:.2f} % (read, synthesized and bounded in {time.perf_counter() - began:.1f} s)",
        highlight=False,
    )
    return synthesized, bound


def _trace(args: argparse.Namespace):
    """The trace file, or a generated one (``--synthesize``, read back through the same checks)."""
    if args.synthesize is None:
        return read_trace(args.trace, args.format, args.limit)
    with tempfile.TemporaryDirectory(prefix="hybridcache-synthesize-") as scratch:
        path = Path(scratch) / f"{args.synthesize}-seed{args.seed}.jsonl"
        write_trace(generate(args.synthesize, args.seed, args.sessions), path)
        trace = read_trace(str(path), "mooncake", args.limit)
    args.trace = f"synthesized:{args.synthesize}:seed{args.seed}:sessions{args.sessions}"
    return trace


def _run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    options = check_options(args)
    synthesized, bound = _read(args, console)
    requests = synthesized.requests
    trace = TraceFacts(
        trace=args.trace,
        bound_token_hit_rate=bound.token_hit_rate,
        bound_request_hit_rate=bound.request_hit_rate,
        continuations=synthesized.stats.continuations,
        unique_tokens=bound.prompt_tokens - int(bound.shared_tokens.sum()),
    )
    records = []
    with tempfile.TemporaryDirectory(prefix="hybridcache-replay-") as scratch:
        configs = _configs(args, options, requests, Path(scratch))  # the whole sweep, checked before any server starts
        with open_shared_tier(args.shared_tier, args.store_url, Path(scratch)) as shared, \
                Progress(console=errors, transient=True) as progress:
            for config in configs:
                if shared is not None:
                    config = dataclasses.replace(
                        config, tiers=dataclasses.replace(config.tiers, shared=shared, shared_name=args.shared_tier))
                label = f"{config.policy.name} @ {_budget_label(config.budget)}, {config.replicas} x {config.routing}"
                bars = _RunProgress(progress, label, len(requests))
                record = replay(requests, config, progress=bars.advance, tuning_progress=bars.tuned)
                records.append(record.row(trace))
                bars.close()
    add_oracle_fractions(records)
    _print(records, console)
    if any(record["replicas"] > 1 or "tiers" in record for record in records):
        print_fleet(records, console)
    _write(args, records, errors)
    return 0


def _configs(args: argparse.Namespace, options: CheckedOptions, requests, scratch: Path) -> list[RunConfig]:
    """Every run of the sweep, in order: per policy, per budget, per replica count, per routing.
    Their tiers (when any is asked for) are the replicas' own; the shared store joins them once
    it is open."""
    profile, mean_prompt = options.profile, mean_prompt_tokens(requests)
    tiers = None
    if options.tier_options["host_bytes"] or options.tier_options["disk_bytes"] or args.shared_tier != "none":
        tiers = TierSetup(disk_root=scratch, **options.tier_options)
    return [
        RunConfig(profile, policy, budget, block_size=args.block_size, prefill_chunk=args.prefill_chunk,
                  replicas=replicas, routing=routing, tiers=tiers, device_tflops=args.device_tflops)
        for policy in options.policies
        for budget in _budgets(args, profile, policy, mean_prompt)
        for replicas in args.replicas
        for routing in args.routing
    ]


def _budget_cell(budget: Budget) -> str:
    """The budget, short: ``3 GB``, or ``1+2 GB`` for KV + checkpoint budgets given apart."""
    if budget.cache_bytes is not None:
        return f"{budget.cache_bytes / 1e9:g} GB"
    return f"{budget.kv_bytes / 1e9:g}+{budget.state_bytes / 1e9:g} GB"


def _budget_label(budget: Budget) -> str:
    if budget.cache_bytes is not None:
        return f"{budget.cache_bytes / 1e9:g} GB"
    return f"{budget.kv_bytes / 1e9:g} GB KV + {budget.state_bytes / 1e9:g} GB states"


def _print(records: list[dict], console: Console) -> None:
    """One row per run, narrow enough for an 80-column terminal (rich fits it to the width)."""
    replicated = any(record.get("replicas", 1) > 1 or record.get("shared_tier", "none") != "none" for record in records)
    shared = any(record.get("shared_tier", "none") != "none" for record in records)
    setting = ["fleet"] * replicated + ["shared"] * shared
    versus = ["of oracle"] * any(record.get("oracle_fraction") is not None for record in records)
    columns = ["policy", "budget", *setting, "token hit", "req hit", "of bound", *versus, "ckpts", "TTFT ms/req", "wall s"]
    table = cli_args.compact_table("hybridcache replay", columns, left=("policy", "budget", "fleet", "shared"))
    table.caption = "budget K+S: KV and checkpoint budgets given apart; ckpts: checkpoints written; TTFT: saved"
    for record in records:
        budget = Budget(record["kv_bytes"], record["state_bytes"], record["cache_bytes"])
        where = (f"{record['replicas']} x {record['routing']}",) * replicated + (record["shared_tier"],) * shared
        table.add_row(
            record["policy"],
            _budget_cell(budget),
            *where,
            f"{100 * record['token_hit_rate']:.2f}%",
            f"{100 * record['request_hit_rate']:.1f}%",
            f"{100 * record['bound_fraction']:.1f}%",
            *(_percent(record.get("oracle_fraction")) for _ in versus),
            f"{record['checkpoints_written']:,}",
            f"{record['ttft_saved_ms_per_request']:.1f}",
            f"{record['wall_s']:.1f}",
        )
    console.print(table)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _write(args: argparse.Namespace, records: list[dict], errors: Console) -> None:
    """The JSON records and the plot; their paths were checked before the run, so only a
    change since (a folder removed, a full disk) fails here."""
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
        except OSError as error:
            raise InvalidArgumentError(f"cannot write {args.json}: {error.strerror}") from None
        errors.print(f"wrote {escape(args.json)}", highlight=False)
    if args.plot:
        from hybridcache.replay.plot import plot_hit_rates

        try:
            plot_hit_rates(records, args.plot)
        except OSError as error:
            raise InvalidArgumentError(f"cannot write {args.plot}: {error.strerror}") from None
        errors.print(f"wrote {escape(args.plot)}", highlight=False)
