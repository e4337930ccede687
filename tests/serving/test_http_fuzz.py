"""Any JSON a client sends, however it combines the fields a server reads with values of the
wrong type, range or shape, gets a served completion or an OpenAI-style error object with a
4xx status: never a 5xx, and the server stays healthy and idle afterwards."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytest

from tests.serving.conftest import SERVER_ARGS, request, running_server
from tests.serving.test_http_errors import _wait_until_idle

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["tiny", "support-bot", "user", "assistant", "system", "text", "image_url", "length"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage", "name"]) | st.text(max_size=6),
                      inner, max_size=4),
    max_leaves=10,
)
COUNTS = st.integers(0, 5)
RATES = st.floats(-0.5, 2.5)
FLAGS = st.booleans()
WORDS = st.text(max_size=8)
PLAUSIBLE = {  # values of the right type, in or near their range
    **dict.fromkeys(["max_tokens", "max_completion_tokens", "n", "min_tokens", "top_k", "seed", "logprobs",
                     "top_logprobs", "best_of"], COUNTS),
    **dict.fromkeys(["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"], RATES),
    **dict.fromkeys(["stream", "echo", "ignore_eos", "return_token_ids", "add_special_tokens",
                     "add_generation_prompt", "continue_final_message", "parallel_tool_calls"], FLAGS),
    **dict.fromkeys(["user", "cache_salt", "suffix"], WORDS),
    "stop": WORDS | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": FLAGS, "continuous_usage_stats": FLAGS}),
    "logit_bias": st.dictionaries(st.integers(0, 100).map(str), st.floats(-100, 100), max_size=2),
}
SHARED = ["max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stream", "stream_options", "seed",
          "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user",
          "cache_salt", "ignore_eos", "min_tokens", "return_token_ids", "echo"]
COMPLETION_ONLY = ["suffix", "best_of", "add_special_tokens"]
CHAT_ONLY = ["max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
             "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "parallel_tool_calls"]


def _mostly(plausible, hostile=VALUES):
    """``plausible`` nine times in ten, else any JSON value: most bodies are served, so the
    paths behind validation are reached too."""
    return st.integers(0, 9).flatmap(lambda pick: hostile if pick == 0 else plausible)


def _body(required: dict, optional: list[str]):
    """The required fields, and up to three of the optional ones."""
    def add(names: list[str]):
        fields = {name: _mostly(PLAUSIBLE.get(name, VALUES)) for name in names}
        return st.fixed_dictionaries({**required, **fields})

    return st.lists(st.sampled_from(optional), max_size=3, unique=True).flatmap(add)


MESSAGE = st.fixed_dictionaries({
    "role": _mostly(st.sampled_from(["user", "assistant", "system", "developer"])),
    "content": _mostly(st.text(max_size=20)),
})
REQUIRED = {"model": _mostly(st.just("tiny")), "max_tokens": _mostly(st.integers(1, 4)), "stream": _mostly(FLAGS)}
PROMPT = st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 100), min_size=1, max_size=8)
COMPLETION = _body(
    {**REQUIRED, "prompt": _mostly(PROMPT)},
    [name for name in SHARED + COMPLETION_ONLY if name not in REQUIRED],
)
CHAT = _body(
    {**REQUIRED, "messages": _mostly(st.lists(MESSAGE, min_size=1, max_size=3))},
    [name for name in SHARED + CHAT_ONLY if name not in REQUIRED],
)
BODIES = st.one_of(
    COMPLETION.map(lambda body: ("/v1/completions", body)),
    CHAT.map(lambda body: ("/v1/chat/completions", body)),
    COMPLETION.map(lambda body: ("/tokenize", body)),
)


@pytest.fixture(scope="module")
def fuzzed():
    """A server of its own: whatever these bodies leave behind is seen here, not by another test."""
    with running_server(*SERVER_ARGS) as (base, _):
        yield base


def _is_error_object(raw: bytes) -> bool:
    error = json.loads(raw).get("error")
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(BODIES)
def test_any_body_is_served_or_refused_with_an_error_object(fuzzed, case):
    path, body = case
    status, headers, raw = request(fuzzed, "POST", path, json.dumps(body).encode())
    assert status < 500, raw
    if status != 200:
        assert 400 <= status < 500 and _is_error_object(raw), raw
    elif headers.get("content-type", "").startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    else:
        json.loads(raw)


def test_the_server_is_healthy_and_idle_after_the_bodies(fuzzed):
    _wait_until_idle(fuzzed)
    status, _, raw = request(fuzzed, "GET", "/health")
    assert status == 200 and json.loads(raw)["status"] == "ok"
