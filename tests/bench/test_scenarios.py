"""Every benchmark scenario runs at smoke size and reports what its records promise (no
assertions on time: speed is measured by `hybridcache bench`, not by tests)."""

import json

import pytest

from hybridcache.bench.cli_support import (
    ALL_SCENARIOS,
    ENGINE_SCENARIOS,
    SMOKE_GRIDS,
    cases_for,
    plot,
    run_scenario,
    with_ratios,
)
from hybridcache.bench.impl import HybridcacheImpl
from hybridcache.bench.scenarios import SCENARIOS, Case
from hybridcache.cli import console

REQUIRED = ("scenario", "impl", "batch", "context", "block_size", "p50_ms", "p99_ms", "per_request_us")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_runs_at_smoke_size(scenario):
    cases = cases_for(scenario, None, None, None, 64, smoke=True)
    records = run_scenario(scenario, ["hybridcache"], cases, console)
    assert records
    for record in records:
        assert all(field in record for field in REQUIRED), record
        assert record["impl"] == "hybridcache"
        assert record["p99_ms"] >= record["p50_ms"] >= 0
        assert record["per_request_us"] == pytest.approx(record["p50_ms"] * 1000 / record["batch"])


def test_match_records_carry_ingest_total_and_floor():
    (record,) = SCENARIOS["match"]([HybridcacheImpl()], Case(batch=3, context=512, warmups=1, samples=2), lambda: None)
    assert record["total_p50_ms"] >= record["ingest_p50_ms"]
    assert record["floor_p50_ms"] > 0 and record["overhead_over_floor"] > 0


def test_memory_record_reports_metadata_and_host_bytes():
    (record,) = run_scenario("memory", ["hybridcache"], cases_for("memory", None, None, None, 64, smoke=True), console)
    assert record["metadata_bytes"] > 0 and record["host_bytes_per_token"] > 0
    assert record["cached_tokens"] == record["batch"] * record["context"]


def test_ratios_are_added_when_both_implementations_ran(tmp_path):
    ours = {"scenario": "match", "impl": "hybridcache", "batch": 1, "context": 8, "p50_ms": 1.0, "p99_ms": 2.0}
    theirs = dict(ours, impl="lmdeploy", p50_ms=10.0, p99_ms=30.0)
    records = with_ratios([ours, theirs])
    assert records[0]["speedup_p50"] == 10.0 and records[0]["speedup_p99"] == 15.0
    plot_path = tmp_path / "chart.png"
    plot(records, str(plot_path))
    assert plot_path.stat().st_size > 0
    assert json.loads(json.dumps(records))


def test_every_scenario_has_a_smoke_grid():
    """``bench all`` runs every scenario but those needing an engine's own environment."""
    assert set(ALL_SCENARIOS) == set(SMOKE_GRIDS) - set(ENGINE_SCENARIOS) == set(SCENARIOS) | {"memory"}
    assert set(ENGINE_SCENARIOS) <= set(SMOKE_GRIDS)
