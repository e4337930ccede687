"""Model profiles: what caching a token or a state costs in bytes, and what recomputing it costs
in FLOPs, for hybrid attention / state-space models.

Owns no mutable state: profiles are frozen and the built-in configs are read-only mappings.

A profile is computed from a model config in the transformers ``config.json`` schema (a path,
or one of the built-in configs below, which are the published models' values). Formulas (per
token unless noted; ``b`` = bytes of the cache dtype; FLOPs count a multiply-add as 2):

* KV bytes per token = sum over attention layers of ``2 * kv_heads * head_dim * b``.
* State bytes per checkpoint = sum over recurrent layers of the recurrent state plus the
  convolution window the next token needs (``d_conv - 1`` columns):
  Mamba2 ``heads * head_dim * d_state * b_ssm + (d_inner + 2 * groups * d_state) * (d_conv - 1) * b``;
  Mamba1 ``d_inner * d_state * b_ssm + d_inner * (d_conv - 1) * b``;
  Gated DeltaNet ``v_heads * k_dim * v_dim * b + (2 * k_heads * k_dim + v_heads * v_dim) * (kernel - 1) * b``.
* Linear FLOPs = 2 * (weights a token multiplies): attention projections, MLP or the active
  experts (top-k routed + shared + router), recurrent in/out projections, convolutions.
  The LM head is left out: a prefill computes logits for its last token only.
* Attention FLOPs of a token at position ``t`` (0-based) = ``4 * heads * head_dim * (t + 1)``
  per attention layer (QK^T and AV over ``t + 1`` keys): prefilling ``[a, b)`` costs the
  coefficient times ``(b (b + 1) - a (a + 1)) / 2``.
* Recurrent FLOPs: Mamba scan ``5 * d_inner * d_state`` (decay, input outer product, readout);
  Gated DeltaNet ``7 * v_heads * k_dim * v_dim`` (decay, delta correction, rank-1 update, readout).

The file sits at the package top rather than under ``workloads`` because the checkpoint
policies (FLOPs saved per byte) are library components that need profiles, and the library
core must not depend on the trace readers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from types import MappingProxyType

from hybridcache.errors import InvalidArgumentError, InvalidConfigError
from hybridcache.files import MAX_CONFIG_BYTES, read_bounded
from hybridcache.profile_configs import BUILTIN_CONFIGS

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelProfile:
    name: str
    kv_bytes_per_token: int
    state_bytes: int  # one checkpoint of every recurrent layer's state
    linear_flops_per_token: float
    recurrent_flops_per_token: float
    attention_flops_coefficient: float  # a token at position t costs coefficient * (t + 1)
    attention_layers: int
    recurrent_layers: int

    def __post_init__(self) -> None:
        """Budgets divide by both sizes; FLOPs must be finite and non-negative."""
        for field in ("kv_bytes_per_token", "state_bytes", "attention_layers", "recurrent_layers"):
            value, minimum = getattr(self, field), 0 if field.endswith("layers") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidConfigError(f"ModelProfile.{field} must be an int >= {minimum}, got {value!r}")
        for field in ("linear_flops_per_token", "recurrent_flops_per_token", "attention_flops_coefficient"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise InvalidConfigError(f"ModelProfile.{field} must be a finite number >= 0, got {value!r}")

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to prefill positions ``[start, end)`` with ``[0, start)`` already cached."""
        if isinstance(start, bool) or isinstance(end, bool) or not 0 <= start <= end:
            raise InvalidArgumentError(f"need 0 <= start <= end, got [{start}, {end})")
        tokens = end - start
        quadratic = (end * (end + 1) - start * (start + 1)) / 2
        per_token = self.linear_flops_per_token + self.recurrent_flops_per_token
        return tokens * per_token + self.attention_flops_coefficient * quadratic

    @property
    def state_tokens_equivalent(self) -> float:
        """How many tokens of KV one checkpoint weighs."""
        return self.state_bytes / self.kv_bytes_per_token


