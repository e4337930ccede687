"""What a client can do to the router's port: requests it cannot read are refused with an
error object, and a silent client loses its connection; the router serves on either way.

A real ``hybridcache router`` process on a free loopback port, in front of one replica URL
nothing listens on (so a request that is read is answered 503: no replica), stopped by its pid.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.router.fleet import Fleet
from hybridcache.router.policy import check_policy
from hybridcache.router.proxy import RouterServer
from hybridcache.tiers.local_servers import free_port
from tests.router.cluster import get, router
from tests.slow_clients import trickled_until_closed

CLIENT_TIMEOUT_S = 0.5
DEADLINE_S = 30  # our side's bound on waiting for the router: a deadline, not a measurement


@pytest.fixture(scope="module")
def front():
    process = router([f"http://127.0.0.1:{free_port()}"], extra=("--client-timeout", str(CLIENT_TIMEOUT_S)))
    try:
        process.wait_healthy()
        yield process
    finally:
        process.stop()


def _connect(front) -> socket.socket:
    return socket.create_connection(("127.0.0.1", front.port), timeout=DEADLINE_S)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the router sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def _assert_error_object(error: dict, code: str) -> None:
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize(("headers", "status", "code"), [
    ("Content-Length: abc", 400, "malformed_body"),
    ("Content-Length: -5", 400, "malformed_body"),
    ("Content-Length: 1e3", 400, "malformed_body"),
    ("Content-Length: \u0663", 400, "malformed_body"),  # a digit, but not an ASCII one
    ("Content-Length: 1000000000000", 413, "body_too_large"),
    ("Transfer-Encoding: chunked", 411, "length_required"),
])
def test_a_body_it_cannot_read_is_refused_and_the_connection_closed(front, headers, status, code):
    with _connect(front) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{headers}\r\n\r\n".encode() + b'5\r\n{"a":\r\n')
        answer = _read_until_closed(sock)  # ends: the unread body is never taken for a next request
    got, error = _status_and_error(answer)
    assert got == status
    _assert_error_object(error, code)
    assert get(front.url, "/health")[0] == 200


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_refused_and_the_connection_kept(front, body):
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with _connect(front) as sock:
        sock.sendall(request + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = _read_until_closed(sock)
    first, _, rest = answer.partition(b"HTTP/1.1 200")
    status, error = _status_and_error(first)
    assert status == 400
    _assert_error_object(error, "malformed_body")
    assert rest.endswith(b"ok")  # the same connection then served the next request


def test_a_request_it_can_read_but_not_place_gets_an_error_object(front):
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    with _connect(front) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        status, error = _status_and_error(_read_until_closed(sock))
    assert status == 503
    _assert_error_object(error, "no_replica")


@pytest.mark.parametrize("sent", [
    b"",  # connected, never a byte
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers never ended
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"",  # body never ended
    b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",  # answered, then an idle keep-alive
])
def test_a_silent_client_loses_its_connection(front, sent):
    idle = [_connect(front) for _ in range(20)]  # other silent clients hold no one up
    try:
        with _connect(front) as sock:
            sock.sendall(sent)
            answer = _read_until_closed(sock)  # returns once the router closed; our timeout is the deadline
        assert answer == b"" or answer.startswith(b"HTTP/1.1 200")
        assert get(front.url, "/health")[0] == 200
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("bad", [0, -1.5, float("inf"), float("nan"), True, "60"])
@pytest.mark.parametrize("name", ["timeout_s", "client_timeout_s"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(name, bad):
    fleet = Fleet([f"http://127.0.0.1:{free_port()}"], check_policy("restorable"))
    try:
        with pytest.raises(InvalidArgumentError, match=name):
            RouterServer(fleet, **{name: bad})
    finally:
        fleet.close()


def _served(base: str, path: str) -> bytes:
    """``path``'s answer once the router has a free slot for it (the slots of closed connections
    free as the router reads each close)."""
    deadline = time.monotonic() + DEADLINE_S
    while (answer := get(base, path))[0] == 503:
        assert time.monotonic() < deadline, "a slot was never freed"
        time.sleep(0.05)
    assert answer[0] == 200
    return answer[1]


def test_past_max_connections_a_client_is_answered_503_and_served_once_one_leaves():
    process = router([f"http://127.0.0.1:{free_port()}"], extra=("--max-connections", "2", "--client-timeout", "30"))
    try:
        process.wait_healthy()
        idle = [_connect(process) for _ in range(2)]  # accepted in order: they hold both slots ...
        deadline = time.monotonic() + DEADLINE_S
        try:
            while True:
                with _connect(process) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    answer = _read_until_closed(sock)
                if not answer.startswith(b"HTTP/1.1 200"):
                    break
                assert time.monotonic() < deadline, "never turned away"
                idle.append(_connect(process))  # ... unless an earlier client still held one: hold it too
            status, error = _status_and_error(answer)
            assert status == 503
            _assert_error_object(error, "too_many_connections")
        finally:
            idle.pop().close()
        assert _served(process.url, "/health") == b"ok"  # served beside the one idle client left
        for sock in idle:
            sock.close()
        metrics = _served(process.url, "/metrics").decode().splitlines()
        assert int(next(line.split()[-1] for line in metrics
                        if line.startswith("hybridcache_router_connections_refused_total "))) >= 1
    finally:
        process.stop()


@pytest.mark.parametrize("bad", [0, -1, True, "4", 2.0, 10**9])
def test_a_max_connections_that_is_not_a_count_the_process_can_hold_is_refused(bad):
    fleet = Fleet([f"http://127.0.0.1:{free_port()}"], check_policy("restorable"))
    try:
        with pytest.raises((InvalidArgumentError, InvalidTypeError), match="max_connections"):
            RouterServer(fleet, max_connections=bad)
    finally:
        fleet.close()


# each trickle lasts about 40 periods (200 bytes, 0.1 s apart): if each byte counted it would outlast the bound
@pytest.mark.parametrize("head", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: ",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n",
], ids=["head", "body"])
def test_a_client_trickling_its_request_a_byte_at_a_time_loses_its_connection(front, head):
    with _connect(front) as sock:
        assert trickled_until_closed(sock, head, b"a" * 200, CLIENT_TIMEOUT_S / 5)
    assert get(front.url, "/health")[0] == 200
