import json

from hybridcache.cli import main
from tests.cli_runner import run_main
from tests.workloads._traces import mooncake, write_lines

ROWS = [
    mooncake(0, 1500, 20, [1, 2, 3]),
    mooncake(5, 1500, 10, [1, 2, 4]),
    mooncake(9, 1800, 10, [1, 2, 6, 5]),  # continues the first request
    mooncake(12, 1500, 10, [1, 2, 4]),
]


def test_replay_sweep_writes_json_and_plot(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", ROWS)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["replay", str(trace), "--cache-bytes", "2GB,4GB", "--policy", "reference,interval:32",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    records = json.loads(out.read_text())
    assert [(r["policy"], r["cache_bytes"]) for r in records] == [
        ("reference", 2 * 10**9), ("reference", 4 * 10**9), ("interval:32", 2 * 10**9), ("interval:32", 4 * 10**9)]
    for field in ("trace", "policy", "admission", "eviction", "model", "cache_bytes", "kv_bytes", "state_bytes",
                  "requests", "token_hit_rate", "request_hit_rate", "bound_token_hit_rate", "flops_saved", "wall_s",
                  "prefill_tokens_saved", "ttft_saved_s", "checkpoints_written", "checkpoint_bytes_written",
                  "evictions", "misses"):
        assert field in records[0]
    assert records[0]["continuations"] == 1 and records[0]["model"] == "marconi-7b"
    assert 0 < records[0]["token_hit_rate"] <= records[0]["bound_token_hit_rate"]
    assert png.stat().st_size > 0
    assert "hybridcache replay" in capsys.readouterr().out


def test_replay_with_separate_budgets(tmp_path):
    trace = write_lines(tmp_path / "t.jsonl", ROWS)
    out = tmp_path / "r.json"
    rc = main(["replay", str(trace), "--model", "qwen3-next-80b-a3b", "--kv-bytes", "1GB", "--state-bytes", "2GB",
               "--limit", "3", "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())[0]
    assert record["cache_bytes"] is None and record["kv_bytes"] == 10**9 and record["requests"] == 3


def test_replay_refuses_bad_options(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", ROWS)
    cases = [
        (["--cache-bytes", "1GB", "--policy", "lfu"], "unknown policy"),
        (["--cache-bytes", "1GB", "--kv-bytes", "1GB", "--state-bytes", "1GB"], "not both"),
        (["--kv-bytes", "1GB"], "equal length"),
        (["--cache-bytes", "lots"], "cannot parse size"),
        (["--cache-bytes", "1GB", "--model", "nope"], "unknown model profile"),
        (["--cache-bytes", "1GB", "--limit", "0"], "--limit"),
    ]
    for options, message in cases:
        status, out, err = run_main(["replay", str(trace), *options], capsys)
        assert status == 2 and message in err and out == ""
    status, _, err = run_main(["replay", str(tmp_path / "missing.jsonl"), "--cache-bytes", "1GB"], capsys)
    assert status == 2 and "cannot read" in err and "No such file" in err


def test_replay_reports_unwritable_outputs_and_bad_numbers(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", ROWS)
    cases = [
        (["--json", str(tmp_path / "no" / "r.json")], "cannot write"),
        (["--json", "/proc/r.json"], "argument --json: cannot write /proc/r.json"),  # os.access says yes to root there
        (["--device-tflops", "0"], "--device-tflops"),
        (["--device-tflops", "nan"], "--device-tflops"),
        (["--block-size", "3"], "--block-size"),
    ]
    for options, message in cases:
        status, out, err = run_main(["replay", str(trace), "--cache-bytes", "2GB", *options], capsys)
        assert status == 2 and message in err and out == ""


def test_replay_sweeps_replicas_and_routings_with_a_local_redis(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", ROWS)
    out = tmp_path / "r.json"
    rc = main(["replay", str(trace), "--cache-bytes", "2GB", "--replicas", "1,2", "--routing", "round-robin,restorable",
               "--shared-tier", "redis", "--host-bytes", "1GB", "--disk-bytes", "2GB", "--json", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())
    assert [(r["replicas"], r["routing"], r["shared_tier"]) for r in records] == [
        (1, "round-robin", "redis"), (1, "restorable", "redis"), (2, "round-robin", "redis"), (2, "restorable", "redis")]
    assert all("remote_hit_tokens" in r and "stored_bytes_per_unique_token" in r["tiers"] for r in records)
    assert "hit rate vs replicas" in capsys.readouterr().out


def test_replay_refuses_bad_tier_options(tmp_path, capsys):
    trace = write_lines(tmp_path / "t.jsonl", ROWS)
    cases = [
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "two"], "--replicas"),
        (["--routing", "random"], "--routing"),
        (["--shared-tier", "memcached"], "--shared-tier"),
        (["--store-url", "redis://127.0.0.1:1/0"], "--store-url needs"),
        (["--tier-chunk", "100", "--host-bytes", "1GB"], "--tier-chunk"),
        (["--disk-bytes", "1GB"], "needs a host tier"),
        (["--host-bytes", "lots"], "cannot parse size"),
        (["--shared-tier", "mooncake", "--store-url", "127.0.0.1:5"], "bad Mooncake store url"),
        (["--shared-tier", "redis", "--store-url", "redis://127.0.0.1:1/0"], "redis"),
    ]
    for options, message in cases:
        status, out, err = run_main(["replay", str(trace), "--cache-bytes", "2GB", *options], capsys)
        assert status == 2 and message in err, (options, err)
