import dataclasses

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.workloads import read_trace, synthesize
from tests.paths import SHARED_TRACE
from tests.workloads._traces import mooncake, write_lines


def _synth(tmp_path, rows, **options):
    return synthesize(read_trace(write_lines(tmp_path / "t.jsonl", rows)), **options)


def test_same_hash_id_same_block_tokens(tmp_path):
    out = _synth(tmp_path, [mooncake(0, 1024, 3, [1, 2]), mooncake(1, 700, 3, [1, 9]), mooncake(2, 300, 1, [2])])
    first, second, third = out.requests
    assert np.array_equal(first.prompt[:512], second.prompt[:512])
    assert not np.array_equal(first.prompt[512:700], second.prompt[512:700])
    # id 2 at another position is the same content: ids name block content, not positions
    assert np.array_equal(third.prompt, first.prompt[512:812])
    for request in out.requests:
        assert request.tokens.dtype == np.int32 and not request.tokens.flags.writeable
        assert 0 <= request.tokens.min() and request.tokens.max() < out.vocab_size
    assert first.output_length == 3 and first.prompt_length == 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.prompt_length = 5


def test_synthesis_is_deterministic_and_seeded(tmp_path):
    rows = [mooncake(0, 1024, 3, [1, 2])]
    a, b = _synth(tmp_path, rows), _synth(tmp_path, rows)
    assert np.array_equal(a.requests[0].tokens, b.requests[0].tokens)
    c = _synth(tmp_path, rows, seed=1)
    assert not np.array_equal(a.requests[0].tokens, c.requests[0].tokens)
    small = _synth(tmp_path, rows, vocab_size=7)
    assert small.requests[0].tokens.max() < 7


def test_bad_synthesis_arguments(tmp_path):
    trace = read_trace(write_lines(tmp_path / "t.jsonl", [mooncake(0, 10, 1, [1])]))
    with pytest.raises(InvalidTypeError):
        synthesize("trace")
    with pytest.raises(InvalidArgumentError):
        synthesize(trace, vocab_size=1)
    with pytest.raises(InvalidArgumentError):
        synthesize(trace, seed=-1)
    with pytest.raises(InvalidArgumentError, match="seed must be at most 2"):
        synthesize(trace, seed=2**64)
    with pytest.raises(InvalidTypeError, match="seed must be an int"):
        synthesize(trace, seed=1.0)


def test_the_largest_seed_wraps_without_overflow(tmp_path):
    trace = read_trace(write_lines(tmp_path / "t.jsonl", [mooncake(0, 10, 1, [1])]))
    with np.errstate(over="raise"):
        assert synthesize(trace, seed=2**64 - 1).requests[0].tokens.size == 11


# A: 2 full blocks + a partial one, 100 output tokens (history 1600 tokens).
A = mooncake(0, 1500, 100, [1, 2, 3])


def _continues(tmp_path, rows):
    out = _synth(tmp_path, rows)
    return [request.continues for request in out.requests], out


def test_continuation_gets_the_history_written_into_its_new_blocks(tmp_path):
    links, out = _continues(tmp_path, [A, mooncake(1, 1900, 5, [1, 2, 4, 5]), mooncake(2, 1100, 1, [1, 2, 4])])
    assert links == [None, 0, None] and out.stats.continuations == 1
    a, b, c = out.requests
    assert np.array_equal(b.prompt[: a.tokens.size], a.tokens)  # A's prompt + output
    # the rest of block 4 is its own filler, and block 4 is fixed at first sight
    assert np.array_equal(c.prompt[1024:1100], b.prompt[1024:1100])


@pytest.mark.parametrize("b_row", [
    mooncake(1, 1900, 5, [1, 9, 4, 5]),  # d = 1 < 2
    mooncake(1, 1600 + 4097, 5, [1, 2] + list(range(10, 20))),  # gap 4097 > 4096
    mooncake(1, 1550, 5, [1, 2, 4, 5]),  # gap < 0: shorter than the 1600-token history
    mooncake(1, 1024, 5, [1, 2]),  # B has exactly d blocks
])
def test_no_continuation_when_a_condition_fails(tmp_path, b_row):
    links, _ = _continues(tmp_path, [A, b_row])
    assert links == [None, None]


def test_parent_needs_exactly_d_full_blocks(tmp_path):
    three_full = mooncake(0, 1536, 10, [1, 2, 3])
    links, _ = _continues(tmp_path, [three_full, mooncake(1, 1700, 5, [1, 2, 4, 5])])
    assert links == [None, None]


def test_most_recent_parent_that_fits_the_window(tmp_path):
    late_long = mooncake(1, 1500, 4000, [1, 2, 6])  # later, but B would be shorter than its history
    links, _ = _continues(tmp_path, [A, late_long, mooncake(2, 1900, 5, [1, 2, 4, 5])])
    assert links == [None, None, 0]
    later_fit = mooncake(1, 1500, 50, [1, 2, 6])
    links, _ = _continues(tmp_path, [A, later_fit, mooncake(2, 1900, 5, [1, 2, 4, 5])])
    assert links == [None, None, 1]


def test_bailian_parent_is_explicit(tmp_path):
    base = {"timestamp": 0, "type": "text", "turn": 1}
    rows = [
        dict(base, chat_id=1, parent_chat_id=-1, input_length=40, output_length=8, hash_ids=[1, 2, 3]),
        dict(base, chat_id=2, parent_chat_id=1, input_length=60, output_length=2, hash_ids=[1, 2, 4, 5]),
        dict(base, chat_id=3, parent_chat_id=1, input_length=44, output_length=2, hash_ids=[1, 2, 7]),  # shorter than 48
    ]
    links, out = _continues(tmp_path, rows)
    assert links == [None, 0, None] and out.stats.parents_refused == 1
    assert np.array_equal(out.requests[1].prompt[:48], out.requests[0].tokens)


def test_explicit_tokens_are_kept_and_outputs_synthesized(tmp_path):
    rows = [{"prompt": [5, 6, 7], "output_length": 2}, {"prompt": [5, 6], "output_length": 1, "output": [4]}]
    out = _synth(tmp_path, rows)
    assert out.requests[0].prompt.tolist() == [5, 6, 7] and out.requests[0].output_length == 2
    assert out.requests[1].output.tolist() == [4]


def test_shared_trace_has_84_continuations_in_its_first_2000_requests():
    out = synthesize(read_trace(SHARED_TRACE, limit=2000))
    assert out.stats.continuations == 84 and out.stats.conflicting_blocks == 0
    for request in out.requests:
        if request.continues is not None:
            parent = out.requests[request.continues]
            assert np.array_equal(request.prompt[: parent.tokens.size], parent.tokens)
