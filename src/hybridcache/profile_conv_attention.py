"""Hybrids whose every layer is attention with short convolutions around it, so one layer holds
both KV and a state (transformers' ``hybrid`` cache layers): Inkling-2 (``inkling2_text``),
its looped variant (``inkling2_loop_text``) and ZAYA (``zaya``). Their ``hybrid_sliding``
layers attend over a window and are refused, as every windowed attention is here.
``profile_architectures`` lists them in ``ARCHITECTURES``.

Owns nothing mutable: functions and read-only tables.
"""

from __future__ import annotations

from types import MappingProxyType

from hybridcache.errors import InvalidConfigError
from hybridcache.profile_layers import (
    MAX_LAYERS,
    Fields,
    Totals,
    cache_bytes,
    first_int,
    moe,
    rejected_windowed,
)

_HYBRID_KINDS = MappingProxyType({"hybrid": "hybrid", "hybrid_sliding": "windowed"})
INKLING_CONV_BYTES = 4  # the model runs its convolutions, and caches their windows, in float32


def _inkling2_layer(totals: Totals, cfg: Fields) -> None:
    """One Inkling-2 full-attention layer: a query projection; keys and values each through a
    short convolution whose taps are partly projected from the layer input (per KV head); an
    output projection gated by the input; a learned sink and a relative-position bias per head;
    experts; and short convolutions after the attention and after the experts. Its state is the
    window of its four convolutions (``conv_kernel_size - 1`` columns of the key width, the
    value width and twice the hidden width), in float32."""
    hidden, kernel = cfg.int("hidden_size"), cfg.int("conv_kernel_size")
    heads, kv_heads, head_dim = cfg.int("num_attention_heads"), cfg.int("num_key_value_heads"), cfg.int("head_dim")
    relative, extent = cfg.int("d_rel"), cfg.int("rel_extent")
    kv_width, width = kv_heads * head_dim, heads * head_dim
    totals.kv_bytes += 2 * kv_width * cache_bytes(cfg)
    totals.state_bytes += 2 * (kv_width + hidden) * (kernel - 1) * INKLING_CONV_BYTES
    totals.linear_params += hidden * width + 2 * (hidden * kv_width + hidden * kv_heads * kernel)
    totals.linear_params += 2 * hidden * width + hidden * heads + hidden * heads * relative  # gate, output, sink, bias
    totals.linear_params += heads * relative * extent  # the bias profile of every distance, once a query
    totals.conv_flops += 2 * (2 * kv_width + 2 * hidden) * kernel
    totals.attention_coefficient += 4 * heads * head_dim
    totals.attention_layers += 1
    totals.recurrent_layers += 1
    experts = (first_int(cfg, ("n_routed_experts", "num_local_experts")), cfg.int("num_experts_per_tok"),
               first_int(cfg, ("moe_intermediate_size", "intermediate_size")))
    moe(totals, hidden, experts, 0)


def _inkling2_kinds(cfg: Fields) -> list[str]:
    """``layer_types``, or transformers' layout (every sixth layer full, the rest windowed);
    windowed layers refused."""
    if cfg.config.get("layer_types") is None:
        layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
        kinds = ["hybrid" if (layer + 1) % 6 == 0 else "windowed" for layer in range(layers)]
    else:
        kinds = cfg.kinds("layer_types", _HYBRID_KINDS)
    rejected_windowed(cfg, kinds, "sliding_window_size")
    return kinds


def _inkling2(cfg: Fields) -> Totals:
    """Inkling-2: every layer an ``_inkling2_layer``."""
    totals = Totals()
    for _ in _inkling2_kinds(cfg):
        _inkling2_layer(totals, cfg)
    return totals


def _inkling2_loop(cfg: Fields) -> Totals:
    """Inkling-2 looped: layers ``[loop_layer_index_start, loop_layer_index_end)`` run
    ``loop_num_passes`` times, each pass in cache layers of its own, so they are charged once a
    pass; a pass after the first also mixes four messages from the previous pass into each
    looped layer (low-rank gates of ``loop_gate_rank``)."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    kinds = _inkling2_kinds(cfg)
    start, end = cfg.int("loop_layer_index_start", 0, len(kinds)), cfg.int("loop_layer_index_end", 0, len(kinds))
    if start >= end:
        raise InvalidConfigError(f"{cfg.model_type} config: loop_layer_index_start {start} must be below "
                                 f"loop_layer_index_end {end}")
    passes, rank = cfg.int("loop_num_passes", 1, MAX_LAYERS), cfg.int("loop_gate_rank")
    if len(kinds) + (passes - 1) * (end - start) > MAX_LAYERS:
        raise InvalidConfigError(f"{cfg.model_type} config: the loop visits more than {MAX_LAYERS} layers")
    for _ in range(len(kinds) + (passes - 1) * (end - start)):
        _inkling2_layer(totals, cfg)
    totals.linear_params += (passes - 1) * (end - start) * 4 * (2 * hidden * rank + 2 * rank * hidden)
    return totals


def _zaya(cfg: Fields) -> Totals:
    """ZAYA: every layer compressed convolutional attention and one routed expert. Queries and
    keys pass through a depthwise and then a grouped causal convolution (``cca_time0`` and
    ``cca_time1`` taps), whose window of ``cca_time0 + cca_time1 - 2`` columns the cache keeps;
    half of each value head is the previous token's projection, which it keeps too. Both in the
    cache dtype, with the usual KV."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    kinds = cfg.kinds("layer_types", _HYBRID_KINDS) if cfg.config.get("layer_types") is not None \
        else ["hybrid"] * cfg.int("num_hidden_layers", 1, MAX_LAYERS)
    rejected_windowed(cfg, kinds)
    heads, kv_heads, head_dim = cfg.int("num_attention_heads"), cfg.int("num_key_value_heads"), cfg.int("head_dim")
    channels, kv_width = (heads + kv_heads) * head_dim, kv_heads * head_dim
    if heads % kv_heads or kv_width % 2:
        raise InvalidConfigError(f"{cfg.model_type} config: num_attention_heads must be a multiple of "
                                 "num_key_value_heads, and the value width even (half of it is delayed a token)")
    depthwise, grouped = cfg.int("cca_time0"), cfg.int("cca_time1")
    experts, top_k, router = cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("router_hidden_size")
    if top_k > experts:
        raise InvalidConfigError(f"a MoE layer routes to {top_k} of only {experts} experts")
    for _ in kinds:
        totals.kv_bytes += 2 * kv_width * cache_bytes(cfg)
        totals.state_bytes += (channels * (depthwise + grouped - 2) + kv_width // 2) * cache_bytes(cfg)
        totals.linear_params += hidden * (channels + kv_width) + heads * head_dim * hidden
        totals.linear_params += hidden * router + 2 * router * router + router * (experts + 1)  # the router's MLP
        totals.linear_params += top_k * 3 * hidden * cfg.int("moe_intermediate_size")
        totals.conv_flops += 2 * channels * (depthwise + head_dim * grouped)
        totals.attention_coefficient += 4 * heads * head_dim
        totals.attention_layers += 1
        totals.recurrent_layers += 1
    return totals


CONV_ATTENTION = MappingProxyType({
    "inkling2_text": _inkling2,
    "inkling2_loop_text": _inkling2_loop,
    "zaya": _zaya,
})
