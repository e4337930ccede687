"""Token hit rate versus cache budget, one curve per policy, the oracle dashed (matplotlib, Agg backend).

Owns no state; imported only when a plot is asked for (matplotlib is an optional extra).
"""

from __future__ import annotations

from collections import defaultdict

from hybridcache.errors import InvalidArgumentError


def _budget_gb(record: dict) -> float:
    total = record["cache_bytes"] if record["cache_bytes"] is not None else record["kv_bytes"] + record["state_bytes"]
    return total / 1e9


def plot_hit_rates(records: list[dict], path: str) -> None:
    if not records:
        raise InvalidArgumentError("nothing to plot: no replay records")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError("--plot needs matplotlib (pip install 'hybridcache[bench]')") from None
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for record in records:
        curves[record["policy"]].append((_budget_gb(record), 100 * record["token_hit_rate"]))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for policy, points in curves.items():
        points.sort()
        dashed = policy == "oracle"  # the offline estimate of the best: a reference, not a policy
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy,
                  linestyle="--" if dashed else "-", color="black" if dashed else None)
    axes.axhline(100 * records[0]["bound_token_hit_rate"], linestyle="--", color="grey", label="infinite-cache bound")
    axes.set_xlabel("cache budget (GB, KV + states)")
    axes.set_ylabel("token hit rate (%)")
    axes.set_title(f"{records[0]['model']} on {records[0]['trace'].rsplit('/', 1)[-1]}")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise InvalidArgumentError(f"cannot write the plot {path}: {error}") from None
    finally:
        plt.close(figure)
