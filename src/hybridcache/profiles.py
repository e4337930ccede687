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
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from hybridcache.errors import InvalidArgumentError, InvalidConfigError

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


# --- layer formulas ------------------------------------------------------------------------


def _attention(totals: _Totals, cfg: dict, q_gate: bool = False) -> None:
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    totals.kv_bytes += 2 * kv_heads * head_dim * _bytes(cfg)
    q_out = heads * head_dim * (2 if q_gate else 1)  # Qwen3-Next's gated attention doubles q_proj
    totals.linear_params += hidden * (q_out + 2 * kv_heads * head_dim) + heads * head_dim * hidden
    totals.attention_coefficient += 4 * heads * head_dim
    totals.attention_layers += 1


def _mamba2(totals: _Totals, cfg: dict, geometry: tuple[int, int, int, int, int]) -> None:
    heads, head_dim, d_state, groups, d_conv = geometry
    hidden, d_inner = cfg["hidden_size"], heads * head_dim
    conv_dim = d_inner + 2 * groups * d_state
    totals.state_bytes += heads * head_dim * d_state * _ssm_bytes(cfg) + conv_dim * (d_conv - 1) * _bytes(cfg)
    totals.linear_params += hidden * (2 * d_inner + 2 * groups * d_state + heads) + d_inner * hidden
    totals.conv_flops += 2 * conv_dim * d_conv
    totals.recurrent_flops += 5 * d_inner * d_state
    totals.recurrent_layers += 1


def _mamba1(totals: _Totals, cfg: dict) -> None:
    hidden, d_state, d_conv = cfg["hidden_size"], cfg["mamba_d_state"], cfg["mamba_d_conv"]
    d_inner, dt_rank = cfg["mamba_expand"] * hidden, cfg["mamba_dt_rank"]
    totals.state_bytes += d_inner * d_state * _ssm_bytes(cfg) + d_inner * (d_conv - 1) * _bytes(cfg)
    totals.linear_params += hidden * 2 * d_inner + d_inner * (dt_rank + 2 * d_state) + dt_rank * d_inner + d_inner * hidden
    totals.conv_flops += 2 * d_inner * d_conv
    totals.recurrent_flops += 5 * d_inner * d_state
    totals.recurrent_layers += 1


def _gated_delta(totals: _Totals, cfg: dict) -> None:
    hidden, kernel = cfg["hidden_size"], cfg["linear_conv_kernel_dim"]
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    k_dim, v_dim = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
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
    totals.linear_params += hidden * count + top_k * 3 * hidden * intermediate + 3 * hidden * shared


def _bytes(cfg: dict) -> int:
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    if dtype not in _DTYPE_BYTES:
        raise InvalidConfigError(f"unsupported dtype {dtype!r}")
    return _DTYPE_BYTES[dtype]


def _ssm_bytes(cfg: dict) -> int:
    dtype = cfg.get("mamba_ssm_cache_dtype")
    return _bytes(cfg) if dtype is None else _bytes({"dtype": dtype})


# --- architectures -------------------------------------------------------------------------


