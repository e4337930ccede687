"""The admission-floor reports (issue 25): unit costs, admission stages and the CPU-time
columns of the match scenarios report what they promise (no assertions on time)."""

import io

import pytest
from rich.console import Console

from hybridcache.bench.admission_stages import measure_admission_stages
from hybridcache.bench.cli_support import FLOOR_SCENARIOS, run_floor_report
from hybridcache.bench.impl import HybridcacheImpl
from hybridcache.bench.scenarios import SCENARIOS, Case
from hybridcache.bench.unit_costs import UNITS, measure_unit_costs
from hybridcache.cli import SCENARIO_NAMES


def test_unit_costs_cover_every_unit_with_a_non_negative_cost():
    records = measure_unit_costs(number=200, repeats=1)
    assert [r["unit"] for r in records] == [unit for unit, _ in UNITS]
    assert all(r["cpu_ns"] >= 0 for r in records)


def test_admission_stages_count_the_calls_of_each_stage_per_request():
    record = measure_admission_stages(Case(batch=3, context=512, warmups=1, samples=1))
    stages = {stage["stage"]: stage for stage in record["stages"]}
    # every request hits the checkpoint its ingest remembered: admitted together, no match each
    assert "match" not in stages and "pin_restore" not in stages
    assert stages["admit_remembered › place_blocks"]["calls_per_request"] == pytest.approx(1.0)  # its new block
    for stage in ("admit_remembered › remembered_hits", "take_remembered_hits › pin_selected_restores",
                  "admit_remembered › allocate_stamped", "admit_remembered › allocate_runtimes"):  # once per batch
        assert stages[stage]["calls_per_request"] == pytest.approx(1 / 3)
        assert stages[stage]["python_calls_per_request"] >= 1 / 3
    assert 0 < sum(stage["share"] for stage in record["stages"]) <= 1 + 1e-9
    assert record["python_calls_per_request"] > record["builtin_calls_per_request"] > 0
    assert record["cpu_us_per_request"] > 0 and record["wall_us_per_request"] > 0


@pytest.mark.parametrize("scenario", FLOOR_SCENARIOS)
def test_floor_reports_run_at_smoke_size_and_are_bench_scenarios(scenario):
    output = io.StringIO()
    records = run_floor_report(scenario, None, None, 64, True, Console(file=output, width=200))
    assert records and all(r["scenario"] == scenario for r in records)
    assert f"bench {scenario}" in output.getvalue()
    assert scenario in SCENARIO_NAMES


@pytest.mark.parametrize("scenario", ["match", "kv-match"])
def test_match_records_carry_cpu_time_next_to_wall_time(scenario):
    case = Case(batch=3, context=512, warmups=1, samples=2)
    (record,) = SCENARIOS[scenario]([HybridcacheImpl()], case, lambda: None)
    assert record["total_cpu_p50_ms"] > 0 and record["floor_cpu_p50_ms"] > 0
    assert record["cpu_overhead_over_floor"] == pytest.approx(record["total_cpu_p50_ms"] / record["floor_cpu_p50_ms"])


@pytest.mark.parametrize("hybrid", [False, True])
def test_identity_stages_split_a_hit_into_the_comparison_and_the_bookkeeping(hybrid):
    from hybridcache.bench.admission_stages import measure_identity_stages

    record = measure_identity_stages(Case(batch=3, context=512, warmups=1, samples=1), hybrid, top=5)
    assert record["scenario"] == ("match" if hybrid else "kv-match")
    parts = ("ingest", "match", "floor", "comparison")
    assert all(record[f"{part}_us_per_request"] > 0 for part in parts)
    assert record["bookkeeping_us_per_request"] == pytest.approx(
        record["ingest_us_per_request"] + record["match_us_per_request"] - record["comparison_us_per_request"]
    )
    assert len(record["functions"]) == 5 and record["python_calls_per_request"] > record["builtin_calls_per_request"] > 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_hit_chain_times_every_stage_of_a_hit_against_the_floor(hybrid):
    from hybridcache.bench import hit_chain

    record = hit_chain.measure_hit_chain(Case(batch=3, context=512, warmups=1, samples=1), hybrid)
    assert record["scenario"] == ("match" if hybrid else "kv-match")
    stages = record["stages_us_per_request"]
    assert {"ingest (trie.prepare)", "match (trie.match)", "floor (np.array_equal)"} <= set(stages)
    assert any("comparison" in name for name in stages) and all(value >= 0 for value in stages.values())
