"""Real ``hybridcache serve`` processes on free loopback ports, stopped by their pid."""

from __future__ import annotations

import http.client
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from hybridcache.bench.serve import server_process  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
STARTUP_S = 180  # a loaded CI machine imports torch slowly; a deadline, never an assertion on speed
# Small pools so that eviction and overload are reachable; the same arguments build the engine
# the tests compare against.
ENGINE_ARGS = ("--num-kv-blocks", "256", "--num-state-slots", "24", "--checkpoint-budget", "12",
               "--max-batch-tokens", "512", "--prefill-chunk", "256")
SERVER_ARGS = (*ENGINE_ARGS, "--max-running", "4", "--max-waiting", "8", "--adapters", "support-bot,legal-bot")


@contextmanager
def running_server(*args: str):
    """Start a server (this checkout's sources), wait for ``/health``, yield its base URL and
    process; it is stopped with SIGTERM by its pid at the end."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with server_process(*args, env=env, startup_s=STARTUP_S) as running:
        yield running


def request(base: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    """One raw HTTP call: ``(status, headers with lower-case names, body bytes)``."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        connection.request(method, path, body=payload, headers={"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def metric(base: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` (labels given must all match)."""
    _, _, text = request(base, "GET", "/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.fixture(scope="package")
def server():
    with running_server(*SERVER_ARGS) as (base, _):
        yield base


@pytest.fixture(scope="package")
def server_uncached():
    """Caching off, and room for one request at a time (the overload tests use it too)."""
    with running_server(*ENGINE_ARGS, "--max-running", "1", "--max-waiting", "0", "--no-prefix-caching") as (base, _):
        yield base
