"""Choosing the next token from a chunk's logits: greedy, or seeded temperature / top-p sampling.

Owns: one ``torch.Generator`` per sampling request, created from the request's seed when its
first token is drawn and dropped when the request ends. A greedy request (temperature 0) never
draws, so its tokens are the model's argmax exactly as without a sampler; a seeded request draws
once per generated token, so the same seed and the same logits give the same tokens whether its
prefix came from the cache or was recomputed.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.types import as_int


def as_temperature(value: object) -> float:
    """A sampling temperature: a finite float >= 0 (0 is greedy)."""
    number = _as_float("temperature", value)
    if not 0.0 <= number <= 100.0:
        raise InvalidArgumentError(f"temperature must lie in [0, 100], got {number}")
    return number


def as_top_p(value: object) -> float:
    """A nucleus mass in (0, 1]."""
    number = _as_float("top_p", value)
    if not 0.0 < number <= 1.0:
        raise InvalidArgumentError(f"top_p must lie in (0, 1], got {number}")
    return number


def as_seed(value: object) -> int:
    """A generator seed: an int in ``[0, 2**63)``."""
    seed = as_int("seed", value, 0)
    if seed >= 2**63:
        raise InvalidArgumentError(f"seed must be < 2**63, got {seed}")
    return seed


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond every float
        raise InvalidArgumentError(f"{name} must be finite, got an int of {int(value).bit_length()} bits") from None
    if not np.isfinite(number):
        raise InvalidArgumentError(f"{name} must be finite, got {number}")
    return number


def sample_token(logits: np.ndarray, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token drawn from ``softmax(logits / temperature)`` restricted to the smallest set of
    most likely tokens whose mass reaches ``top_p`` (computed in float64). The largest logit is
    taken off before dividing, so that a temperature as small as a float allows (``5e-324``)
    makes the largest score 0 and the others -inf, the greedy choice, instead of inf / inf."""
    scores = torch.from_numpy(np.asarray(logits, dtype=np.float64))
    scores = (scores - scores.max()) / temperature
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=-1) - ordered
        ordered[before >= top_p] = 0.0  # keeps the first token always: its mass before is 0
        probs = torch.zeros_like(probs).scatter_(0, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """Per-request generators of the requests that sample (temperature > 0)."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def choose(self, request_id: int, logits: np.ndarray, temperature: float, top_p: float, seed: int | None) -> int:
        """The request's next token, drawn with its own generator (seeded on its first draw)."""
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(random.getrandbits(63) if seed is None else seed)
            self._generators[request_id] = generator
        return sample_token(logits, temperature, top_p, generator)

    def forget(self, request_id: int) -> None:
        self._generators.pop(request_id, None)

    def request_ids(self) -> set[int]:
        return set(self._generators)
