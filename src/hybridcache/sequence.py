"""A request as the cache sees it.

Owns: the request's int32 token buffer, its computed-token counter, its block table, its
namespace, its multimodal spans and its routed-expert history. The per-request protocol state
that the prefix cache writes lives in :class:`hybridcache.prefix_state.PrefixState`, reachable
as ``sequence.prefix_state``.

Tokens are append-only. The buffer grows by reallocation (amortized doubling), and every view
handed out covers only tokens that already exist and is read-only, so no later growth or
append can change what a view shows. Buffers come from and go back to
:mod:`hybridcache.token_buffers` (a dead sequence's buffer serves the next one, unless a view
of it is still alive).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Sequence as SequenceLike

import numpy as np

from hybridcache import token_buffers
from hybridcache.errors import (
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidStepError,
    InvalidTokenError,
    InvalidTypeError,
)
from hybridcache.prefix_state import PrefixState
from hybridcache.types import (
    BASE_NAMESPACE,
    EXPERT_DTYPE,
    TOKEN_DTYPE,
    MultimodalSpan,
    Namespace,
    as_int,
    as_ordered,
    validated_spans,
)

_TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
MAX_TOKEN_ID = 2**31 - 1
MAX_EXPERT_ID = np.iinfo(EXPERT_DTYPE).max
MAX_BLOCK_ID = np.iinfo(np.int32).max
_INITIAL_CAPACITY = 64
_WORD_DTYPE = np.uint64  # two tokens per word: the block hash reads tokens in pairs
_ids = itertools.count()


def as_token_array(tokens: object) -> np.ndarray:
    """Validate token ids and return them as a fresh contiguous int32 array. Any ordered
    iterable is materialized once (a generator is read exactly once); sets and mappings,
    whose order is undefined, are refused."""
    return np.array(_validated_tokens(tokens), dtype=TOKEN_DTYPE, copy=True)


def _validated_tokens(tokens: object) -> np.ndarray:
    """``as_token_array`` without the copy: the validated ids as a 1-D integer array, possibly
    the caller's own (for callers that copy them into a buffer of their own at once)."""
    if isinstance(tokens, np.ndarray):
        array = tokens
    else:
        items = as_ordered("tokens", tokens)
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in items):
            raise InvalidTypeError("token ids must be ints")
        # Range-check the Python ints before the int64 conversion, which would overflow.
        if any(t < 0 or t > MAX_TOKEN_ID for t in items):
            raise InvalidTokenError("token ids must lie in [0, 2**31)")
        array = np.asarray(items if items else [], dtype=np.int64)
    if array.ndim != 1:
        raise InvalidTypeError("tokens must be one-dimensional")
    if array.dtype.kind not in "iu" and array.size:
        raise InvalidTypeError(f"token ids must have an integer dtype, got {array.dtype}")
    if array.size and _largest_id(array) > MAX_TOKEN_ID:
        raise InvalidTokenError("token ids must lie in [0, 2**31)")
    return array


def as_block_ids(block_ids: object, limit: int = MAX_BLOCK_ID + 1) -> np.ndarray:
    """``block_ids`` (an int, or a flat or nested sequence of ints) as a flat int32 array, each
    id checked to lie in ``[0, limit)`` on its original value: the cast to int32 would wrap
    ``2**32 + k`` to ``k``, another holder's block."""
    try:
        ids = np.asarray(block_ids)
    except ValueError:  # ragged nesting
        raise InvalidTypeError("block ids must be ints, not a ragged nesting") from None
    if ids.size == 0:
        return np.empty(0, dtype=np.int32)
    if ids.dtype.kind not in "iu":
        raise InvalidTypeError(f"block ids must be integers, got {ids.dtype}")
    ids = ids.reshape(-1)
    if int(ids.min()) < 0 or int(ids.max()) >= limit:
        raise InvalidBlockIdError(f"block id outside [0, {limit})")
    return ids.astype(np.int32, copy=False)


