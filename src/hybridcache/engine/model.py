"""A tiny random-weight hybrid language model (Mamba2-style recurrent + attention, MoE FFN).

Owns: its weights, fixed at construction from ``seed``, and a bounded memo of the low-rank adapter
weights derived from the adapter names used most recently (derived data, never changed once made).
Every KV entry and recurrent state lives in the caller's ``CacheTensors``; ``forward`` writes
the KV of the positions it computes and the state slot of each chunk, nothing else.

Exactness contract: each position runs through all layers on its own, with tensor shapes that
depend only on the position (matrix-vector products, attention over ``[0, p]``), and every
value a later position needs is read back from ``CacheTensors``. So how a sequence is split into
chunks, what else is in the batch, and whether earlier KV/state was computed now or copied in
from other blocks/slots cannot change a single bit of the logits, routed experts or tokens
(``forward`` pins torch to one intra-op thread, so the caller's thread setting does not matter).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hybridcache.engine.model_api import (
    ATTENTION,
    EXPERT_DTYPE,
    RECURRENT,
    ChunkOutput,
    ForwardChunk,
    LayerLayout,
    ModelLayout,
    TensorSpec,
)
from hybridcache.errors import (
    InvalidArgumentError,
    InvalidSpanError,
    InvalidTokenError,
    InvalidTypeError,
    SharedWriteError,
)

from hybridcache.types import as_optional_name

from hybridcache.engine.cache_tensors import CacheTensors
from hybridcache.engine.tiny_config import TinyHybridConfig, torch_dtype

ADAPTER_MEMO_SIZE = 64
_RMS_EPS = 1e-6
_ROPE_BASE = 10000.0
# With a tied LM head, a residual stream dominated by the input embedding makes every token
# predict itself and greedy decoding sticks on one token, which would let engine bugs pass
# unnoticed. Damping the input and amplifying the mixer/expert outputs keeps the predictions
# context dependent: typical greedy runs of 40 tokens visit 20-30 distinct tokens.
_INPUT_SCALE = 0.1
_OUTPUT_GAIN = 2.0


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    digest: bytes


@dataclass(frozen=True)
class _ChunkPlan:
    """A validated chunk in the types the hot loop uses."""

    tokens: list[int]
    start: int
    table: torch.Tensor  # int64 block ids covering [0, start + len)
    table_ids: list[int]  # the same ids as Python ints, for per-position lookups
    state_slot: int
    adapter: str | None
    spans: tuple[_Span, ...]
    replay: np.ndarray | None  # (len(tokens), routed_expert_width) forced expert ids, or None


# --- weights -----------------------------------------------------------------------------------
# Projections are stored (out, in) so every product is ``torch.mv(weight, vector)``.


@dataclass(frozen=True)
class _RecurrentWeights:
    in_proj: torch.Tensor  # (inner z + conv channels + ssm heads, hidden)
    conv_weight: torch.Tensor  # (conv_kernel, conv channels); the last row meets the newest input
    conv_bias: torch.Tensor
    dt_bias: torch.Tensor  # (ssm heads,)
    decay_rate: torch.Tensor  # A = -exp(A_log) with A_log = log U[1, 16], stored as A; (ssm heads,)
    skip: torch.Tensor  # D, (ssm heads, 1)
    out_proj: torch.Tensor  # (hidden, inner)


@dataclass(frozen=True)
class _AttentionWeights:
    qkv_proj: torch.Tensor  # (3 * heads * head_dim, hidden)
    out_proj: torch.Tensor  # (hidden, heads * head_dim)


@dataclass(frozen=True)
class _MoeWeights:
    router: torch.Tensor  # (experts, hidden)
    up: torch.Tensor  # (experts * expert hidden, hidden): expert e owns rows [e*W, (e+1)*W)
    down: torch.Tensor  # (hidden, experts * expert hidden): expert e owns the same columns


@dataclass(frozen=True)
class _Layer:
    kind: str  # "R" or "A"
    index: int  # position among the layers of the same kind (its row in CacheTensors)
    mixer_norm: torch.Tensor
    mixer: _RecurrentWeights | _AttentionWeights
    ffn_norm: torch.Tensor
    moe: _MoeWeights


@dataclass(frozen=True)
class _AdapterLayer:
    down: torch.Tensor  # (rank, mixer output width)
    up: torch.Tensor  # (hidden, rank)


def _seed_from(*parts: bytes) -> int:
    """A 63-bit generator seed from SHA-256 (stable across processes, unlike ``hash``)."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little") + part)
    return int.from_bytes(hasher.digest()[:8], "little") >> 1


