import json

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, TraceFormatError
from hybridcache.workloads import read_trace
from tests.workloads._traces import mooncake, write_lines

GOOD = mooncake(0, 1000, 5, [7, 8])


def test_reads_mooncake_lines(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [GOOD, "", mooncake(3, 512, 0, [7])])
    trace = read_trace(path)
    assert trace.format == "mooncake" and trace.block_tokens == 512
    assert [entry.line for entry in trace.entries] == [1, 3]
    first = trace.entries[0]
    assert (first.input_length, first.output_length, first.timestamp_ms) == (1000, 5, 0.0)
    assert first.hash_ids.tolist() == [7, 8] and not first.hash_ids.flags.writeable


def test_reads_bailian_lines_in_seconds(tmp_path):
    row = {"chat_id": 3, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 20, "output_length": 4,
           "type": "text", "turn": 1, "hash_ids": [1, 2]}
    child = dict(row, chat_id=4, parent_chat_id=3, timestamp=2.0, turn=2, input_length=40, hash_ids=[1, 2, 3])
    trace = read_trace(write_lines(tmp_path / "b.jsonl", [row, child]))
    assert trace.format == "bailian" and trace.block_tokens == 16
    assert trace.entries[0].timestamp_ms == 1500.0 and trace.entries[0].parent_chat_id is None
    assert trace.entries[1].parent_chat_id == 3 and trace.entries[1].kind == "text"


def test_reads_explicit_tokens(tmp_path):
    rows = [{"prompt": [1, 2, 3], "output_length": 2, "output": [9, 9], "conversation": "c1"},
            {"prompt": [1, 2], "output_length": 1, "timestamp": 5}]
    trace = read_trace(write_lines(tmp_path / "o.jsonl", rows))
    assert trace.format == "tokens"
    assert trace.entries[0].prompt.dtype == np.int32 and trace.entries[0].conversation == "c1"
    assert trace.entries[0].timestamp_ms == 0.0 and trace.entries[1].timestamp_ms == 5.0


def test_limit_and_explicit_format(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [GOOD, GOOD, GOOD])
    assert len(read_trace(path, "mooncake", limit=2).entries) == 2
    with pytest.raises(InvalidArgumentError):
        read_trace(path, "csv")
    with pytest.raises(InvalidArgumentError):
        read_trace(path, limit=0)


BAD_LINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ({"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "missing field 'input_length'"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1}, "missing field 'hash_ids'"),
    ({"input_length": 10, "output_length": 1, "hash_ids": [1]}, "missing field 'timestamp'"),
    (mooncake(0, -5, 1, []), "input_length must be >= 1"),
    (mooncake(0, 0, 1, []), "input_length must be >= 1"),
    (mooncake(0, 10, -1, [1]), "output_length must be >= 0"),
    (mooncake(0, 10, 1, [1, 2]), "allows 1 blocks"),
    (mooncake(0, 1100, 1, [1, 2]), "do not cover"),
    (mooncake(0, "10", 1, [1]), "input_length must be an int"),
    (mooncake(0, 10.0, 1, [1]), "input_length must be an int"),
    (mooncake(0, 10, True, [1]), "output_length must be an int"),
    (mooncake(0, 10, 1, ["a"]), "hash_ids must hold ints"),
    (mooncake(0, 10, 1, [True]), "hash_ids must hold ints"),
    (mooncake(0, 2**22, 1, list(range(8192))), "4,194,305 tokens, over the 4,194,304"),
    (mooncake(0, 10, 1, [-3]), "hash_ids values must lie"),
    (mooncake(0, 10, 1, 7), "hash_ids must be a list"),
    (mooncake(-1, 10, 1, [1]), "timestamp must be >= 0"),
    (mooncake("now", 10, 1, [1]), "timestamp must be a finite number"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_bad_mooncake_line_names_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, line])
    with pytest.raises(TraceFormatError, match=message) as error:
        read_trace(path, "mooncake")
    assert f"{path}:2:" in str(error.value)


def test_time_going_back_is_refused(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake(10, 10, 1, [1]), mooncake(10, 10, 1, [1]), mooncake(9, 10, 1, [1])])
    with pytest.raises(TraceFormatError, match=r"t.jsonl:3: timestamp goes back"):
        read_trace(path)


BAILIAN = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 16, "output_length": 1, "turn": 1, "hash_ids": [1]}


@pytest.mark.parametrize("change, message", [
    ({"chat_id": None}, "chat_id must be an int"),
    ({"parent_chat_id": -2}, "parent_chat_id must be >= -1"),
    ({"type": 3}, "type must be a string"),
    ({"turn": "one"}, "turn must be an int"),
    ({"hash_ids": [1, 2]}, "allows 1 blocks of 16"),
])
def test_bad_bailian_lines(tmp_path, change, message):
    path = write_lines(tmp_path / "b.jsonl", [dict(BAILIAN, **change)])
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path, "bailian")


@pytest.mark.parametrize("seconds", [1e306, 2.0**53 / 1000 * 1.5])
def test_a_bailian_time_beyond_the_clock_in_milliseconds_is_refused(tmp_path, seconds):
    path = write_lines(tmp_path / "b.jsonl", [dict(BAILIAN, timestamp=seconds)])
    with pytest.raises(TraceFormatError, match=r"b.jsonl:1: timestamp_ms must be a finite number in \[0, 9,007"):
        read_trace(path, "bailian")


def test_a_mooncake_time_beyond_the_clock_is_refused(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake(1e300, 10, 1, [1])])
    with pytest.raises(TraceFormatError, match="t.jsonl:1: timestamp_ms must be a finite number"):
        read_trace(path)


def test_a_hash_id_beyond_64_bits_is_refused(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake(0, 10, 1, [2**64])])
    with pytest.raises(TraceFormatError, match="t.jsonl:1: hash_ids holds an int beyond 64 bits"):
        read_trace(path)


@pytest.mark.parametrize("row, message", [
    ({"prompt": [], "output_length": 1}, "at least one token"),
    ({"prompt": [1, 2**31], "output_length": 1}, "prompt values must lie"),
    ({"prompt": [1, 2], "output_length": 2, "output": [3]}, "output holds 1 tokens"),
    ({"prompt": [1], "output_length": 1, "conversation": [1]}, "conversation must be"),
    ({"prompt": "abc", "output_length": 1}, "prompt must be a list"),
])
def test_bad_token_lines(tmp_path, row, message):
    path = write_lines(tmp_path / "o.jsonl", [row])
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path, "tokens")


def test_missing_empty_and_binary_files(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceFormatError, match="no request"):
        read_trace(write_lines(tmp_path / "empty.jsonl", ["", "  "]))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        read_trace(binary)


@pytest.mark.parametrize("path", ["/tmp/a\x00b.jsonl", "/tmp/\ud800.jsonl"])
def test_a_path_no_file_can_have_is_refused(path):
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(path)


@pytest.mark.parametrize("fmt", [["mooncake"], None, 5])
def test_a_format_that_is_not_a_name_is_refused(tmp_path, fmt):
    with pytest.raises(InvalidArgumentError, match="unknown trace format"):
        read_trace(write_lines(tmp_path / "t.jsonl", [GOOD]), fmt)


def test_errors_are_input_errors(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD)[:-1]])
    with pytest.raises(ValueError):
        read_trace(path)
