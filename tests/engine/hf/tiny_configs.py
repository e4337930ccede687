"""Tiny random configs of transformers' hybrid families, for tests and the docs/models.md table.

Owns nothing: every call builds a fresh config. The sizes are chosen so a few hundred tokens
run in milliseconds on a CPU; ``sensitive=True`` raises the init range and slows the recurrent
decay so that the recurrent state visibly matters (with the default init, zeroing a Mamba2
state moves the logits by about 1e-7, which would let a broken restore pass).
"""

from __future__ import annotations

import transformers

VOCAB = 96

# Sizes shared by most families; a family's own entry overrides them.
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,  # generate() then never stops early, so every step is compared
}

_MAMBA2_SSD = {
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 8,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
}

_GDN = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}

# Shared by Inkling-2 and Inkling-2-Loop, whose entries use the smallest layer pattern with both of their kinds.
_INKLING2 = {
    "unpadded_vocab_size": VOCAB, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    "sliding_window_size": 16, "d_rel": 8, "rel_extent": 16, "n_layers_per_attn_res_block": 2,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "conv_kernel_size": 4,
}

_MOE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}

# 2.5x the usual 0.02: the recurrent state moves the logits by 1e-3..1e-1 (zeroing it is visible),
# while the float32 scan states of SSD / GDN / KDA families still agree far below 1e-6.
SENSITIVE = {"initializer_range": 0.05}

# family -> (config class name, overrides, overrides that make the recurrent state matter)
FAMILIES: dict[str, tuple[str, dict, dict]] = {
    "mamba2": (
        "Mamba2Config",
        {"num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 1, "expand": 2, "chunk_size": 16},
        SENSITIVE,
    ),
    "bamba": ("BambaConfig", {**_MAMBA2_SSD, "attn_layer_indices": [1]}, SENSITIVE),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {**_MAMBA2_SSD, **_MOE, "shared_intermediate_size": 16,
         "layer_types": ["mamba", "attention", "mamba", "attention"]},
        SENSITIVE,
    ),
    "falcon_h1": ("FalconH1Config", {**_MAMBA2_SSD, "mamba_d_ssm": 64}, SENSITIVE),
    "nemotron_h": (
        "NemotronHConfig",
        {"layers_block_type": ["mamba", "attention", "moe", "mamba"], "ssm_state_size": 8, "mamba_num_heads": 4,
         "mamba_head_dim": 16, "n_groups": 1, "conv_kernel": 4, "expand": 2, "chunk_size": 16,
         "n_routed_experts": 4, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
         "num_experts_per_tok": 2, "use_mamba_kernels": False},
        SENSITIVE,
    ),
    "jamba": (
        "JambaConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
         "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
         "mamba_expand": 2, "use_mamba_kernels": False},
        SENSITIVE,
    ),
    "zamba": (
        "ZambaConfig",
        {"attention_hidden_size": 64, "attention_head_dim": 16, "n_mamba_heads": 2, "attn_layer_period": 2,
         "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
         "use_mamba_kernels": False, "num_key_value_heads": 4},
        SENSITIVE,
    ),
    "zamba2": (
        "Zamba2Config",
        {"layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "mamba_d_state": 8, "mamba_d_conv": 4,
         "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 4, "chunk_size": 16, "use_mamba_kernels": False,
         "num_key_value_heads": 4, "intermediate_size": 48, "adapter_rank": 4},
        SENSITIVE,
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        {**_GDN, **_MOE, "shared_expert_intermediate_size": 16,
         "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
        SENSITIVE,
    ),
    "qwen3_5_text": (
        "Qwen3_5TextConfig",
        {**_GDN, "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
        SENSITIVE,
    ),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        {**_GDN, **_MOE, "shared_expert_intermediate_size": 16,
         "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
        SENSITIVE,
    ),
    "lfm2": (
        "Lfm2Config",
        {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "block_auto_adjust_ff_dim": False,
         "num_attention_heads": 2, "num_key_value_heads": 1},
        SENSITIVE,
    ),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        {**_MOE, "num_dense_layers": 1, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
         "num_attention_heads": 2, "num_key_value_heads": 1},
        SENSITIVE,
    ),
    "lfm3": (
        "Lfm3Config",
        {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "sliding_window": None},
        SENSITIVE,
    ),
    "olmo_hybrid": (
        "OlmoHybridConfig",
        {**_GDN, "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
        SENSITIVE,
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        {**_MOE, "num_local_experts": 4, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 16,
         "qk_nope_head_dim": 8, "v_head_dim": 8, "linear_head_dim": 8, "linear_num_heads": 4,
         "num_key_value_heads": 4, "n_shared_experts": 1, "num_expert_group": 1, "topk_group": 1,
         "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
         "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
        SENSITIVE,
    ),
    "bailing_hybrid": (
        "BailingHybridConfig",
        {**_MOE, "num_local_experts": 4, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 16,
         "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4, "n_group": 1, "topk_group": 1,
         "first_k_dense_replace": 1, "num_mtp_layers": 0, "layer_group_size": 2},
        SENSITIVE,
    ),
    "zaya": (
        "ZayaConfig",
        {"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 16, "router_hidden_size": 16},
        SENSITIVE,
    ),
    # No causal-LM class in transformers: saved as its text model, which the engine refuses.
    "glm5_next": (
        "Glm5NextTextConfig",
        {**_MOE, "n_routed_experts": 4, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 16,
         "v_head_dim": 16, "num_key_value_heads": 4, "index_topk": 16, "index_kpool": 4, "index_head_dim": 16,
         "index_n_heads": 2, "linear_head_dim": 8, "linear_num_heads": 4, "hc_mult": 2,
         "layer_types": ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
         "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
        SENSITIVE,
    ),
    "qwen4_exp_text": (
        "Qwen4ExpTextConfig",
        {**_GDN, **_MOE, "shared_expert_intermediate_size": 16, "hc_count": 2, "hc_lowrank": 8,
         "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
         "indexer_compress_ratio": 4,
         "layer_types": ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"]},
        SENSITIVE,
    ),
    "inkling2_text": (
        "Inkling2TextConfig",
        {**_INKLING2, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"]},
        SENSITIVE,
    ),
    "inkling2_loop_text": (
        "Inkling2LoopTextConfig",
        {**_INKLING2, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
         "loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 2, "loop_gate_rank": 8},
        SENSITIVE,
    ),
    "minimax": (
        "MiniMaxConfig",
        {**_MOE, "block_size": 16, "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
        SENSITIVE,
    ),
    "lara_mini": (
        "LaraMiniConfig",
        {**_GDN, **_MOE, "shared_expert_intermediate_size": 16},
        SENSITIVE,
    ),
}


def tiny_config(family: str, *, sensitive: bool = False) -> transformers.PretrainedConfig:
    """A tiny config of ``family`` (a key of ``FAMILIES``)."""
    class_name, overrides, sensitive_overrides = FAMILIES[family]
    config_class = getattr(transformers, class_name)
    defaults = config_class()
    values = {name: value for name, value in _COMMON.items() if hasattr(defaults, name)}
    values.update(overrides)
    if sensitive:
        values.update(sensitive_overrides)
    return config_class(**values)