class _WeightDrawer:
    """Draws float64 tensors from one generator in call order, then casts them to the model dtype."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._dtype = dtype

    def normal(self, *shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        draw = torch.randn(shape, generator=self._generator, dtype=torch.float64)
        return (draw * std + mean).to(self._dtype)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        draw = torch.rand(shape, generator=self._generator, dtype=torch.float64)
        return (low + (high - low) * draw).to(self._dtype)


def _draw_recurrent(config: TinyHybridConfig, draw: _WeightDrawer) -> _RecurrentWeights:
    hidden, inner, heads = config.hidden_size, config.ssm_inner_size, config.num_ssm_heads
    channels = config.conv_channels
    # dt starts in [1e-3, 1e-1] as in Mamba2; the bias is softplus^-1 of that draw.
    dt_init = torch.exp(draw.uniform(heads, low=math.log(1e-3), high=math.log(1e-1)))
    return _RecurrentWeights(
        in_proj=draw.normal(inner + channels + heads, hidden, std=hidden**-0.5),
        conv_weight=draw.normal(config.conv_kernel, channels, std=config.conv_kernel**-0.5),
        conv_bias=draw.normal(channels, std=0.1),
        dt_bias=dt_init + torch.log(-torch.expm1(-dt_init)),
        decay_rate=-draw.uniform(heads, low=1.0, high=16.0),
        skip=draw.normal(heads, 1, std=0.5, mean=1.0),
        out_proj=draw.normal(hidden, inner, std=_OUTPUT_GAIN * inner**-0.5),
    )


def _draw_attention(config: TinyHybridConfig, draw: _WeightDrawer) -> _AttentionWeights:
    hidden, width = config.hidden_size, config.attention_width
    qkv_proj = draw.normal(3 * width, hidden, std=hidden**-0.5)
    # Pre-scale the query rows by 1/sqrt(head_dim): the rotary embedding is a rotation, so this
    # equals scaling the scores and saves one op per attention step.
    qkv_proj[:width] *= config.attention_head_dim**-0.5
    return _AttentionWeights(
        qkv_proj=qkv_proj,
        out_proj=draw.normal(hidden, width, std=_OUTPUT_GAIN * width**-0.5),
    )


def _draw_moe(config: TinyHybridConfig, draw: _WeightDrawer) -> _MoeWeights:
    hidden, experts, width = config.hidden_size, config.num_experts, config.expert_hidden_size
    down = draw.normal(experts, hidden, width, std=_OUTPUT_GAIN * width**-0.5)
    return _MoeWeights(
        router=draw.normal(experts, hidden, std=hidden**-0.5),
        up=draw.normal(experts * width, hidden, std=hidden**-0.5),
        down=down.permute(1, 0, 2).reshape(hidden, experts * width).contiguous(),
    )


def _draw_layers(config: TinyHybridConfig, draw: _WeightDrawer) -> list[_Layer]:
    layers, seen = [], {"R": 0, "A": 0}
    for kind in config.layer_pattern:
        mixer_norm = draw.normal(config.hidden_size, std=0.1, mean=1.0)
        mixer = _draw_recurrent(config, draw) if kind == "R" else _draw_attention(config, draw)
        ffn_norm = draw.normal(config.hidden_size, std=0.1, mean=1.0)
        layers.append(_Layer(kind, seen[kind], mixer_norm, mixer, ffn_norm, _draw_moe(config, draw)))
        seen[kind] += 1
    return layers


# --- small numeric pieces ----------------------------------------------------------------------
# Tensors here are a few dozen elements, so each torch call costs ~1-2 us of dispatch. The helpers
# use few calls and avoid kernels that open an OpenMP region (torch.softmax, batched matmul),
# which cost milliseconds when the machine is busy.


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    inverse_rms = 1.0 / math.sqrt(float(x.dot(x)) / x.numel() + _RMS_EPS)
    return x * weight * inverse_rms


@contextlib.contextmanager
def _single_thread():
    """Run torch on one intra-op thread, restoring the caller's setting afterwards.

    Reductions over long attention rows are split across threads, and how they are split
    depends on the thread count; pinning one thread makes the bits independent of the caller's
    setting (so separate processes agree too). It is also faster: these tensors are far too
    small to pay for waking a thread pool.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    exp = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return exp / exp.sum(dim=dim, keepdim=True)


