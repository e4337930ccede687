"""Deterministic token synthesis for block-hash traces, with continuation inference.

Owns, while one trace is synthesized (a ``_Synthesizer``): the block contents fixed so far that
differ from a hash id's default filler (the blocks a continuation wrote its history into), the
set of hash ids seen, and which earlier request ends each prompt of exactly ``d`` full blocks.
The result is immutable.

Rules (issue 13, item 1):

* A hash id's default content is ``block_tokens`` tokens drawn from ``[0, vocab_size)`` by a
  counter-based hash of ``(seed, id, offset)``: the same id always gives the same tokens, a
  partial last block takes a prefix of them. A request's output is drawn the same way from
  ``(seed, request index, position)``.
* Continuation (Mooncake: inferred). Let ``d`` be the number of B's leading hash ids seen in
  earlier requests. B continues A when ``d >= 2``, A's prompt has exactly ``d`` full blocks
  ending in B's block ``d - 1``, B has more than ``d`` blocks and
  ``0 <= B.input - (A.input + A.output) <= 4096``; of the earlier requests that satisfy all of
  this, A is the most recent. (Taking the most recent request with ``d`` full blocks first and
  testing the length window after finds 79 continuations in the first 2,000 requests of
  mooncake-synthetic instead of the calibration's 84: the calibration applied the window while
  choosing A.)
* Continuation (Qwen-Bailian: explicit). A is the request named by ``parent_chat_id``; the same
  structural conditions apply (``d >= 1``, A has exactly ``d`` full blocks, which are B's first
  ``d``, B has more blocks, ``B.input >= A.input + A.output``), without the 4096 cap.
* A continuation's first-seen blocks are written so that B's prompt starts with A's whole
  prompt and output; the rest of those blocks is its own id's filler. Their content is fixed
  at first sight: a later request with the same id sees the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.types import as_int
from hybridcache.workloads.records import MAX_BLOCK_TOKENS, Trace, TraceEntry, TraceRequest, frozen_array

DEFAULT_VOCAB = 32_000  # Llama-2's vocabulary, the tokenizer behind Marconi's traces
MAX_CONTINUATION_GAP = 4096  # tokens a new turn may add after the history it continues
MAX_SEED = 2**64 - 1  # the seed is added to a 64-bit stream constant, wrapping
_BLOCK_STREAM = np.uint64(0x9E3779B97F4A7C15)
_OUTPUT_STREAM = np.uint64(0xD1B54A32D192ED03)
_POSITION_BITS = np.uint64(MAX_BLOCK_TOKENS.bit_length() - 1)  # room for a block's positions inside one id's stream


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, element-wise on uint64 (wrapping arithmetic)."""
    values = values ^ (values >> np.uint64(30))
    values = values * np.uint64(0xBF58476D1CE4E5B9)
    values = values ^ (values >> np.uint64(27))
    values = values * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def _draw(stream: np.uint64, seed: int, keys: np.ndarray, length: int, vocab: int) -> np.ndarray:
    """``length`` tokens for each key: row ``i`` depends only on ``(stream, seed, keys[i])``."""
    salt = np.uint64((int(stream) + seed) % 2**64)  # wrapped in Python: NumPy warns on overflow
    base = (keys.astype(np.uint64) << _POSITION_BITS) ^ salt
    counters = base[:, None] + np.arange(length, dtype=np.uint64)[None, :]
    return (_mix(_mix(counters)) % np.uint64(vocab)).astype(np.int32)


@dataclass(frozen=True)
class SynthesisStats:
    """What synthesis decided: continuations found, explicit parents refused, and the
    continuation blocks that could not be written because their id was already fixed."""

    requests: int
    continuations: int
    parents_refused: int
    conflicting_blocks: int


@dataclass(frozen=True)
class SynthesizedTrace:
    trace: Trace
    requests: tuple[TraceRequest, ...]
    stats: SynthesisStats
    vocab_size: int


