"""A connection waits on a silent client for at most two ``--client-timeout`` periods: one that
never finishes its request, or stops reading its stream, is closed (its request cancelled),
while one that keeps reading, however long its answer takes, is served to the end."""

from __future__ import annotations

import json
import socket
import time

import pytest

from hybridcache.errors import InvalidConfigError
from hybridcache.serving.config import ServeConfig
from hybridcache.serving.connection import connection_protocol
from tests.serving.conftest import metric, request, running_server
from tests.slow_clients import trickled_until_closed

CLIENT_TIMEOUT_S = 0.5
DEADLINE_S = 60  # our side's bound on waiting for the server: a deadline, not a measurement


# A KV pool holding a stream far longer than the sockets buffer (about 150 bytes a token).
LONG_STREAM = ("--num-kv-blocks", "4096", "--num-state-slots", "24", "--checkpoint-budget", "12",
               "--max-batch-tokens", "512", "--prefill-chunk", "256")
LONG_ANSWER_TOKENS = 60_000


@pytest.fixture(scope="module")
def server():
    with running_server(*LONG_STREAM, "--client-timeout", str(CLIENT_TIMEOUT_S)) as (base, _):
        yield base


def _connect(base: str, receive_buffer: int | None = None) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(DEADLINE_S)
    sock.connect((host, int(port)))
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # an aborted connection
        pass
    return data


def _stream_request(max_tokens: int) -> bytes:
    body = json.dumps({"model": "tiny", "prompt": "a long answer", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def _wait_until_idle(base: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while metric(base, "vllm:num_requests_running") or metric(base, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "a request kept running after its client stopped reading"
        time.sleep(0.2)


@pytest.mark.parametrize("sent", [
    b"",  # connected, never a byte
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers never ended
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
])
def test_a_client_that_never_finishes_its_request_loses_its_connection(server, sent):
    idle = [_connect(server) for _ in range(20)]  # other silent clients hold no one up
    try:
        with _connect(server) as sock:
            sock.sendall(sent)
            assert _read_until_closed(sock) == b""  # returns once the server closed it
        assert request(server, "GET", "/health")[0] == 200
    finally:
        for sock in idle:
            sock.close()


SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: "
SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100000\r\n\r\n")


# each trickle lasts about 40 periods (200 bytes, 0.1 s apart): if each byte counted as progress it would outlast the bound
@pytest.mark.parametrize("head", [SLOW_HEAD, SLOW_BODY], ids=["head", "body"])
def test_a_client_trickling_its_request_a_byte_at_a_time_loses_its_connection(server, head):
    with _connect(server) as sock:
        assert trickled_until_closed(sock, head, b"a" * 200, CLIENT_TIMEOUT_S / 5)
    assert request(server, "GET", "/health")[0] == 200


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_its_request_cancelled(server):
    generated = metric(server, "vllm:generation_tokens_total")
    with _connect(server, receive_buffer=1024) as sock:
        sock.sendall(_stream_request(LONG_ANSWER_TOKENS))  # megabytes no buffer holds
        begun = b""
        while b"data: {" not in begun:  # the stream has begun (so the request is in the engine) ...
            chunk = sock.recv(4096)
            assert chunk, f"the server closed the connection before the stream began: {begun!r}"
            begun += chunk
        _wait_until_idle(server)  # ... and, no longer read, is cancelled
        answer = begun + _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" not in answer
    assert metric(server, "vllm:generation_tokens_total") == generated  # cancelled, not served
    status, _, _ = request(server, "POST", "/v1/completions", {"model": "tiny", "prompt": "still serving", "max_tokens": 2})
    assert status == 200


def test_a_client_that_keeps_reading_gets_its_whole_answer_however_long(server):
    with _connect(server, receive_buffer=1024) as sock:
        sock.sendall(_stream_request(1500))
        answer, reads = b"", 0
        while chunk := sock.recv(512):  # a slow reader: the server's writes wait on it, and it keeps taking them
            answer, reads = answer + chunk, reads + 1
            if answer.endswith(b"0\r\n\r\n"):  # the chunked body's end
                break
            time.sleep(CLIENT_TIMEOUT_S / 10)
    assert b"data: [DONE]" in answer and b'"finish_reason":"length"' in answer  # all 1,500 tokens
    assert reads > 20  # so the answer lasted over two periods in which the client sent nothing


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "60"])
def test_a_client_timeout_that_is_not_a_positive_number_of_seconds_is_refused(bad):
    with pytest.raises(InvalidConfigError, match="client_timeout_s"):
        ServeConfig(client_timeout_s=bad)
    with pytest.raises(InvalidConfigError, match="client_timeout_s"):
        connection_protocol(bad, 8)


def test_past_max_connections_a_connection_is_answered_503_and_served_once_one_leaves():
    with running_server("--max-connections", "2", "--client-timeout", "30") as (base, _):
        idle = [_connect(base) for _ in range(2)]
        try:
            with _connect(base) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = _read_until_closed(sock)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503")
            error = json.loads(body)["error"]
            assert error["code"] == "too_many_connections" and error["type"] == "server_overloaded"
        finally:
            idle.pop().close()
        deadline = time.monotonic() + DEADLINE_S  # the place frees once the server reads the close
        while request(base, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, "a connection's place was never freed"
            time.sleep(0.05)
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("bad", [0, -1, True, "4", 2.0, 10**9])
def test_a_max_connections_the_process_cannot_hold_is_refused(bad):
    with pytest.raises(InvalidConfigError, match="max_connections"):
        ServeConfig(max_connections=bad)