def _route(scores: list[float], k: int, forced: list[int] | None = None) -> tuple[list[int], list[float]]:
    """The ``k`` best experts (ties go to the lower id), or the ``forced`` ones when replaying,
    and their softmax weights over the chosen scores.

    Forced experts are put in the same best-first order before the weights are computed, so
    replaying the experts a run chose reproduces its weights bit for bit. Router scores are a
    handful of floats, so Python arithmetic is cheaper than torch calls.
    """
    candidates = range(len(scores)) if forced is None else forced
    chosen = sorted(candidates, key=lambda expert: (-scores[expert], expert))[:k]
    best = scores[chosen[0]]
    exps = [math.exp(scores[expert] - best) for expert in chosen]
    total = sum(exps)
    return chosen, [value / total for value in exps]


# --- validation --------------------------------------------------------------------------------


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    return value.__index__()


def _span_fields(span: object) -> tuple[object, object, object]:
    if hasattr(span, "content_id") and hasattr(span, "start") and hasattr(span, "end"):
        return span.start, span.end, span.content_id
    if not isinstance(span, tuple) or len(span) != 3:
        raise InvalidTypeError(f"multimodal span must be a (start, end, content) tuple, got {span!r}")
    return span


def _validated_spans(spans: object) -> tuple[_Span, ...]:
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Iterable):
        raise InvalidTypeError("multimodal must be a sequence of (start, end, content) tuples")
    result = []
    for span in spans:
        start, end, content = _span_fields(span)
        start, end = _as_int("span start", start), _as_int("span end", end)
        content = content.encode() if isinstance(content, str) else content
        if not isinstance(content, (bytes, bytearray)):
            raise InvalidTypeError("span content must be bytes or str")
        if start < 0 or end <= start:
            raise InvalidSpanError(f"span [{start}, {end}) is empty or negative")
        result.append(_Span(start, end, hashlib.sha256(content).digest()))
    result.sort(key=lambda s: s.start)
    for left, right in zip(result, result[1:]):
        if right.start < left.end:
            raise InvalidSpanError(f"spans starting at {left.start} and {right.start} overlap")
    return tuple(result)


def _validated_adapter(adapter: object) -> str | None:
    if adapter is not None and not isinstance(adapter, str):
        raise InvalidTypeError(f"adapter must be None or a str, got {type(adapter).__name__}")
    return as_optional_name("adapter", adapter)


def _validated_tokens(tokens: object, vocab_size: int) -> list[int]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise InvalidTypeError("token_ids must be a sequence of ints")
    result = [_as_int("token id", token) for token in tokens]
    if not result:
        raise InvalidArgumentError("a chunk needs at least one token")
    for token in result:
        if not 0 <= token < vocab_size:
            raise InvalidTokenError(f"token id {token} outside the vocabulary [0, {vocab_size})")
    return result


def _validated_table(block_table: object, end: int, cache: CacheTensors) -> np.ndarray:
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


def _validated_replays(replay: object, count: int) -> list[object]:
    """``replay_experts`` as one entry per chunk (all None when not replaying)."""
    if replay is None:
        return [None] * count
    if isinstance(replay, (str, bytes, np.ndarray)) or not isinstance(replay, Iterable):
        raise InvalidTypeError("replay_experts must be None or one entry per chunk")
    replays = list(replay)
    if len(replays) != count:
        raise InvalidArgumentError(f"{len(replays)} replay entries for {count} chunks")
    return replays


def _validated_expert_rows(rows: object, tokens: int, width: int) -> np.ndarray | None:
    """One chunk's replayed expert ids as a fresh ``(tokens, width)`` int64 array, or None."""
    if rows is None:
        return None
    array = np.array(rows)
    if array.dtype.kind not in "iu" or array.shape != (tokens, width):
        raise InvalidArgumentError(f"replayed experts must be ints shaped ({tokens}, {width})")
    return array.astype(np.int64)


