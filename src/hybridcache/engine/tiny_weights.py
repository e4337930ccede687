"""The tiny model's weights: their record types and how they are drawn from a seed.

Owns nothing mutable: every weight is drawn once, deterministically, from ``seed`` (and an
adapter's from its name alone), and never changed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from hybridcache.engine.tiny_config import TinyHybridConfig

# With a tied LM head, a residual stream dominated by the input embedding makes every token
# predict itself and greedy decoding sticks on one token, which would let engine bugs pass
# unnoticed. Damping the input and amplifying the mixer/expert outputs keeps the predictions
# context dependent: typical greedy runs of 40 tokens visit 20-30 distinct tokens.
INPUT_SCALE = 0.1
OUTPUT_GAIN = 2.0

# Projections are stored (out, in) so every product is ``torch.mv(weight, vector)``.


@dataclass(frozen=True)
class RecurrentWeights:
    in_proj: torch.Tensor  # (inner z + conv channels + ssm heads, hidden)
    conv_weight: torch.Tensor  # (conv_kernel, conv channels); the last row meets the newest input
    conv_bias: torch.Tensor
    dt_bias: torch.Tensor  # (ssm heads,)
    decay_rate: torch.Tensor  # A = -exp(A_log) with A_log = log U[1, 16], stored as A; (ssm heads,)
    skip: torch.Tensor  # D, (ssm heads, 1)
    out_proj: torch.Tensor  # (hidden, inner)


@dataclass(frozen=True)
class AttentionWeights:
    qkv_proj: torch.Tensor  # (3 * heads * head_dim, hidden)
    out_proj: torch.Tensor  # (hidden, heads * head_dim)


@dataclass(frozen=True)
class MoeWeights:
    router: torch.Tensor  # (experts, hidden)
    up: torch.Tensor  # (experts * expert hidden, hidden): expert e owns rows [e*W, (e+1)*W)
    down: torch.Tensor  # (hidden, experts * expert hidden): expert e owns the same columns


@dataclass(frozen=True)
class Layer:
    kind: str  # "R" or "A"
    index: int  # position among the layers of the same kind (its row in CacheTensors)
    mixer_norm: torch.Tensor
    mixer: RecurrentWeights | AttentionWeights
    ffn_norm: torch.Tensor
    moe: MoeWeights


@dataclass(frozen=True)
class AdapterLayer:
    down: torch.Tensor  # (rank, mixer output width)
    up: torch.Tensor  # (hidden, rank)


def seed_from(*parts: bytes) -> int:
    """A 63-bit generator seed from SHA-256 (stable across processes, unlike ``hash``)."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little") + part)
    return int.from_bytes(hasher.digest()[:8], "little") >> 1


class WeightDrawer:
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


def _draw_recurrent(config: TinyHybridConfig, draw: WeightDrawer) -> RecurrentWeights:
    hidden, inner, heads = config.hidden_size, config.ssm_inner_size, config.num_ssm_heads
    channels = config.conv_channels
    # dt starts in [1e-3, 1e-1] as in Mamba2; the bias is softplus^-1 of that draw.
    dt_init = torch.exp(draw.uniform(heads, low=math.log(1e-3), high=math.log(1e-1)))
    return RecurrentWeights(
        in_proj=draw.normal(inner + channels + heads, hidden, std=hidden**-0.5),
        conv_weight=draw.normal(config.conv_kernel, channels, std=config.conv_kernel**-0.5),
        conv_bias=draw.normal(channels, std=0.1),
        dt_bias=dt_init + torch.log(-torch.expm1(-dt_init)),
        decay_rate=-draw.uniform(heads, low=1.0, high=16.0),
        skip=draw.normal(heads, 1, std=0.5, mean=1.0),
        out_proj=draw.normal(hidden, inner, std=OUTPUT_GAIN * inner**-0.5),
    )


def _draw_attention(config: TinyHybridConfig, draw: WeightDrawer) -> AttentionWeights:
    hidden, width = config.hidden_size, config.attention_width
    qkv_proj = draw.normal(3 * width, hidden, std=hidden**-0.5)
    # Pre-scale the query rows by 1/sqrt(head_dim): the rotary embedding is a rotation, so this
    # equals scaling the scores and saves one op per attention step.
    qkv_proj[:width] *= config.attention_head_dim**-0.5
    return AttentionWeights(
        qkv_proj=qkv_proj,
        out_proj=draw.normal(hidden, width, std=OUTPUT_GAIN * width**-0.5),
    )


def _draw_moe(config: TinyHybridConfig, draw: WeightDrawer) -> MoeWeights:
    hidden, experts, width = config.hidden_size, config.num_experts, config.expert_hidden_size
    down = draw.normal(experts, hidden, width, std=OUTPUT_GAIN * width**-0.5)
    return MoeWeights(
        router=draw.normal(experts, hidden, std=hidden**-0.5),
        up=draw.normal(experts * width, hidden, std=hidden**-0.5),
        down=down.permute(1, 0, 2).reshape(hidden, experts * width).contiguous(),
    )


def draw_layers(config: TinyHybridConfig, draw: WeightDrawer) -> list[Layer]:
    layers, seen = [], {"R": 0, "A": 0}
    for kind in config.layer_pattern:
        mixer_norm = draw.normal(config.hidden_size, std=0.1, mean=1.0)
        mixer = _draw_recurrent(config, draw) if kind == "R" else _draw_attention(config, draw)
        ffn_norm = draw.normal(config.hidden_size, std=0.1, mean=1.0)
        layers.append(Layer(kind, seen[kind], mixer_norm, mixer, ffn_norm, _draw_moe(config, draw)))
        seen[kind] += 1
    return layers
