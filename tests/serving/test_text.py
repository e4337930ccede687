"""The byte-level chat tokenizer of the tiny model, the text a stream sends, the request
schemas and the miss log."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridcache.errors import InvalidArgumentError, InvalidTypeError, MalformedRequestError
from hybridcache.serving.metrics import _MissLog
from hybridcache.serving.responses import TextProgress
from hybridcache.serving.schemas import MAX_STOP_CHARACTERS, ChatCompletionRequest, CompletionRequest, parse_body
from hybridcache.serving.tokenizer import BOS, END_OF_TURN, ROLE_IDS, ByteChatTokenizer


def test_the_byte_template_makes_each_turn_a_prefix_of_the_next():
    tokenizer = ByteChatTokenizer(512)
    first = [{"role": "user", "content": "héllo"}]
    second = first + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    ids = tokenizer.prompt_ids(first)
    assert ids == [BOS, ROLE_IDS["user"], *"héllo".encode(), END_OF_TURN, ROLE_IDS["assistant"]]
    assert tokenizer.prompt_ids(second)[: len(ids)] == ids
    assert tokenizer.text([*"hé".encode(), 300, END_OF_TURN]) == "hé"
    with pytest.raises(InvalidArgumentError):
        ByteChatTokenizer(100)


def test_streamed_text_holds_back_incomplete_characters_and_stop_prefixes():
    progress = TextProgress(ByteChatTokenizer(512), ("END",))
    ids = list("abcé".encode()) + list("xEN".encode())
    assert progress.advance(ids[:4], final=False) == "abc"  # the é is half there
    assert progress.advance(ids[:5], final=False) == "é"
    assert progress.advance(ids[:8], final=False) == "x"  # "EN" may start "END"
    assert progress.advance(ids[:8] + [ord("D"), ord("z")], final=False) == ""
    assert progress.stopped and progress.sent == "abcéx"


@given(st.text("abE", max_size=40), st.lists(st.text("abE", min_size=1, max_size=12), max_size=4))
def test_the_held_back_end_is_the_longest_end_a_stop_string_begins_with(text, stops):
    longest = max((size for stop in stops for size in range(1, min(len(stop) - 1, len(text)) + 1)
                   if text.endswith(stop[:size])), default=0)
    assert TextProgress(None, tuple(stops))._stop_prefix_length(text) == longest


def test_a_stop_string_longer_than_the_bound_is_refused():
    body = b'{"model": "tiny", "prompt": "x", "stop": ["%s"]}'
    assert parse_body(body % (b"s" * MAX_STOP_CHARACTERS), CompletionRequest).stop_strings()
    with pytest.raises(InvalidArgumentError, match="characters"):
        parse_body(body % (b"s" * (MAX_STOP_CHARACTERS + 1)), CompletionRequest).stop_strings()


def test_streamed_text_without_stops_sends_everything_at_the_end():
    progress = TextProgress(ByteChatTokenizer(512), ())
    assert progress.advance(list("hi".encode()) + [0xC3], final=True) == "hi\ufffd"


@pytest.mark.parametrize(
    "raw, error",
    [(b"\xc3(", MalformedRequestError), (b"nul", MalformedRequestError), (b'"text"', MalformedRequestError),
     (b'{"model": "tiny", "prompt": true}', InvalidTypeError), (b'{"model": "tiny", "prompt": []}', InvalidArgumentError),
     (b'{"model": "tiny", "prompt": "x", "seed": -1}', InvalidArgumentError),
     (b'{"model": "tiny", "prompt": "x", "logprobs": true}', InvalidArgumentError)],
)
def test_bad_completion_bodies_are_refused_with_a_specific_error(raw, error):
    with pytest.raises(error):
        parse_body(raw, CompletionRequest)


def test_chat_bodies_take_text_parts_and_max_completion_tokens():
    body = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
                      b' {"type": "text", "text": "b"}]}], "max_completion_tokens": 5, "unknown": 1}', ChatCompletionRequest)
    assert body.messages[0].text() == "ab" and body.requested_max_tokens == 5


def test_the_miss_log_speaks_once_then_at_most_once_per_interval(caplog):
    log = _MissLog(interval_s=60)
    with caplog.at_level(logging.WARNING, logger="hybridcache.serving"):
        log.observe({"no_checkpoint": 1}, now=0)
        log.observe({"no_checkpoint": 5}, now=30)
        log.observe({"no_checkpoint": 9}, now=61)
        log.observe({"no_checkpoint": 9}, now=200)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and "1 more" in lines[0] and "8 more" in lines[1] and "no_checkpoint" in lines[1]