def _as_positions(start: object, end: object) -> tuple[int, int]:
    return as_int("start", start), as_int("end", end)


def _largest_id(array: np.ndarray) -> int:
    """The largest id, a negative one counting as larger than any valid id: one pass (read as
    unsigned, a negative id of 32 bits or more exceeds ``MAX_TOKEN_ID``) where two would
    read a long prompt twice."""
    if array.dtype.kind == "u":
        return int(array.max())
    if array.dtype.itemsize >= 4:
        return int(array.view(array.dtype.str.replace("i", "u")).max())
    return int(array.max()) if int(array.min()) >= 0 else MAX_TOKEN_ID + 1


class Sequence:
    """One request: tokens, counters, block table, namespace, multimodal spans, routed experts."""

    def __init__(
        self,
        tokens: object,
        *,
        adapter: str | None = None,
        cache_salt: str | None = None,
        multimodal: SequenceLike[MultimodalSpan] = (),
        want_routed_experts: bool = False,
        seq_id: int | None = None,
    ) -> None:
        initial = _validated_tokens(tokens)  # copied into the buffer below, converted on the way
        self.namespace = BASE_NAMESPACE if adapter is None and cache_salt is None else Namespace(adapter, cache_salt)
        self.spans = validated_spans(multimodal, initial.size)
        self._span_starts = [span.start for span in self.spans]
        self.want_routed_experts = bool(want_routed_experts)
        self.seq_id = next(_ids) if seq_id is None else as_int("seq_id", seq_id)
        self._set_buffer(token_buffers.take(token_buffers.capacity_class(max(_INITIAL_CAPACITY, initial.size))))
        self._tokens[: initial.size] = initial
        self._num_tokens = int(initial.size)
        self._num_computed = 0
        self._blocks = np.full(8 + initial.size // 16, -1, dtype=np.int32)
        self._num_blocks = 0
        self._experts: np.ndarray | None = None
        self._num_experts = 0
        self.prefix_state = PrefixState()

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self._num_tokens}, computed={self._num_computed}, "
            f"blocks={self._num_blocks}, namespace={self.namespace})"
        )

    # --- tokens ------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Tokens known so far (prompt plus appended)."""
        return self._num_tokens

    @property
    def num_valid(self) -> int:
        """Tokens that may be cached; equal to ``num_tokens`` (no draft tokens are held here)."""
        return self._num_tokens

    @property
    def num_computed(self) -> int:
        """Tokens whose KV and recurrent state exist (the resume step)."""
        return self._num_computed

    @property
    def tokens(self) -> np.ndarray:
        """Read-only int32 view of every token."""
        return self.token_view(0, self._num_tokens)

    def token_view(self, start: int, end: int) -> np.ndarray:
        """Read-only view of tokens ``[start, end)``; it stays valid after later appends."""
        if type(start) is not int or type(end) is not int:  # the common call pays two checks
            start, end = _as_positions(start, end)
        if not 0 <= start <= end <= self._num_tokens:
            raise InvalidStepError(f"token range [{start}, {end}) outside [0, {self._num_tokens})")
        view = self._tokens[start:end]
        view.flags.writeable = False
        return view

    def __del__(self, _give=token_buffers.give) -> None:  # bound early: module teardown clears globals
        state = self.__dict__
        state.pop("_words", None)
        tokens = state.pop("_tokens", None)
        if tokens is not None:
            _give(tokens)

    def __getstate__(self) -> dict:  # the word view and the address are derived from the buffer
        state = self.__dict__.copy()
        del state["_words"], state["_tokens_address"]
        return state

    def __setstate__(self, state: dict) -> None:  # a copy's buffer lives elsewhere
        self.__dict__.update(state)
        tokens = self._tokens
        if tokens.size & 1:  # pickled by a version that allowed an odd-sized buffer
            tokens = np.concatenate([tokens, np.zeros(1, dtype=TOKEN_DTYPE)])
        self._set_buffer(tokens)

    def _set_buffer(self, tokens: np.ndarray) -> None:
        """Adopt ``tokens`` (an even-sized int32 buffer) and the views and address derived
        from it."""
        self._tokens = tokens
        self._tokens_address = tokens.ctypes.data
        self._words = tokens.view(_WORD_DTYPE)
        self._words.flags.writeable = False

    def token_words(self, start: int, end: int) -> np.ndarray:
        """Read-only view of tokens ``[start, end)`` packed in pairs into 64-bit words (block
        hashing); ``start`` and ``end`` are even."""
        if type(start) is not int or type(end) is not int:
            start, end = _as_positions(start, end)
        if not 0 <= start <= end <= self._num_tokens or (start | end) & 1:
            raise InvalidStepError(f"token words [{start}, {end}) outside [0, {self._num_tokens}) or odd")
        return self._words[start >> 1 : end >> 1]

    def token_address(self, start: int, end: int) -> int:
        """Memory address of token ``start`` for a native read of tokens ``[start, end)``
        (exact comparisons); valid until the next append."""
        if type(start) is not int or type(end) is not int:
            start, end = _as_positions(start, end)
        if not 0 <= start <= end <= self._num_tokens:
            raise InvalidStepError(f"token range [{start}, {end}) outside [0, {self._num_tokens})")
        return self._tokens_address + start * _TOKEN_BYTES

    def append_tokens(self, tokens: object) -> None:
        """Append generated or user tokens (validated int ids)."""
        new = as_token_array(tokens)
        needed = self._num_tokens + new.size
        if needed > self._tokens.size:
            grown = token_buffers.take(token_buffers.capacity_class(max(needed, 2 * self._tokens.size)))
            grown[: self._num_tokens] = self._tokens[: self._num_tokens]
            outgrown = self._tokens
            self._set_buffer(grown)
            token_buffers.give(outgrown)
        self._tokens[self._num_tokens : needed] = new
        self._num_tokens = needed

    def set_computed(self, step: int) -> None:
        """Move the resume step (forward after a forward or a hit, back on rollback).

        The routed-expert history is truncated to the new step: rows beyond it describe tokens
        that will be computed again.
        """
        if type(step) is not int:
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
                raise InvalidTypeError("step must be an int")
            step = int(step)
        if not 0 <= step <= self._num_tokens:
            raise InvalidStepError(f"step {step} outside [0, {self._num_tokens}]")
        self._num_computed = step
        if self._num_experts > step:
            self._num_experts = step

    # --- block table -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_table(self) -> np.ndarray:
        """Read-only view of the block ids held, by block index."""
        view = self._blocks[: self._num_blocks]
        view.flags.writeable = False
        return view

    def write_blocks(self, index: int, block_ids: object) -> np.ndarray:
        """Write ``block_ids`` at table positions ``[index, index + len)`` and return the ids
        they replaced (the caller owns dropping those references).

        Writing starts at or before the current end of the table: a table has no holes.
        """
        ids = as_block_ids(block_ids)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise InvalidTypeError("block index must be an int")
        if not 0 <= index <= self._num_blocks:
            raise InvalidBlockIdError(f"block index {index} outside [0, {self._num_blocks}]")
        return self.place_blocks(index, ids)

    def place_blocks(self, index: int, ids: np.ndarray) -> np.ndarray:
        """``write_blocks`` for ids that come from the block pool or the trie (a flat int32
        array): the same write without re-validating the ids."""
        num_blocks = self._num_blocks
        if index > num_blocks:
            raise InvalidBlockIdError(f"block index {index} beyond the table's {num_blocks} blocks")
        end = index + ids.size
        if end > self._blocks.size:
            grown = np.full(max(end, 2 * self._blocks.size), -1, dtype=np.int32)
            grown[:num_blocks] = self._blocks[:num_blocks]
            self._blocks = grown
        replaced = self._blocks[index : min(end, num_blocks)].copy() if index < num_blocks else np.empty(0, np.int32)
        self._blocks[index:end] = ids
        if end > num_blocks:
            self._num_blocks = end
        return replaced

    def truncate_blocks(self, count: int) -> np.ndarray:
        """Shorten the table to ``count`` blocks and return the removed ids (caller unrefs)."""
        count = as_int("count", count)
        if not 0 <= count <= self._num_blocks:
            raise InvalidBlockIdError(f"cannot truncate {self._num_blocks} blocks to {count}")
        removed = self._blocks[count : self._num_blocks].copy()
        self._blocks[count : self._num_blocks] = -1
        self._num_blocks = count
        return removed

    # --- multimodal ----------------------------------------------------------------------------

    def spans_overlapping(self, start: int, end: int) -> tuple[MultimodalSpan, ...]:
        """Spans with any position in ``[start, end)``, in canonical (start) order."""
        if not self.spans or end <= start:
            return ()
        first = max(0, bisect.bisect_right(self._span_starts, start) - 1)
        last = bisect.bisect_left(self._span_starts, end)
        return tuple(s for s in self.spans[first:last] if s.end > start and s.start < end)

    def is_boundary_safe(self, step: int) -> bool:
        """True when ``step`` is not strictly inside a multimodal span."""
        if not self.spans:
            return True
        index = bisect.bisect_left(self._span_starts, step) - 1
        return index < 0 or self.spans[index].end <= step

    def clamp_to_safe_block_boundary(self, step: int, block_size: int) -> int:
        """The deepest block boundary at or below ``step`` that is outside every span."""
        step = max(0, step - step % block_size)
        while step > 0 and not self.is_boundary_safe(step):
            index = bisect.bisect_left(self._span_starts, step) - 1
            start = self.spans[index].start
            step = start - start % block_size
        return step

    # --- routed experts ------------------------------------------------------------------------

    @property
    def num_routed_experts(self) -> int:
        """Tokens for which routed-expert rows are recorded (a prefix of the tokens)."""
        return self._num_experts

    @property
    def routed_experts(self) -> np.ndarray | None:
        """Read-only ``(tokens, width)`` routed-expert history, or None while it has no row."""
        if self._experts is None or self._num_experts == 0:
            return None
        view = self._experts[: self._num_experts]
        view.flags.writeable = False
        return view

    def append_routed_experts(self, rows: object) -> None:
        """Append routed-expert rows for the next tokens (one row per token, fixed width)."""
        self.place_routed_experts(self.checked_routed_experts(rows))

    def checked_routed_experts(self, rows: object) -> np.ndarray:
        """``rows`` as the 2-D integer array ``append_routed_experts`` would append, or the
        error it would raise; changes nothing (a caller that must check before it changes
        anything else)."""
        try:
            array = np.asarray(rows)
        except ValueError:  # ragged rows
            array = None
        if array is None or array.ndim != 2 or array.dtype.kind not in "iu":
            raise InvalidTypeError("routed experts must be a 2-D integer array (tokens, width)")
        if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_EXPERT_ID):
            raise InvalidArgumentError(f"expert ids must lie in [0, {MAX_EXPERT_ID}]")
        if self._experts is not None and array.shape[1] != self._experts.shape[1]:
            raise InvalidArgumentError("routed-expert row width changed")
        if self._num_experts + array.shape[0] > self._num_tokens:
            raise InvalidStepError("routed experts beyond the known tokens")
        return array

    def place_routed_experts(self, array: np.ndarray) -> None:
        """``append_routed_experts`` of rows ``checked_routed_experts`` returned."""
        needed = self._num_experts + array.shape[0]
        if self._experts is None or needed > self._experts.shape[0]:
            capacity = max(needed, 2 * (0 if self._experts is None else self._experts.shape[0]), 64)
            grown = np.zeros((capacity, array.shape[1]), dtype=EXPERT_DTYPE)
            if self._experts is not None:
                grown[: self._num_experts] = self._experts[: self._num_experts]
            self._experts = grown
        self._experts[self._num_experts : needed] = array
        self._num_experts = needed
