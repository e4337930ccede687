"""Real ``hybridcache serve`` replicas (tiny model, event streams on loopback) behind a real
``hybridcache router``, each a process on a free loopback port, stopped by its pid."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybridcache.bench.routing import events_config
from hybridcache.router.discovery import read_next_seqs
from hybridcache.tiers.local_servers import free_port

SRC = str(Path(__file__).resolve().parents[2] / "src")
STARTUP_S = 180  # a loaded CI machine imports torch slowly; a deadline, never an assertion on speed
REPLICA_ARGS = ("--num-kv-blocks", "128", "--num-state-slots", "16", "--checkpoint-budget", "8",
                "--max-running", "4", "--max-batch-tokens", "256", "--prefill-chunk", "256", "--adapters", "support-bot")


def _environment() -> dict:
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


class Process:
    """One command on a free loopback port (or the port given), until ``stop``."""

    def __init__(self, command: list[str], port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, env=_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_healthy(self, startup_s: float = STARTUP_S) -> None:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited: {self.process.stderr.read().decode(errors='replace')[-2000:]}")
            try:
                if get(self.url, "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.url} did not become healthy")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process.stderr.close()


def replica(name: str, port: int | None = None, extra: tuple[str, ...] = ()) -> Process:
    port = port or free_port()
    command = [sys.executable, "-m", "hybridcache.cli", "serve", "--port", str(port), "--log-level", "warning",
               *REPLICA_ARGS, *extra, "--kv-events-config", events_config(name)]
    return Process(command, port)


def router(urls: list[str], policy: str = "restorable", health_interval_s: float = 0.2,
           extra: tuple[str, ...] = ()) -> Process:
    port = free_port()
    command = [sys.executable, "-m", "hybridcache.cli", "router", "--port", str(port), "--policy", policy,
               "--health-interval", str(health_interval_s), *(arg for url in urls for arg in ("--replica", url)), *extra]
    return Process(command, port)


def get(base: str, path: str) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def post_json(base: str, path: str, body: dict) -> dict:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = response.read()
        if response.status != 200:
            raise AssertionError(f"{base}{path} answered {response.status}: {answer[:500]!r}")
        return json.loads(answer)
    finally:
        connection.close()


def router_metrics(base: str) -> dict[str, float]:
    """The router's ``/metrics`` samples, keyed by the line's name and labels."""
    _, text = get(base, "/metrics")
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_subscribed(base: str, replicas: int, timeout_s: float = 30.0) -> None:
    """Until the router reports every replica healthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        healthy = [v for k, v in router_metrics(base).items() if k.startswith("hybridcache_router_replica_healthy")]
        if len(healthy) == replicas and all(healthy):
            return
        time.sleep(0.1)
    raise AssertionError("the router never saw every replica healthy")


def wait_settled(base: str, timeout_s: float = 60.0) -> None:
    """Until the router reads every replica idle and has applied every batch each replica has
    queued on its streams (``GET /kv_events`` ``next_seq``), so the next route sees every
    change made so far (bounded; never a sleep standing in for the events' delivery)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = router_metrics(base)
        loads = {k.split('replica="')[1].split('"')[0]: v for k, v in samples.items()
                 if k.startswith("hybridcache_router_replica_load")}
        if not any(loads.values()) and all(_caught_up(samples, url) for url in loads):
            return
        time.sleep(0.05)
    raise AssertionError("the replicas never became idle with every event applied")


def _caught_up(samples: dict[str, float], url: str) -> bool:
    """Whether the router applied what ``url`` queued; read after the router's metrics, so a
    replica idle then has nothing newer. A replica a test stopped does not answer: the router
    no longer routes to it."""
    expected = read_next_seqs(url, timeout_s=30)
    if expected is None:
        return True
    applied = (samples[f'hybridcache_router_replica_applied_seq{{replica="{url}",stream="{stream}"}}']
               for stream in ("kv", "state"))
    return all(not wanted or seen >= wanted - 1 for seen, wanted in zip(applied, expected))
