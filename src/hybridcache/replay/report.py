"""The multi-replica tables of ``hybridcache replay``: hit rate vs replicas per routing, and
what the tiers did per run.

Owns no state; reads the records ``driver.replay`` returns.
"""

from __future__ import annotations

from rich.console import Console

from hybridcache.cli_args import compact_table


def _setting(record: dict) -> tuple:
    budget = record["cache_bytes"] if record["cache_bytes"] is not None else record["kv_bytes"] + record["state_bytes"]
    return record["policy"], f"{budget / 1e9:g} GB", record["routing"], record["shared_tier"]


def _bytes(value: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def print_fleet(records: list[dict], console: Console) -> None:
    counts = sorted({record["replicas"] for record in records})
    rows: dict[tuple, dict[int, dict]] = {}
    for record in records:
        rows.setdefault(_setting(record), {})[record["replicas"]] = record
    setting = ["policy", "budget/replica", "routing", "shared tier"]
    table = compact_table("token hit rate vs replicas (each replica: the whole budget)",
                          setting + [f"{count} repl." for count in counts], left=tuple(setting))
    for setting, by_count in rows.items():
        cells = [f"{100 * by_count[c]['token_hit_rate']:.2f}%" if c in by_count else "" for c in counts]
        table.add_row(*setting, *cells)
    console.print(table)
    tiered = [record for record in records if "tiers" in record]
    if not tiered:
        return
    setting = ["repl.", "routing", "shared"]
    traffic = compact_table("tiers: restores and bytes moved", setting + ["remote hit tok", "restores", "moved/hit nominal",
                            "moved/hit wire"], left=("routing", "shared"))
    cost = compact_table("tiers: cost, storage, misses", setting + ["restore s", "recompute s", "stored B/unique tok",
                         "misses"], left=("routing", "shared", "misses"))
    for record in tiered:
        tiers = record["tiers"]
        where = (str(record["replicas"]), record["routing"], record["shared_tier"])
        misses = ", ".join(f"{reason} {count:,}" for reason, count in sorted(tiers["misses"].items()))
        traffic.add_row(*where, f"{record['remote_hit_tokens']:,}", f"{tiers['restores']:,}",
                        _bytes(tiers["bytes_moved_per_hit_nominal"]), _bytes(tiers["bytes_moved_per_hit_actual"]))
        cost.add_row(*where, f"{tiers['restore_s']:.2f}", f"{tiers['recompute_s']:.2f}",
                     f"{tiers['stored_bytes_per_unique_token']:,.0f}", misses or "-")
    console.print(traffic)
    console.print(cost)


def _oracle_setting(record: dict) -> tuple:
    budget = record["cache_bytes"] if record["cache_bytes"] is not None else (record["kv_bytes"], record["state_bytes"])
    return (record["trace"], record["model"], budget, record.get("replicas", 1), record.get("routing"),
            record.get("shared_tier"))


def add_oracle_fractions(records: list[dict], oracle: str = "oracle") -> None:
    """Give every record ``oracle_token_hit_rate`` and ``oracle_fraction`` (its token hit rate
    over the oracle's at the same trace, model, budget and fleet) when the sweep ran the oracle
    there; None otherwise."""
    best = {_oracle_setting(r): r["token_hit_rate"] for r in records if r["policy"] == oracle}
    for record in records:
        rate = best.get(_oracle_setting(record))
        record["oracle_token_hit_rate"] = rate
        record["oracle_fraction"] = record["token_hit_rate"] / rate if rate else None
