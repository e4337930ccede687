"""Model architectures as sums of layers: one function per ``model_type`` a profile can be
computed for (``ARCHITECTURES``: the families here, ``profile_hybrids``', ``profile_indexed``',
``profile_conv_attention``' and ``profile_recurrent``'), each reading the published
``config.json`` fields (and their transformers spellings) through ``profile_layers.Fields``.

Owns nothing mutable: functions and a read-only table.
"""

from __future__ import annotations

from types import MappingProxyType

from hybridcache.errors import InvalidConfigError
from hybridcache.profile_conv_attention import CONV_ATTENTION
from hybridcache.profile_hybrids import HYBRIDS
from hybridcache.profile_indexed import INDEXED
from hybridcache.profile_recurrent import RECURRENT
from hybridcache.profile_layers import (
    MAX_LAYERS,
    Fields,
    Totals,
    attention,
    delta_hybrid_layers,
    first_int,
    gated_delta,
    layers_at,
    mamba1,
    mamba1_geometry,
    mamba2,
    mamba2_geometry,
    mlp,
    moe,
    short_conv,
)


def _qwen3_next(cfg: Fields) -> Totals:
    """Qwen3-Next and Qwen3.5 (``qwen3_5_text`` dense, ``qwen3_5_moe_text`` with experts):
    gated attention and Gated DeltaNet layers."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    dense = cfg.model_type == "qwen3_5_text"
    if not dense:
        experts = (cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size"))
        shared = cfg.int("shared_expert_intermediate_size", 0)
    for kind in _qwen_layer_kinds(cfg):
        if kind == "attention":
            attention(totals, cfg, q_gate=True)
        else:
            gated_delta(totals, cfg)
        if dense:
            mlp(totals, hidden, cfg.int("intermediate_size"))
        else:
            moe(totals, hidden, experts, shared)
    return totals


def _qwen_layer_kinds(cfg: Fields) -> list[str]:
    """``layer_types``, or without it every ``full_attention_interval``-th layer attention (as
    transformers fills them in)."""
    if "layer_types" in cfg.config or "full_attention_interval" not in cfg.config:
        return cfg.kinds("layer_types", {"full_attention": "attention", "linear_attention": "linear"})
    interval = cfg.int("full_attention_interval", 1, MAX_LAYERS)
    layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
    return ["attention" if (layer + 1) % interval == 0 else "linear" for layer in range(layers)]


def _lfm2_ffn(cfg: Fields) -> int:
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


def _lfm2(cfg: Fields) -> Totals:
    """LFM2 (``lfm2``) and LFM2-MoE (``lfm2_moe``: its first ``num_dense_layers`` dense)."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    if "layer_types" in cfg.config:
        kinds = cfg.kinds("layer_types", {"conv": "conv", "full_attention": "attention"})
    else:
        attention_at = layers_at(cfg, "full_attn_idxs", cfg.config.get("full_attn_idxs"))
        kinds = ["attention" if layer in attention_at else "conv" for layer in range(cfg.int("num_hidden_layers", 1, MAX_LAYERS))]
    experts = cfg.model_type == "lfm2_moe"
    dense_layers = cfg.int("num_dense_layers", 0, MAX_LAYERS) if experts else len(kinds)
    for layer, kind in enumerate(kinds):
        if kind == "attention":
            attention(totals, cfg)
        else:
            short_conv(totals, cfg)
        if layer < dense_layers:
            mlp(totals, hidden, cfg.int("intermediate_size") if experts else _lfm2_ffn(cfg))
        else:
            moe(totals, hidden, (cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size")), 0)
    return totals


def _kimi_linear(cfg: Fields) -> Totals:
    """Kimi-Linear: MLA and KDA layers, its checkpoint's ``linear_attn_config`` (1-based layer
    lists) or transformers' ``layer_types``; a dense MLP where ``mlp_layer_types`` says
    ``dense`` (without it, the first ``first_k_dense_replace`` layers, default 1), experts
    elsewhere."""
    totals = Totals()
    linear = cfg.config.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise InvalidConfigError(f"{cfg.model_type} config: linear_attn_config must be an object")
    inner = Fields({**cfg.config, **linear}, cfg.model_type)
    heads = first_int(inner, ("num_heads", "linear_num_heads"))
    dim = inner.int("head_dim") if "head_dim" in linear else cfg.int("linear_head_dim")  # the top level's head_dim is MLA's
    kernel = first_int(inner, ("short_conv_kernel_size", "linear_conv_kernel_dim"))
    layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
    if "layer_types" in cfg.config:
        kinds = cfg.kinds("layer_types", {"full_attention": "attention", "linear_attention": "linear"})
    else:
        attention_at = layers_at(cfg, "linear_attn_config.full_attn_layers", linear.get("full_attn_layers"), base=1)
        linear_at = layers_at(cfg, "linear_attn_config.kda_layers", linear.get("kda_layers"), base=1)
        if attention_at & linear_at or len(attention_at | linear_at) != layers:
            raise InvalidConfigError(f"{cfg.model_type} config: full_attn_layers and kda_layers must split the {layers} layers")
        kinds = ["attention" if layer in attention_at else "linear" for layer in range(layers)]
    return delta_hybrid_layers(totals, cfg, kinds, (heads, dim, kernel), dense_first=1, shared_default=0)


def _bamba(cfg: Fields) -> Totals:
    """Bamba: Mamba2 layers with attention at ``attn_layer_indices``; ``mamba_d_head`` may be
    ``"auto"`` (the inner width over the heads)."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    heads = cfg.int("mamba_n_heads")
    if cfg.config.get("mamba_d_head", "auto") == "auto":
        head_dim = cfg.int("mamba_expand") * hidden // heads
    else:
        head_dim = cfg.int("mamba_d_head")
    mamba = (heads, max(1, head_dim), cfg.int("mamba_d_state"), cfg.int("mamba_n_groups"), cfg.int("mamba_d_conv"))
    attention_at = layers_at(cfg, "attn_layer_indices", cfg.config.get("attn_layer_indices") or [])
    for layer in range(cfg.int("num_hidden_layers", 1, MAX_LAYERS)):
        if layer in attention_at:
            attention(totals, cfg)
        else:
            mamba2(totals, cfg, mamba)
        mlp(totals, hidden, cfg.int("intermediate_size"))
    return totals


def _granite_hybrid(cfg: Fields) -> Totals:
    totals, hidden = Totals(), cfg.int("hidden_size")
    mamba = mamba2_geometry(cfg)
    kinds = cfg.kinds("layer_types", {"attention": "attention", "full_attention": "attention", "mamba": "mamba",
                                      "linear_attention": "mamba"})  # transformers 5 saves the last spelling
    experts = cfg.int("num_local_experts", 0)
    for kind in kinds:
        if kind == "attention":
            attention(totals, cfg)
        else:
            mamba2(totals, cfg, mamba)
        if experts:
            routed = (experts, cfg.int("num_experts_per_tok"), cfg.int("intermediate_size"))
            moe(totals, hidden, routed, cfg.int("shared_intermediate_size", 0))
        else:
            mlp(totals, hidden, cfg.int("shared_intermediate_size"))
    return totals


_NEMOTRON_KINDS = MappingProxyType({
    "M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba", "attention": "attention", "mlp": "mlp",
    "moe": "moe", "linear_attention": "mamba", "full_attention": "attention",
})


def _nemotron_h(cfg: Fields) -> Totals:
    totals, hidden = Totals(), cfg.int("hidden_size")
    if cfg.config.get("hybrid_override_pattern"):
        kinds = cfg.kinds("hybrid_override_pattern", _NEMOTRON_KINDS, letters=True)
    else:
        kinds = cfg.kinds("layers_block_type", _NEMOTRON_KINDS)
    mamba = tuple(cfg.int(name) for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"))
    for kind in kinds:
        if kind == "mamba":
            mamba2(totals, cfg, mamba)
        elif kind == "attention":
            attention(totals, cfg)
        elif kind == "mlp":
            mlp(totals, hidden, cfg.int("intermediate_size"), gated=False)  # squared-ReLU, no gate
        else:
            experts = (cfg.int("n_routed_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size"))
            moe(totals, hidden, experts, cfg.int("moe_shared_expert_intermediate_size", 0))
    return totals


def _falcon_h1(cfg: Fields) -> Totals:
    totals, hidden = Totals(), cfg.int("hidden_size")
    mamba = mamba2_geometry(cfg)
    for _ in range(cfg.int("num_hidden_layers", 1, MAX_LAYERS)):  # every layer runs attention and Mamba2 in parallel
        attention(totals, cfg)
        mamba2(totals, cfg, mamba)
        mlp(totals, hidden, cfg.int("intermediate_size"))
    return totals


def _jamba(cfg: Fields) -> Totals:
    totals, hidden = Totals(), cfg.int("hidden_size")
    mamba = mamba1_geometry(cfg, ("hidden_size", "mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank"))
    attention_period, expert_period = cfg.int("attn_layer_period"), cfg.int("expert_layer_period")
    attention_offset, expert_offset = cfg.int("attn_layer_offset", 0), cfg.int("expert_layer_offset", 0)
    for layer in range(cfg.int("num_hidden_layers", 1, MAX_LAYERS)):
        if layer % attention_period == attention_offset:
            attention(totals, cfg)
        else:
            mamba1(totals, cfg, mamba)
        if layer % expert_period == expert_offset:
            experts = (cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("intermediate_size"))
            moe(totals, hidden, experts, 0)
        else:
            mlp(totals, hidden, cfg.int("intermediate_size"))
    return totals


def _marconi_7b(cfg: Fields) -> Totals:
    """Marconi's 7B Attention-Mamba2 hybrid; its bytes are the issue's exact figures."""
    hidden, d_state, d_conv = cfg.int("hidden_size"), cfg.int("d_state"), cfg.int("d_conv")
    attention_layers, mamba_layers = cfg.int("attention_layers", 0, MAX_LAYERS), cfg.int("mamba_layers", 0, MAX_LAYERS)
    totals = Totals()
    full_mha = cfg.with_field("num_key_value_heads", cfg.int("num_attention_heads"))
    for _ in range(attention_layers):
        attention(totals, full_mha)
    for _ in range(mamba_layers):
        mamba2(totals, cfg, (cfg.int("mamba_heads"), cfg.int("mamba_head_dim"), d_state, 1, d_conv))
    for _ in range(cfg.int("mlp_layers", 0, MAX_LAYERS)):
        mlp(totals, hidden, cfg.int("intermediate_size"), gated=False)
    totals.kv_bytes = attention_layers * 2 * hidden * 2  # 4 * 2 * 4096 * 2 = 65,536
    # 24 * (4096 * 128 * 2 + (2 * 4096 + 2 * 128) * 4 * 2) = 26,787,840 B (the KV of ~409 tokens)
    totals.state_bytes = mamba_layers * (hidden * d_state * 2 + (2 * hidden + 2 * d_state) * d_conv * 2)
    return totals


ARCHITECTURES = MappingProxyType({
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
    **HYBRIDS,
    **INDEXED,
    **CONV_ATTENTION,
    **RECURRENT,
})
