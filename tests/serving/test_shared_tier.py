"""``hybridcache serve --shared-tier redis``: two servers sharing one real Redis (the second
restores what the first computed, exactly), a Redis that goes away (the response says
``tier_unavailable``), and a local Redis that serve starts itself and stops on shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError
from hybridcache.serving.config import ServeConfig
from hybridcache.serving.tier_setup import open_tiers
from hybridcache.tiers import local_servers
from tests.serving.conftest import ENGINE_ARGS, metric, request, running_server

PROMPT_TOKENS = 600  # two whole tier chunks (256 tokens) before the last token
RESTORED = 512


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, PROMPT_TOKENS).tolist()


def _complete(base: str, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    status, _, raw = request(base, "POST", "/v1/completions", body)
    assert status == 200, raw
    return json.loads(raw)


def _shared(url: str) -> tuple[str, ...]:
    return (*ENGINE_ARGS, "--shared-tier", "redis", "--store-url", url)


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_second_server_restores_from_the_shared_redis_what_the_first_computed(redis_server):
    url = f"redis://127.0.0.1:{redis_server.port}/3"
    prompt = _prompt(1)
    with running_server(*_shared(url)) as (first, _), running_server(*_shared(url)) as (second, _):
        computed = _complete(first, prompt)
        assert _cached(computed) == 0
        assert metric(first, "hybridcache:tier_checkpoints_written_total", tier="shared") >= 2
        assert metric(first, "hybridcache:checkpoints_written_total") > 0
        restored = _complete(second, prompt)
        assert _cached(restored) == RESTORED and restored["hybridcache"] == {"cached_tokens": RESTORED, "miss_reason": None}
        assert restored["choices"][0]["token_ids"] == computed["choices"][0]["token_ids"]
        assert metric(second, "hybridcache:restored_tokens_total", tier="shared") == RESTORED
        assert metric(second, "hybridcache:restored_tokens_total", tier="device") == 0
        assert metric(second, "hybridcache:restored_tokens_total", tier="host") == 0
        assert metric(second, "vllm:prefix_cache_hits_total") == RESTORED


def test_a_shared_redis_that_went_away_is_reported_as_tier_unavailable(tmp_path):
    redis = local_servers.start_redis(tmp_path)
    try:
        url = f"redis://127.0.0.1:{redis.port}/0"
        prompt = _prompt(2)
        with running_server(*_shared(url)) as (first, _), running_server(*_shared(url)) as (second, _):
            computed = _complete(first, prompt)
            redis.stop()
            missed = _complete(second, prompt)
            assert _cached(missed) == 0 and missed["hybridcache"]["miss_reason"] == "tier_unavailable"
            assert missed["choices"][0]["token_ids"] == computed["choices"][0]["token_ids"]
            assert metric(second, "hybridcache:tier_misses_total", reason="tier_unavailable") == 1
            assert metric(second, "hybridcache:request_misses_total", reason="tier_unavailable") == 1
    finally:
        redis.stop()


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def test_serve_starts_a_local_redis_and_stops_it_on_shutdown():
    with running_server(*ENGINE_ARGS, "--shared-tier", "redis") as (base, process):
        (redis_pid,) = [pid for pid in _children(process.pid) if Path(f"/proc/{pid}/comm").read_text().strip() == "redis-server"]
        assert _cached(_complete(base, _prompt(3))) == 0
        assert metric(base, "hybridcache:tier_checkpoints_written_total", tier="shared") >= 2
    assert process.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its graceful shutdown
    assert not Path(f"/proc/{redis_pid}").exists()


def test_closing_the_tiers_stops_the_redis_they_started():
    """In this process (no parent-death signal can stop it here): ``close`` itself stops and
    reaps the server, and a second ``close`` changes nothing."""
    before = set(_children(os.getpid()))
    tiers = open_tiers(ServeConfig(shared_tier="redis"))
    (started,) = set(_children(os.getpid())) - before
    assert tiers.store is not None and list(tiers.store.tiers) == ["shared"]
    tiers.close()
    tiers.close()
    assert not Path(f"/proc/{started}").exists() and tiers.store is None


def test_a_bad_shared_tier_is_refused_before_anything_starts():
    for options in (dict(shared_tier="memcached"), dict(store_url="redis://127.0.0.1:1/0"),
                    dict(shared_tier="mooncake", store_url="redis://127.0.0.1:1/0")):
        with pytest.raises(InvalidArgumentError):
            ServeConfig(**options)


def test_an_unreachable_shared_redis_stops_serve_with_one_line_and_no_traceback():
    url = f"redis://127.0.0.1:{local_servers.free_port()}/0"  # nothing listens there
    done = subprocess.run(
        [sys.executable, "-m", "hybridcache.cli", "serve", *_shared(url), "--port", str(local_servers.free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.startswith("hybridcache serve: error: ") and len(done.stderr.strip().splitlines()) == 1
