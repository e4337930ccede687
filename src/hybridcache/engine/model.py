"""A tiny random-weight hybrid language model (Mamba2-style recurrent + attention, MoE FFN).

Owns: its weights, fixed at construction from ``seed``, and a bounded memo of the low-rank adapter
weights derived from the adapter names used most recently (derived data, never changed once made).
Every KV entry and recurrent state lives in the caller's ``CacheTensors``; ``forward`` writes
the KV of the positions it computes and the state slot of each chunk, nothing else, once every
chunk passed ``chunk_plans.validated_plans``.

Exactness contract: each position runs through all layers on its own, with tensor shapes that
depend only on the position (matrix-vector products, attention over ``[0, p]``), and every
value a later position needs is read back from ``CacheTensors``. So how a sequence is split into
chunks, what else is in the batch, and whether earlier KV/state was computed now or copied in
from other blocks/slots cannot change a single bit of the logits, routed experts or tokens
(``forward`` pins torch to one intra-op thread, so the caller's thread setting does not matter).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Sequence

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
from hybridcache.errors import InvalidTypeError

from hybridcache.engine.cache_tensors import CacheTensors
from hybridcache.engine.model_identity import identity_digest, library_versions
from hybridcache.engine.chunk_checks import Span, as_index
from hybridcache.engine.chunk_plans import ChunkPlan, validated_plans
from hybridcache.engine.tiny_config import TinyHybridConfig, torch_dtype
from hybridcache.engine.tiny_math import rms_norm, route, single_thread, softmax
from hybridcache.engine.tiny_weights import (
    INPUT_SCALE,
    AdapterLayer,
    Layer,
    MoeWeights,
    RecurrentWeights,
    WeightDrawer,
    draw_layers,
    seed_from,
)

ADAPTER_MEMO_SIZE = 64
_ROPE_BASE = 10000.0


@dataclass
class _ChunkRun:
    """One chunk in progress: its plan, the cache it reads and writes, the recurrent layers'
    working states, the adapter's weights (None: base model) and the experts each position routed to."""

    plan: ChunkPlan
    cache: CacheTensors
    states: list[list[torch.Tensor]]
    adapter: list[AdapterLayer] | None
    routed: np.ndarray  # (tokens, routed_expert_width)


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


def _dataclass_tensors(name: str, value: object):
    """The tensors among a weight record's fields (and its nested records'), named by path."""
    for item in fields(value):
        field_value = getattr(value, item.name)
        if isinstance(field_value, torch.Tensor):
            yield f"{name}.{item.name}", field_value
        elif is_dataclass(field_value):
            yield from _dataclass_tensors(f"{name}.{item.name}", field_value)


