"""Random-weight transformers checkpoints for benchmarks: a real hybrid architecture at a size
where prefill dominates, saved with ``save_pretrained`` and read back like any checkpoint.

Owns nothing: ``save_random_checkpoint`` writes a fresh directory and returns its path. Nothing
is downloaded; transformers builds the model from a config.
"""

from __future__ import annotations

import os

import torch
import transformers

# Bamba (IBM's Mamba2 + attention hybrid): layer 1 and 3 attention, 0 and 2 Mamba2 (SSD).
BAMBA_SHAPE = {
    "vocab_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "mamba_n_heads": 16,
    "mamba_d_state": 64,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,  # a random model's "end" token would end turns at random
}


def save_random_checkpoint(directory: str | os.PathLike, *, hidden_size: int = 512, num_layers: int = 4,
                           seed: int = 0) -> str:
    """A random Bamba checkpoint of ``num_layers`` layers (attention every second layer) and
    width ``hidden_size`` in ``directory``; returns the directory."""
    attention_layers = list(range(1, num_layers, 2))
    config = transformers.BambaConfig(
        **BAMBA_SHAPE, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        attn_layer_indices=attention_layers, mamba_d_head=2 * hidden_size // BAMBA_SHAPE["mamba_n_heads"],
    )
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)
