"""The two commands a newcomer runs, and the benchmark smoke run CI keeps alive."""

import json
import os
import subprocess
import sys

import pytest

from hybridcache.cli import build_parser


def _run_cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="160")
    return subprocess.run(
        [sys.executable, "-m", "hybridcache.cli", *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )


def test_demo_serves_identical_outputs_and_prints_the_hit_rate_table(tmp_path):
    result = _run_cli("demo", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hit rate" in result.stdout
    assert "overall" in result.stdout
    assert "identical" in result.stdout and "DIFFERENT" not in result.stdout


def test_kv_match_smoke_writes_json_records(tmp_path):
    out = tmp_path / "kv.json"
    result = _run_cli("bench", "kv-match", "--smoke", "--json", str(out), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    (record,) = json.loads(out.read_text())
    for field in ("scenario", "impl", "batch", "context", "block_size", "p50_ms", "p99_ms", "per_request_us"):
        assert field in record
    assert record["scenario"] == "kv-match"
    assert record["per_request_us"] == pytest.approx(record["p50_ms"] * 1000 / record["batch"])


def test_unknown_scenario_is_rejected():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "no-such-scenario"])


def test_memory_smoke_reports_metadata_and_host_bytes(tmp_path):
    out = tmp_path / "memory.json"
    result = _run_cli("bench", "memory", "--smoke", "--json", str(out), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    (record,) = json.loads(out.read_text())
    assert record["scenario"] == "memory"
    assert record["checkpoints"] == record["batch"]
    assert record["metadata_bytes"] > 0
    assert record["host_bytes_per_token"] > 0