def _check_writable(writes: set[int], writable: object) -> None:
    if writable is None:
        return
    if isinstance(writable, (str, bytes)) or not isinstance(writable, Iterable):
        raise InvalidTypeError("writable_blocks must be None or a set of block ids")
    foreign = writes - {_as_int("writable block", block) for block in writable}
    if foreign:
        raise SharedWriteError(f"chunk would write KV into blocks {sorted(foreign)} it does not own")


# --- the model ---------------------------------------------------------------------------------


def _tiny_layout(config: TinyHybridConfig, dtype: str) -> ModelLayout:
    """Per attention layer a post-rotary key and a value per token; per recurrent layer the
    last ``conv_kernel - 1`` conv inputs and the SSM state, all in the model dtype."""
    heads = (config.num_attention_heads, config.attention_head_dim)
    kv = (TensorSpec("keys", heads, dtype), TensorSpec("values", heads, dtype))
    ssm = TensorSpec("ssm", (config.num_ssm_heads, config.ssm_head_dim, config.ssm_state_size), dtype)
    # A kernel of 1 keeps no earlier conv inputs.
    conv = (TensorSpec("conv", (config.conv_kernel - 1, config.conv_channels), dtype),) if config.conv_kernel > 1 else ()
    state = (*conv, ssm)
    layers = tuple(
        LayerLayout(index, ATTENTION, kv=kv) if kind == "A" else LayerLayout(index, RECURRENT, state=state)
        for index, kind in enumerate(config.layer_pattern)
    )
    return ModelLayout(
        layers, config.vocab_size, config.routed_expert_width, serves_adapters=True, serves_multimodal=True
    )


