"""A replica restarted between two of the router's health checks, whose new run already
published past the seqs the router had applied from the old one: a real ``hybridcache serve``
process killed and started again on its URL, watched by the router's ``Fleet`` in this process
(its health checks called here, so the restart falls between two of them). Only the replica's
``instance_id`` in ``GET /kv_events`` tells the two runs apart."""

from __future__ import annotations

import signal

import pytest

from hybridcache.router.discovery import read_next_seqs, read_streams
from hybridcache.router.fleet import Fleet
from hybridcache.router.request_key import RequestKey
from tests.router.cluster import post_json, replica

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("zmq", reason="the events extra is not installed")


def _complete(url: str, prompt: list[int]) -> int:
    """Send ``prompt`` straight to the replica; the cached tokens it reports."""
    answer = post_json(url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                "ignore_eos": True})
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _prompt(number: int) -> list[int]:
    return [number % 200 + 2, number // 200 + 2] + [number % 7 + 3] * 46


def _predicted(fleet: Fleet, prompt: list[int]) -> int:
    _, decision = fleet.route(RequestKey(prompt), len(prompt))
    return decision.predicted_tokens


def test_a_restart_whose_new_seqs_passed_the_old_is_detected_by_its_instance_id():
    server = replica("r0")
    fleet = None
    try:
        server.wait_healthy()
        fleet = Fleet([server.url], "restorable", health_interval_s=3600)  # checks only when called here
        fleet.check_health()
        for number in range(2):
            _complete(server.url, _prompt(number))
        assert fleet.settle(fleet.replicas[0], timeout_s=30)
        first_run = fleet.replicas[0].instance_id
        applied = fleet.status()[0].applied_seqs
        assert first_run == read_streams(server.url, 30).instance_id and _predicted(fleet, _prompt(0) + [5]) > 0

        server.stop(signal.SIGKILL)
        server = replica("r0", port=server.port)  # the same URL, an empty cache, streams from seq 0
        server.wait_healthy()
        number = 100
        while not all(now > seen for now, seen in zip(read_next_seqs(server.url, 30), applied)):
            _complete(server.url, _prompt(number))  # the new run passes the old one's seqs, unseen
            number += 1
            assert number < 200, "the restarted replica's seqs never passed the old ones"
        second_run = read_streams(server.url, 30).instance_id
        assert second_run is not None and second_run != first_run

        fleet.check_health()  # the new id: the old run's index is forgotten, the replica kept
        assert fleet.replicas[0].feed is None and fleet.status()[0].healthy
        fleet.check_health()  # subscribed anew, rebuilt from the new run's replay sockets
        assert fleet.replicas[0].instance_id == second_run
        assert fleet.settle(fleet.replicas[0], timeout_s=30)
        for prompt in (_prompt(0) + [5], _prompt(100) + [5]):  # the old run's prefix, then the new one's
            assert _predicted(fleet, prompt) == _complete(server.url, prompt)
        assert _predicted(fleet, _prompt(100) + [6]) > 0
    finally:
        if fleet is not None:
            fleet.close()
        server.stop()