@dataclass
class _Totals:
    kv_bytes: int = 0
    state_bytes: int = 0
    linear_params: int = 0
    conv_flops: int = 0
    recurrent_flops: int = 0
    attention_coefficient: int = 0
    attention_layers: int = 0
    recurrent_layers: int = 0

    def profile(self, name: str) -> ModelProfile:
        return ModelProfile(
            name=name,
            kv_bytes_per_token=self.kv_bytes,
            state_bytes=self.state_bytes,
            linear_flops_per_token=float(2 * self.linear_params + self.conv_flops),
            recurrent_flops_per_token=float(self.recurrent_flops),
            attention_flops_coefficient=float(self.attention_coefficient),
            attention_layers=self.attention_layers,
            recurrent_layers=self.recurrent_layers,
        )


# --- config fields ----------------------------------------------------------------------------

_MAX_DIMENSION = 2**24  # widths, heads, states, experts: far above any published model
_MAX_LAYERS = 4096


class _Fields:
    """A model config whose fields are checked as the formulas read them: every count or width
    is an int (not a bool) in ``[minimum, 2**24]``, every layer list a list of known kinds. A
    bad field raises ``InvalidConfigError`` naming it."""

    def __init__(self, config: dict, model_type: str) -> None:
        self.config, self.model_type = config, model_type

    def int(self, name: str, minimum: int = 1, maximum: int = _MAX_DIMENSION) -> int:
        if name not in self.config:
            raise InvalidConfigError(f"{self.model_type} config lacks {name!r}")
        return self._checked(name, self.config[name], minimum, maximum)

    def optional_int(self, name: str) -> int | None:
        value = self.config.get(name)
        return None if value is None else self._checked(name, value, 1, _MAX_DIMENSION)

    def _checked(self, name: str, value: object, minimum: int, maximum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise InvalidConfigError(
                f"{self.model_type} config: {name} must be an int in [{minimum}, {maximum:,}], got {value!r}"
            )
        return value

    def kinds(self, name: str, allowed: Mapping[str, str], letters: bool = False) -> list[str]:
        """The layer kinds listed in ``name`` (a list, or with ``letters`` a string of one-letter
        kinds), each mapped through ``allowed``."""
        if name not in self.config:
            raise InvalidConfigError(f"{self.model_type} config lacks {name!r}")
        listed = self.config[name]
        if not isinstance(listed, (list, str) if letters else list) or not 1 <= len(listed) <= _MAX_LAYERS:
            raise InvalidConfigError(
                f"{self.model_type} config: {name} must list 1 to {_MAX_LAYERS} layer kinds, got {_shown(listed)}"
            )
        unknown = [kind for kind in listed if not isinstance(kind, str) or kind not in allowed]
        if unknown:
            raise InvalidConfigError(
                f"{self.model_type} config: {name} holds unknown layer kinds {_shown(unknown[:3])}; known: {', '.join(allowed)}"
            )
        self._check_layer_count(name, len(listed))
        return [allowed[kind] for kind in listed]

    def _check_layer_count(self, name: str, listed: int) -> None:
        """A layer list must name every layer: transformers builds ``num_hidden_layers`` of them,
        so a shorter or longer list would size some other model."""
        if "num_hidden_layers" not in self.config:
            return
        layers = self.int("num_hidden_layers", 1, _MAX_LAYERS)
        if layers != listed:
            raise InvalidConfigError(
                f"{self.model_type} config: {name} lists {listed} layer kinds but num_hidden_layers is {layers}"
            )

    def dtype_bytes(self, name: str, default: str | None) -> int:
        dtype = self.config.get(name) or default
        if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
            raise InvalidConfigError(f"unsupported dtype {_shown(dtype)} ({name})")
        return _DTYPE_BYTES[dtype]

    def with_field(self, name: str, value: object) -> "_Fields":
        return _Fields({**self.config, name: value}, self.model_type)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- layer formulas ------------------------------------------------------------------------


def _attention(totals: _Totals, cfg: _Fields, q_gate: bool = False) -> None:
    hidden, heads, kv_heads = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_key_value_heads")
    head_dim = cfg.optional_int("head_dim") or hidden // heads
    if head_dim < 1:
        raise InvalidConfigError(f"{cfg.model_type} config: hidden_size {hidden} < num_attention_heads {heads}")
    totals.kv_bytes += 2 * kv_heads * head_dim * _bytes(cfg)
    q_out = heads * head_dim * (2 if q_gate else 1)  # Qwen3-Next's gated attention doubles q_proj
    totals.linear_params += hidden * (q_out + 2 * kv_heads * head_dim) + heads * head_dim * hidden
    totals.attention_coefficient += 4 * heads * head_dim
    totals.attention_layers += 1


def _mamba2(totals: _Totals, cfg: _Fields, geometry: tuple[int, int, int, int, int]) -> None:
    heads, head_dim, d_state, groups, d_conv = geometry
    hidden, d_inner = cfg.int("hidden_size"), heads * head_dim
    conv_dim = d_inner + 2 * groups * d_state
    totals.state_bytes += heads * head_dim * d_state * _ssm_bytes(cfg) + conv_dim * (d_conv - 1) * _bytes(cfg)
    totals.linear_params += hidden * (2 * d_inner + 2 * groups * d_state + heads) + d_inner * hidden
    totals.conv_flops += 2 * conv_dim * d_conv
    totals.recurrent_flops += 5 * d_inner * d_state
    totals.recurrent_layers += 1


def _mamba1(totals: _Totals, cfg: _Fields) -> None:
    hidden, d_state, d_conv = cfg.int("hidden_size"), cfg.int("mamba_d_state"), cfg.int("mamba_d_conv")
    d_inner, dt_rank = cfg.int("mamba_expand") * hidden, cfg.int("mamba_dt_rank")
    totals.state_bytes += d_inner * d_state * _ssm_bytes(cfg) + d_inner * (d_conv - 1) * _bytes(cfg)
    totals.linear_params += hidden * 2 * d_inner + d_inner * (dt_rank + 2 * d_state) + dt_rank * d_inner + d_inner * hidden
    totals.conv_flops += 2 * d_inner * d_conv
    totals.recurrent_flops += 5 * d_inner * d_state
    totals.recurrent_layers += 1


def _gated_delta(totals: _Totals, cfg: _Fields) -> None:
    hidden, kernel = cfg.int("hidden_size"), cfg.int("linear_conv_kernel_dim")
    k_heads, v_heads = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
    k_dim, v_dim = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    totals.state_bytes += v_heads * k_dim * v_dim * _ssm_bytes(cfg) + conv_dim * (kernel - 1) * _bytes(cfg)
    totals.linear_params += hidden * (conv_dim + v_heads * v_dim + 2 * v_heads) + v_heads * v_dim * hidden
    totals.conv_flops += 2 * conv_dim * kernel
    totals.recurrent_flops += 7 * v_heads * k_dim * v_dim
    totals.recurrent_layers += 1


def _mlp(totals: _Totals, hidden: int, intermediate: int, gated: bool = True) -> None:
    totals.linear_params += (3 if gated else 2) * hidden * intermediate


def _moe(totals: _Totals, hidden: int, experts: tuple[int, int, int], shared: int) -> None:
    count, top_k, intermediate = experts
    if top_k > count:
        raise InvalidConfigError(f"a MoE layer routes to {top_k} of only {count} experts")
    totals.linear_params += hidden * count + top_k * 3 * hidden * intermediate + 3 * hidden * shared


def _bytes(cfg: _Fields) -> int:
    return cfg.dtype_bytes("dtype", cfg.config.get("torch_dtype") or "bfloat16")


def _ssm_bytes(cfg: _Fields) -> int:
    return _bytes(cfg) if cfg.config.get("mamba_ssm_cache_dtype") is None else cfg.dtype_bytes("mamba_ssm_cache_dtype", None)


# --- architectures -------------------------------------------------------------------------


def _qwen3_next(cfg: _Fields) -> _Totals:
    """Qwen3-Next and Qwen3.5 (``qwen3_5_text`` dense, ``qwen3_5_moe_text`` with experts):
    gated attention and Gated DeltaNet layers."""
    totals, hidden = _Totals(), cfg.int("hidden_size")
    dense = cfg.model_type == "qwen3_5_text"
    if not dense:
        experts = (cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size"))
        shared = cfg.int("shared_expert_intermediate_size", 0)
    for kind in _qwen_layer_kinds(cfg):
        if kind == "attention":
            _attention(totals, cfg, q_gate=True)
        else:
            _gated_delta(totals, cfg)
        if dense:
            _mlp(totals, hidden, cfg.int("intermediate_size"))
        else:
            _moe(totals, hidden, experts, shared)
    return totals


def _qwen_layer_kinds(cfg: _Fields) -> list[str]:
    """``layer_types``, or without it every ``full_attention_interval``-th layer attention (as
    transformers fills them in)."""
    if "layer_types" in cfg.config or "full_attention_interval" not in cfg.config:
        return cfg.kinds("layer_types", {"full_attention": "attention", "linear_attention": "linear"})
    interval = cfg.int("full_attention_interval", 1, _MAX_LAYERS)
    layers = cfg.int("num_hidden_layers", 1, _MAX_LAYERS)
    return ["attention" if (layer + 1) % interval == 0 else "linear" for layer in range(layers)]


def _layers_at(cfg: _Fields, name: str, indices: object, base: int = 0) -> set[int]:
    """The 0-based layers a config lists by index (``base``: the first index it uses)."""
    layers = cfg.int("num_hidden_layers", 1, _MAX_LAYERS)
    if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in indices) \
            or not all(base <= i < layers + base for i in indices):
        raise InvalidConfigError(
            f"{cfg.model_type} config: {name} must list layer indices in [{base}, {layers + base}), got {_shown(indices)}"
        )
    return {i - base for i in indices}


def _short_conv(totals: _Totals, cfg: _Fields) -> None:
    """LFM2's gated short convolution: in projection to B, C, x; a depthwise causal
    convolution of ``conv_L_cache`` taps; out projection. Its state is the window alone."""
    hidden, kernel = cfg.int("hidden_size"), cfg.int("conv_L_cache")
    totals.state_bytes += hidden * (kernel - 1) * _bytes(cfg)
    totals.linear_params += 3 * hidden * hidden + hidden * hidden
    totals.conv_flops += 2 * hidden * kernel + 2 * hidden  # the taps, and the two gates
    totals.recurrent_layers += 1


def _lfm2_ffn(cfg: _Fields) -> int:
    """The feed-forward width LFM2 builds from ``intermediate_size`` (its auto-adjust rule)."""
    width = cfg.int("intermediate_size")
    if cfg.config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = cfg.config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or not 0 < multiplier <= 64:
                raise InvalidConfigError(f"{cfg.model_type} config: block_ffn_dim_multiplier must be in (0, 64], got {multiplier!r}")
            multiple = cfg.int("block_multiple_of") if "block_multiple_of" in cfg.config else 256
            width = multiple * -(-int(multiplier * width) // multiple)
    return max(1, width)


def _lfm2(cfg: _Fields) -> _Totals:
    """LFM2 (``lfm2``) and LFM2-MoE (``lfm2_moe``: its first ``num_dense_layers`` dense)."""
    totals, hidden = _Totals(), cfg.int("hidden_size")
    if "layer_types" in cfg.config:
        kinds = cfg.kinds("layer_types", {"conv": "conv", "full_attention": "attention"})
    else:
        attention = _layers_at(cfg, "full_attn_idxs", cfg.config.get("full_attn_idxs"))
        kinds = ["attention" if layer in attention else "conv" for layer in range(cfg.int("num_hidden_layers", 1, _MAX_LAYERS))]
    moe = cfg.model_type == "lfm2_moe"
    dense_layers = cfg.int("num_dense_layers", 0, _MAX_LAYERS) if moe else len(kinds)
    for layer, kind in enumerate(kinds):
        if kind == "attention":
            _attention(totals, cfg)
        else:
            _short_conv(totals, cfg)
        if layer < dense_layers:
            _mlp(totals, hidden, cfg.int("intermediate_size") if moe else _lfm2_ffn(cfg))
        else:
            _moe(totals, hidden, (cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size")), 0)
    return totals


def _first_int(cfg: _Fields, names: tuple[str, ...], minimum: int = 1) -> int:
    """The first of ``names`` the config holds (published checkpoints and transformers name
    some fields differently)."""
    for name in names:
        if name in cfg.config:
            return cfg.int(name, minimum)
    raise InvalidConfigError(f"{cfg.model_type} config lacks {' or '.join(repr(name) for name in names)}")


def _latent_attention(totals: _Totals, cfg: _Fields) -> None:
    """Multi-head latent attention (Kimi-Linear, DeepSeek-V3): a serving engine caches the
    compressed latent and the rotary key per token, ``kv_lora_rank + qk_rope_head_dim``."""
    hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
    rank, rope, nope, value = (cfg.int(name) for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    q_rank = cfg.optional_int("q_lora_rank")
    query = heads * (nope + rope)
    totals.kv_bytes += (rank + rope) * _bytes(cfg)
    totals.linear_params += (hidden * query if q_rank is None else hidden * q_rank + q_rank * query)
    totals.linear_params += hidden * (rank + rope) + rank * heads * (nope + value) + heads * value * hidden
    totals.attention_coefficient += 2 * heads * (nope + rope) + 2 * heads * value
    totals.attention_layers += 1


def _delta_attention(totals: _Totals, cfg: _Fields, heads: int, dim: int, kernel: int) -> None:
    """Kimi Delta Attention: q, k, v with short convolutions, low-rank forget and output gates,
    a per-head ``dim x dim`` state."""
    hidden, width = cfg.int("hidden_size"), heads * dim
    totals.state_bytes += heads * dim * dim * _ssm_bytes(cfg) + 3 * width * (kernel - 1) * _bytes(cfg)
    totals.linear_params += 3 * hidden * width + 2 * (hidden * dim + dim * width) + hidden * heads + width * hidden
    totals.conv_flops += 2 * 3 * width * kernel
    totals.recurrent_flops += 7 * heads * dim * dim
    totals.recurrent_layers += 1


def _kimi_linear(cfg: _Fields) -> _Totals:
    """Kimi-Linear: MLA and KDA layers, its checkpoint's ``linear_attn_config`` (1-based layer
    lists) or transformers' ``layer_types``; a dense MLP where ``mlp_layer_types`` says
    ``dense`` (without it, the first ``first_k_dense_replace`` layers, default 1), experts
    elsewhere."""
    totals, hidden = _Totals(), cfg.int("hidden_size")
    linear = cfg.config.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise InvalidConfigError(f"{cfg.model_type} config: linear_attn_config must be an object")
    inner = _Fields({**cfg.config, **linear}, cfg.model_type)
    heads = _first_int(inner, ("num_heads", "linear_num_heads"))
    dim = _first_int(inner, ("head_dim", "linear_head_dim")) if "head_dim" in linear else _first_int(cfg, ("linear_head_dim",))
    kernel = _first_int(inner, ("short_conv_kernel_size", "linear_conv_kernel_dim"))
    layers = cfg.int("num_hidden_layers", 1, _MAX_LAYERS)
    if "layer_types" in cfg.config:
        kinds = cfg.kinds("layer_types", {"full_attention": "attention", "linear_attention": "linear"})
    else:
        attention = _layers_at(cfg, "linear_attn_config.full_attn_layers", linear.get("full_attn_layers"), base=1)
        linears = _layers_at(cfg, "linear_attn_config.kda_layers", linear.get("kda_layers"), base=1)
        if attention & linears or len(attention | linears) != layers:
            raise InvalidConfigError(f"{cfg.model_type} config: full_attn_layers and kda_layers must split the {layers} layers")
        kinds = ["attention" if layer in attention else "linear" for layer in range(layers)]
    if "mlp_layer_types" in cfg.config:
        dense_at = [kind == "dense" for kind in cfg.kinds("mlp_layer_types", {"dense": "dense", "sparse": "sparse"})]
    else:
        first = cfg.int("first_k_dense_replace", 0, _MAX_LAYERS) if "first_k_dense_replace" in cfg.config else 1
        dense_at = [layer < first for layer in range(layers)]
    experts = (_first_int(cfg, ("num_experts", "num_local_experts")),
               _first_int(cfg, ("num_experts_per_token", "num_experts_per_tok")), cfg.int("moe_intermediate_size"))
    shared = _first_int(cfg, ("num_shared_experts", "n_shared_experts"), 0) if any(
        name in cfg.config for name in ("num_shared_experts", "n_shared_experts")) else 0
    for layer, kind in enumerate(kinds):
        if kind == "attention":
            _latent_attention(totals, cfg)
        else:
            _delta_attention(totals, cfg, heads, dim, kernel)
        if dense_at[layer]:
            _mlp(totals, hidden, cfg.int("intermediate_size"))
        else:
            _moe(totals, hidden, experts, shared * experts[2])
    return totals


def _bamba(cfg: _Fields) -> _Totals:
    """Bamba: Mamba2 layers with attention at ``attn_layer_indices``; ``mamba_d_head`` may be
    ``"auto"`` (the inner width over the heads)."""
    totals, hidden = _Totals(), cfg.int("hidden_size")
    heads = cfg.int("mamba_n_heads")
    if cfg.config.get("mamba_d_head", "auto") == "auto":
        head_dim = cfg.int("mamba_expand") * hidden // heads
    else:
        head_dim = cfg.int("mamba_d_head")
    mamba = (heads, max(1, head_dim), cfg.int("mamba_d_state"), cfg.int("mamba_n_groups"), cfg.int("mamba_d_conv"))
    attention = _layers_at(cfg, "attn_layer_indices", cfg.config.get("attn_layer_indices") or [])
    for layer in range(cfg.int("num_hidden_layers", 1, _MAX_LAYERS)):
        if layer in attention:
            _attention(totals, cfg)
        else:
            _mamba2(totals, cfg, mamba)
        _mlp(totals, hidden, cfg.int("intermediate_size"))
    return totals


def _mamba2_geometry(cfg: _Fields) -> tuple[int, int, int, int, int]:
    """(heads, head dim, d_state, groups, d_conv) under the granite / falcon field names."""
    names = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv")
    return tuple(cfg.int(name) for name in names)


def _granite_hybrid(cfg: _Fields) -> _Totals:
    totals, hidden = _Totals(), cfg.int("hidden_size")
    mamba = _mamba2_geometry(cfg)
    kinds = cfg.kinds("layer_types", {"attention": "attention", "full_attention": "attention", "mamba": "mamba",
                                      "linear_attention": "mamba"})  # transformers 5 saves the last spelling
    experts = cfg.int("num_local_experts", 0)
    for kind in kinds:
        if kind == "attention":
            _attention(totals, cfg)
        else:
            _mamba2(totals, cfg, mamba)
        if experts:
            routed = (experts, cfg.int("num_experts_per_tok"), cfg.int("intermediate_size"))
            _moe(totals, hidden, routed, cfg.int("shared_intermediate_size", 0))
        else:
            _mlp(totals, hidden, cfg.int("shared_intermediate_size"))
    return totals


_NEMOTRON_KINDS = MappingProxyType({
    "M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba", "attention": "attention", "mlp": "mlp",
    "moe": "moe", "linear_attention": "mamba", "full_attention": "attention",
})


def _nemotron_h(cfg: _Fields) -> _Totals:
    totals, hidden = _Totals(), cfg.int("hidden_size")
    if cfg.config.get("hybrid_override_pattern"):
        kinds = cfg.kinds("hybrid_override_pattern", _NEMOTRON_KINDS, letters=True)
    else:
        kinds = cfg.kinds("layers_block_type", _NEMOTRON_KINDS)
    mamba = tuple(cfg.int(name) for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"))
    for kind in kinds:
        if kind == "mamba":
            _mamba2(totals, cfg, mamba)
        elif kind == "attention":
            _attention(totals, cfg)
        elif kind == "mlp":
            _mlp(totals, hidden, cfg.int("intermediate_size"), gated=False)  # squared-ReLU, no gate
        else:
            experts = (cfg.int("n_routed_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size"))
            _moe(totals, hidden, experts, cfg.int("moe_shared_expert_intermediate_size", 0))
    return totals


def _falcon_h1(cfg: _Fields) -> _Totals:
    totals, hidden = _Totals(), cfg.int("hidden_size")
    mamba = _mamba2_geometry(cfg)
    for _ in range(cfg.int("num_hidden_layers", 1, _MAX_LAYERS)):  # every layer runs attention and Mamba2 in parallel
        _attention(totals, cfg)
        _mamba2(totals, cfg, mamba)
        _mlp(totals, hidden, cfg.int("intermediate_size"))
    return totals


def _jamba(cfg: _Fields) -> _Totals:
    totals, hidden = _Totals(), cfg.int("hidden_size")
    attention_period, expert_period = cfg.int("attn_layer_period"), cfg.int("expert_layer_period")
    attention_offset, expert_offset = cfg.int("attn_layer_offset", 0), cfg.int("expert_layer_offset", 0)
    for layer in range(cfg.int("num_hidden_layers", 1, _MAX_LAYERS)):
        if layer % attention_period == attention_offset:
            _attention(totals, cfg)
        else:
            _mamba1(totals, cfg)
        if layer % expert_period == expert_offset:
            experts = (cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("intermediate_size"))
            _moe(totals, hidden, experts, 0)
        else:
            _mlp(totals, hidden, cfg.int("intermediate_size"))
    return totals


def _marconi_7b(cfg: _Fields) -> _Totals:
    """Marconi's 7B Attention-Mamba2 hybrid; its bytes are the issue's exact figures."""
    hidden, d_state, d_conv = cfg.int("hidden_size"), cfg.int("d_state"), cfg.int("d_conv")
    attention_layers, mamba_layers = cfg.int("attention_layers", 0, _MAX_LAYERS), cfg.int("mamba_layers", 0, _MAX_LAYERS)
    totals = _Totals()
    full_mha = cfg.with_field("num_key_value_heads", cfg.int("num_attention_heads"))
    for _ in range(attention_layers):
        _attention(totals, full_mha)
    for _ in range(mamba_layers):
        _mamba2(totals, cfg, (cfg.int("mamba_heads"), cfg.int("mamba_head_dim"), d_state, 1, d_conv))
    for _ in range(cfg.int("mlp_layers", 0, _MAX_LAYERS)):
        _mlp(totals, hidden, cfg.int("intermediate_size"), gated=False)
    totals.kv_bytes = attention_layers * 2 * hidden * 2  # 4 * 2 * 4096 * 2 = 65,536
    # 24 * (4096 * 128 * 2 + (2 * 4096 + 2 * 128) * 4 * 2) = 26,787,840 B (the KV of ~409 tokens)
    totals.state_bytes = mamba_layers * (hidden * d_state * 2 + (2 * hidden + 2 * d_state) * d_conv * 2)
    return totals


_ARCHITECTURES = {
    "qwen3_next": _qwen3_next,
    "qwen3_5_text": _qwen3_next,
    "qwen3_5_moe_text": _qwen3_next,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2,
    "kimi_linear": _kimi_linear,
    "bamba": _bamba,
    "granitemoehybrid": _granite_hybrid,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "jamba": _jamba,
    "marconi_hybrid": _marconi_7b,
}


PROFILE_NAMES = tuple(BUILTIN_CONFIGS)


def _supported(model_type: object) -> bool:
    return isinstance(model_type, str) and model_type in _ARCHITECTURES


def profile_from_config(config: dict, name: str | None = None) -> ModelProfile:
    """A profile from a config mapping in the transformers ``config.json`` schema. Every field
    a formula reads is checked (``_Fields``); the model must have attention and recurrent
    layers, since the cache's budgets divide by both the KV per token and the state size."""
    if not isinstance(config, Mapping):
        raise InvalidConfigError("a model config must be a mapping")
    text = config.get("text_config")
    if not _supported(config.get("model_type")) and isinstance(text, Mapping):
        # a multimodal checkpoint (Qwen3.5, Kimi-K3): its language model, in the outer dtype unless it names one
        outer = {key: config[key] for key in ("dtype", "torch_dtype", "_name_or_path") if key in config}
        config = {**outer, **text}
    model_type = config.get("model_type")
    if not _supported(model_type):
        raise InvalidConfigError(f"unsupported model_type {_shown(model_type)}; supported: {', '.join(_ARCHITECTURES)}")
    totals = _ARCHITECTURES[model_type](_Fields(dict(config), model_type))
    if totals.kv_bytes < 1 or totals.state_bytes < 1:
        raise InvalidConfigError(
            f"{model_type} config is not a hybrid model: {totals.attention_layers} attention layers "
            f"({totals.kv_bytes} KV bytes per token), {totals.recurrent_layers} recurrent layers "
            f"({totals.state_bytes} state bytes); both must be at least one"
        )
    return totals.profile(name or str(config.get("_name_or_path") or model_type))


def load_profile(name_or_path: str) -> ModelProfile:
    """A built-in profile by name, or one computed from a ``config.json`` path (a regular file
    of at most ``MAX_CONFIG_BYTES``)."""
    if name_or_path in BUILTIN_CONFIGS:
        return profile_from_config(BUILTIN_CONFIGS[name_or_path], name_or_path)
    path = Path(name_or_path)
    if not path.exists():
        raise InvalidArgumentError(
            f"unknown model profile {name_or_path!r}; built in: {', '.join(PROFILE_NAMES)}, or a config.json path"
        )
    data = read_bounded(path, MAX_CONFIG_BYTES, InvalidConfigError)
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:  # ValueError: bad JSON, or an int over the digit limit
        raise InvalidConfigError(f"{path}: cannot read a model config ({error})") from None
    except RecursionError:
        raise InvalidConfigError(f"{path}: cannot read a model config (JSON nested too deeply)") from None
    return profile_from_config(config, path.parent.name or path.stem)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i)?)?b?\s*$", re.IGNORECASE)
_UNIT_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
MAX_SIZE = 2**63  # sizes are int64 downstream


def parse_size(text: str) -> int:
    """Bytes from ``400GB`` (400e9), ``512MiB`` (512 * 2**20), ``1.5T``, ``4096`` (bytes)."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"a size must be a string, got {type(text).__name__}")
    match = _SIZE.match(text)
    if not match:
        raise InvalidArgumentError(f"cannot parse size {text!r}; use e.g. 400GB, 512MiB or 4096")
    number, prefix, binary = match.groups()
    power = _UNIT_POWERS[prefix.lower()] if prefix else 0
    value = float(number) * (1024 if binary else 1000) ** power
    if value < 1:
        raise InvalidArgumentError(f"size {text!r} is below one byte")
    if not value < MAX_SIZE:
        raise InvalidArgumentError(f"size {text!r} is over the {MAX_SIZE:,} bytes (8 EiB) a size may name")
    return int(round(value))
