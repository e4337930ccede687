"""``hybridcache replay`` under hostile or careless input (issue 19, items 11 and 21, and the
new-user findings): every class of bad input ends in one clear line on stderr and exit status
2, never a traceback, and every option is refused before the trace is read."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hybridcache.profiles import BUILTIN_CONFIGS
from hybridcache import machine
from hybridcache.workloads import readers
from tests.cli_runner import run_main, run_process
from tests.workloads._traces import mooncake, write_lines

ROWS = [mooncake(0, 1500, 20, [1, 2, 3]), mooncake(5, 1500, 10, [1, 2, 4])]


@pytest.fixture
def trace(tmp_path):
    return str(write_lines(tmp_path / "t.jsonl", ROWS))


def _refused(argv: list[str], capsys) -> str:
    """What a refused command said on stderr (exit status 2, no traceback, nothing on stdout)."""
    status, out, err = run_main(argv, capsys)
    assert status == 2, (argv, out, err)
    assert "Traceback" not in out + err and "error" not in out
    return err


# --- budgets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    (["--cache-bytes", "10PB"], "budget too large to replay"),
    (["--cache-bytes", "2GB,900PB"], "budget too large to replay"),  # the second budget of a sweep, checked before the first run
    (["--kv-bytes", "8000PB", "--state-bytes", "1GB"], "budget too large to replay"),
    (["--kv-bytes", "1GB", "--state-bytes", "5000PB"], "budget too large to replay"),
    (["--cache-bytes", "99999999999999999999PB"], "8 EiB"),
    (["--cache-bytes", "1" * 400], "8 EiB"),
    (["--cache-bytes", "1KB"], "budget too small"),
])
def test_budgets_that_cannot_be_allocated_are_refused(trace, capsys, options, message):
    assert message in _refused(["replay", trace, *options], capsys)


def test_a_fleet_is_refused_when_all_its_replicas_cannot_be_allocated(trace, capsys, monkeypatch):
    monkeypatch.setattr(machine, "host_memory_bytes", lambda: 2**30)  # a 1 GiB machine
    assert run_main(["replay", trace, "--cache-bytes", "400GB"], capsys)[0] == 0
    assert "budget too large to replay" in _refused(["replay", trace, "--cache-bytes", "400GB", "--replicas", "1,1024"], capsys)


# --- numbers and denominators of the options -----------------------------------------------------


@pytest.mark.parametrize("options, message", [
    (["--block-size", "0"], "--block-size"),
    (["--block-size", "-16"], "--block-size"),
    (["--block-size", "7"], "--block-size"),
    (["--block-size", str(2**40)], "--block-size"),
    (["--block-size", "sixteen"], "--block-size"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--tier-chunk", "-32", "--host-bytes", "1GB"], "--tier-chunk"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--limit", "-5"], "--limit"),
    (["--device-tflops", "inf"], "--device-tflops"),
    (["--device-tflops", "-400"], "--device-tflops"),
    (["--replicas", "1,100000"], "--replicas"),
    (["--shared-bandwidth", "0"], "--shared-bandwidth"),
    (["--policy", "interval:0"], "interval"),
    (["--policy", ","], "no policy"),
    (["--seed", "\u0663"], "--seed"),  # int() reads other scripts' digits: options take ASCII ones
    (["--limit", "\u0661\u0662"], "--limit"),
    (["--device-tflops", "\u0661\u0660"], "--device-tflops"),
    (["--replicas", "1,\u0662"], "--replicas"),
    (["--shared-bandwidth", "\u0661\u0662GB"], "--shared-bandwidth"),
    (["--policy", "interval:\u0663\u0662"], "admission 'interval' needs a positive int"),
    (["--policy", "interval:\u00b2"], "admission 'interval' needs a positive int"),
    (["--eviction", "marconi:\u0661"], "eviction 'marconi' takes a weight"),
    (["--admission", ""], "the admission name must be a non-empty string"),
    (["--eviction", " "], "the eviction name must be a non-empty string"),
])
def test_out_of_range_options_are_refused(trace, capsys, options, message):
    err = _refused(["replay", trace, "--cache-bytes", "2GB", *options], capsys)
    assert message in err, err
    assert "budget too small" not in err  # refused as the option it is, not as a derived budget


def test_options_are_checked_before_the_trace_is_read(tmp_path, capsys):
    missing = str(tmp_path / "absent.jsonl")
    assert "--block-size" in _refused(["replay", missing, "--cache-bytes", "2GB", "--block-size", "0"], capsys)
    assert "unknown policy" in _refused(["replay", missing, "--cache-bytes", "2GB", "--policy", "lfu"], capsys)
    assert "unknown model profile" in _refused(["replay", missing, "--cache-bytes", "2GB", "--model", "nope"], capsys)
    assert "--json" in _refused(["replay", missing, "--cache-bytes", "2GB", "--json", str(tmp_path / "no" / "r.json")], capsys)
    assert "--plot" in _refused(["replay", missing, "--cache-bytes", "2GB", "--plot", str(tmp_path / "no" / "r.png")], capsys)
    assert "--plot" in _refused(["replay", missing, "--cache-bytes", "2GB", "--plot", str(tmp_path / "r.txt")], capsys)
    assert "folder" in _refused(["replay", missing, "--cache-bytes", "2GB", "--json", str(tmp_path)], capsys)
    assert "give --cache-bytes" in _refused(["replay", missing], capsys)


# --- the trace: sizes, special files, JSON ----------------------------------------------------------


@pytest.mark.parametrize("line, message", [
    ("[" * 100_000, "nested too deeply"),
    ('{"a": ' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    (json.dumps(mooncake(0, 1500, 10**12, [1, 2, 3])), "output_length must be <="),
    (json.dumps(mooncake(0, 10**12, 1, [1])), "input_length must be <="),
    (json.dumps(mooncake(0, 4_000_000, 1_000_000, [1] * 7813)), "over the 4,194,304 a request may hold"),
    ('{"timestamp": 0, "input_length": ' + "9" * 5000 + "}", "not valid JSON"),
    ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "finite"),
    (json.dumps({"prompt": [1, 2], "output_length": 10**15}), "output_length must be <="),
])
def test_oversized_and_malformed_trace_lines_are_refused(tmp_path, capsys, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    assert message in _refused(["replay", str(path), "--cache-bytes", "2GB"], capsys)


def test_a_line_over_the_bound_is_refused_without_reading_it_whole(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 4096)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '{"timestamp": 1' + " " * 10_000 + "}\n", encoding="utf-8")
    err = _refused(["replay", str(path), "--cache-bytes", "2GB"], capsys)
    assert "line longer than 4,096 bytes" in err, err
    assert "long.jsonl:2" in err


def test_a_trace_over_the_total_bound_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(readers, "MAX_TRACE_TOKENS", 2000)
    path = write_lines(tmp_path / "t.jsonl", ROWS)
    assert "the trace passes 2,000 tokens" in _refused(["replay", str(path), "--cache-bytes", "2GB"], capsys)
    assert run_main(["replay", str(path), "--cache-bytes", "2GB", "--limit", "1"], capsys)[0] == 0


@pytest.mark.parametrize("kind", ["char device", "fifo", "directory", "link to a device"])
def test_special_files_are_refused_as_traces_and_configs(tmp_path, capsys, kind):
    path = tmp_path / "special"
    if kind == "char device":
        path = "/dev/zero"
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    good = str(write_lines(tmp_path / "t.jsonl", ROWS))
    assert "not a regular file" in _refused(["replay", str(path), "--cache-bytes", "2GB"], capsys)
    assert "not a regular file" in _refused(["replay", good, "--cache-bytes", "2GB", "--model", str(path)], capsys)


def test_a_subprocess_sees_no_traceback_for_dev_zero_and_a_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        result = run_process("replay", path, "--cache-bytes", "2GB", cwd=tmp_path, timeout=60)
        assert result.returncode == 2 and "not a regular file" in result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""


# --- model profiles (config.json) ------------------------------------------------------------------


def _config(name: str, **changes) -> dict:
    config = dict(BUILTIN_CONFIGS[name])
    config.update(changes)
    return {key: value for key, value in config.items() if value is not ...}


@pytest.mark.parametrize("config, message", [
    (_config("jamba-1.5-mini", num_key_value_heads=0), "num_key_value_heads must be an int"),
    (_config("qwen3-next-80b-a3b", layer_types="full_attention"), "layer_types must list"),
    (_config("qwen3-next-80b-a3b", layer_types=["full_attention", "sliding"]), "unknown layer kinds"),
    (_config("qwen3-next-80b-a3b", layer_types=[]), "layer_types must list"),
    (_config("qwen3-next-80b-a3b", linear_num_value_heads=0), "linear_num_value_heads must be an int"),
    (_config("qwen3-next-80b-a3b", linear_num_key_heads=0), "linear_num_key_heads must be an int"),
    (_config("qwen3-next-80b-a3b", hidden_size=-2048), "hidden_size must be an int"),
    (_config("qwen3-next-80b-a3b", hidden_size=float("nan")), "hidden_size must be an int"),
    (_config("qwen3-next-80b-a3b", hidden_size=True), "hidden_size must be an int"),
    (_config("qwen3-next-80b-a3b", hidden_size=2048.0), "hidden_size must be an int"),
    (_config("qwen3-next-80b-a3b", hidden_size=10**30), "hidden_size must be an int"),
    (_config("qwen3-next-80b-a3b", num_experts_per_tok=600), "routes to 600 of only 512 experts"),
    (_config("qwen3-next-80b-a3b", layer_types=["linear_attention"] * 48), "not a hybrid model"),
    (_config("granite-4.0-h-small", mamba_n_groups=0), "mamba_n_groups must be an int"),
    (_config("granite-4.0-h-small", layer_types=["attention"] * 40), "not a hybrid model"),
    (_config("nemotron-h-8b", hybrid_override_pattern="M*X"), "unknown layer kinds"),
    (_config("nemotron-h-8b", n_groups="8"), "n_groups must be an int"),
    (_config("falcon-h1-7b", num_hidden_layers=10**9), "num_hidden_layers must be an int"),
    (_config("jamba-1.5-mini", num_attention_heads=8192), "hidden_size 4096 < num_attention_heads 8192"),
    (_config("jamba-1.5-mini", attn_layer_period=0), "attn_layer_period must be an int"),
    (_config("jamba-1.5-mini", attn_layer_offset=99), "not a hybrid model"),
    (_config("jamba-1.5-mini", dtype=["bfloat16"]), "unsupported dtype"),
    (_config("jamba-1.5-mini", dtype=False), "unsupported dtype False (dtype)"),
    (_config("jamba-1.5-mini", dtype=0), "unsupported dtype 0 (dtype)"),
    (_config("jamba-1.5-mini", dtype={}), "unsupported dtype {} (dtype)"),
    (_config("jamba-1.5-mini", dtype=None, torch_dtype=[]), "unsupported dtype [] (torch_dtype)"),
    (_config("marconi-7b", mamba_layers=0), "not a hybrid model"),
    (_config("marconi-7b", model_type=["jamba"]), "unsupported model_type"),
    ([1, 2, 3], "must be a mapping"),
])
def test_bad_model_configs_are_refused(tmp_path, trace, capsys, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    assert message in _refused(["replay", trace, "--cache-bytes", "2GB", "--model", str(path)], capsys)


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000, "nested too deeply"),
    ('{"hidden_size": ' + "9" * 5000 + "}", "cannot read a model config"),
    ("\xff", "cannot read a model config"),
])
def test_unreadable_model_configs_are_refused(tmp_path, trace, capsys, text, message):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("latin-1") if text == "\xff" else text.encode())
    assert message in _refused(["replay", trace, "--cache-bytes", "2GB", "--model", str(path)], capsys)


# --- what a new user sees ---------------------------------------------------------------------------


def test_help_names_every_policy_the_defaults_and_the_required_budget(capsys):
    status, out, _ = run_main(["replay", "--help"], capsys)
    assert status == 0
    text = " ".join(out.split())
    for policy in ("reference", "interval:N", "marconi", "auto"):
        assert policy in text
    assert "(default: 32)" in text and "(default: marconi-7b)" in text
    assert "required unless --kv-bytes" in text and "(default: None)" not in text
    assert "(default: 1)" in text and "(default: round-robin)" in text


def test_output_fits_an_80_column_terminal_and_errors_go_to_stderr(tmp_path):
    rows = [mooncake(i, 1500, 10, [1, 2, 3 + i % 2]) for i in range(6)]
    trace = write_lines(tmp_path / "t.jsonl", rows)
    result = run_process("replay", str(trace), "--kv-bytes", "1GB", "--state-bytes", "2GB", "--policy",
                         "reference,interval:32", "--replicas", "1,2", "--host-bytes", "1GB", cwd=tmp_path, columns=80)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) > 10 and max(len(line) for line in lines) <= 80
    assert "…" not in result.stdout and "interval:32" in result.stdout and "round-robin" in result.stdout
    bad = run_process("replay", str(trace), "--cache-bytes", "1KB", cwd=tmp_path, columns=80)
    assert bad.returncode == 2 and "budget too small" in bad.stderr and "error" not in bad.stdout


def test_marconi_tuning_reports_its_progress():
    """The bar does not freeze while Marconi replays its tuning window: every window request
    of every weight is reported, in order, up to the total."""
    from hybridcache.replay import replay, resolve_policy
    from tests.replay._helpers import budget, config, request

    rng = np.random.default_rng(3)
    shared = rng.integers(0, 50_000, size=64)
    requests = [request(i, np.concatenate([shared, rng.integers(0, 50_000, size=96)])) for i in range(40)]
    seen: list[tuple[int, int]] = []
    record = replay(requests, config(resolve_policy("marconi"), budget(24, 3)), tuning_progress=lambda d, t: seen.append((d, t)))
    assert record.alpha is not None and seen
    total = seen[0][1]
    assert [done for done, _ in seen] == list(range(1, total + 1)) and {t for _, t in seen} == {total}


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux /proc")
def test_a_regular_file_that_cannot_be_read_is_refused(trace, capsys):
    """``/proc/self/mem`` passes the regular-file check, then fails every read."""
    assert "cannot read /proc/self/mem" in _refused(["replay", "/proc/self/mem", "--cache-bytes", "2GB"], capsys)
    assert "cannot read /proc/self/mem" in _refused(["replay", trace, "--cache-bytes", "2GB", "--model", "/proc/self/mem"], capsys)
