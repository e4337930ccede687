"""``hybridcache router`` in front of real replica processes (the tiny engine behind HTTP,
event streams on loopback): routing by restorable depth, predictions equal to the reported
``cached_tokens``, streaming relayed, a killed replica never losing a request."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybridcache.router.fleet import Fleet
from hybridcache.router.proxy import RouterServer

ROOT = Path(__file__).resolve().parents[2]


class ReplicaProcess:
    """A ``tests.router.fake_replica`` process on a free loopback port, stopped by its pid."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.router.fake_replica"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        line = self.process.stdout.readline()  # bounded by the process: it prints or exits
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"the replica did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, 15)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, 9)
                self.process.wait(10)
        self.process.stdout.close()


def _cluster():
    replicas = [ReplicaProcess() for _ in range(2)]
    server = RouterServer(Fleet([r.url for r in replicas], "restorable", health_interval_s=0.2), "127.0.0.1", 0)
    server.start()
    try:
        yield server, replicas
    finally:
        server.close()
        for replica in replicas:
            replica.stop()


shared_cluster = pytest.fixture(scope="module")(_cluster)  # tests that keep both replicas alive
cluster = pytest.fixture(_cluster)


def _post(server: RouterServer, path: str, body: dict) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _wait_synced(server: RouterServer, timeout_s: float = 10.0) -> None:
    """Until every replica is subscribed and the last batches had time to arrive (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(r.healthy and r.feed is not None for r in server.fleet.replicas):
            time.sleep(0.3)
            return
        time.sleep(0.05)
    raise AssertionError("the replicas never came up")


def test_multi_turn_requests_follow_their_state_and_predictions_equal_cached_tokens(shared_cluster):
    server, _ = shared_cluster
    checked = server.metrics.value("predictions_checked")
    _wait_synced(server)
    rng = np.random.default_rng(0)
    conversations = [list(map(int, rng.integers(0, 100, 30))) for _ in range(4)]
    for _ in range(3):
        for index, prompt in enumerate(conversations):
            status, data = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3})
            assert status == 200
            answer = json.loads(data)
            conversations[index] = prompt + answer["token_ids"] + list(map(int, rng.integers(0, 100, 6)))
            time.sleep(0.2)  # the replica's events reach the router before the next turn
    metrics = server.metrics
    assert metrics.value("predictions_checked") - checked == 12
    assert metrics.value("predictions_exact") == metrics.value("predictions_checked")
    assert metrics.value("reported_cached_tokens") > 0


def test_streaming_answers_are_relayed_with_their_usage(shared_cluster):
    server, _ = shared_cluster
    _wait_synced(server)
    checked = server.metrics.value("predictions_checked")
    status, data = _post(server, "/v1/completions", {"prompt": list(range(1, 25)), "max_tokens": 3, "stream": True})
    assert status == 200
    events = [line[5:].strip() for line in data.decode().split("\n") if line.startswith("data:")]
    assert events[-1] == "[DONE]" and len(events) == 5
    assert json.loads(events[-2])["usage"]["prompt_tokens"] == 24
    assert server.metrics.value("predictions_checked") == checked + 1


def test_text_prompts_are_tokenized_by_a_replica_and_chat_is_routed(shared_cluster):
    server, _ = shared_cluster
    _wait_synced(server)
    status, _ = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there, router"}]})
    assert status == 200
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    assert "hybridcache_router_decisions_total" in text and 'hybridcache_router_replica_healthy' in text


def test_a_killed_replica_loses_no_request(cluster):
    server, replicas = cluster
    _wait_synced(server)
    replicas[0].stop()
    for number in range(6):  # the first may still pick the dead one: retried on the other
        status, data = _post(server, "/v1/completions", {"prompt": [number + 1] * 20, "max_tokens": 2})
        assert status == 200, data
    dead = server.fleet.replicas[0]
    assert not dead.healthy and dead.index is None
