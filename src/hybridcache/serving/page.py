"""The live page at ``/``: plain HTML with inline SVG, rendered on the server from the same
snapshot ``/metrics`` reads (no script, no network; the page refreshes itself).

Owns nothing mutable: ``render_page`` reads ``ServingMetrics`` and fills ``static/page.html``.
"""

from __future__ import annotations

from html import escape
from importlib import resources
from string import Template

from hybridcache.serving.metrics import MISS_ADVICE, EngineSnapshot, ServingMetrics

CHART_W, CHART_H = 600, 140
_TEMPLATE = Template(resources.files("hybridcache.serving").joinpath("static/page.html").read_text(encoding="utf-8"))


def render_page(metrics: ServingMetrics) -> str:
    snap = metrics.snapshot
    return _TEMPLATE.substitute(
        model=escape(metrics.served_name),
        query_tokens=snap.query_tokens, hit_tokens=snap.hit_tokens, hit_rate=repr(snap.hit_rate), hits=snap.hits,
        running=snap.running, waiting=snap.waiting, kv_usage=repr(snap.kv_usage), state_usage=repr(snap.state_usage),
        checkpoints=snap.checkpoints_held, checkpoints_evicted=snap.evicted_checkpoints,
        hit_rate_chart=_hit_rate_chart(list(metrics.history)),
        usage_bars=_usage_bars(snap),
        miss_rows="\n".join(_miss_row(reason, snap.misses.get(reason, 0)) for reason in sorted(set(MISS_ADVICE) | set(snap.misses))),
        recent_rows="\n".join(_recent_row(record) for record in reversed(metrics.recent)),
    )


def interval_hit_rates(history: list[EngineSnapshot]) -> list[float]:
    """Each interval's token hit rate (restored over queried tokens between two snapshots);
    an interval without queries repeats the previous rate."""
    rates, last = [], 0.0
    for before, after in zip(history, history[1:]):
        queried = after.query_tokens - before.query_tokens
        last = (after.hit_tokens - before.hit_tokens) / queried if queried > 0 else last
        rates.append(last)
    return rates


def _hit_rate_chart(history: list[EngineSnapshot]) -> str:
    rates = interval_hit_rates(history)
    step = CHART_W / max(len(rates) - 1, 1)
    points = " ".join(f"{i * step:.1f},{CHART_H - rate * CHART_H:.1f}" for i, rate in enumerate(rates))
    line = f'<polyline fill="none" stroke="#2a7" stroke-width="2" points="{points}"/>' if rates else ""
    return (
        f'<svg id="hit-rate-chart" width="{CHART_W + 40}" height="{CHART_H + 20}" role="img" aria-label="hit rate over time">'
        f'<g transform="translate(35,5)"><rect width="{CHART_W}" height="{CHART_H}" fill="#f6f6f6"/>{line}</g>'
        f'<text x="0" y="12">100%</text><text x="8" y="{CHART_H + 5}">0%</text></svg>'
    )


def _usage_bars(snap: EngineSnapshot) -> str:
    bars = []
    for row, (label, value) in enumerate((("KV blocks", snap.kv_usage), ("state slots", snap.state_usage))):
        y = row * 26
        bars.append(
            f'<text x="0" y="{y + 14}">{label}</text><rect x="90" y="{y}" width="400" height="18" fill="#eee"/>'
            f'<rect x="90" y="{y}" width="{400 * value:.1f}" height="18" fill="#36c"/>'
            f'<text x="500" y="{y + 14}">{100 * value:.1f}%</text>'
        )
    return f'<svg id="usage-bars" width="560" height="52" role="img" aria-label="pool usage">{"".join(bars)}</svg>'


def _miss_row(reason: str, count: int) -> str:
    advice = escape(MISS_ADVICE.get(reason, ""))
    return f'<tr data-reason="{escape(reason)}"><td>{escape(reason)}</td><td class="count">{count}</td><td>{advice}</td></tr>'


def _recent_row(record) -> str:
    cells = (record.request_id, record.endpoint, record.prompt_tokens, record.cached_tokens, record.completion_tokens,
             record.miss_reason or "", f"{record.ttft_s:.4f}")
    return "<tr>" + "".join(f"<td>{escape(str(cell))}</td>" for cell in cells) + "</tr>"
