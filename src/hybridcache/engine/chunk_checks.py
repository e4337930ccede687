"""Validation of what a forward is handed: chunks' tokens, block tables, multimodal spans,
adapters, writable blocks and replayed experts. Shared by every ``PagedModel``.

Owns nothing. Each check returns a fresh value in the type the hot loop uses, or raises a
``hybridcache.errors`` class. ``as_index`` accepts anything with ``__index__`` (torch and NumPy
integer scalars included, as block tables and token lists carry them), unlike
``hybridcache.types.as_int``, which is the rule for caller-facing arguments.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from hybridcache.engine.model_api import CacheStorage
from hybridcache.errors import InvalidArgumentError, InvalidSpanError, InvalidTokenError, InvalidTypeError, SharedWriteError
from hybridcache.types import as_optional_name

@dataclass(frozen=True)
class Span:
    start: int
    end: int
    digest: bytes


def as_index(name: str, value: object) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    return value.__index__()


def _span_fields(span: object) -> tuple[object, object, object]:
    if hasattr(span, "content_id") and hasattr(span, "start") and hasattr(span, "end"):
        return span.start, span.end, span.content_id
    if not isinstance(span, tuple) or len(span) != 3:
        raise InvalidTypeError(f"multimodal span must be a (start, end, content) tuple, got {span!r}")
    return span


def validated_spans(spans: object) -> tuple[Span, ...]:
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Iterable):
        raise InvalidTypeError("multimodal must be a sequence of (start, end, content) tuples")
    result = []
    for span in spans:
        start, end, content = _span_fields(span)
        start, end = as_index("span start", start), as_index("span end", end)
        content = content.encode() if isinstance(content, str) else content
        if not isinstance(content, (bytes, bytearray)):
            raise InvalidTypeError("span content must be bytes or str")
        if start < 0 or end <= start:
            raise InvalidSpanError(f"span [{start}, {end}) is empty or negative")
        result.append(Span(start, end, hashlib.sha256(content).digest()))
    result.sort(key=lambda s: s.start)
    for left, right in zip(result, result[1:]):
        if right.start < left.end:
            raise InvalidSpanError(f"spans starting at {left.start} and {right.start} overlap")
    return tuple(result)


def validated_adapter(adapter: object) -> str | None:
    if adapter is not None and not isinstance(adapter, str):
        raise InvalidTypeError(f"adapter must be None or a str, got {type(adapter).__name__}")
    return as_optional_name("adapter", adapter)


def validated_tokens(tokens: object, vocab_size: int) -> list[int]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise InvalidTypeError("token_ids must be a sequence of ints")
    result = [as_index("token id", token) for token in tokens]
    if not result:
        raise InvalidArgumentError("a chunk needs at least one token")
    for token in result:
        if not 0 <= token < vocab_size:
            raise InvalidTokenError(f"token id {token} outside the vocabulary [0, {vocab_size})")
    return result


def validated_table(block_table: object, end: int, cache: CacheStorage) -> np.ndarray:
    """The table prefix covering positions ``[0, end)`` as a fresh int64 array."""
    table = np.asarray(block_table)
    if table.ndim != 1 or (table.size and table.dtype.kind not in "iu"):
        raise InvalidTypeError("block_table must be a one-dimensional sequence of ints")
    needed = -(-end // cache.block_size)
    if table.size < needed:
        covered = table.size * cache.block_size
        raise InvalidArgumentError(f"block table covers {covered} positions, chunk ends at {end}")
    table = table[:needed].astype(np.int64)
    for block in table.tolist():
        cache.check_block(block)
    return table


def validated_replays(replay: object, count: int) -> list[object]:
    """``replay_experts`` as one entry per chunk (all None when not replaying)."""
    if replay is None:
        return [None] * count
    if isinstance(replay, (str, bytes, np.ndarray)) or not isinstance(replay, Iterable):
        raise InvalidTypeError("replay_experts must be None or one entry per chunk")
    replays = list(replay)
    if len(replays) != count:
        raise InvalidArgumentError(f"{len(replays)} replay entries for {count} chunks")
    return replays


def validated_expert_rows(rows: object, tokens: int, width: int) -> np.ndarray | None:
    """One chunk's replayed expert ids as a fresh ``(tokens, width)`` int64 array, or None."""
    if rows is None:
        return None
    array = np.array(rows)
    if array.dtype.kind not in "iu" or array.shape != (tokens, width):
        raise InvalidArgumentError(f"replayed experts must be ints shaped ({tokens}, {width})")
    return array.astype(np.int64)


def check_writable(writes: set[int], writable: object) -> None:
    if writable is None:
        return
    if isinstance(writable, (str, bytes)) or not isinstance(writable, Iterable):
        raise InvalidTypeError("writable_blocks must be None or a set of block ids")
    foreign = writes - {as_index("writable block", block) for block in writable}
    if foreign:
        raise SharedWriteError(f"chunk would write KV into blocks {sorted(foreign)} it does not own")
