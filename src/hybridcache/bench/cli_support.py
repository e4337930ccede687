"""Grids, implementations and output for ``hybridcache bench``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from hybridcache.bench.implementations import make_impl
from hybridcache.bench.memory import measure_in_fresh_process
from hybridcache.bench.scenarios import SCENARIOS, Case
from hybridcache.cli_args import filled_table
from hybridcache.errors import InvalidArgumentError

MATCH_GRID = [(128, 65536), (128, 131072), (512, 65536), (512, 131072)]
DEFAULT_GRIDS = {
    "match": MATCH_GRID,
    "match-partial": MATCH_GRID,
    "kv-match": MATCH_GRID,
    "admit-many": MATCH_GRID,
    "rollback": MATCH_GRID,
    "rematch": MATCH_GRID,
    "miss": [(128, 131072)],
    "publish": [(16, 131072)],
    "evict": [(1000, 128)],
    "memory": [(512, 131072)],
    "lmdeploy-schedule": MATCH_GRID,
}
SMOKE_GRIDS = {name: [(4, 1024)] for name in DEFAULT_GRIDS} | {"evict": [(8, 128)], "memory": [(4, 4096)]}
DEFAULT_STEPS = (1, 64, 1024)
# Scenarios of an engine's own code on hybridcache: they need that engine's environment
# (lmdeploy-schedule: ``make lmdeploy-env``), so ``bench all`` leaves them out.
ENGINE_SCENARIOS = ("lmdeploy-schedule",)
ALL_SCENARIOS = tuple(name for name in DEFAULT_GRIDS if name not in ENGINE_SCENARIOS)
MAX_CASE_TOKENS = 2**28  # 1 GiB of int32 prompt tokens; the largest default case holds 2**26


def cases_for(scenario: str, batches, contexts, steps, block_size: int, smoke: bool) -> list[Case]:
    if smoke:
        grid = SMOKE_GRIDS[scenario]
    elif batches or contexts:
        defaults = DEFAULT_GRIDS[scenario]
        grid = [(b, c) for b in (batches or sorted({b for b, _ in defaults})) for c in (contexts or sorted({c for _, c in defaults}))]
    else:
        grid = DEFAULT_GRIDS[scenario]
    too_large = [(b, c) for b, c in grid if b * c > MAX_CASE_TOKENS]
    if too_large:
        batch, context = too_large[0]
        raise InvalidArgumentError(
            f"batch {batch:,} x context {context:,} = {batch * context:,} tokens; a case holds at most {MAX_CASE_TOKENS:,}"
        )
    rounds = {"warmups": 1, "samples": 2} if smoke else {}
    cases = [Case(batch=b, context=c, block_size=block_size, **rounds) for b, c in grid]
    if scenario == "miss":
        step_list = (1, 4) if smoke else (steps or DEFAULT_STEPS)
        cases = [replace(case, steps=s) for case in cases for s in step_list]
    return cases


def run_scenario(scenario: str, impl_names: list[str], cases: list[Case], console: Console) -> list[dict]:
    if scenario == "lmdeploy-schedule":  # both implementations are lmdeploy's Scheduler, its trie or ours
        from hybridcache.bench.lmdeploy_schedule import bench_lmdeploy_schedule

        return [record for case in cases for record in bench_lmdeploy_schedule(case)]
    records = []
    with Progress(console=console, transient=True) as progress:
        for case in cases:
            if scenario == "memory":
                for name in impl_names:
                    records.append(measure_in_fresh_process(name, case.batch, case.context, case.block_size))
                continue
            impls = [make_impl(name) for name in impl_names]
            label = f"{scenario} set-up: batch={case.batch} context={case.context}"
            task = progress.add_task(label, total=max(case.batch, 100))
            records.extend(SCENARIOS[scenario](impls, case, lambda: progress.advance(task)))
            progress.remove_task(task)
    return records


def with_ratios(records: list[dict]) -> list[dict]:
    """Add ``speedup`` (reference p50 / ours) to our records when both ran the same case."""
    keyed = {}
    for record in records:
        key = (record["scenario"], record["batch"], record["context"], record.get("steps"), record.get("kind"))
        keyed.setdefault(key, {})[record["impl"]] = record
    for pair in keyed.values():
        ours, theirs = pair.get("hybridcache"), pair.get("lmdeploy")
        if ours and theirs:
            if "metadata_bytes" in ours:
                ours["metadata_ratio"] = theirs["metadata_bytes"] / max(1, ours["metadata_bytes"])
                ours["host_bytes_ratio"] = theirs["host_bytes_per_token"] / ours["host_bytes_per_token"]
            else:
                ours["speedup_p50"] = theirs["p50_ms"] / ours["p50_ms"]
                ours["speedup_p99"] = theirs["p99_ms"] / ours["p99_ms"]
    return records


def _without_empty_columns(columns: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Scenarios fill different columns (only a reference run has ×ref); a column no row fills
    would only take width from the others on a narrow terminal."""
    kept = [i for i in range(len(columns)) if any(row[i] for row in rows)]
    return [columns[i] for i in kept], [[row[i] for i in kept] for row in rows]


