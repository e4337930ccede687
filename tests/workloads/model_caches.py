"""What the profile tests read off a transformers model: its config as the JSON a checkpoint
carries, and a cache tensor's bytes per token (or per sequence)."""

from __future__ import annotations

import math


def config_values(config, dtype: str = "float32") -> dict:
    """``config`` as a ``config.json`` mapping whose dtype is ``dtype``."""
    values = config.to_dict()
    values.pop("torch_dtype", None)
    return {**values, "dtype": dtype}


def row_bytes(tensor) -> int:
    """The bytes of one row of ``tensor`` along its first (batch) axis."""
    return math.prod(tensor.shape[1:]) * tensor.element_size()
