"""The built-in model configs ``hybridcache replay --model NAME`` accepts: published values of
each model's ``config.json``, with the differences from the transformers 5.24.0 defaults noted.

Owns nothing mutable: read-only mappings, turned into profiles by ``hybridcache.profiles``.
"""

from __future__ import annotations

from types import MappingProxyType

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
