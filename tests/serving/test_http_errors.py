"""Bad input, overload, requests that can never fit and clients that leave: an OpenAI-style
error object with the right status, never a traceback or a hang, and nothing left running."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from tests.serving.conftest import ENGINE_ARGS, metric, request, running_server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CASES = [
    (COMPLETIONS, b"{not json", 400, "malformed_body", None),
    (COMPLETIONS, b"\xff\xfe{}", 400, "malformed_body", None),
    (COMPLETIONS, b"[1, 2]", 400, "malformed_body", None),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found", "model"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": -3}, 400, "invalid_value", "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 10**12}, 400, "request_too_large", "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": "8"}, 422, "invalid_type", "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": 7}, 422, "invalid_type", "prompt"),
    (COMPLETIONS, {"model": "tiny"}, 422, "invalid_type", "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1, 2, 100000]}, 400, "invalid_value", "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1, -2]}, 400, "invalid_value", "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "n": 2}, 400, "invalid_value", "n"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "n": 0}, 400, "invalid_value", "n"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "presence_penalty": 3}, 400, "invalid_value", "presence_penalty"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "logit_bias": [1]}, 422, "invalid_type", "logit_bias"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "temperature": 5}, 400, "invalid_value", "temperature"),
    (COMPLETIONS, {"model": "tiny", "prompt": "x" * 5000}, 400, "request_too_large", "prompt"),
    (CHAT, {"model": "tiny", "messages": []}, 400, "invalid_value", "messages"),
    (CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value", "messages"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user"}]}, 422, "invalid_type", "messages"),
    (CHAT, {"model": "tiny", "messages": "hello"}, 422, "invalid_type", "messages"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, 400, "invalid_value", "stop"),
]


HUGE = b"9" * 5000  # more digits than Python's JSON reader converts (sys.get_int_max_str_digits)
TOKENIZE = "/tokenize"
# Raw bodies: integers no reader converts, JSON's non-numbers, and lone UTF-16 surrogates spelled
# as escapes (valid JSON, no Unicode text: they cannot be tokenized, hashed or encoded back).
RAW_CASES = [
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + HUGE + b"}", None),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "seed": ' + HUGE + b"}", None),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "temperature": ' + HUGE + b"}", None),
    (COMPLETIONS, b'{"model": "tiny", "prompt": [1, ' + HUGE + b"]}", None),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "top_p": NaN}', None),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "temperature": -Infinity}', None),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "ok \\udfff then"}', "prompt"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud83d"]}', "stop"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "cache_salt": "\\ud800"}', "cache_salt"),
    (COMPLETIONS, b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "user": "\\ud800"}', "user"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}', None),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": ' + HUGE + b"}",
     None),
    (TOKENIZE, b'{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    (TOKENIZE, b'{"model": "tiny", "prompt": [' + HUGE + b"]}", None),
]


@pytest.mark.parametrize("path, body, param", RAW_CASES)
def test_unreadable_numbers_and_lone_surrogates_are_a_malformed_body(server, path, body, param):
    got, _, raw = request(server, "POST", path, body)
    error = json.loads(raw)["error"]
    assert (got, error["type"], error["code"], error["param"]) == (400, "invalid_request_error", "malformed_body", param)


# Options the server does not implement: refused by name rather than silently ignored.
UNIMPLEMENTED_CASES = [
    (COMPLETIONS, "presence_penalty", 0.5), (CHAT, "presence_penalty", -1), (COMPLETIONS, "frequency_penalty", 1.0),
    (CHAT, "frequency_penalty", 0.2), (COMPLETIONS, "logit_bias", {"65": 100}), (CHAT, "logit_bias", {"65": -100}),
    (COMPLETIONS, "best_of", 3), (COMPLETIONS, "suffix", " the end"), (CHAT, "top_logprobs", 2),
    (CHAT, "logprobs", True), (COMPLETIONS, "logprobs", 3), (COMPLETIONS, "echo", True), (CHAT, "n", 2),
    (COMPLETIONS, "top_k", 40), (CHAT, "repetition_penalty", 1.2), (COMPLETIONS, "min_p", 0.1),
    (COMPLETIONS, "min_tokens", 4), (CHAT, "stop_token_ids", [257]), (COMPLETIONS, "use_beam_search", True),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
]
# The same options at the values that mean "off" are served as if omitted.
OFF_VALUES = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1, "suffix": "",
              "top_logprobs": 0, "logprobs": False, "echo": False, "n": 1, "top_k": -1, "repetition_penalty": 1,
              "min_p": 0, "min_tokens": 0, "stop_token_ids": [], "use_beam_search": False}


def _generation_body(path: str, **extra) -> dict:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    return {"model": "tiny", **prompt, "max_tokens": 2, **extra}


@pytest.mark.parametrize("path, field, value", UNIMPLEMENTED_CASES)
def test_an_option_this_server_does_not_implement_is_refused_by_name(server, path, field, value):
    got, _, raw = request(server, "POST", path, _generation_body(path, **{field: value}))
    error = json.loads(raw)["error"]
    assert (got, error["code"], error["param"]) == (400, "invalid_value", field)
    assert error["message"].startswith(f"{field} is not implemented by this server")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unimplemented_options_at_their_off_values_are_served(server, path):
    plain = json.loads(request(server, "POST", path, _generation_body(path, temperature=0))[2])
    status, _, raw = request(server, "POST", path, _generation_body(path, temperature=0, **OFF_VALUES))
    answered = json.loads(raw)
    assert status == 200 and answered["choices"] == plain["choices"]


def test_a_surrogate_pair_is_text_not_a_malformed_body(server):
    body = b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1}'  # one emoji, as JSON escapes it
    status, _, raw = request(server, "POST", COMPLETIONS, body)
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == 4  # its four UTF-8 bytes


@pytest.mark.parametrize("path, body, status, code, param", CASES)
def test_bad_input_gets_an_openai_error_object(server, path, body, status, code, param):
    got, _, raw = request(server, "POST", path, body)
    error = json.loads(raw)["error"]
    assert (got, error["code"], error["param"]) == (status, code, param)
    assert error["message"] and error["type"] and "Traceback" not in error["message"]


def test_an_oversized_body_gets_413_without_being_read(server):
    status, _, raw = request(server, "POST", COMPLETIONS, b"{" + b" " * (5 << 20) + b"}")
    assert status == 413 and json.loads(raw)["error"]["code"] == "body_too_large"


def test_unknown_routes_and_methods_get_error_objects(server):
    assert request(server, "GET", "/v1/nothing")[0] == 404
    status, _, raw = request(server, "GET", COMPLETIONS)
    assert status == 405 and "error" in json.loads(raw)


def _open_stream(base: str, max_tokens: int) -> tuple[socket.socket, bytes]:
    """A streaming completion on a raw socket, read until its first chunk arrived: the socket
    and everything read so far (a short stream may already hold more chunks, or all of them)."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "a long generation", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the stream before its first chunk: {received!r}"
        received += chunk
    return sock, received


