"""Immutable records of a request trace: raw entries as read, and synthesized requests.

Owns no mutable state: every record is a frozen dataclass and every array in one is a
read-only int32 (tokens) or int64 (hash ids) NumPy array, a copy of what its builder handed in.

A ``TraceEntry`` and a ``Trace`` check their fields as they are built, so a trace built by hand
obeys the rules a trace read from a file does (the readers build the same records): a field
of the wrong type raises ``InvalidTypeError``, a bad value ``InvalidArgumentError`` (token ids
``InvalidTokenError``), and an entry that does not fit its trace (a hash-id count that does not
cover its prompt, a timestamp going back) ``TraceFormatError`` naming the path and the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTokenError, InvalidTypeError, TraceFormatError
from hybridcache.sequence import MAX_TOKEN_ID, as_token_array
from hybridcache.types import as_int, as_ordered, ceil_div, finite_float, is_int

BLOCK_TOKENS = {"mooncake": 512, "bailian": 16, "tokens": 0}
MAX_BLOCK_TOKENS = 2**20  # synthesis draws a block's tokens from positions below 2**20 of its id's stream
# A 1M-token context plus its output fits one request (tokens are int32 once synthesized).
MAX_REQUEST_TOKENS = 2**22
MAX_HASH_ID = 2**63 - 1
MAX_TIMESTAMP_MS = float(2**53)  # below it a float counts whole milliseconds exactly (285,000 years)


def frozen_array(values: object, dtype: type) -> np.ndarray:
    """A read-only copy of ``values`` as a one-dimensional array of ``dtype``."""
    array = np.array(values, dtype=dtype).reshape(-1)
    array.flags.writeable = False
    return array


def _hash_ids(values: object) -> np.ndarray:
    """Block hash ids as a read-only int64 copy: ints in ``[0, MAX_HASH_ID]``, an array checked
    whole (the readers hand in one per line)."""
    wanted = f"hash_ids values must lie in [0, {MAX_HASH_ID}]"
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise InvalidTypeError("hash_ids must be one-dimensional")
        if values.size and values.dtype.kind not in "iu":
            raise InvalidTypeError(f"hash_ids must have an integer dtype, got {values.dtype}")
        ids = np.array(values, dtype=np.int64)  # an id of 2**63 or more wraps negative here
        if ids.size and ids.view(np.uint64).max() > MAX_HASH_ID:  # one pass finds a negative id too
            raise InvalidArgumentError(wanted)
    else:
        values = as_ordered("hash_ids", values)
        if not all(is_int(value) for value in values):
            raise InvalidTypeError("hash_ids must hold ints only")
        if not all(0 <= value <= MAX_HASH_ID for value in values):
            raise InvalidArgumentError(wanted)
        ids = np.array(values, dtype=np.int64)
    ids.flags.writeable = False
    return ids


def _tokens(name: str, values: object, length: int, length_name: str) -> np.ndarray:
    try:
        tokens = as_token_array(values)
    except InvalidTokenError:
        raise InvalidTokenError(f"{name} values must lie in [0, {MAX_TOKEN_ID}]") from None
    if tokens.size != length:
        raise InvalidArgumentError(f"{name} holds {tokens.size} tokens, {length_name} says {length}")
    tokens.flags.writeable = False
    return tokens


def _timestamp_ms(value: object) -> float:
    number = finite_float(value)
    if number is None or not 0 <= number <= MAX_TIMESTAMP_MS:
        raise InvalidArgumentError(f"timestamp_ms must be a finite number in [0, {MAX_TIMESTAMP_MS:,.0f}], got {value!r}")
    return number


@dataclass(frozen=True)
class TraceEntry:
    """One validated trace line.

    ``hash_ids`` (block-hash formats) and ``prompt`` (explicit-token format) are mutually
    exclusive. ``parent_chat_id`` names the request this one continues when the format says so
    (Qwen-Bailian); ``conversation`` is an optional label of the explicit-token format.
    """

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: np.ndarray | None = None
    prompt: np.ndarray | None = None
    output: np.ndarray | None = None
    chat_id: int | None = None
    parent_chat_id: int | None = None
    turn: int | None = None
    kind: str | None = None
    conversation: str | None = None

    def __post_init__(self) -> None:
        put = partial(object.__setattr__, self)
        put("line", as_int("line", self.line, 1))
        put("timestamp_ms", _timestamp_ms(self.timestamp_ms))
        put("input_length", as_int("input_length", self.input_length, 1))
        put("output_length", as_int("output_length", self.output_length, 0))
        tokens = self.input_length + self.output_length
        if tokens > MAX_REQUEST_TOKENS:
            raise InvalidArgumentError(f"{tokens:,} tokens, over the {MAX_REQUEST_TOKENS:,} a request may hold")
        if (self.hash_ids is None) == (self.prompt is None):
            raise InvalidArgumentError("a trace entry holds either hash_ids or a prompt, not both or neither")
        if self.hash_ids is not None:
            put("hash_ids", _hash_ids(self.hash_ids))
        else:
            put("prompt", _tokens("prompt", self.prompt, self.input_length, "input_length"))
        if self.output is not None:
            put("output", _tokens("output", self.output, self.output_length, "output_length"))
        for name in ("chat_id", "parent_chat_id", "turn"):
            if getattr(self, name) is not None:
                put(name, as_int(name, getattr(self, name), 0))
        for name in ("kind", "conversation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidTypeError(f"{name} must be a str, got {type(value).__name__}")
            put(name, None if value is None else str(value))


def entry_fault(entry: TraceEntry, fmt: str, block_tokens: int, previous_ms: float) -> str | None:
    """Why ``entry`` cannot follow an entry that arrived at ``previous_ms`` in a trace of
    ``fmt`` with ``block_tokens``-token blocks; None when it can."""
    if fmt == "tokens":
        if entry.prompt is None:
            return "an entry of the tokens format needs a prompt, not hash_ids"
    elif entry.hash_ids is None:
        return f"an entry of the {fmt} format needs hash_ids, not a prompt"
    else:
        count, expected = entry.hash_ids.size, ceil_div(entry.input_length, block_tokens)
        if count > expected:
            return f"{count} hash ids but input_length {entry.input_length} allows {expected} blocks of {block_tokens}"
        if count < expected:
            return f"{count} hash ids do not cover input_length {entry.input_length} ({expected} blocks of {block_tokens})"
    if entry.timestamp_ms < previous_ms:
        return f"timestamp goes back in time ({entry.timestamp_ms} ms after {previous_ms} ms)"
    return None


@dataclass(frozen=True)
class Trace:
    """A whole validated trace: where it came from, its format and block size, its entries."""

    path: str
    format: str
    block_tokens: int  # tokens per hash id; 0 for the explicit-token format
    entries: tuple[TraceEntry, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise InvalidTypeError(f"a trace's path must be a str, got {type(self.path).__name__}")
        if not isinstance(self.format, str) or self.format not in BLOCK_TOKENS:
            raise InvalidArgumentError(f"unknown trace format {self.format!r}; choose one of {', '.join(BLOCK_TOKENS)}")
        block = as_int("block_tokens", self.block_tokens, 0)
        if (block == 0) != (self.format == "tokens") or block > MAX_BLOCK_TOKENS:
            raise InvalidArgumentError(
                f"block_tokens must be 0 for the tokens format and in [1, {MAX_BLOCK_TOKENS:,}] for a "
                f"block-hash format, got {block} for {self.format}"
            )
        entries = as_ordered("entries", self.entries)
        if not entries:
            raise InvalidArgumentError("a trace holds at least one entry")
        if not all(isinstance(entry, TraceEntry) for entry in entries):
            raise InvalidTypeError("a trace's entries must be TraceEntry records")
        previous = 0.0
        for entry in entries:
            fault = entry_fault(entry, self.format, block, previous)
            if fault is not None:
                raise TraceFormatError(f"{self.path}:{entry.line}: {fault}")
            previous = entry.timestamp_ms
        object.__setattr__(self, "path", str(self.path))
        object.__setattr__(self, "block_tokens", block)
        object.__setattr__(self, "entries", entries)


@dataclass(frozen=True)
class TraceRequest:
    """One request after synthesis: its prompt and output tokens (one read-only int32 array),
    arrival time and, when it continues an earlier request, that request's index."""

    index: int
    arrival_ms: float
    prompt_length: int
    tokens: np.ndarray
    continues: int | None = None

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[: self.prompt_length]

    @property
    def output(self) -> np.ndarray:
        return self.tokens[self.prompt_length :]

    @property
    def output_length(self) -> int:
        return int(self.tokens.size) - self.prompt_length
