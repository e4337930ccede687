"""The tiny reference model's shape: ``TinyHybridConfig``, and the dtype names it runs in.

Owns nothing mutable. A leaf of the engine package, so the model and its cache tensors both
import it without importing each other's modules in a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridcache.engine.model_api import EXPERT_DTYPE
from hybridcache.errors import InvalidArgumentError, InvalidConfigError

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def torch_dtype(name: object) -> torch.dtype:
    """The torch dtype for ``"float64"`` or ``"float32"``."""
    if name not in _DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


# --- configuration -------------------------------------------------------------------------------

_CONFIG_MINIMUMS = {
    "vocab_size": 2,
    "hidden_size": 1,
    "num_attention_heads": 1,
    "attention_head_dim": 2,
    "num_ssm_heads": 1,
    "ssm_head_dim": 1,
    "ssm_state_size": 1,
    "conv_kernel": 1,
    "num_experts": 1,
    "experts_per_token": 1,
    "expert_hidden_size": 1,
    "adapter_rank": 1,
}


@dataclass(frozen=True)
class TinyHybridConfig:
    """Shape of the tiny model. ``layer_pattern`` has one letter per layer: ``R`` = recurrent
    (Mamba2-style) mixer, ``A`` = attention mixer; every mixer is followed by an MoE FFN."""

    vocab_size: int = 512
    hidden_size: int = 32
    layer_pattern: str = "RARA"
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    num_ssm_heads: int = 2
    ssm_head_dim: int = 16
    ssm_state_size: int = 8
    conv_kernel: int = 4
    num_experts: int = 4
    experts_per_token: int = 2
    expert_hidden_size: int = 32
    adapter_rank: int = 4

    def __post_init__(self) -> None:
        for name, minimum in _CONFIG_MINIMUMS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidConfigError(f"{name} must be an int, got {type(value).__name__}")
            if value < minimum:
                raise InvalidConfigError(f"{name} must be >= {minimum}, got {value}")
        if not isinstance(self.layer_pattern, str) or not self.layer_pattern:
            raise InvalidConfigError("layer_pattern must be a non-empty str")
        if set(self.layer_pattern) - {"R", "A"}:
            raise InvalidConfigError(f"layer_pattern may only hold 'R' and 'A', got {self.layer_pattern!r}")
        # Rotary embedding rotates head_dim as pairs.
        if self.attention_head_dim % 2:
            raise InvalidConfigError(f"attention_head_dim must be even, got {self.attention_head_dim}")
        if self.experts_per_token > self.num_experts:
            raise InvalidConfigError("experts_per_token must not exceed num_experts")
        if self.num_experts - 1 > np.iinfo(EXPERT_DTYPE).max:
            raise InvalidConfigError("expert ids must fit in int16")

    @property
    def num_attention_layers(self) -> int:
        return self.layer_pattern.count("A")

    @property
    def num_recurrent_layers(self) -> int:
        return self.layer_pattern.count("R")

    @property
    def routed_expert_width(self) -> int:
        """Expert ids recorded per token: ``experts_per_token`` for every layer."""
        return len(self.layer_pattern) * self.experts_per_token

    @property
    def attention_width(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def ssm_inner_size(self) -> int:
        return self.num_ssm_heads * self.ssm_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels the causal conv sees: x (inner size), B and C (state size each)."""
        return self.ssm_inner_size + 2 * self.ssm_state_size