class _Synthesizer:
    def __init__(self, trace: Trace, vocab: int, seed: int) -> None:
        self.trace, self.vocab, self.seed = trace, vocab, seed
        self.block = trace.block_tokens
        self.fixed: dict[int, np.ndarray] = {}  # id -> its block when it differs from the filler
        self.seen: set[int] = set()
        self.ends_at: dict[tuple[int, int], list[int]] = {}  # (full blocks, last full id) -> requests
        self.by_chat: dict[int, int] = {}
        self.requests: list[TraceRequest] = []
        self.continuations = self.parents_refused = self.conflicts = 0

    def output_of(self, index: int, length: int) -> np.ndarray:
        return _draw(_OUTPUT_STREAM, self.seed, np.array([index]), length, self.vocab).reshape(-1)

    def blocks_of(self, ids: np.ndarray) -> np.ndarray:
        rows = _draw(_BLOCK_STREAM, self.seed, ids, self.block, self.vocab)
        if self.fixed:
            for row, block_id in enumerate(ids.tolist()):
                written = self.fixed.get(block_id)
                if written is not None:
                    rows[row] = written
        return rows

    def seen_prefix(self, ids: np.ndarray) -> int:
        count = 0
        for block_id in ids.tolist():
            if block_id not in self.seen:
                break
            count += 1
        return count

    def parent_for(self, entry: TraceEntry, seen: int) -> TraceRequest | None:
        ids = entry.hash_ids
        if entry.parent_chat_id is None:
            candidates = self.ends_at.get((seen, int(ids[seen - 1])), ()) if seen >= 2 else ()
            for index in reversed(candidates):  # the most recent one that fits
                if self._continues(entry, self.requests[index], seen, MAX_CONTINUATION_GAP):
                    return self.requests[index]
            return None
        index = self.by_chat.get(entry.parent_chat_id)
        if index is None or seen < 1 or not self._continues(entry, self.requests[index], seen, None):
            self.parents_refused += 1
            return None
        return self.requests[index]

    def _continues(self, entry: TraceEntry, parent: TraceRequest, seen: int, gap_cap: int | None) -> bool:
        parent_ids = self.trace.entries[parent.index].hash_ids
        if parent.prompt_length // self.block != seen or len(entry.hash_ids) <= seen:
            return False
        if not np.array_equal(parent_ids[:seen], entry.hash_ids[:seen]):
            return False
        gap = entry.input_length - parent.tokens.size
        return gap >= 0 and (gap_cap is None or gap <= gap_cap)

    def write_history(self, entry: TraceEntry, parent: TraceRequest, seen: int, rows: np.ndarray) -> None:
        """Write the parent's prompt and output into the request's first-seen blocks."""
        history = parent.tokens
        block = self.block
        for row in range(seen, -(-history.size // block)):
            block_id = int(entry.hash_ids[row])
            if block_id in self.seen:
                self.conflicts += 1  # fixed earlier: its tokens stay, the request diverges there
                continue
            first, last = row * block, min((row + 1) * block, history.size)
            rows[row, : last - first] = history[first:last]
            self.fixed[block_id] = frozen_array(rows[row], np.int32)

    def add(self, entry: TraceEntry) -> TraceRequest:
        index = len(self.requests)
        if entry.prompt is not None:
            prompt, parent = entry.prompt, None
        else:
            seen = self.seen_prefix(entry.hash_ids)
            parent = self.parent_for(entry, seen)
            rows = self.blocks_of(entry.hash_ids)
            if parent is not None:
                self.write_history(entry, parent, seen, rows)
                self.continuations += 1
            prompt = rows.reshape(-1)[: entry.input_length]
            self._remember(entry, index)
        output = entry.output if entry.output is not None else self.output_of(index, entry.output_length)
        tokens = frozen_array(np.concatenate([prompt, output]), np.int32)
        request = TraceRequest(index, entry.timestamp_ms, entry.input_length, tokens, None if parent is None else parent.index)
        self.requests.append(request)
        return request

    def _remember(self, entry: TraceEntry, index: int) -> None:
        self.seen.update(entry.hash_ids.tolist())
        full = entry.input_length // self.block
        if full:
            self.ends_at.setdefault((full, int(entry.hash_ids[full - 1])), []).append(index)
        if entry.chat_id is not None:
            self.by_chat[entry.chat_id] = index


def synthesize(trace: Trace, vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> SynthesizedTrace:
    """Turn a trace (its records checked themselves as they were built) into requests with
    tokens, in arrival order."""
    if not isinstance(trace, Trace):
        raise InvalidTypeError("trace must be a Trace (see read_trace)")
    vocab_size, seed = as_int("vocab_size", vocab_size, 2), as_int("seed", seed, 0)
    if vocab_size > 2**31:
        raise InvalidArgumentError("vocab_size must be at most 2**31 (int32 token ids)")
    if seed > MAX_SEED:
        raise InvalidArgumentError(f"seed must be at most 2**64 - 1, got {seed}")
    synthesizer = _Synthesizer(trace, vocab_size, seed)
    for entry in trace.entries:
        synthesizer.add(entry)
    stats = SynthesisStats(
        requests=len(synthesizer.requests),
        continuations=synthesizer.continuations,
        parents_refused=synthesizer.parents_refused,
        conflicting_blocks=synthesizer.conflicts,
    )
    return SynthesizedTrace(trace, tuple(synthesizer.requests), stats, vocab_size)