def _wait_until_idle(base: str) -> None:
    deadline = time.monotonic() + 120
    while metric(base, "vllm:num_requests_running") or metric(base, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "a request kept running after its client left"
        time.sleep(0.2)


def test_a_client_that_leaves_cancels_its_request(server):
    generated = metric(server, "vllm:generation_tokens_total")
    _open_stream(server, 3000)[0].close()
    _wait_until_idle(server)
    assert metric(server, "vllm:generation_tokens_total") == generated  # a cancelled request is not a served one
    status, _, _ = request(server, "POST", COMPLETIONS, {"model": "tiny", "prompt": "still serving", "max_tokens": 2})
    assert status == 200


def test_overload_gets_503_with_retry_after(server_uncached):
    busy, _ = _open_stream(server_uncached, 3000)  # this server holds one request at a time
    try:
        status, headers, raw = request(server_uncached, "POST", COMPLETIONS, {"model": "tiny", "prompt": "me too"})
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert json.loads(raw)["error"]["code"] == "server_overloaded"
    finally:
        busy.close()
    _wait_until_idle(server_uncached)
    assert request(server_uncached, "POST", COMPLETIONS, {"model": "tiny", "prompt": "now", "max_tokens": 2})[0] == 200


def test_a_stream_ends_with_done_exactly_as_openai(server):
    status, headers, raw = request(server, "POST", CHAT, {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    events = raw.decode().split("\n\n")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: ") for event in events[:-1])
    last = json.loads(events[-3].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]


def test_sigterm_lets_a_stream_in_flight_finish_then_the_server_exits():
    with running_server(*ENGINE_ARGS) as (base, process):
        sock, received = _open_stream(base, 12)
        os.kill(process.pid, signal.SIGTERM)
        while b"data: [DONE]" not in received:
            chunk = sock.recv(65536)
            assert chunk, "the stream was cut before [DONE]"
            received += chunk
        sock.close()
        assert process.wait(120) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
    assert b'"finish_reason":"length"' in received


def test_continuous_usage_stats_put_the_counts_so_far_in_every_chunk(server):
    status, _, raw = request(server, "POST", COMPLETIONS, {
        "model": "tiny", "prompt": "counting as we go", "max_tokens": 4, "stream": True, "ignore_eos": True,
        "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(event.removeprefix("data: ")) for event in raw.decode().split("\n\n")[:-2]]
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks[:-1]]
    assert status == 200 and counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
