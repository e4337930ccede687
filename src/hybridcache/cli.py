"""Command line: ``hybridcache demo`` and ``hybridcache bench <scenario>``."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

console = Console(width=140)


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _bench_kv_match(args: argparse.Namespace) -> list[dict]:
    from hybridcache.bench.kv_match import KVMatchCase, run_case

    if args.smoke:
        cases = [KVMatchCase(batch=4, context=1024, block_size=args.block_size, warmups=1, samples=2)]
    else:
        cases = [
            KVMatchCase(batch=b, context=c, block_size=args.block_size, warmups=args.warmups, samples=args.samples)
            for b in args.batch
            for c in args.context
        ]
    records = []
    with Progress(console=console, transient=True) as progress:
        for case in cases:
            task = progress.add_task(f"prefill batch={case.batch} context={case.context}", total=case.batch)
            records.append(run_case(case, lambda: progress.advance(task)))
            progress.remove_task(task)
    return records


def _bench_memory(args: argparse.Namespace) -> list[dict]:
    from hybridcache.bench.memory import run_case

    grid = [(4, 4096)] if args.smoke else [(b, c) for b in args.batch for c in args.context]
    records = []
    with Progress(console=console, transient=True) as progress:
        for batch, context in grid:
            task = progress.add_task(f"publish batch={batch} context={context}", total=batch)
            records.append(run_case(batch, context, args.block_size, lambda: progress.advance(task)))
            progress.remove_task(task)
    return records


SCENARIOS = {"kv-match": _bench_kv_match, "memory": _bench_memory}
DEFAULT_GRID = {"kv-match": ([128, 512], [65536, 131072]), "memory": ([512], [131072])}


def _print_memory(records: list[dict]) -> None:
    table = Table(title="hybridcache bench memory")
    for column in ("batch", "context", "block", "checkpoints", "cached tokens", "metadata B", "host B", "host B/token"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in records:
        table.add_row(
            str(r["batch"]), str(r["context"]), str(r["block_size"]), str(r["checkpoints"]), f"{r['cached_tokens']:,}",
            f"{r['metadata_bytes']:,}", f"{r['host_bytes']:,}", f"{r['host_bytes_per_token']:.2f}",
        )
    console.print(table)


def _print_records(records: list[dict], cpu: int | None) -> None:
    if records and records[0]["scenario"] == "memory":
        _print_memory(records)
        return
    table = Table(title=f"hybridcache bench (pinned cpu {cpu}, {platform.processor() or platform.machine()})")
    for column in ("scenario", "impl", "batch", "context", "block", "p50 ms", "p99 ms", "µs/request"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in records:
        table.add_row(
            r["scenario"], r["impl"], str(r["batch"]), str(r["context"]), str(r["block_size"]),
            f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['per_request_us']:.1f}",
        )
    console.print(table)


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from hybridcache.bench.method import ensure_controlled_process, pin_to_one_cpu

    ensure_controlled_process(argv)
    cpu = pin_to_one_cpu()
    if args.scenario in DEFAULT_GRID:
        default_batch, default_context = DEFAULT_GRID[args.scenario]
        args.batch = args.batch or default_batch
        args.context = args.context or default_context
    records = SCENARIOS[args.scenario](args)
    _print_records(records, cpu)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
        console.print(f"wrote {args.json}")
    return 0


def _demo(_: argparse.Namespace, __: list[str]) -> int:
    from hybridcache.demo import run_demo

    return 0 if run_demo(console) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridcache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="replay a multi-turn workload through the prefix cache")
    demo.set_defaults(handler=_demo)
    bench = commands.add_parser("bench", help="run a benchmark scenario")
    bench.add_argument("scenario", choices=sorted(SCENARIOS))
    bench.add_argument("--batch", type=_int_list, help="comma-separated batch sizes (default: 128,512)")
    bench.add_argument("--context", type=_int_list, help="comma-separated prompt lengths (default: 65536,131072)")
    bench.add_argument("--block-size", type=int, default=64)
    bench.add_argument("--warmups", type=int, default=2)
    bench.add_argument("--samples", type=int, default=10)
    bench.add_argument("--smoke", action="store_true", help="a seconds-long run that only checks the scenario works")
    bench.add_argument("--json", metavar="PATH", help="write the records as JSON")
    bench.set_defaults(handler=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return args.handler(args, argv)


if __name__ == "__main__":
    sys.exit(main())