class TinyHybridModel:
    """Random-weight hybrid LM whose cached and uncached runs agree bit for bit."""

    def __init__(self, config: TinyHybridConfig, *, seed: int = 0, dtype: str = "float64") -> None:
        if not isinstance(config, TinyHybridConfig):
            raise InvalidTypeError("config must be a TinyHybridConfig")
        self.config = config
        self.seed = _as_int("seed", seed)
        self.dtype_name = dtype
        self.dtype = torch_dtype(dtype)
        draw = _WeightDrawer(self.seed, self.dtype)
        self.embedding = draw.normal(config.vocab_size, config.hidden_size, std=1.0)
        self._input_embedding = self.embedding * _INPUT_SCALE
        self._layers = _draw_layers(config, draw)
        self._final_norm = draw.normal(config.hidden_size, std=0.1, mean=1.0)
        half = config.attention_head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) / half
        self._rope_inverse_frequency = (_ROPE_BASE**-exponents).to(self.dtype)
        self._rope_magnitude = torch.ones(half, dtype=self.dtype)
        self._adapters: OrderedDict[str, list[_AdapterLayer]] = OrderedDict()
        self._layout = _tiny_layout(config, dtype)

    # --- public ------------------------------------------------------------------------------

    @property
    def layout(self) -> ModelLayout:
        """The cached tensors per layer (``CacheTensors`` packs each attention layer's keys and
        values into one tensor; the layout names them apart)."""
        return self._layout

    def new_storage(self, *, num_blocks: int, block_size: int, num_state_slots: int) -> CacheTensors:
        return CacheTensors(
            self.config,
            num_blocks=num_blocks,
            block_size=block_size,
            num_state_slots=num_state_slots,
            dtype=self.dtype_name,
        )

    def forward(
        self,
        chunks: Sequence[ForwardChunk],
        cache: CacheTensors,
        *,
        replay_experts: Sequence[np.ndarray | None] | None = None,
    ) -> list[ChunkOutput]:
        """Run every chunk, writing its KV and final recurrent state into ``cache``.

        All chunks are validated before anything is written; an error leaves ``cache`` as it was.
        Chunks run one after another and share nothing, so batching never affects a result.
        ``replay_experts`` (one entry per chunk, ``None`` or ``(tokens, routed_expert_width)``
        expert ids) makes every MoE layer use the recorded experts instead of choosing; their
        weights are the softmax of the router's scores at those experts, so replaying what a
        run chose reproduces it bit for bit.
        """
        plans = self._validated_plans(chunks, cache, replay_experts)
        with torch.no_grad(), _single_thread():
            return [self._run_chunk(plan, cache) for plan in plans]

    # --- validation --------------------------------------------------------------------------

    def _validated_plans(self, chunks: object, cache: CacheTensors, replay: object) -> list[_ChunkPlan]:
        self._check_cache(cache)
        if isinstance(chunks, ForwardChunk) or not isinstance(chunks, Iterable):
            raise InvalidTypeError("chunks must be a list of ForwardChunk")
        chunks = list(chunks)
        replays = _validated_replays(replay, len(chunks))
        plans, slots = [], set()
        written, written_guarded = set(), set()
        for chunk, rows in zip(chunks, replays):
            if not isinstance(chunk, ForwardChunk):
                raise InvalidTypeError(f"chunks must hold ForwardChunk, got {type(chunk).__name__}")
            plan, chunk_writes = self._validated_plan(chunk, cache, rows)
            if self.config.num_recurrent_layers and plan.state_slot in slots:
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

    def _check_cache(self, cache: CacheTensors) -> None:
        if not isinstance(cache, CacheTensors):
            raise InvalidTypeError("cache must be a CacheTensors")
        if cache.config != self.config:
            raise InvalidArgumentError("cache was built for a different TinyHybridConfig")
        if cache.dtype != self.dtype:
            raise InvalidArgumentError(f"cache dtype {cache.dtype} differs from model dtype {self.dtype}")

    def _validated_plan(self, chunk: ForwardChunk, cache: CacheTensors, rows: object) -> tuple[_ChunkPlan, set[int]]:
        tokens = _validated_tokens(chunk.token_ids, self.config.vocab_size)
        start = _as_int("start", chunk.start)
        if start < 0:
            raise InvalidArgumentError(f"start must be >= 0, got {start}")
        end = start + len(tokens)
        table = _validated_table(chunk.block_table, end, cache)
        slot = _as_int("state_slot", chunk.state_slot)
        cache.check_slot(slot)
        # Row 0 is the pool's padding row; a sequence computing into it is an engine bug.
        if slot == 0 and self.config.num_recurrent_layers:
            raise InvalidArgumentError("state slot 0 is the reserved padding row")
        writes = set()
        if self.config.num_attention_layers:
            writes = set(table[start // cache.block_size :].tolist())
        _check_writable(writes, chunk.writable_blocks)
        plan = _ChunkPlan(
            tokens=tokens,
            start=start,
            table=torch.from_numpy(table),
            table_ids=table.tolist(),
            state_slot=slot,
            adapter=_validated_adapter(chunk.adapter),
            spans=_validated_spans(chunk.multimodal),
            replay=self._validated_replay(rows, len(tokens)),
        )
        return plan, writes

    def _validated_replay(self, rows: object, tokens: int) -> np.ndarray | None:
        """Forced experts must be distinct valid ids within each layer's ``experts_per_token``."""
        config = self.config
        replay = _validated_expert_rows(rows, tokens, config.routed_expert_width)
        if replay is None:
            return None
        if replay.size and (int(replay.min()) < 0 or int(replay.max()) >= config.num_experts):
            raise InvalidArgumentError(f"replayed expert ids must lie in [0, {config.num_experts})")
        per_layer = np.sort(replay.reshape(tokens, len(config.layer_pattern), config.experts_per_token), axis=2)
        if (per_layer[..., 1:] == per_layer[..., :-1]).any():
            raise InvalidArgumentError("replayed experts repeat an expert within one layer")
        return replay

    # --- one chunk ---------------------------------------------------------------------------

    def _run_chunk(self, plan: _ChunkPlan, cache: CacheTensors) -> ChunkOutput:
        """Positions one at a time; only the last position's hidden state reaches the LM head."""
        states = self._load_states(plan, cache)
        adapter = self._adapter_layers(plan.adapter) if plan.adapter is not None else None
        routed = np.empty((len(plan.tokens), self.config.routed_expert_width), dtype=EXPERT_DTYPE)
        hidden = None
        for offset, token in enumerate(plan.tokens):
            position = plan.start + offset
            hidden = self._embed(token, position, plan.spans)
            hidden = self._position_step(hidden, position, plan, states, adapter, cache, routed[offset])
        self._store_states(plan, cache, states)
        logits = torch.mv(self.embedding, _rms_norm(hidden, self._final_norm))
        return ChunkOutput(int(torch.argmax(logits)), routed, logits.numpy().copy())

    def _load_states(self, plan: _ChunkPlan, cache: CacheTensors) -> list[list[torch.Tensor]]:
        """Per recurrent layer ``[conv, ssm]`` working copies; zeros for a sequence's first chunk."""
        states = []
        for layer in range(self.config.num_recurrent_layers):
            conv, ssm = cache.read_state(layer, plan.state_slot)
            if plan.start == 0:
                # The state after 0 tokens is zero by definition, whatever the row held before.
                conv, ssm = torch.zeros_like(conv), torch.zeros_like(ssm)
            states.append([conv, ssm])
        return states

    @staticmethod
    def _store_states(plan: _ChunkPlan, cache: CacheTensors, states: list[list[torch.Tensor]]) -> None:
        for layer, (conv, ssm) in enumerate(states):
            cache.write_state(layer, plan.state_slot, conv, ssm)

    def _position_step(
        self,
        hidden: torch.Tensor,
        position: int,
        plan: _ChunkPlan,
        states: list[list[torch.Tensor]],
        adapter: list[_AdapterLayer] | None,
        cache: CacheTensors,
        routed_row: np.ndarray,
    ) -> torch.Tensor:
        """All layers for one position; fills ``routed_row`` with each layer's expert ids."""
        width = self.config.experts_per_token
        forced = None if plan.replay is None else plan.replay[position - plan.start].tolist()
        rotation = self._rotation(position) if self.config.num_attention_layers else None
        for layer_number, layer in enumerate(self._layers):
            mixer_in = _rms_norm(hidden, layer.mixer_norm)
            if layer.kind == "R":
                mixed = self._recurrent_step(layer.mixer, mixer_in, states[layer.index])
            else:
                mixed = self._attention_step(layer, mixer_in, position, rotation, plan, cache)
            hidden = hidden + self._mixer_output(layer, layer_number, mixed, adapter)
            columns = slice(layer_number * width, (layer_number + 1) * width)
            layer_forced = None if forced is None else forced[columns]
            ffn_out, experts = self._moe_step(layer.moe, _rms_norm(hidden, layer.ffn_norm), layer_forced)
            hidden = hidden + ffn_out
            routed_row[columns] = experts
        return hidden

    # --- per-position pieces -------------------------------------------------------------------

    def _embed(self, token: int, position: int, spans: tuple[_Span, ...]) -> torch.Tensor:
        for span in spans:
            if span.start <= position < span.end:
                return self._content_embedding(span, position - span.start) * _INPUT_SCALE
        return self._input_embedding[token]

    def _content_embedding(self, span: _Span, offset: int) -> torch.Tensor:
        """A placeholder's embedding: a function of the content bytes and the offset in the span only."""
        seed = _seed_from(b"multimodal", span.digest, offset.to_bytes(8, "little"))
        generator = torch.Generator().manual_seed(seed)
        draw = torch.randn(self.config.hidden_size, generator=generator, dtype=torch.float64)
        return draw.to(self.dtype)

    def _rotation(self, position: int) -> torch.Tensor:
        """Rotary embedding of ``position`` as unit complex numbers, one per pair of head dims."""
        return torch.polar(self._rope_magnitude, position * self._rope_inverse_frequency)

    def _recurrent_step(
        self, weights: _RecurrentWeights, x: torch.Tensor, state: list[torch.Tensor]
    ) -> torch.Tensor:
        """One Mamba2-style step; replaces ``state`` = ``[conv window, ssm state]`` with the new one."""
        config = self.config
        inner, channels, heads = config.ssm_inner_size, config.conv_channels, config.num_ssm_heads
        gate, conv_in, dt = torch.mv(weights.in_proj, x).split((inner, channels, heads))
        window = torch.cat((state[0], conv_in.unsqueeze(0)))
        conv_out = F.silu((window * weights.conv_weight).sum(dim=0) + weights.conv_bias)
        state[0] = window[1:]
        size = config.ssm_state_size
        xs, b, c = conv_out.split((inner, size, size))
        xs = xs.view(heads, config.ssm_head_dim)
        dt = F.softplus(dt + weights.dt_bias)
        decay = torch.exp(dt * weights.decay_rate)
        # h = decay * h + dt * (x outer B), per head
        ssm = torch.addcmul(state[1] * decay.view(heads, 1, 1), (xs * dt.view(heads, 1)).unsqueeze(2), b)
        state[1] = ssm
        y = torch.addcmul((ssm * c).sum(dim=-1), xs, weights.skip)
        return y.view(inner) * F.silu(gate)

    def _attention_step(
        self,
        layer: _Layer,
        x: torch.Tensor,
        position: int,
        rotation: torch.Tensor,
        plan: _ChunkPlan,
        cache: CacheTensors,
    ) -> torch.Tensor:
        heads, dim = self.config.num_attention_heads, self.config.attention_head_dim
        qkv = torch.mv(layer.mixer.qkv_proj, x).view(3, heads, dim)
        pairs = torch.view_as_complex(qkv[:2].view(2, heads, dim // 2, 2))
        query, key = torch.view_as_real(pairs * rotation).view(2, heads, dim)
        block_size = cache.block_size
        block = plan.table_ids[position // block_size]
        cache.write_kv(layer.index, block, position % block_size, torch.stack((key, qkv[2])))
        # Read the current position back from the cache too, so every key/value in the sum has
        # travelled the same path whether it was computed now or copied in from another block.
        keys, values = cache.read_kv(layer.index, plan.table[: position // block_size + 1], position + 1)
        scores = (keys * query).sum(dim=-1)
        probs = _softmax(scores, dim=0)
        return (probs.unsqueeze(2) * values).sum(dim=0).view(heads * dim)

    @staticmethod
    def _mixer_output(
        layer: _Layer, layer_number: int, mixed: torch.Tensor, adapter: list[_AdapterLayer] | None
    ) -> torch.Tensor:
        out = torch.mv(layer.mixer.out_proj, mixed)
        if adapter is not None:
            delta = adapter[layer_number]
            out = out + torch.mv(delta.up, torch.mv(delta.down, mixed))
        return out

    def _moe_step(
        self, moe: _MoeWeights, x: torch.Tensor, forced: list[int] | None
    ) -> tuple[torch.Tensor, list[int]]:
        """Top-k routing (or the ``forced`` experts) with softmax weights over the chosen k;
        returns the ids ascending.

        The experts run as one dense product whose unchosen experts get gate 0: their terms are
        exact zeros, so the result is the sparse top-k sum, in one fixed summation order.
        """
        chosen, weights = _route(torch.mv(moe.router, x).tolist(), self.config.experts_per_token, forced)
        gates = [0.0] * self.config.num_experts
        for expert, weight in zip(chosen, weights):
            gates[expert] = weight
        gates = torch.tensor(gates, dtype=self.dtype).unsqueeze(1)
        hidden = F.silu(torch.mv(moe.up, x)).view(self.config.num_experts, -1) * gates
        return torch.mv(moe.down, hidden.view(-1)), sorted(chosen)

    # --- adapters ----------------------------------------------------------------------------

    def _adapter_layers(self, name: str) -> list[_AdapterLayer]:
        """The adapter's weights, derived on first use; the memo keeps the most recently used
        ``ADAPTER_MEMO_SIZE`` (re-deriving one gives the very same bits)."""
        layers = self._adapters.get(name)
        if layers is None:
            layers = self._adapters[name] = self._derive_adapter(name)
            if len(self._adapters) > ADAPTER_MEMO_SIZE:
                self._adapters.popitem(last=False)
        else:
            self._adapters.move_to_end(name)
        return layers

    def _derive_adapter(self, name: str) -> list[_AdapterLayer]:
        """Low-rank mixer-output deltas seeded by ``sha256(name)`` alone (not the model seed)."""
        config = self.config
        draw = _WeightDrawer(_seed_from(b"adapter", name.encode()), self.dtype)
        layers = []
        for kind in config.layer_pattern:
            width = config.ssm_inner_size if kind == "R" else config.attention_width
            down = draw.normal(config.adapter_rank, width, std=width**-0.5)
            up = draw.normal(config.hidden_size, config.adapter_rank, std=config.adapter_rank**-0.5)
            layers.append(_AdapterLayer(down, up))
        return layers
