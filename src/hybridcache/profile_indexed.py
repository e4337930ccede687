"""Hybrids whose attention layers pick the keys each query reads with an indexer (DeepSeek-style
sparse attention): GLM-5-Next (``glm5_next_text``: MLA with a DSA indexer, Kimi Delta Attention)
and Qwen4-Exp (``qwen4_exp_text``: gated attention with a QSA indexer, Gated DeltaNet, per-layer
n-gram embeddings). An indexer keeps a key of its own for every token, so it is charged as KV
per token beside the attention's. ``profile_architectures`` lists them in ``ARCHITECTURES``.

Their linear-attention states are charged as every family's are, in the cache dtype or
``mamba_ssm_cache_dtype``, as a serving engine keeps them; transformers keeps both in float32
(it casts GLM-5-Next's KDA state, and Qwen4-Exp's Gated DeltaNet scan returns float32), which
``mamba_ssm_cache_dtype: "float32"`` reproduces.

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
    cache_bytes,
    defaulted,
    delta_hybrid_layers,
    first_int,
    gated_delta,
    layers_at,
    moe,
)

_INDEXED_KINDS = MappingProxyType({"linear_attention": "linear", "indexed_attention": "attention",
                                   "full_attention": "attention"})  # checkpoints say full_attention
_INDEXER_MODES = MappingProxyType({"full": "full", "shared": "shared", "F": "full", "S": "shared"})
TOKEN_ID_BYTES = 8  # Qwen4-Exp caches the n-gram context as int64 token ids


def _glm5_indexer_modes(cfg: Fields) -> list[str]:
    """Per layer, ``"full"`` (runs its indexer) or ``"shared"`` (reuses the previous layer's
    top-k): ``indexer_types``, ``index_topk_pattern``, or transformers' rule from
    ``index_topk_freq`` and ``index_skip_topk_offset``."""
    for name in ("indexer_types", "index_topk_pattern"):
        if cfg.config.get(name) is not None:
            return cfg.kinds(name, _INDEXER_MODES, letters=True)
    layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
    every = defaulted(cfg, "index_topk_freq", 1)
    offset = defaulted(cfg, "index_skip_topk_offset", 2, minimum=0)
    return ["full" if max(layer - offset + 1, 0) % every == 0 else "shared" for layer in range(layers)]


def _glm5_next(cfg: Fields) -> Totals:
    """GLM-5-Next: multi-head latent attention (NoPE: ``qk_rope_head_dim`` 0) with a DSA indexer
    at ``indexed_attention`` layers, low-rank-gated Kimi Delta Attention elsewhere, dense MLPs
    where ``mlp_layer_types`` says so (without it the first three, as transformers fills it in)
    and experts with ``n_shared_experts`` elsewhere, and
    ``hc_mult`` residual streams mixed around every block.

    A layer whose indexer runs caches per token its indexer key, its pooling gate score (both
    ``index_head_dim`` wide) and one validity entry, in the cache dtype; a ``shared`` layer
    reuses the top-k of the layer just before it and caches no indexer key. Attention FLOPs
    are counted over the whole prefix, as transformers computes them under a top-k mask."""
    totals = Totals()
    kinds = cfg.kinds("layer_types", _INDEXED_KINDS)
    delta = (cfg.int("linear_num_heads"), cfg.int("linear_head_dim"), cfg.int("linear_conv_kernel_dim"))
    delta_hybrid_layers(totals, cfg, kinds, delta, dense_first=3, shared_default=1)
    _glm5_indexers(totals, cfg, kinds)
    streams, hidden = cfg.int("hc_mult"), cfg.int("hidden_size")
    totals.linear_params += len(kinds) * 2 * (2 + streams) * streams * streams * hidden  # two mixers a layer
    return totals


def _glm5_indexers(totals: Totals, cfg: Fields, kinds: list[str]) -> None:
    modes = _glm5_indexer_modes(cfg)
    hidden, heads, width = cfg.int("hidden_size"), cfg.int("index_n_heads"), cfg.int("index_head_dim")
    pool, q_rank = cfg.int("index_kpool"), cfg.int("q_lora_rank")
    for layer, kind in enumerate(kinds):
        if kind != "attention":
            continue
        if modes[layer] == "shared":
            if layer == 0 or kinds[layer - 1] != "attention" or modes[layer - 1] != "full":
                raise InvalidConfigError(
                    f"{cfg.model_type} config: layer {layer} shares the indexer top-k of layer {layer - 1}, "
                    "which is not an indexed_attention layer that runs its own indexer (indexer_types)"
                )
            continue
        totals.kv_bytes += (2 * width + 1) * cache_bytes(cfg)
        totals.linear_params += q_rank * heads * width + hidden * width + hidden * heads + width * hidden
        totals.attention_coefficient += 2 * heads * width // pool  # scores against one pooled key per pool


def _qwen4_exp(cfg: Fields) -> Totals:
    """Qwen4-Exp: gated attention with a QSA indexer at ``indexed_attention`` layers, Gated
    DeltaNet elsewhere, experts with a gated shared expert in every layer, ``hc_count``
    residual streams mixed by low-rank gates, and per-layer n-gram embeddings (PLE) at the
    1-based ``ple_layer_ids`` (linear layers only).

    The indexer caches one ``indexer_head_dim`` key per token in the cache dtype (it needs
    ``indexer_kv_heads`` 1, as transformers checks). A PLE layer adds to its state the window
    of its dilated convolution, ``(ple_conv_kernel_size - 1) * ngram_size`` columns of
    ``hc_count * hidden_size`` channels, and the last ``ngram_size - 1`` token ids (int64). The
    rotary positions the model stores beside the first indexer are the prompt's own positions,
    rebuilt from the prompt, and are not charged."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    kinds = cfg.kinds("layer_types", _INDEXED_KINDS)
    ple_at = layers_at(cfg, "ple_layer_ids", cfg.config.get("ple_layer_ids") or [], base=1)
    if any(kinds[layer] != "linear" for layer in ple_at):
        raise InvalidConfigError(f"{cfg.model_type} config: ple_layer_ids may name linear_attention layers only")
    experts = (cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size"))
    shared = cfg.int("shared_expert_intermediate_size")
    for layer, kind in enumerate(kinds):
        if kind == "attention":
            attention(totals, cfg, q_gate=True, head_dim=first_int(cfg, ("head_dim",), default=256))
            _qsa_indexer(totals, cfg)
        else:
            gated_delta(totals, cfg)
            if layer in ple_at:
                _per_layer_embedding(totals, cfg)
        moe(totals, hidden, experts, shared)
        totals.linear_params += hidden  # the shared expert's gate
    streams, rank = cfg.int("hc_count", 2), cfg.int("hc_lowrank")
    mixer = 2 * streams * hidden * rank
    totals.linear_params += len(kinds) * 2 * (mixer + streams * hidden * streams) + mixer  # two a layer, one at the end
    return totals


_QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def _qsa_indexer(totals: Totals, cfg: Fields) -> None:
    unset = [name for name in _QSA_FIELDS if cfg.config.get(name) is None]
    if unset:
        raise InvalidConfigError(
            f"{cfg.model_type} config leaves the QSA indexer unset ({', '.join(unset)}), but transformers builds "
            "one at every indexed_attention layer: such a config builds no model"
        )
    hidden, heads, width = cfg.int("hidden_size"), cfg.int("indexer_n_heads"), cfg.int("indexer_head_dim")
    key_heads = cfg.int("indexer_kv_heads", 1, 1)
    block = cfg.int("indexer_compress_ratio")
    budget = cfg.int("indexer_budget")
    if budget % block:
        raise InvalidConfigError(f"{cfg.model_type} config: indexer_budget {budget} is not a multiple of "
                                 f"indexer_compress_ratio {block}")
    totals.kv_bytes += key_heads * width * cache_bytes(cfg)
    totals.linear_params += hidden * (heads + key_heads) * width
    totals.attention_coefficient += 2 * heads * width // block  # scores against one mean key per block


def _per_layer_embedding(totals: Totals, cfg: Fields) -> None:
    hidden, streams = cfg.int("hidden_size"), cfg.int("hc_count", 2)
    ngram, kernel = cfg.int("ngram_size", 2), cfg.int("ple_conv_kernel_size")
    embedding = defaulted(cfg, "ple_embed_dim", hidden)
    if embedding % ((ngram - 1) * cfg.int("heads_per_ngram")):
        raise InvalidConfigError(f"{cfg.model_type} config: ple_embed_dim {embedding} is not a multiple of "
                                 "(ngram_size - 1) * heads_per_ngram")
    channels = streams * hidden
    totals.state_bytes += channels * (kernel - 1) * ngram * cache_bytes(cfg) + (ngram - 1) * TOKEN_ID_BYTES
    totals.linear_params += embedding * (channels + hidden)  # the key and value projections
    totals.conv_flops += 2 * channels * kernel


INDEXED = MappingProxyType({
    "glm5_next_text": _glm5_next,
    "qwen4_exp_text": _qwen4_exp,
})

# Wrapper model types whose text-only checkpoints keep the text fields at the top level
FLAT_TEXT_CONFIGS = MappingProxyType({"glm5_next": "glm5_next_text"})
