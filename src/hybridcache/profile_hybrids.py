"""More attention / recurrent hybrids as sums of layers, one function per ``model_type``:
Zamba and Zamba2 (a shared attention block called from several layers), LFM3, OLMo-Hybrid,
Bailing-Hybrid, MiniMax (lightning attention) and LaraMini. ``profile_architectures`` lists
them in ``ARCHITECTURES`` beside its own.

Owns nothing mutable: functions and read-only tables.
"""

from __future__ import annotations

from types import MappingProxyType

from hybridcache.errors import InvalidConfigError
from hybridcache.profile_layers import (
    MAX_LAYERS,
    Fields,
    Totals,
    attention,
    defaulted,
    delta_hybrid_layers,
    first_int,
    gated_delta,
    lightning_attention,
    mamba1,
    mamba1_geometry,
    mamba2,
    mlp,
    moe,
    rejected_windowed,
    short_conv,
)

# transformers 5 renames "mamba" to "linear_attention" when it loads a config; checkpoints
# saved before keep the first spelling.
_ZAMBA_KINDS = MappingProxyType({"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"})


def _zamba_kinds(cfg: Fields) -> list[str]:
    """``layers_block_type``, or without it transformers' layout: two Mamba layers, a hybrid
    one, then a hybrid layer where ``i % attn_layer_period == attn_layer_offset``."""
    for name in ("layers_block_type", "layer_types"):
        if cfg.config.get(name) is not None:
            return cfg.kinds(name, _ZAMBA_KINDS)
    period, offset = cfg.int("attn_layer_period", 1, MAX_LAYERS), cfg.int("attn_layer_offset", 0, MAX_LAYERS)
    rest = ["hybrid" if i % period == offset else "mamba" for i in range(cfg.int("num_hidden_layers", 3, MAX_LAYERS) - 3)]
    return ["mamba", "mamba", "hybrid", *rest]


