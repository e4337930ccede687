"""The live page at ``/``, rendered by headless Chromium: it shows the chart, the usage bars,
the misses by reason and the recent requests, and its numbers equal ``/metrics``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.serving.conftest import metric, request

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run")


def rendered_dom(url: str) -> str:
    with tempfile.TemporaryDirectory(prefix="hybridcache-chromium-") as profile:
        done = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                              capture_output=True, timeout=120, check=True)
    return done.stdout.decode()


def figure(dom: str, element_id: str) -> float:
    return float(re.search(rf'id="{element_id}">([^<]*)<', dom).group(1))


def _figures(server: str) -> dict[str, float]:
    return {
        "query-tokens": metric(server, "vllm:prefix_cache_queries_total"),
        "hit-tokens": metric(server, "vllm:prefix_cache_hits_total"),
        "running": metric(server, "vllm:num_requests_running"),
        "waiting": metric(server, "vllm:num_requests_waiting"),
        "kv-usage": metric(server, "vllm:kv_cache_usage_perc"),
        "state-usage": metric(server, "hybridcache:state_slot_usage_perc"),
        "checkpoints": metric(server, "hybridcache:checkpoints"),
        "hits": metric(server, "hybridcache:checkpoint_hits_total"),
    }


def _settled_figures(server: str, prompt_tokens: int, attempts: int = 300) -> dict[str, float]:
    """The figures once the loop's snapshot has seen every prompt sent (its queried tokens
    reach their sum) and nothing runs or waits. The snapshot is taken on the loop thread after
    each step, and an answer is sent inside the step that ends it, so a snapshot read right
    after an answer can predate the request; the queried tokens say which step it is from
    (bounded)."""
    for _ in range(attempts):
        figures = _figures(server)
        if figures["query-tokens"] >= prompt_tokens and figures["running"] == figures["waiting"] == 0:
            return figures
        time.sleep(0.1)
    raise AssertionError("the server never settled")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_page_renders_and_its_numbers_equal_the_metrics(server):
    messages = [{"role": "user", "content": "A question for the live page, long enough to fill blocks."}]
    prompt_tokens = 0
    for _ in range(2):
        status, _, body = request(server, "POST", "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 3})
        assert status == 200
        prompt_tokens += json.loads(body)["usage"]["prompt_tokens"]
    settled = _settled_figures(server, prompt_tokens)
    dom = rendered_dom(f"{server}/")
    assert "<svg" in dom and 'id="hit-rate-chart"' in dom and 'id="usage-bars"' in dom
    expected = _figures(server)
    assert expected == settled  # nothing changed while the page rendered
    assert {key: figure(dom, key) for key in expected} == expected
    assert figure(dom, "hit-rate") == pytest.approx(expected["hit-tokens"] / expected["query-tokens"])
    for reason, count in re.findall(r'data-reason="([a-z_]+)"><td>[a-z_]+</td><td class="count">(\d+)<', dom):
        assert float(count) == metric(server, "hybridcache:prefix_cache_misses_total", reason=reason)
    recent = re.search(r'<table id="recent">(.*?)</table>', dom, re.S).group(1)
    cached_column = [int(row[3]) for row in re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(\d+)</td><td>(\d+)</td>", recent)]
    assert cached_column and cached_column[0] > 0  # the newest request, a repeated prompt, restored its prefix
