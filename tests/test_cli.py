"""The two commands a newcomer runs, and the benchmark smoke run CI keeps alive."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridcache.cli import build_parser
from tests.cli_runner import run_main, run_process

REPOSITORY = Path(__file__).resolve().parents[1]


def _run_cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    """The command on an 80-column terminal: no line of its output may be wider."""
    result = run_process(*args, cwd=tmp_path, columns=80)
    assert max((len(line) for line in result.stdout.splitlines()), default=0) <= 80, result.stdout
    assert "…" not in result.stdout
    return result


def test_demo_serves_identical_outputs_and_prints_the_hit_rate_table(tmp_path):
    result = _run_cli("demo", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hit rate" in result.stdout
    assert "overall" in result.stdout
    assert "identical" in result.stdout and "DIFFERENT" not in result.stdout


def test_progress_bars_go_to_stderr_and_are_erased_when_done(tmp_path):
    """On a terminal (rich treats FORCE_COLOR as one) the bars are drawn on stderr only, and the
    last one is erased so no stale line stays above the table."""
    result = run_process("bench", "kv-match", "--smoke", cwd=tmp_path, columns=80, extra_env={"FORCE_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert "━" in result.stderr and "━" not in result.stdout
    assert "\x1b[2K" in result.stderr[result.stderr.rindex("━"):]  # the bar's line cleared after its last frame
    table = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", result.stdout)
    assert "hybridcache bench" in table and max(len(line) for line in table.splitlines()) <= 80


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


@pytest.fixture
def bench_in_process(monkeypatch):
    """``bench`` run inside the test process: no re-execution, no CPU pinning."""
    from hybridcache.bench import method

    monkeypatch.setattr(method, "ensure_controlled_process", lambda argv: None)
    monkeypatch.setattr(method, "pin_to_one_cpu", lambda: None)


@pytest.mark.parametrize("options, message", [
    (["match", "--batch", "0"], "--batch"),
    (["match", "--batch", "4,-1"], "--batch"),
    (["match", "--context", "0"], "--context"),
    (["miss", "--steps", "0"], "--steps"),
    (["match", "--block-size", "0"], "--block-size"),
    (["match", "--block-size", "7"], "--block-size"),
    (["match", "--block-size", str(2**40)], "--block-size"),
    (["match", "--plot", "/no/such/folder/p.png"], "--plot"),
    (["match", "--plot", "chart.txt"], "--plot"),
    (["match", "--json", "/no/such/folder/r.json"], "--json"),
    (["match", "--json", "/proc/r.json"], "--json"),
    (["match", "--batch", "\u0664"], "--batch"),
    (["soak-engine", "--requests", "0"], "--requests"),
    (["soak-engine", "--requests", "-5"], "--requests"),
])
def test_bench_refuses_bad_options_before_running(capsys, bench_in_process, options, message):
    status, out, err = run_main(["bench", *options], capsys)
    assert status == 2 and message in err and out == ""
    assert "Traceback" not in err


def test_soak_engine_help_states_its_default(capsys):
    status, out, _ = run_main(["bench", "--help"], capsys)
    assert status == 0 and "(default: 10000)" in out


def _make_demo(folder: Path, python3_is_new_enough: bool) -> subprocess.CompletedProcess:
    """``make demo`` in a copy of the Makefile on a PATH whose only Python is a stub
    ``python3`` that passes (or fails) the version check and does nothing else."""
    folder.mkdir()
    shutil.copy(REPOSITORY / "Makefile", folder / "Makefile")
    (folder / "pyproject.toml").write_text("")
    stub = folder / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text(f"#!/bin/sh\nexit {0 if python3_is_new_enough else 1}\n")
    stub.chmod(0o755)
    make = shutil.which("make")
    return subprocess.run([make, "demo"], cwd=folder, env={"PATH": str(stub.parent)}, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_finds_a_suitable_python_or_says_what_it_needs(tmp_path):
    usable = _make_demo(tmp_path / "new", python3_is_new_enough=True)
    assert "python3 -m venv .venv" in usable.stdout  # then fails: the stub builds no venv
    too_old = _make_demo(tmp_path / "old", python3_is_new_enough=False)
    assert too_old.returncode != 0 and "-m venv" not in too_old.stdout
    assert "no Python 3.11 or newer found (tried python3.11, python3)" in too_old.stderr


def test_bench_refuses_a_case_too_large_to_hold(capsys, bench_in_process):
    status, out, err = run_main(["bench", "match", "--batch", "1048576", "--context", "16777216"], capsys)
    assert status == 2 and "a case holds at most" in err and out == ""


def test_bench_compare_without_the_reference_says_how_to_set_it_up(capsys, monkeypatch, bench_in_process):
    from hybridcache.bench import lmdeploy_impl

    def missing():
        raise RuntimeError(f"lmdeploy is not importable (ModuleNotFoundError); {lmdeploy_impl.SETUP_HINT}")

    monkeypatch.setattr(lmdeploy_impl, "load_lmdeploy", missing)
    status, out, err = run_main(["bench", "kv-match", "--smoke", "--compare", "lmdeploy"], capsys)
    assert status == 2 and "run make compare-setup first" in err and out == ""


def test_router_refuses_an_unknown_policy_without_a_traceback(capsys):
    status, out, err = run_main(["router", "--replica", "http://127.0.0.1:9", "--policy", "fastest"], capsys)
    assert status == 2 and "unknown routing policy" in err and out == ""
    assert "Traceback" not in err


def test_bench_lmdeploy_schedule_outside_the_lmdeploy_environment_says_where_to_run_it(capsys, monkeypatch, bench_in_process):
    import importlib

    real_import = importlib.import_module

    def without_lmdeploy(name, *args):
        if name.startswith("lmdeploy"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_lmdeploy)
    status, out, err = run_main(["bench", "lmdeploy-schedule", "--smoke"], capsys)
    assert status == 2 and "make lmdeploy-env" in err and out == ""