def print_records(records: list[dict], console: Console, cpu: int | None) -> None:
    timed = [r for r in records if r["scenario"] != "memory"]
    memory = [r for r in records if r["scenario"] == "memory"]
    if timed:
        columns = ["scenario", "impl", "batch", "context", "S", "p50 ms", "p99 ms", "µs/req", "ingest ms", "total ms",
                   "floor ms", "cpu total", "cpu floor", "cpu ×floor", "trie cpu", "trie share", "×ref", "cpu ×ref",
                   "trie ×ref", "cpu+arrival ×ref"]
        rows = [
            [r["scenario"] + (f" ({r['kind']})" if "kind" in r else ""), r["impl"], str(r["batch"]), str(r["context"]),
             str(r.get("steps", "")), f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['per_request_us']:.1f}",
             _opt(r, "ingest_p50_ms"), _opt(r, "total_p50_ms"), _opt(r, "floor_p50_ms"),
             _opt(r, "total_cpu_p50_ms"), _opt(r, "floor_cpu_p50_ms"), _opt(r, "cpu_overhead_over_floor", "{:.2f}×"),
             _opt(r, "trie_cpu_p50_ms"), _opt(r, "trie_share_p50", "{:.0%}"),
             _opt(r, "speedup_p50", "{:.1f}×"), _opt(r, "cpu_speedup_p50", "{:.2f}×"), _opt(r, "trie_cpu_speedup_p50", "{:.2f}×"),
             _opt(r, "cpu_total_speedup_p50", "{:.2f}×")]
            for r in timed
        ]
        columns, rows = _without_empty_columns(columns, rows)
        console.print(filled_table(f"hybridcache bench (pinned to cpu {cpu})", columns, rows, left=("scenario", "impl")))
    if memory:
        columns = ["impl", "batch", "context", "metadata bytes", "host bytes", "host B/token", "ref/ours meta", "ref/ours host"]
        rows = [
            [r["impl"], str(r["batch"]), str(r["context"]), f"{r['metadata_bytes']:,}", f"{r['host_bytes']:,}",
             f"{r['host_bytes_per_token']:.2f}", _opt(r, "metadata_ratio", "{:.0f}×"), _opt(r, "host_bytes_ratio", "{:.1f}×")]
            for r in memory
        ]
        console.print(filled_table("hybridcache bench memory", columns, rows, left=("impl",)))


def _opt(record: dict, key: str, fmt: str = "{:.2f}") -> str:
    return fmt.format(record[key]) if key in record else ""


def write_json(records: list[dict], path: str) -> None:
    Path(path).write_text(json.dumps(records, indent=2))


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in records if "p50_ms" in r]
    labels = sorted({(r["scenario"], r["batch"], r["context"], r.get("steps"), r.get("kind")) for r in timed}, key=str)
    impls = sorted({r["impl"] for r in timed})
    figure, axis = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4.5))
    width = 0.8 / max(1, 2 * len(impls))
    for i, impl in enumerate(impls):
        by_label = {(r["scenario"], r["batch"], r["context"], r.get("steps"), r.get("kind")): r for r in timed if r["impl"] == impl}
        for j, stat in enumerate(("p50_ms", "p99_ms")):
            values = [by_label[label][stat] if label in by_label else 0 for label in labels]
            offsets = [k + (2 * i + j - len(impls)) * width for k in range(len(labels))]
            axis.bar(offsets, values, width, label=f"{impl} {stat[:3]}")
    axis.set_xticks(range(len(labels)))
    axis.set_xticklabels([f"{s}\n{b}×{c // 1024}K" + (f"\nS={st}" if st else "") for s, b, c, st, _ in labels], fontsize=7)
    axis.set_ylabel("ms per batch")
    axis.set_yscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --- the admission floor (issue 25): unit costs and admission stages, tables of their own ----

FLOOR_SCENARIOS = ("unit-costs", "admission-stages")


def run_floor_report(scenario: str, batches, contexts, block_size: int, smoke: bool, console: Console) -> list[dict]:
    """Measure and print ``unit-costs`` or ``admission-stages``; returns the records."""
    if scenario == "unit-costs":
        from hybridcache.bench.unit_costs import measure_unit_costs

        records = measure_unit_costs(number=2_000, repeats=2) if smoke else measure_unit_costs()
        rows = [[escape(r["unit"]), escape(r["statement"]), f"{r['cpu_ns']:.0f}"] for r in records]
        console.print(filled_table("hybridcache bench unit-costs (CPU ns per operation)", ["unit", "statement", "cpu ns"],
                                   rows, left=("unit", "statement")))
        return [{"scenario": scenario, **r} for r in records]
    from hybridcache.bench.admission_stages import measure_admission_stages

    records = [measure_admission_stages(case) for case in cases_for("admit-many", batches, contexts, None, block_size, smoke)]
    for record in records:
        title = (f"hybridcache bench admission-stages, batch {record['batch']} x {record['context']}: "
                 f"{record['cpu_us_per_request']:.1f} µs CPU ({record['wall_us_per_request']:.1f} wall) per request, "
                 f"{record['python_calls_per_request']} calls ({record['builtin_calls_per_request']} of C functions)")
        rows = [[s["stage"], f"{s['calls_per_request']:.2f}", f"{s['python_calls_per_request']:.1f}",
                 f"{100 * s['share']:.1f}", f"{s['cpu_us_per_request']:.2f}"] for s in record["stages"]]
        console.print(filled_table(title, ["stage", "calls/req", "calls inside/req", "share %", "cpu µs/req"], rows,
                                   left=("stage",)))
    return [{"scenario": scenario, **r} for r in records]