def _qwen3_next(cfg: dict) -> _Totals:
    totals, hidden = _Totals(), cfg["hidden_size"]
    experts = (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"])
    for kind in cfg["layer_types"]:
        if kind == "full_attention":
            _attention(totals, cfg, q_gate=True)
        else:
            _gated_delta(totals, cfg)
        _moe(totals, hidden, experts, cfg["shared_expert_intermediate_size"])
    return totals


def _granite_hybrid(cfg: dict) -> _Totals:
    totals, hidden = _Totals(), cfg["hidden_size"]
    mamba = (cfg["mamba_n_heads"], cfg["mamba_d_head"], cfg["mamba_d_state"], cfg["mamba_n_groups"], cfg["mamba_d_conv"])
    for kind in cfg["layer_types"]:
        if kind in ("attention", "full_attention"):
            _attention(totals, cfg)
        else:
            _mamba2(totals, cfg, mamba)
        if cfg["num_local_experts"]:
            experts = (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"])
            _moe(totals, hidden, experts, cfg["shared_intermediate_size"])
        else:
            _mlp(totals, hidden, cfg["shared_intermediate_size"])
    return totals


_NEMOTRON_KINDS = {
    "M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "linear_attention": "mamba", "full_attention": "attention",
}


def _nemotron_h(cfg: dict) -> _Totals:
    totals, hidden = _Totals(), cfg["hidden_size"]
    pattern = cfg.get("hybrid_override_pattern")
    kinds = [_NEMOTRON_KINDS.get(kind, kind) for kind in (pattern if pattern else cfg["layers_block_type"])]
    mamba = (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"], cfg["conv_kernel"])
    for kind in kinds:
        if kind == "mamba":
            _mamba2(totals, cfg, mamba)
        elif kind == "attention":
            _attention(totals, cfg)
        elif kind == "mlp":
            _mlp(totals, hidden, cfg["intermediate_size"], gated=False)  # squared-ReLU, no gate
        else:
            experts = (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"])
            _moe(totals, hidden, experts, cfg["moe_shared_expert_intermediate_size"])
    return totals


def _falcon_h1(cfg: dict) -> _Totals:
    totals, hidden = _Totals(), cfg["hidden_size"]
    mamba = (cfg["mamba_n_heads"], cfg["mamba_d_head"], cfg["mamba_d_state"], cfg["mamba_n_groups"], cfg["mamba_d_conv"])
    for _ in range(cfg["num_hidden_layers"]):  # every layer runs attention and Mamba2 in parallel
        _attention(totals, cfg)
        _mamba2(totals, cfg, mamba)
        _mlp(totals, hidden, cfg["intermediate_size"])
    return totals


def _jamba(cfg: dict) -> _Totals:
    totals, hidden = _Totals(), cfg["hidden_size"]
    for layer in range(cfg["num_hidden_layers"]):
        if layer % cfg["attn_layer_period"] == cfg["attn_layer_offset"]:
            _attention(totals, cfg)
        else:
            _mamba1(totals, cfg)
        if layer % cfg["expert_layer_period"] == cfg["expert_layer_offset"]:
            _moe(totals, hidden, (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]), 0)
        else:
            _mlp(totals, hidden, cfg["intermediate_size"])
    return totals


def _marconi_7b(cfg: dict) -> _Totals:
    """Marconi's 7B Attention-Mamba2 hybrid; its bytes are the issue's exact figures."""
    hidden, d_state, d_conv = cfg["hidden_size"], cfg["d_state"], cfg["d_conv"]
    totals = _Totals()
    for _ in range(cfg["attention_layers"]):
        _attention(totals, {**cfg, "num_key_value_heads": cfg["num_attention_heads"]})  # full MHA
    for _ in range(cfg["mamba_layers"]):
        _mamba2(totals, cfg, (cfg["mamba_heads"], cfg["mamba_head_dim"], d_state, 1, d_conv))
    for _ in range(cfg["mlp_layers"]):
        _mlp(totals, hidden, cfg["intermediate_size"], gated=False)
    totals.kv_bytes = cfg["attention_layers"] * 2 * hidden * 2  # 4 * 2 * 4096 * 2 = 65,536
    # 24 * (4096 * 128 * 2 + (2 * 4096 + 2 * 128) * 4 * 2) = 26,787,840 B (the KV of ~409 tokens)
    totals.state_bytes = cfg["mamba_layers"] * (hidden * d_state * 2 + (2 * hidden + 2 * d_state) * d_conv * 2)
    return totals


_ARCHITECTURES = {
    "qwen3_next": _qwen3_next,
    "granitemoehybrid": _granite_hybrid,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "jamba": _jamba,
    "marconi_hybrid": _marconi_7b,
}


# --- built-in configs (published values; differences from the transformers 5.24.0 defaults noted) ---

_GRANITE_SMALL_LAYERS = ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]

BUILTIN_CONFIGS = MappingProxyType({
    "marconi-7b": MappingProxyType({
        # Not a transformers model: the 7B hybrid of Marconi's evaluation (24 Mamba2, 4
        # attention, 28 MLP layers, d_model 4096, d_state 128, fp16). Bytes follow the issue
        # exactly; FLOPs assume Mamba2 with expand 2 (128 heads of 64), 32 full MHA heads and
        # a 16,384-wide non-gated MLP, the NVIDIA Mamba2-Hybrid-8B geometry it is taken from.
        "model_type": "marconi_hybrid", "hidden_size": 4096, "d_state": 128, "d_conv": 4,
        "attention_layers": 4, "mamba_layers": 24, "mlp_layers": 28, "num_attention_heads": 32,
        "mamba_heads": 128, "mamba_head_dim": 64, "intermediate_size": 16384, "dtype": "float16",
    }),
    "qwen3-next-80b-a3b": MappingProxyType({
        "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)],
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "vocab_size": 151936,
        "intermediate_size": 5120,  # default 5632; unused (every layer is MoE)
        "max_position_embeddings": 262144,  # default 32768
        "dtype": "bfloat16",  # default None
    }),
    "granite-4.0-h-small": MappingProxyType({
        "model_type": "granitemoehybrid", "hidden_size": 4096, "num_attention_heads": 32,
        "mamba_d_head": 64, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2,
        "num_hidden_layers": 40,  # default 32
        "layer_types": _GRANITE_SMALL_LAYERS,  # default: 32 layers; published: attention at 5, 15, 25, 35
        "num_key_value_heads": 8,  # default 32
        "mamba_d_state": 128,  # default 256
        "num_local_experts": 72,  # default 8
        "num_experts_per_tok": 10,  # default 2
        "intermediate_size": 768,  # default 11008 (per expert)
        "shared_intermediate_size": 8192,  # default 1024 (published value not checked here)
        "vocab_size": 100352,  # default 32000
        "max_position_embeddings": 131072,  # default 2048
        "dtype": "bfloat16",  # default None
    }),
    "nemotron-h-8b": MappingProxyType({
        "model_type": "nemotron_h", "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
        "conv_kernel": 4, "vocab_size": 131072,
        "mamba_ssm_cache_dtype": "float32",  # the transformers default; engines may keep bf16
        # default layers_block_type is a 4-layer sample; published 52-layer pattern:
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "max_position_embeddings": 8192,  # default 4096 (Nemotron-H-8B-Base-8K)
        "dtype": "bfloat16",  # default None
    }),
    "falcon-h1-7b": MappingProxyType({
        "model_type": "falcon_h1", "mamba_d_conv": 4, "mamba_expand": 2,
        # The transformers defaults describe no published size; the 7B values below are the
        # model card's table (depth, width, heads, KV heads, Mamba heads, d_head, d_state).
        "hidden_size": 3072,  # default 4096
        "num_hidden_layers": 44,  # default 32
        "num_attention_heads": 12,  # default 32
        "num_key_value_heads": 2,  # default 8
        "head_dim": 128,  # default hidden_size // heads
        "mamba_n_heads": 24,  # default 128
        "mamba_d_head": 128,  # default 8
        "mamba_d_ssm": 3072,  # default 1024 (= heads * d_head)
        "mamba_d_state": 256,
        "mamba_n_groups": 1,
        "intermediate_size": 12288,  # default 14336 (published value not checked here)
        "vocab_size": 130049,  # default 128000 (published value not checked here)
        "max_position_embeddings": 262144,  # default 8192
        "dtype": "bfloat16",  # default None
    }),
    "jamba-1.5-mini": MappingProxyType({
        # The transformers defaults are Jamba's published geometry (v0.1 and 1.5-Mini share it).
        "model_type": "jamba", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
        "expert_layer_offset": 1, "num_experts": 16, "num_experts_per_tok": 2,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256,
        "vocab_size": 65536, "max_position_embeddings": 262144,
        "dtype": "bfloat16",  # default None
    }),
})
PROFILE_NAMES = tuple(BUILTIN_CONFIGS)


def profile_from_config(config: dict, name: str | None = None) -> ModelProfile:
    """A profile from a config mapping in the transformers ``config.json`` schema."""
    if not hasattr(config, "get"):
        raise InvalidConfigError("a model config must be a mapping")
    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise InvalidConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(_ARCHITECTURES)}")
    try:
        totals = _ARCHITECTURES[model_type](dict(config))
    except KeyError as missing:
        raise InvalidConfigError(f"{model_type} config lacks {missing}") from None
    except TypeError as error:
        raise InvalidConfigError(f"{model_type} config has a field of the wrong type ({error})") from None
    return totals.profile(name or str(config.get("_name_or_path") or model_type))


def load_profile(name_or_path: str) -> ModelProfile:
    """A built-in profile by name, or one computed from a ``config.json`` path."""
    if name_or_path in BUILTIN_CONFIGS:
        return profile_from_config(BUILTIN_CONFIGS[name_or_path], name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise InvalidArgumentError(
            f"unknown model profile {name_or_path!r}; built in: {', '.join(PROFILE_NAMES)}, or a config.json path"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidConfigError(f"{path}: cannot read a model config ({error})") from None
    return profile_from_config(config, path.parent.name or path.stem)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i)?)?b?\s*$", re.IGNORECASE)
_UNIT_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


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
    return int(round(value))
