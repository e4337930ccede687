"""The tiny model's forward input checked as a whole and turned into ``ChunkPlan`` values, the
types its hot loop uses.

Owns nothing: every chunk of a forward is checked (tokens, table, state slot, writable blocks,
replayed experts; no two chunks sharing a state slot or a written block) before the model
writes anything, so a refused forward leaves the cache as it was. The per-field checks every
``PagedModel`` shares are ``chunk_checks``'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from hybridcache.engine.cache_tensors import CacheTensors
from hybridcache.engine.chunk_checks import (
    Span,
    as_index,
    check_writable,
    validated_adapter,
    validated_expert_rows,
    validated_replays,
    validated_spans,
    validated_table,
    validated_tokens,
)
from hybridcache.engine.model_api import ForwardChunk
from hybridcache.engine.tiny_config import TinyHybridConfig
from hybridcache.errors import InvalidArgumentError, InvalidTypeError, SharedWriteError


@dataclass(frozen=True)
class ChunkPlan:
    """A validated chunk in the types the hot loop uses."""

    tokens: list[int]
    start: int
    table: torch.Tensor  # int64 block ids covering [0, start + len)
    table_ids: list[int]  # the same ids as Python ints, for per-position lookups
    state_slot: int
    adapter: str | None
    spans: tuple[Span, ...]
    replay: np.ndarray | None  # (len(tokens), routed_expert_width) forced expert ids, or None


def validated_plans(
    config: TinyHybridConfig, dtype: torch.dtype, chunks: object, cache: CacheTensors, replay: object
) -> list[ChunkPlan]:
    """Every chunk of one forward of a model of ``config`` and ``dtype`` into ``cache``, with
    the experts to ``replay`` per chunk (or None), checked and planned."""
    _check_cache(config, dtype, cache)
    if isinstance(chunks, ForwardChunk) or not isinstance(chunks, Iterable):
        raise InvalidTypeError("chunks must be a list of ForwardChunk")
    chunks = list(chunks)
    replays = validated_replays(replay, len(chunks))
    plans, slots = [], set()
    written, written_guarded = set(), set()
    for chunk, rows in zip(chunks, replays):
        if not isinstance(chunk, ForwardChunk):
            raise InvalidTypeError(f"chunks must hold ForwardChunk, got {type(chunk).__name__}")
        plan, chunk_writes = _validated_plan(config, chunk, cache, rows)
        if config.num_recurrent_layers and plan.state_slot in slots:
            raise InvalidArgumentError(f"state slot {plan.state_slot} used by two chunks")
        # Two chunks writing one block means neither owns it exclusively. Like the per-chunk
        # guard, this check only runs for chunks that carry ``writable_blocks``.
        guarded = chunk.writable_blocks is not None
        clash = chunk_writes & (written if guarded else written_guarded)
        if clash:
            raise SharedWriteError(f"two chunks write KV into blocks {sorted(clash)}")
        slots.add(plan.state_slot)
        written |= chunk_writes
        if guarded:
            written_guarded |= chunk_writes
        plans.append(plan)
    return plans


def _check_cache(config: TinyHybridConfig, dtype: torch.dtype, cache: CacheTensors) -> None:
    if not isinstance(cache, CacheTensors):
        raise InvalidTypeError("cache must be a CacheTensors")
    if cache.config != config:
        raise InvalidArgumentError("cache was built for a different TinyHybridConfig")
    if cache.dtype != dtype:
        raise InvalidArgumentError(f"cache dtype {cache.dtype} differs from model dtype {dtype}")


def _validated_plan(
    config: TinyHybridConfig, chunk: ForwardChunk, cache: CacheTensors, rows: object
) -> tuple[ChunkPlan, set[int]]:
    tokens = validated_tokens(chunk.token_ids, config.vocab_size)
    start = as_index("start", chunk.start)
    if start < 0:
        raise InvalidArgumentError(f"start must be >= 0, got {start}")
    end = start + len(tokens)
    table = validated_table(chunk.block_table, end, cache)
    slot = as_index("state_slot", chunk.state_slot)
    cache.check_slot(slot)
    # Row 0 is the pool's padding row; a sequence computing into it is an engine bug.
    if slot == 0 and config.num_recurrent_layers:
        raise InvalidArgumentError("state slot 0 is the reserved padding row")
    writes = set()
    if config.num_attention_layers:
        writes = set(table[start // cache.block_size :].tolist())
    check_writable(writes, chunk.writable_blocks)
    plan = ChunkPlan(
        tokens=tokens,
        start=start,
        table=torch.from_numpy(table),
        table_ids=table.tolist(),
        state_slot=slot,
        adapter=validated_adapter(chunk.adapter),
        spans=validated_spans(chunk.multimodal),
        replay=_validated_replay(config, rows, len(tokens)),
    )
    return plan, writes


def _validated_replay(config: TinyHybridConfig, rows: object, tokens: int) -> np.ndarray | None:
    """Forced experts must be distinct valid ids within each layer's ``experts_per_token``."""
    replay = validated_expert_rows(rows, tokens, config.routed_expert_width)
    if replay is None:
        return None
    if replay.size and (int(replay.min()) < 0 or int(replay.max()) >= config.num_experts):
        raise InvalidArgumentError(f"replayed expert ids must lie in [0, {config.num_experts})")
    per_layer = np.sort(replay.reshape(tokens, len(config.layer_pattern), config.experts_per_token), axis=2)
    if (per_layer[..., 1:] == per_layer[..., :-1]).any():
        raise InvalidArgumentError("replayed experts repeat an expert within one layer")
    return replay
