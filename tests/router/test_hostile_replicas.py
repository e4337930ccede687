"""What a replica sends is input the router does not control: a replay socket that never
answers or answers garbage, a stream description that makes no sense, an answer that is
huge, cut, badly framed or nested past the parser's stack. Each costs that replica its index,
its health or the one answer, never the router, its fleet thread or another route.

Real ``hybridcache router`` processes on free loopback ports, in front of fake replicas
(``tests.router.fakes``), stopped by their pid; one in-process ``Fleet`` where the test must
hold a replay request open. Waits are deadlines, never measurements.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from hybridcache.errors import EventStreamError
from hybridcache.router.discovery import read_streams
from hybridcache.router.fleet import Fleet
from hybridcache.router.request_key import RequestKey
from tests.router.cluster import router, router_metrics
from tests.router.fakes import ANSWER, FakeReplica

DEADLINE_S = 30  # our side's bound on waiting: a deadline, not a measurement
PROMPT = {"model": "tiny", "prompt": list(range(1, 40)), "max_tokens": 1}


@pytest.fixture
def fakes():
    made: list[FakeReplica] = []
    yield lambda **options: made.append(FakeReplica(**options)) or made[-1]
    for fake in made:
        fake.close()


@pytest.fixture
def routers():
    started = []

    def start(urls, extra=()):
        process = router(urls, extra=extra)
        started.append(process)
        process.wait_healthy()
        return process

    yield start
    for process in started:
        process.stop()


def _post(base: str, body: dict, path: str = "/v1/completions") -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=DEADLINE_S)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never {what}")


def _healthy(base: str, url: str) -> float:
    return router_metrics(base)[f'hybridcache_router_replica_healthy{{replica="{url}"}}']


def test_a_gap_whose_replay_never_answers_stalls_no_route_or_status(fakes):
    asked, release = threading.Event(), threading.Event()

    def replay(identity):  # the subscription's catch-up is answered; the gap's is held open
        if fake.replay_requests > 1:
            asked.set()
            release.wait(DEADLINE_S * 4)
        fake.end_replay(identity)

    fake = fakes(replay=replay)
    fleet = Fleet([fake.url], "restorable", health_interval_s=DEADLINE_S * 4, timeout_s=DEADLINE_S * 4)
    fleet.start()
    done = threading.Event()
    try:
        _wait_for(lambda: fake.publish(5) or asked.is_set(), "asked the replay socket for the gap")

        def route_and_read():
            fleet.route(RequestKey(list(range(1, 40))), 39)
            fleet.status()
            done.set()

        threading.Thread(target=route_and_read, daemon=True).start()
        assert done.wait(DEADLINE_S)  # the replay wait (four deadlines) holds no lock they need
        assert not release.is_set() and fleet.status()[0].healthy
    finally:
        release.set()
        fleet.close()


def test_a_replay_answer_of_one_frame_kills_neither_the_router_nor_its_health_checks(fakes, routers):
    hostile = fakes(replay=lambda identity: hostile.replay_socket.send_multipart([identity, b"", b"x"]))
    good = fakes()
    front = routers([hostile.url, good.url])  # its first catch-up, at startup, is the garbage
    _wait_for(lambda: hostile.replay_requests >= 3, "asked the hostile replay socket again (health checks running)")
    assert _post(front.url, PROMPT)[0] == 200
    hostile.metrics_ok = False
    _wait_for(lambda: _healthy(front.url, hostile.url) == 0, "marked the replica whose /metrics fails dead")
    assert _healthy(front.url, good.url) == 1


@pytest.mark.parametrize("describe", [
    lambda d: d.update(block_size=0), lambda d: d.update(block_size=-4), lambda d: d.update(block_size=True),
    lambda d: d.update(block_size=2**40), lambda d: d.update(block_size="16"),
    lambda d: d["kv"].update(replay_endpoint="bogus://nowhere"), lambda d: d["kv"].update(endpoint=5),
    lambda d: d["kv"].update(topic=["kv"]), lambda d: d.update(adapters="support-bot"), lambda d: d.update(kv=None),
], ids=["block 0", "block -4", "block true", "block 2**40", "block str", "bogus replay", "endpoint int", "topic list",
        "adapters str", "kv null"])
def test_a_stream_description_that_makes_no_sense_is_no_stream_description(fakes, describe):
    with pytest.raises(EventStreamError):
        read_streams(fakes(describe=describe).url, DEADLINE_S)


def test_replicas_describing_invalid_streams_are_routed_by_load(fakes, routers):
    zero = fakes(describe=lambda d: d.update(block_size=0))
    bogus = fakes(describe=lambda d: d["kv"].update(replay_endpoint="bogus://nowhere"))
    front = routers([zero.url, bogus.url])
    for _ in range(4):
        assert _post(front.url, PROMPT) == (200, json.dumps(ANSWER).encode())
    assert _healthy(front.url, zero.url) == 1 and _healthy(front.url, bogus.url) == 1


def test_an_answer_declared_past_the_buffer_bound_is_relayed_as_it_arrives(fakes, routers):
    piece = b"x" * (1 << 20)

    def answer(handler, path, body):
        handler.send_response(200)
        handler.send_header("Content-Length", str(10**12))  # buffered, this was a MemoryError
        handler.end_headers()
        handler.wfile.write(piece)
        handler.close_connection = True
        return True

    front = routers([fakes(answer=answer).url])
    host, port = front.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=DEADLINE_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps(PROMPT), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.length == 10**12
        received = []
        while chunk := _read_piece(response):
            received.append(chunk)
    finally:
        connection.close()
    assert b"".join(received) == piece  # every byte the replica sent, then the connection ends


def _read_piece(response: http.client.HTTPResponse) -> bytes:
    try:
        return response.read1(1 << 16)
    except http.client.IncompleteRead:
        return b""


@pytest.mark.parametrize("extra", [{"prompt": [-1] + list(range(1, 40))}, {"prompt": [2**32] * 20}, {"prompt": [2**70] * 20},
                                   {"cache_salt": "\ud800"}, {"adapter": "\udc00"}],
                         ids=["negative id", "id 2**32", "id 2**70", "salt lone surrogate", "adapter lone surrogate"])
def test_a_request_whose_key_cannot_be_built_gets_the_replicas_own_answer(fakes, routers, extra):
    refusal = {"error": {"message": "invalid", "type": "invalid_request_error", "code": "invalid_value"}}
    replica = fakes(answer=lambda handler, path, body: path != "/tokenize" and handler.send(400, refusal) is None)
    front = routers([replica.url])
    assert _post(front.url, {**PROMPT, **extra}) == (400, json.dumps(refusal).encode())


def _hostile_answers(mode: dict):
    def answer(handler, path, body):
        kind = mode.get(path)
        if kind == "deep":
            handler.send(200, b'{"usage":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        elif kind == "ids past uint32":
            handler.send(200, {"tokens": [2**40] * 20})
        elif kind == "short":
            handler.send_response(200)
            handler.send_header("Content-Length", "1000")
            handler.end_headers()
            handler.wfile.write(b'{"a":1')
            handler.close_connection = True
        elif kind == "bad chunks":
            handler.send_response(200)
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            handler.wfile.write(b"zz\r\nhello\r\n")
            handler.close_connection = True
        return kind is not None
    return answer


@pytest.mark.parametrize("path, kind", [("/v1/completions", "deep"), ("/tokenize", "deep"), ("/tokenize", "ids past uint32")])
def test_answers_the_router_cannot_parse_cost_it_nothing(fakes, routers, path, kind):
    front = routers([fakes(answer=_hostile_answers({path: kind})).url])
    status, body = _post(front.url, {**PROMPT, "prompt": "hello"} if path == "/tokenize" else PROMPT)
    assert status == 200 and body.startswith(b'{"usage":' if path == "/v1/completions" else b'{"choices"')


@pytest.mark.parametrize("kind", ["short", "bad chunks"])
def test_an_answer_failing_before_its_first_byte_is_a_failed_connection(fakes, routers, kind):
    hostile = fakes(answer=_hostile_answers({"/v1/completions": kind}))
    alone = routers([hostile.url])
    status, body = _post(alone.url, PROMPT)
    assert status == 503 and json.loads(body)["error"]["code"] == "no_replica"
    beside_a_good_one = routers([hostile.url, fakes().url])
    for _ in range(3):  # whichever is chosen first, the answer is the good replica's
        assert _post(beside_a_good_one.url, PROMPT) == (200, json.dumps(ANSWER).encode())
