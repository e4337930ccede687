"""Real ``hybridcache serve`` processes on free loopback ports, stopped by their pid."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

SRC = str(Path(__file__).resolve().parents[2] / "src")
STARTUP_S = 180  # a loaded CI machine imports torch slowly; a deadline, never an assertion on speed
# Small pools so that eviction and overload are reachable; the same arguments build the engine
# the tests compare against.
ENGINE_ARGS = ("--num-kv-blocks", "256", "--num-state-slots", "24", "--checkpoint-budget", "12",
               "--max-batch-tokens", "512", "--prefill-chunk", "256")
SERVER_ARGS = (*ENGINE_ARGS, "--max-running", "4", "--max-waiting", "8")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def running_server(*args: str):
    """Start a server, wait for ``/health``, yield its base URL; SIGTERM it by pid at the end."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-c", "import sys; from hybridcache.cli import main; sys.exit(main())", "serve",
               "--port", str(port), "--log-level", "warning", *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def _wait_healthy(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stdout.read().decode(errors='replace')}")
        try:
            status, _, _ = request(f"http://127.0.0.1:{port}", "GET", "/health")
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


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
    with running_server(*SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="package")
def server_uncached():
    """Caching off, and room for one request at a time (the overload tests use it too)."""
    with running_server(*ENGINE_ARGS, "--max-running", "1", "--max-waiting", "0", "--no-prefix-caching") as base:
        yield base