class TinyHybridModel:
    """Random-weight hybrid LM whose cached and uncached runs agree bit for bit."""

    def __init__(self, config: TinyHybridConfig, *, seed: int = 0, dtype: str = "float64") -> None:
        if not isinstance(config, TinyHybridConfig):
            raise InvalidTypeError("config must be a TinyHybridConfig")
        self.config = config
        self.seed = as_index("seed", seed)
        self.dtype_name = dtype
        self.dtype = torch_dtype(dtype)
        draw = WeightDrawer(self.seed, self.dtype)
        self.embedding = draw.normal(config.vocab_size, config.hidden_size, std=1.0)
        self._input_embedding = self.embedding * INPUT_SCALE
        self._layers = draw_layers(config, draw)
        self._final_norm = draw.normal(config.hidden_size, std=0.1, mean=1.0)
        half = config.attention_head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) / half
        self._rope_inverse_frequency = (_ROPE_BASE**-exponents).to(self.dtype)
        self._rope_magnitude = torch.ones(half, dtype=self.dtype)
        self._adapters: OrderedDict[str, list[AdapterLayer]] = OrderedDict()
        self._layout = _tiny_layout(config, dtype)

    # --- public ------------------------------------------------------------------------------

    @property
    def layout(self) -> ModelLayout:
        """The cached tensors per layer (``CacheTensors`` packs each attention layer's keys and
        values into one tensor; the layout names them apart)."""
        return self._layout

    def weights_identity(self) -> str:
        """The digest of everything this model computes with: its config (``experts_per_token``,
        ``adapter_rank`` and every other field), seed, dtype, each weight tensor and the library
        versions. Adapter weights are drawn from the adapter's name and this seed and config."""
        described = {"config": asdict(self.config), "seed": self.seed, "dtype": self.dtype_name}
        described["rope_base"] = _ROPE_BASE
        return identity_digest("tiny_hybrid", described, self._named_tensors(), library_versions())

    def _named_tensors(self):
        yield "embedding", self.embedding
        yield "final_norm", self._final_norm
        yield "rope_inverse_frequency", self._rope_inverse_frequency
        for position, layer in enumerate(self._layers):
            yield from _dataclass_tensors(f"layers[{position}]", layer)

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
        plans = validated_plans(self.config, self.dtype, chunks, cache, replay_experts)
        with torch.no_grad(), single_thread():
            return [self._run_chunk(plan, cache) for plan in plans]

    # --- one chunk ---------------------------------------------------------------------------

    def _run_chunk(self, plan: ChunkPlan, cache: CacheTensors) -> ChunkOutput:
        """Positions one at a time; only the last position's hidden state reaches the LM head."""
        run = _ChunkRun(
            plan=plan,
            cache=cache,
            states=self._load_states(plan, cache),
            adapter=self._adapter_layers(plan.adapter) if plan.adapter is not None else None,
            routed=np.empty((len(plan.tokens), self.config.routed_expert_width), dtype=EXPERT_DTYPE),
        )
        hidden = None
        for offset, token in enumerate(plan.tokens):
            position = plan.start + offset
            hidden = self._embed(token, position, plan.spans)
            hidden = self._position_step(hidden, position, run)
        self._store_states(plan, cache, run.states)
        logits = torch.mv(self.embedding, rms_norm(hidden, self._final_norm))
        return ChunkOutput(int(torch.argmax(logits)), run.routed, logits.numpy().copy())

    def _load_states(self, plan: ChunkPlan, cache: CacheTensors) -> list[list[torch.Tensor]]:
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
    def _store_states(plan: ChunkPlan, cache: CacheTensors, states: list[list[torch.Tensor]]) -> None:
        for layer, (conv, ssm) in enumerate(states):
            cache.write_state(layer, plan.state_slot, conv, ssm)

    def _position_step(self, hidden: torch.Tensor, position: int, run: _ChunkRun) -> torch.Tensor:
        """All layers for one position; fills its row of ``run.routed`` with each layer's expert ids."""
        plan = run.plan
        width = self.config.experts_per_token
        forced = None if plan.replay is None else plan.replay[position - plan.start].tolist()
        routed_row = run.routed[position - plan.start]
        rotation = self._rotation(position) if self.config.num_attention_layers else None
        for layer_number, layer in enumerate(self._layers):
            mixer_in = rms_norm(hidden, layer.mixer_norm)
            if layer.kind == "R":
                mixed = self._recurrent_step(layer.mixer, mixer_in, run.states[layer.index])
            else:
                mixed = self._attention_step(layer, mixer_in, position, rotation, run)
            hidden = hidden + self._mixer_output(layer, layer_number, mixed, run.adapter)
            columns = slice(layer_number * width, (layer_number + 1) * width)
            layer_forced = None if forced is None else forced[columns]
            ffn_out, experts = self._moe_step(layer.moe, rms_norm(hidden, layer.ffn_norm), layer_forced)
            hidden = hidden + ffn_out
            routed_row[columns] = experts
        return hidden

    # --- per-position pieces -------------------------------------------------------------------

    def _embed(self, token: int, position: int, spans: tuple[Span, ...]) -> torch.Tensor:
        for span in spans:
            if span.start <= position < span.end:
                return self._content_embedding(span, position - span.start) * INPUT_SCALE
        return self._input_embedding[token]

    def _content_embedding(self, span: Span, offset: int) -> torch.Tensor:
        """A placeholder's embedding: a function of the content bytes and the offset in the span only."""
        seed = seed_from(b"multimodal", span.digest, offset.to_bytes(8, "little"))
        generator = torch.Generator().manual_seed(seed)
        draw = torch.randn(self.config.hidden_size, generator=generator, dtype=torch.float64)
        return draw.to(self.dtype)

    def _rotation(self, position: int) -> torch.Tensor:
        """Rotary embedding of ``position`` as unit complex numbers, one per pair of head dims."""
        return torch.polar(self._rope_magnitude, position * self._rope_inverse_frequency)

    def _recurrent_step(
        self, weights: RecurrentWeights, x: torch.Tensor, state: list[torch.Tensor]
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
        self, layer: Layer, x: torch.Tensor, position: int, rotation: torch.Tensor, run: _ChunkRun
    ) -> torch.Tensor:
        plan, cache = run.plan, run.cache
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
        probs = softmax(scores, dim=0)
        return (probs.unsqueeze(2) * values).sum(dim=0).view(heads * dim)

    @staticmethod
    def _mixer_output(
        layer: Layer, layer_number: int, mixed: torch.Tensor, adapter: list[AdapterLayer] | None
    ) -> torch.Tensor:
        out = torch.mv(layer.mixer.out_proj, mixed)
        if adapter is not None:
            delta = adapter[layer_number]
            out = out + torch.mv(delta.up, torch.mv(delta.down, mixed))
        return out

    def _moe_step(
        self, moe: MoeWeights, x: torch.Tensor, forced: list[int] | None
    ) -> tuple[torch.Tensor, list[int]]:
        """Top-k routing (or the ``forced`` experts) with softmax weights over the chosen k;
        returns the ids ascending.

        The experts run as one dense product whose unchosen experts get gate 0: their terms are
        exact zeros, so the result is the sparse top-k sum, in one fixed summation order.
        """
        chosen, weights = route(torch.mv(moe.router, x).tolist(), self.config.experts_per_token, forced)
        gates = [0.0] * self.config.num_experts
        for expert, weight in zip(chosen, weights):
            gates[expert] = weight
        gates = torch.tensor(gates, dtype=self.dtype).unsqueeze(1)
        hidden = F.silu(torch.mv(moe.up, x)).view(self.config.num_experts, -1) * gates
        return torch.mv(moe.down, hidden.view(-1)), sorted(chosen)

    # --- adapters ----------------------------------------------------------------------------

    def _adapter_layers(self, name: str) -> list[AdapterLayer]:
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

    def _derive_adapter(self, name: str) -> list[AdapterLayer]:
        """Low-rank mixer-output deltas seeded by ``sha256(name)`` alone (not the model seed)."""
        config = self.config
        draw = WeightDrawer(seed_from(b"adapter", name.encode()), self.dtype)
        layers = []
        for kind in config.layer_pattern:
            width = config.ssm_inner_size if kind == "R" else config.attention_width
            down = draw.normal(config.adapter_rank, width, std=width**-0.5)
            up = draw.normal(config.hidden_size, config.adapter_rank, std=config.adapter_rank**-0.5)
            layers.append(AdapterLayer(down, up))
        return layers
