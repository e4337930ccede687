"""``hybridcache replay TRACE``: hit rates of checkpoint policies on a request trace.

Owns no state between calls; during one, the scratch directory (disk tiers, local server logs)
and the shared tier (``shared_tier``), both removed or stopped at the end. Reads and
synthesizes the trace once, computes its infinite-cache bound once, then replays every
(policy, budget, replicas, routing) combination of the sweep, printing tables and optionally
writing JSON records and a hit-rate-vs-budget plot.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hybridcache.errors import HybridCacheError, InvalidArgumentError
from hybridcache.profiles import PROFILE_NAMES, ModelProfile, load_profile, parse_size
from hybridcache.replay.driver import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DEVICE_TFLOPS,
    Budget,
    mean_prompt_tokens,
    replay,
    split_budget,
    with_ttft,
)
from hybridcache.replay.policies import Policy, resolve_policy
from hybridcache.replay.report import print_fleet
from hybridcache.replay.routing import ROUTINGS, check_routing
from hybridcache.replay.shared_tier import SHARED_TIERS, check_shared_tier, open_shared_tier
from hybridcache.replay.tiering import DEFAULT_TIER_CHUNK, TierSetup
from hybridcache.workloads import FORMATS, infinite_cache_bound, read_trace, synthesize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a JSONL trace (Mooncake, Qwen-Bailian or explicit tokens)")
    parser.add_argument("--format", default="auto", choices=["auto", *FORMATS])
    parser.add_argument("--model", default="marconi-7b", help=f"profile: {', '.join(PROFILE_NAMES)}, or a config.json path")
    parser.add_argument("--cache-bytes", help="combined budget(s), comma list = sweep (e.g. 400GB,800GB)")
    parser.add_argument("--kv-bytes", help="KV budget(s); with --state-bytes (comma lists pair up)")
    parser.add_argument("--state-bytes", help="checkpoint budget(s); with --kv-bytes")
    parser.add_argument("--policy", default="reference", help="comma list = sweep: reference, interval:N")
    parser.add_argument("--admission", help="override the policies' admission part")
    parser.add_argument("--eviction", help="override the policies' eviction part")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="library block size in tokens")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="prefill chunk of the reference rule")
    parser.add_argument(
        "--device-tflops", type=float, default=DEFAULT_DEVICE_TFLOPS, help="sustained TFLOP/s of the TTFT estimate"
    )
    parser.add_argument("--seed", type=int, default=0, help="token synthesis seed")
    parser.add_argument("--replicas", default="1", help="replicas, each with the whole budget; comma list = sweep")
    parser.add_argument("--routing", default="round-robin", help=f"comma list = sweep: {', '.join(ROUTINGS)}")
    parser.add_argument("--shared-tier", default="none", help=f"store shared by the replicas: {', '.join(SHARED_TIERS)}")
    parser.add_argument("--store-url", help="the shared store (redis://HOST:PORT/DB, mooncake://MASTER?metadata=URL); "
                        "without it a local server is started on a free loopback port")
    parser.add_argument("--host-bytes", help="T1 host memory per replica (nominal bytes, e.g. 200GB; default none)")
    parser.add_argument("--disk-bytes", help="T2 local disk per replica (nominal bytes; needs --host-bytes)")
    parser.add_argument("--tier-chunk", type=int, default=DEFAULT_TIER_CHUNK,
                        help="tokens per stored KV chunk, a multiple of --block-size")
    parser.add_argument("--shared-bandwidth", default="12.5GB",
                        help="bytes/s of a replica's link to the shared tier, for the cost model (12.5GB = 100 Gb/s)")
    parser.add_argument("--json", metavar="PATH", help="write the records as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="write token hit rate vs budget, one curve per policy")


def _sizes(text: str | None) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()] if text else []


def _budgets(args: argparse.Namespace, profile: ModelProfile, policy: Policy, mean_prompt: float) -> list[Budget]:
    combined, kv, state = _sizes(args.cache_bytes), _sizes(args.kv_bytes), _sizes(args.state_bytes)
    if combined and (kv or state):
        raise InvalidArgumentError("give either --cache-bytes or --kv-bytes with --state-bytes, not both")
    if combined:
        return [split_budget(size, profile, policy, mean_prompt) for size in combined]
    if not kv or len(kv) != len(state):
        raise InvalidArgumentError("give --cache-bytes, or --kv-bytes and --state-bytes lists of equal length")
    return [Budget(k, s) for k, s in zip(kv, state)]


def _policies(args: argparse.Namespace) -> list[Policy]:
    names = [name for name in args.policy.split(",") if name.strip()]
    if not names:
        raise InvalidArgumentError("--policy names no policy")
    return [resolve_policy(name, args.admission, args.eviction, args.prefill_chunk) for name in names]


def _replica_counts(text: str) -> list[int]:
    counts = []
    for part in (piece.strip() for piece in text.split(",")):
        if not part.isdigit() or int(part) < 1:
            raise InvalidArgumentError(f"--replicas takes positive integers, got {part!r}")
        counts.append(int(part))
    return counts


def _routings(text: str) -> list[str]:
    return [check_routing(part.strip()) for part in text.split(",")]


def _tier_options(args: argparse.Namespace) -> dict:
    """The tier options, checked before any server starts."""
    check_shared_tier(args.shared_tier, args.store_url)
    host = parse_size(args.host_bytes) if args.host_bytes else 0
    disk = parse_size(args.disk_bytes) if args.disk_bytes else 0
    if disk and not host:
        raise InvalidArgumentError("--disk-bytes needs --host-bytes: the disk tier holds host demotions")
    tiered = host or args.shared_tier != "none"
    if tiered and (args.tier_chunk < 1 or args.tier_chunk % args.block_size):
        raise InvalidArgumentError(f"--tier-chunk must be a positive multiple of --block-size {args.block_size}")
    return {"chunk_size": args.tier_chunk, "host_bytes": host, "disk_bytes": disk,
            "shared_bandwidth": float(parse_size(args.shared_bandwidth))}


def run(args: argparse.Namespace, console: Console) -> int:
    try:
        return _run(args, console)
    except HybridCacheError as error:
        console.print(f"[red]hybridcache replay: {error}[/red]")
        return 2
    except KeyboardInterrupt:
        console.print("[red]hybridcache replay: interrupted (servers stopped, scratch removed)[/red]")
        return 130


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.limit is not None and args.limit < 1:
        raise InvalidArgumentError("--limit must be >= 1")
    if not args.device_tflops > 0:
        raise InvalidArgumentError("--device-tflops must be > 0")
    began = time.perf_counter()
    profile = load_profile(args.model)
    synthesized = synthesize(read_trace(args.trace, args.format, args.limit), seed=args.seed)
    requests = synthesized.requests
    bound = infinite_cache_bound(requests)
    prepared_s = time.perf_counter() - began
    console.print(
        f"{args.trace}: {len(requests)} requests, {bound.prompt_tokens:,} prompt tokens, "
        f"{synthesized.stats.continuations} continuations inferred, infinite-cache bound "
        f"{100 * bound.token_hit_rate:.2f} % (read, synthesized and bounded in {prepared_s:.1f} s)"
    )
    policies = _policies(args)
    mean_prompt = mean_prompt_tokens(requests)
    fleets = [(count, routing) for count in _replica_counts(args.replicas) for routing in _routings(args.routing)]
    tier_options = _tier_options(args)
    runs = [(policy, budget) for policy in policies for budget in _budgets(args, profile, policy, mean_prompt)]
    unique_tokens = bound.prompt_tokens - int(bound.shared_tokens.sum())
    context = {
        "trace": args.trace,
        "bound_token_hit_rate": bound.token_hit_rate,
        "bound_request_hit_rate": bound.request_hit_rate,
        "continuations": synthesized.stats.continuations,
    }
    records = []
    with tempfile.TemporaryDirectory(prefix="hybridcache-replay-") as scratch, \
            open_shared_tier(args.shared_tier, args.store_url, Path(scratch)) as shared, \
            Progress(console=console, transient=True) as progress:
        tiers = TierSetup(shared=shared, shared_name=args.shared_tier, disk_root=Path(scratch), **tier_options)
        for policy, budget in runs:
            for replicas, routing in fleets:
                label = f"{policy.name} @ {_budget_label(budget)}, {replicas} x {routing}"
                task = progress.add_task(label, total=len(requests))
                record = replay(
                    requests, profile, policy, budget, args.block_size,
                    prefill_chunk=args.prefill_chunk, progress=lambda task=task: progress.advance(task),
                    replicas=replicas, routing=routing, tiers=tiers if tiers.enabled else None,
                    device_tflops=args.device_tflops,
                )
                record = with_ttft({"trace": args.trace, **record, **context}, args.device_tflops)
                record["bound_fraction"] = record["token_hit_rate"] / bound.token_hit_rate if bound.token_hit_rate else 0.0
                if "tiers" in record:
                    stored = record["tiers"]["stored_bytes_nominal"]
                    kept = stored["shared"] if shared is not None else stored["host"]
                    record["tiers"]["stored_bytes_per_unique_token"] = kept / unique_tokens if unique_tokens else 0.0
                records.append(record)
                progress.remove_task(task)
    _print(records, console)
    if any(record["replicas"] > 1 or "tiers" in record for record in records):
        print_fleet(records, console)
    _write(args, records, console)
    return 0


def _budget_label(budget: Budget) -> str:
    if budget.cache_bytes is not None:
        return f"{budget.cache_bytes / 1e9:g} GB"
    return f"{budget.kv_bytes / 1e9:g} GB KV + {budget.state_bytes / 1e9:g} GB states"


def _print(records: list[dict], console: Console) -> None:
    table = Table(title="hybridcache replay")
    replicated = any(record.get("replicas", 1) > 1 or record.get("shared_tier", "none") != "none" for record in records)
    setting = ("replicas", "routing", "shared") if replicated else ()
    for column in ("policy", "budget", *setting, "token hit", "request hit", "of bound", "checkpoints", "TTFT saved/req", "wall s"):
        table.add_column(column, justify="left" if column in ("policy", "budget", "routing", "shared") else "right")
    for record in records:
        budget = Budget(record["kv_bytes"], record["state_bytes"], record["cache_bytes"])
        where = (str(record["replicas"]), record["routing"], record["shared_tier"]) if replicated else ()
        table.add_row(
            record["policy"],
            _budget_label(budget),
            *where,
            f"{100 * record['token_hit_rate']:.2f} %",
            f"{100 * record['request_hit_rate']:.1f} %",
            f"{100 * record['bound_fraction']:.1f} %",
            f"{record['checkpoints_written']:,}",
            f"{record['ttft_saved_ms_per_request']:.1f} ms",
            f"{record['wall_s']:.1f}",
        )
    console.print(table)


def _write(args: argparse.Namespace, records: list[dict], console: Console) -> None:
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
        except OSError as error:
            raise InvalidArgumentError(f"cannot write {args.json}: {error.strerror}") from None
        console.print(f"wrote {args.json}")
    if args.plot:
        from hybridcache.replay.plot import plot_hit_rates

        plot_hit_rates(records, args.plot)
        console.print(f"wrote {args.plot}")
