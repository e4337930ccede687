"""Readers of request traces in three JSONL formats, validated line by line.

Owns no state between calls. Formats (one JSON object per line; blank lines are skipped):

* ``mooncake``: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` of
  512-token blocks (exactly ``ceil(input_length / 512)`` of them).
* ``bailian`` (Qwen-Bailian): the same with 16-token blocks, ``timestamp`` in seconds, plus
  ``chat_id``, ``parent_chat_id`` (-1: first turn), ``turn`` and ``type``.
* ``tokens`` (ours): ``prompt`` (token ids), ``output_length``, optional ``output`` (token ids,
  exactly ``output_length`` of them), ``timestamp`` (ms) and ``conversation``.

Every malformed line raises ``TraceFormatError`` naming the file and the line: bad JSON (or
JSON nested deeper than a trace line can be), a line over ``MAX_LINE_BYTES``, a missing field, a
wrong type, a negative length, a request over ``MAX_REQUEST_TOKENS``, a trace over
``MAX_TRACE_TOKENS``, a timestamp earlier than the previous one, or a hash-id count that does not
match the prompt length. The trace must be a regular file (``hybridcache.files``): a FIFO or a
device is refused before anything is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError, TraceFormatError
from hybridcache.files import open_regular, read_or_raise
from hybridcache.workloads.records import (
    BLOCK_TOKENS,
    MAX_REQUEST_TOKENS,
    Trace,
    TraceEntry,
    entry_fault,
)

FORMATS = tuple(BLOCK_TOKENS)
MAX_LINE_BYTES = 64 * 2**20  # a 4M-token explicit prompt at up to 15 bytes a token id
# A whole trace holds up to 4 GiB of tokens (int32 once synthesized; the Mooncake traces hold
# about 0.2 G). Larger traces are replayed in parts (limit).
MAX_TRACE_TOKENS = 2**30


class _LineError(Exception):
    """A field of the current line is malformed (turned into ``TraceFormatError``)."""


def _require_int(record: dict, name: str, minimum: int, maximum: int = 2**63 - 1) -> int:
    if name not in record:
        raise _LineError(f"missing field {name!r}")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _LineError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise _LineError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise _LineError(f"{name} must be <= {maximum:,}, got {value:,}")
    return value


def _optional_int(record: dict, name: str, minimum: int) -> int | None:
    return _require_int(record, name, minimum) if record.get(name) is not None else None


def _timestamp(record: dict, required: bool) -> float | None:
    if "timestamp" not in record:
        if required:
            raise _LineError("missing field 'timestamp'")
        return None
    value = record["timestamp"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _LineError(f"timestamp must be a finite number, got {value!r}")
    if value < 0:
        raise _LineError(f"timestamp must be >= 0, got {value}")
    return float(value)


def _int_list(record: dict, name: str) -> np.ndarray:
    """A JSON list of ints as an int64 array, its types checked without a Python loop (JSON
    gives exact ``int``s, and ``bool`` is another type); the entry checks the range."""
    if name not in record:
        raise _LineError(f"missing field {name!r}")
    values = record[name]
    if not isinstance(values, list):
        raise _LineError(f"{name} must be a list of ints, got {type(values).__name__}")
    if not set(map(type, values)) <= {int}:
        raise _LineError(f"{name} must hold ints only, got {next(v for v in values if type(v) is not int)!r}")
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        raise _LineError(f"{name} holds an int beyond 64 bits") from None


def _mooncake(record: dict, line: int, previous_ms: float) -> TraceEntry:
    return TraceEntry(
        line=line,
        timestamp_ms=_timestamp(record, required=True),
        input_length=_require_int(record, "input_length", 1, MAX_REQUEST_TOKENS),
        output_length=_require_int(record, "output_length", 0, MAX_REQUEST_TOKENS),
        hash_ids=_int_list(record, "hash_ids"),
    )


def _bailian(record: dict, line: int, previous_ms: float) -> TraceEntry:
    kind = record.get("type")
    if kind is not None and not isinstance(kind, str):
        raise _LineError(f"type must be a string, got {type(kind).__name__}")
    parent = _require_int(record, "parent_chat_id", -1)
    return TraceEntry(
        line=line,
        timestamp_ms=_timestamp(record, required=True) * 1000.0,  # the format's seconds
        input_length=_require_int(record, "input_length", 1, MAX_REQUEST_TOKENS),
        output_length=_require_int(record, "output_length", 0, MAX_REQUEST_TOKENS),
        hash_ids=_int_list(record, "hash_ids"),
        chat_id=_require_int(record, "chat_id", 0),
        parent_chat_id=None if parent < 0 else parent,
        turn=_optional_int(record, "turn", 0),
        kind=kind,
    )


def _tokens(record: dict, line: int, previous_ms: float) -> TraceEntry:
    """An explicit-token line; one without a time arrives with the previous line."""
    prompt = _int_list(record, "prompt")
    if not prompt.size:
        raise _LineError("prompt must hold at least one token")
    output_length = _require_int(record, "output_length", 0, MAX_REQUEST_TOKENS)
    output = None
    if record.get("output") is not None:
        output = _int_list(record, "output")
    conversation = record.get("conversation")
    if conversation is not None and (isinstance(conversation, bool) or not isinstance(conversation, (str, int))):
        raise _LineError(f"conversation must be a string or an int, got {type(conversation).__name__}")
    timestamp = _timestamp(record, required=False)
    return TraceEntry(
        line=line,
        timestamp_ms=previous_ms if timestamp is None else timestamp,
        input_length=prompt.size,
        output_length=output_length,
        prompt=prompt,
        output=output,
        conversation=None if conversation is None else str(conversation),
    )


_PARSERS: dict[str, Callable[[dict, int, float], TraceEntry]] = {"mooncake": _mooncake, "bailian": _bailian, "tokens": _tokens}


def detect_format(record: dict) -> str:
    """The format a first trace line belongs to, by its distinguishing fields."""
    if "prompt" in record:
        return "tokens"
    if "chat_id" in record or "parent_chat_id" in record:
        return "bailian"
    return "mooncake"


def _parse_line(text: str, where: str) -> dict:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceFormatError(f"{where}: not valid JSON ({error.msg})") from None
    except RecursionError:
        raise TraceFormatError(f"{where}: JSON nested too deeply for a trace line") from None
    except ValueError as error:  # an integer literal over Python's digit limit
        raise TraceFormatError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
    return record


def read_trace(path: str | Path, fmt: str = "auto", limit: int | None = None) -> Trace:
    """Read and validate a trace; ``fmt`` is one of ``FORMATS`` or ``auto`` (by the first
    line); ``limit`` keeps only the first ``limit`` requests."""
    if not isinstance(fmt, str) or (fmt != "auto" and fmt not in _PARSERS):
        raise InvalidArgumentError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)} or auto")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgumentError(f"limit must be an int >= 1, got {limit!r}")
    if not isinstance(path, (str, Path)):
        raise InvalidTypeError(f"path must be a str or a Path, got {type(path).__name__}")
    path = Path(path)
    with open_regular(path, TraceFormatError) as handle:
        found, entries = _read_entries(handle, str(path), fmt, limit)
    if not entries:
        raise TraceFormatError(f"{path}: the trace holds no request")
    return Trace(path=str(path), format=found, block_tokens=BLOCK_TOKENS[found], entries=tuple(entries))


def _lines(handle, where: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line, each read within ``MAX_LINE_BYTES``."""
    number = 0
    while raw := read_or_raise(handle, MAX_LINE_BYTES + 1, where, TraceFormatError, line=True):
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TraceFormatError(f"{where}:{number}: line longer than {MAX_LINE_BYTES:,} bytes")
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceFormatError(f"{where}:{number}: the trace is not UTF-8 text") from None


def _read_entries(handle, where: str, fmt: str, limit: int | None) -> tuple[str, list[TraceEntry]]:
    entries: list[TraceEntry] = []
    previous_time = 0.0
    total_tokens = 0
    for number, text in _lines(handle, where):
        if not text.strip():
            continue
        record = _parse_line(text, f"{where}:{number}")
        fmt = detect_format(record) if fmt == "auto" else fmt
        try:
            entry = _PARSERS[fmt](record, number, previous_time)
        except (_LineError, InvalidArgumentError, InvalidTypeError) as error:  # the entry's own checks
            raise TraceFormatError(f"{where}:{number}: {error}") from None
        fault = entry_fault(entry, fmt, BLOCK_TOKENS[fmt], previous_time)
        if fault is not None:
            raise TraceFormatError(f"{where}:{number}: {fault}")
        total_tokens += entry.input_length + entry.output_length
        if total_tokens > MAX_TRACE_TOKENS:
            raise TraceFormatError(
                f"{where}:{number}: the trace passes {MAX_TRACE_TOKENS:,} tokens here; replay a part of it (limit)"
            )
        previous_time = entry.timestamp_ms
        entries.append(entry)
        if limit is not None and len(entries) >= limit:
            break
    return fmt, entries