def _zamba(cfg: Fields) -> Totals:
    """Zamba: Mamba1 layers; a hybrid layer first runs the one shared attention block (on the
    hidden state and the embeddings side by side, ``attention_hidden_size`` wide) and its MLP,
    then its own linear map and Mamba layer. Every hybrid layer caches its own KV."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    width = defaulted(cfg, "attention_hidden_size", 2 * hidden)
    head_dim = first_int(cfg, ("attention_head_dim", "head_dim"), default=2 * hidden // cfg.int("num_attention_heads"))
    geometry = mamba1_geometry(cfg, ("hidden_size", "mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank"))
    for kind in _zamba_kinds(cfg):
        if kind == "hybrid":
            attention(totals, cfg, width=width, head_dim=max(1, head_dim))
            mlp(totals, hidden, cfg.int("intermediate_size"))
            totals.linear_params += hidden * hidden
        mamba1(totals, cfg, geometry)
    return totals


def _zamba2(cfg: Fields) -> Totals:
    """Zamba2: Mamba2 layers; a hybrid layer runs one of ``num_mem_blocks`` shared attention
    blocks, whose width transformers derives (2 * hidden) and whose head size is
    ``attention_head_dim`` (derived as 2 * hidden / heads when absent), with per-layer low-rank adapters on its MLP (and on q, k, v with
    ``use_shared_attention_adapter``). Every hybrid layer caches its own KV."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    heads = cfg.int("num_attention_heads")
    if cfg.config.get("num_key_value_heads") is None:
        cfg = cfg.with_field("num_key_value_heads", heads)
    ffn, rank = defaulted(cfg, "intermediate_size", 4 * hidden), defaulted(cfg, "adapter_rank", 128)
    head_dim = defaulted(cfg, "attention_head_dim", max(1, 2 * hidden // heads))
    mamba_heads = cfg.int("n_mamba_heads")
    geometry = (mamba_heads, max(1, cfg.int("mamba_expand") * hidden // mamba_heads), cfg.int("mamba_d_state"),
                cfg.int("mamba_ngroups"), cfg.int("mamba_d_conv"))
    for kind in cfg.kinds("layers_block_type" if "layers_block_type" in cfg.config else "layer_types", _ZAMBA_KINDS):
        if kind == "hybrid":
            attention(totals, cfg, width=2 * hidden, head_dim=head_dim)
            mlp(totals, hidden, ffn)
            totals.linear_params += hidden * rank + rank * 2 * ffn + hidden * hidden  # MLP adapter, linear map
            if cfg.config.get("use_shared_attention_adapter"):
                totals.linear_params += 3 * 2 * (2 * hidden * rank)  # q, k, v adapters, down and up
        mamba2(totals, cfg, geometry)
    return totals


def _lfm3(cfg: Fields) -> Totals:
    """LFM3: LFM2's short convolutions and attention (a sigmoid gate per head with
    ``use_attention_gate``), and sliding-window layers, which are refused."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    if "layer_types" in cfg.config:
        kinds = cfg.kinds("layer_types", {"conv": "conv", "full_attention": "attention", "sliding_attention": "windowed"})
    else:  # transformers' layout: attention at i % 4 == 2, a window at i % 4 == 0 past the first
        layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
        kinds = ["attention" if i % 4 == 2 else "windowed" if i % 4 == 0 and i else "conv" for i in range(layers)]
    rejected_windowed(cfg, kinds)
    heads, head_dim = cfg.int("num_attention_heads"), first_int(cfg, ("head_dim",), default=128)
    for kind in kinds:
        if kind == "attention":
            attention(totals, cfg, head_dim=head_dim)
            if cfg.config.get("use_attention_gate", True):
                totals.linear_params += hidden * heads
        else:
            short_conv(totals, cfg)
        mlp(totals, hidden, cfg.int("intermediate_size"))
    return totals


def _olmo_hybrid(cfg: Fields) -> Totals:
    """OLMo-Hybrid: attention and Gated DeltaNet layers (every fourth attention without
    ``layer_types``), linear widths defaulted as transformers does from the attention heads."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    heads = cfg.int("num_attention_heads")
    key_heads = defaulted(cfg, "linear_num_key_heads", heads)
    defaults = {"num_key_value_heads": heads, "linear_num_key_heads": key_heads, "linear_num_value_heads": heads,
                "linear_key_head_dim": max(1, int(0.75 * hidden / key_heads)), "linear_conv_kernel_dim": 4}
    for name, value in defaults.items():
        if cfg.config.get(name) is None:
            cfg = cfg.with_field(name, value)
    if cfg.config.get("linear_value_head_dim") is None:
        cfg = cfg.with_field("linear_value_head_dim", 2 * cfg.int("linear_key_head_dim"))
    if "layer_types" in cfg.config:
        kinds = cfg.kinds("layer_types", {"full_attention": "attention", "linear_attention": "linear"})
    else:
        layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
        kinds = ["attention" if i % 4 == 3 or (layers < 4 and i == layers - 1) else "linear" for i in range(layers)]
    for kind in kinds:
        if kind == "attention":
            attention(totals, cfg)
        else:
            gated_delta(totals, cfg)
        mlp(totals, hidden, cfg.int("intermediate_size"))
    return totals


def _bailing_hybrid(cfg: Fields) -> Totals:
    """Bailing-Hybrid (Ring / Ling linear): MLA with a per-head output gate and Kimi Delta
    Attention; the last layer of every ``layer_group_size`` is MLA. Checkpoints spell the
    experts ``num_experts``, ``num_experts_per_token`` and ``num_shared_experts``."""
    totals = Totals()
    heads = first_int(cfg, ("linear_num_heads", "num_attention_heads"))
    dim = first_int(cfg, ("linear_head_dim", "head_dim"), default=128)  # transformers moves head_dim to linear_head_dim
    kernel = first_int(cfg, ("linear_conv_kernel_dim", "short_conv_kernel_size"), default=4)  # the model reads the first
    layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
    if "layer_types" in cfg.config:
        kinds = cfg.kinds("layer_types", {"full_attention": "attention", "linear_attention": "linear"})
    else:
        group = first_int(cfg, ("layer_group_size",), default=6)
        kinds = ["attention" if (layer + 1) % group == 0 else "linear" for layer in range(layers)]
    return delta_hybrid_layers(totals, cfg, kinds, (heads, dim, kernel), dense_first=2, shared_default=1, bailing=True)


def _minimax_kinds(cfg: Fields) -> list[str]:
    """``layer_types``; the checkpoint's ``attn_type_list`` (1: softmax, 0: lightning); or
    transformers' default, softmax at every even layer."""
    if "layer_types" in cfg.config:
        return cfg.kinds("layer_types", {"full_attention": "attention", "linear_attention": "lightning"})
    if "attn_type_list" in cfg.config:
        return ["attention" if kind == 1 else "lightning" for kind in _attn_types(cfg)]
    return ["attention" if layer % 2 == 0 else "lightning" for layer in range(cfg.int("num_hidden_layers", 1, MAX_LAYERS))]


def _attn_types(cfg: Fields) -> list:
    listed = cfg.config["attn_type_list"]
    layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
    if not isinstance(listed, list) or len(listed) != layers \
            or any(isinstance(kind, bool) or kind not in (0, 1) for kind in listed):
        raise InvalidConfigError(f"{cfg.model_type} config: attn_type_list must hold {layers} entries of 0 or 1")
    return listed


def _minimax(cfg: Fields) -> Totals:
    """MiniMax(-Text-01): lightning attention and softmax attention layers, experts in every
    layer. A ``sliding_window`` would window the softmax layers: refused."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    kinds = _minimax_kinds(cfg)
    if cfg.config.get("sliding_window") is not None:
        rejected_windowed(cfg, ["windowed" if kind == "attention" else kind for kind in kinds])
    heads = cfg.int("num_attention_heads")
    head_dim = cfg.optional_int("head_dim") or max(1, hidden // heads)
    experts = (first_int(cfg, ("num_local_experts", "num_experts")), cfg.int("num_experts_per_tok"), cfg.int("intermediate_size"))
    for kind in kinds:
        if kind == "attention":
            attention(totals, cfg)
        else:
            lightning_attention(totals, cfg, heads, head_dim)
        moe(totals, hidden, experts, 0)
    return totals


def _lara_mini(cfg: Fields) -> Totals:
    """LaraMini: Gated DeltaNet, attention and sliding-window layers (refused), experts with a
    shared expert in every layer."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    kinds = cfg.kinds("layer_types", {"linear_attention": "linear", "full_attention": "attention",
                                      "sliding_attention": "windowed"})
    rejected_windowed(cfg, kinds)
    experts = (cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size"))
    head_dim = defaulted(cfg, "head_dim", 128)  # transformers' default, not hidden / heads
    for kind in kinds:
        if kind == "attention":
            attention(totals, cfg, head_dim=head_dim)
        else:
            gated_delta(totals, cfg)
        moe(totals, hidden, experts, cfg.int("shared_expert_intermediate_size", 0))
    return totals


HYBRIDS = MappingProxyType({
    "zamba": _zamba,
    "zamba2": _zamba2,
    "lfm3": _lfm3,
    "olmo_hybrid": _olmo_hybrid,
    "bailing_hybrid": _bailing_hybrid,
    "minimax": _minimax,
    "lara_mini": _lara_mini,
})
