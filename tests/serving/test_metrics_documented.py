"""Every metric ``/metrics`` serves is documented, by the name a scraper sees, in docs/serving.md."""

from __future__ import annotations

from pathlib import Path

from tests.serving.conftest import request

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_every_served_metric_is_documented(server):
    _, _, text = request(server, "GET", "/metrics")
    served = set()
    for line in text.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if name.endswith("_created"):
                continue  # prometheus_client's creation time of a counter or histogram
            served.add(f"{name}_total" if kind == "counter" and not name.endswith("_total") else name)
    assert {"hybridcache:checkpoints_written_total", "hybridcache:restored_tokens_total",
            "hybridcache:request_misses_total", "hybridcache:tier_misses_total"} <= served
    documented = DOCS.read_text()
    assert sorted(name for name in served if f"`{name}" not in documented) == []
