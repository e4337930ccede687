"""Trace records check what they are built from: a hand-built trace obeys the readers' rules."""

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTokenError, InvalidTypeError, TraceFormatError
from hybridcache.workloads import infinite_cache_bound, synthesize
from hybridcache.workloads.records import MAX_TIMESTAMP_MS, Trace, TraceEntry


def entry(**fields) -> TraceEntry:
    return TraceEntry(**{"line": 1, "timestamp_ms": 0.0, "input_length": 1000, "output_length": 10,
                         "hash_ids": np.array([1, 2]), **fields})


@pytest.mark.parametrize("fields, error, message", [
    ({"input_length": -5}, InvalidArgumentError, "input_length must be >= 1"),
    ({"output_length": -1}, InvalidArgumentError, "output_length must be >= 0"),
    ({"input_length": 2**22, "hash_ids": np.arange(8192)}, InvalidArgumentError, "over the 4,194,304 a request"),
    ({"line": 0}, InvalidArgumentError, "line must be >= 1"),
    ({"input_length": 10.0}, InvalidTypeError, "input_length must be an int"),
    ({"timestamp_ms": float("nan")}, InvalidArgumentError, "timestamp_ms must be a finite number"),
    ({"timestamp_ms": MAX_TIMESTAMP_MS * 2}, InvalidArgumentError, "timestamp_ms must be a finite number"),
    ({"timestamp_ms": "0"}, InvalidArgumentError, "timestamp_ms"),
    ({"hash_ids": None}, InvalidArgumentError, "either hash_ids or a prompt"),
    ({"prompt": np.arange(1000)}, InvalidArgumentError, "either hash_ids or a prompt"),
    ({"hash_ids": np.array([1.5, 2.5])}, InvalidTypeError, "hash_ids must have an integer dtype"),
    ({"hash_ids": [1, 2.5]}, InvalidTypeError, "hash_ids must hold ints"),
    ({"hash_ids": [True, 2]}, InvalidTypeError, "hash_ids must hold ints"),
    ({"hash_ids": np.array([-1, 2])}, InvalidArgumentError, "hash_ids values must lie"),
    ({"hash_ids": np.array([2**63, 2], dtype=np.uint64)}, InvalidArgumentError, "hash_ids values must lie"),
    ({"hash_ids": [2**64, 1]}, InvalidArgumentError, "hash_ids values must lie"),
    ({"hash_ids": np.ones((2, 1), dtype=np.int64)}, InvalidTypeError, "one-dimensional"),
    ({"hash_ids": {1, 2}}, InvalidTypeError, "ordered sequence"),
    ({"hash_ids": None, "input_length": 3, "prompt": np.array([2**40, 2**32 + 7, 1])}, InvalidTokenError, "prompt values"),
    ({"hash_ids": None, "input_length": 3, "prompt": [1, 2]}, InvalidArgumentError, "prompt holds 2 tokens"),
    ({"output": [1]}, InvalidArgumentError, "output holds 1 tokens, output_length says 10"),
    ({"chat_id": -1}, InvalidArgumentError, "chat_id must be >= 0"),
    ({"kind": 3}, InvalidTypeError, "kind must be a str"),
])
def test_a_bad_entry_is_refused_as_it_is_built(fields, error, message):
    with pytest.raises(error, match=message):
        entry(**fields)


def test_an_entry_holds_read_only_copies():
    ids, prompt = np.array([1, 2]), [5, 6, 7]
    built = entry(hash_ids=ids)
    ids[0] = 99
    assert built.hash_ids.tolist() == [1, 2] and built.hash_ids.dtype == np.int64
    assert not built.hash_ids.flags.writeable
    explicit = entry(hash_ids=None, input_length=3, prompt=prompt, output_length=1, output=(9,))
    prompt[0] = 0
    assert explicit.prompt.tolist() == [5, 6, 7] and explicit.prompt.dtype == np.int32
    assert not explicit.prompt.flags.writeable and not explicit.output.flags.writeable


def test_synthesis_of_a_hand_built_trace_ignores_later_changes_to_its_arrays():
    ids = np.array([1, 2])
    trace = Trace("p", "mooncake", 512, (entry(hash_ids=ids),))
    before = synthesize(trace).requests[0].tokens.copy()
    ids[0] = 99
    assert np.array_equal(synthesize(trace).requests[0].tokens, before)


@pytest.mark.parametrize("fmt, block, entries, error, message", [
    ("mooncake", 0, (entry(),), InvalidArgumentError, "block_tokens must be 0 for the tokens format"),
    ("mooncake", -5, (entry(),), InvalidArgumentError, "block_tokens must be >= 0"),
    ("mooncake", "x", (entry(),), InvalidTypeError, "block_tokens must be an int"),
    ("mooncake", 2**21, (entry(),), InvalidArgumentError, "block_tokens must be 0 for the tokens format"),
    ("tokens", 512, (entry(),), InvalidArgumentError, "block_tokens must be 0"),
    (["mooncake"], 512, (entry(),), InvalidArgumentError, "unknown trace format"),
    ("mooncake", 512, (), InvalidArgumentError, "at least one entry"),
    ("mooncake", 512, (1, 2), InvalidTypeError, "TraceEntry records"),
    ("mooncake", 512, entry(), InvalidTypeError, "ordered sequence"),
    ("mooncake", 512, (entry(hash_ids=np.array([1])),), TraceFormatError, "p:1: 1 hash ids do not cover"),
    ("mooncake", 512, (entry(hash_ids=np.arange(50)),), TraceFormatError, "p:1: 50 hash ids but input_length 1000"),
    ("tokens", 0, (entry(),), TraceFormatError, "p:1: an entry of the tokens format needs a prompt"),
    ("mooncake", 512, (entry(timestamp_ms=5.0), entry(line=2, timestamp_ms=4.0)), TraceFormatError,
     "p:2: timestamp goes back in time"),
])
def test_a_bad_trace_is_refused_as_it_is_built(fmt, block, entries, error, message):
    with pytest.raises(error, match=message):
        Trace("p", fmt, block, entries)


def test_a_hand_built_trace_keeps_its_entries_as_a_tuple():
    trace = Trace("p", "bailian", 16, [entry(input_length=32, hash_ids=[1, 2], chat_id=1)])
    assert isinstance(trace.entries, tuple)
    assert infinite_cache_bound(synthesize(trace).requests).prompt_tokens == 32
