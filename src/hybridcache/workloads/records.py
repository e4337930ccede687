"""Immutable records of a request trace: raw entries as read, and synthesized requests.

Owns no mutable state: every record is a frozen dataclass and every array in one is a
read-only int32 (tokens) or int64 (hash ids) NumPy array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def frozen_array(values: object, dtype: type) -> np.ndarray:
    """A read-only copy of ``values`` as a one-dimensional array of ``dtype``."""
    array = np.array(values, dtype=dtype).reshape(-1)
    array.flags.writeable = False
    return array


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


@dataclass(frozen=True)
class Trace:
    """A whole validated trace: where it came from, its format and block size, its entries."""

    path: str
    format: str
    block_tokens: int  # tokens per hash id; 0 for the explicit-token format
    entries: tuple[TraceEntry, ...]


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
