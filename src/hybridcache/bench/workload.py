"""Workload builders shared by benchmark scenarios."""

from __future__ import annotations

import numpy as np

VOCAB = 151_000


def distinct_prompts(batch: int, context: int, seed: int = 0) -> list[np.ndarray]:
    """``batch`` random int32 prompts of ``context`` tokens that differ from their first block."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=context, dtype=np.int32) for _ in range(batch)]
