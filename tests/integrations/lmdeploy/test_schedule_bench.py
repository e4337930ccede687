"""``hybridcache bench lmdeploy-schedule`` runs lmdeploy's Scheduler on both tries and
reports both (a smoke-sized case: the records, not the timings, are checked)."""

from hybridcache.bench.lmdeploy_schedule import bench_lmdeploy_schedule
from hybridcache.bench.scenarios import Case


def test_both_tries_admit_every_request_with_its_aligned_hit():
    records = bench_lmdeploy_schedule(Case(batch=4, context=256, block_size=16, warmups=1, samples=2))
    assert [r["impl"] for r in records] == ["lmdeploy", "hybridcache"]
    for record in records:
        assert record["scenario"] == "lmdeploy-schedule" and len(record["samples_ms"]) == 2
        assert record["p50_ms"] > 0 and record["per_request_us"] > 0
        assert record["ingest_p50_ms"] > 0 and record["total_p50_ms"] > record["p50_ms"]
        assert 0 < record["floor_p50_ms"] < record["p50_ms"] and record["trie_p50_ms"] > 0
        assert 0 < record["cpu_p50_ms"] < record["cpu_total_p50_ms"]
        assert 0 < record["trie_cpu_p50_ms"] and 0 < record["floor_cpu_p50_ms"] < record["cpu_p50_ms"]
        assert 0 < record["trie_share_p50"] < 1 and record["cpu_bound_p50"] > 0  # the trie's part of the step
    assert records[1]["cpu_speedup_p50"] > 0 and records[1]["cpu_total_speedup_p50"] > 0  # lmdeploy's CPU over ours
    assert records[1]["trie_cpu_speedup_p50"] > 0 and records[1]["trie_cpu_speedup_p99"] > 0  # its trie over ours
    assert records[0]["bound_p50"] > 1 and records[0]["bound_p99"] > 1  # lmdeploy's step over its floor
