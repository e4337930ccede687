"""What callers hand the engine and what they get back.

Owns nothing mutable. A ``Request`` and its ``MultimodalInput`` items are copied into
immutable form when they are built (a read-only int32 prompt array, ``bytes`` content, tuples),
and a content identity is computed from that copy only: a caller that keeps changing its own
list or buffer afterwards cannot change what the engine computes or under which identity the
result is cached.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from hybridcache.engine.sampling import as_seed, as_temperature, as_top_p
from hybridcache.errors import HybridCacheError, InvalidSpanError, InvalidTypeError
from hybridcache.sequence import as_token_array
from hybridcache.types import as_bool, as_int, as_name, as_optional_name, as_ordered


@dataclass(frozen=True, eq=False)
class MultimodalInput:
    """Placeholder positions ``[start, end)`` of the prompt whose embeddings come from ``data``
    (for example an image's bytes). Equal data means equal content."""

    start: int
    end: int
    data: bytes
    modality: str = "image"
    content_id: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.data, (bytes, bytearray, memoryview)):
            raise InvalidTypeError("multimodal data must be bytes")
        if not isinstance(self.modality, str):  # as MultimodalSpan: a wrong type is a type error
            raise InvalidTypeError(f"multimodal modality must be a str, got {type(self.modality).__name__}")
        data = bytes(self.data)
        start, end = as_int("multimodal start", self.start), as_int("multimodal end", self.end)
        if start < 0 or end <= start:
            raise InvalidSpanError(f"multimodal span [{start}, {end}) is empty or negative")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "modality", as_name("multimodal modality", self.modality, InvalidSpanError))
        object.__setattr__(self, "content_id", hashlib.sha256(data).hexdigest())


@dataclass(frozen=True, eq=False)
class Request:
    """A prompt and how to serve it. ``prompt`` may be any ordered iterable of token ids (a
    generator is read once); it is kept as a read-only int32 array. ``temperature`` 0 is greedy
    (the model's argmax); above 0 tokens are drawn from the top-``top_p`` mass with a generator
    seeded by ``seed`` (None: a random seed)."""

    prompt: np.ndarray
    max_new_tokens: int = 8
    adapter: str | None = None
    cache_salt: str | None = None
    multimodal: tuple[MultimodalInput, ...] = ()
    return_routed_experts: bool = False
    return_logits: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        prompt = as_token_array(self.prompt)
        prompt.flags.writeable = False
        multimodal = as_ordered("multimodal", self.multimodal)
        if any(not isinstance(item, MultimodalInput) for item in multimodal):
            raise InvalidTypeError("multimodal must be a sequence of MultimodalInput")
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "max_new_tokens", as_int("max_new_tokens", self.max_new_tokens, 1))
        object.__setattr__(self, "adapter", as_optional_name("adapter", self.adapter))
        object.__setattr__(self, "cache_salt", as_optional_name("cache_salt", self.cache_salt))
        object.__setattr__(self, "multimodal", multimodal)
        object.__setattr__(self, "return_routed_experts", as_bool("return_routed_experts", self.return_routed_experts))
        object.__setattr__(self, "return_logits", as_bool("return_logits", self.return_logits))
        object.__setattr__(self, "temperature", as_temperature(self.temperature))
        object.__setattr__(self, "top_p", as_top_p(self.top_p))
        if self.seed is not None:
            object.__setattr__(self, "seed", as_seed(self.seed))


@dataclass
class Result:
    """A finished request. ``error`` is set when the engine gave up on it (its forwards kept
    failing, or it can never fit); ``tokens`` then holds what was generated before.
    ``logits`` (only with ``Request.return_logits``) is a ``[len(tokens), vocab]`` float array:
    row ``i`` holds the logits ``tokens[i]`` was chosen from (greedily, their argmax).
    ``miss_reason`` (a ``MissReason`` value) says why its first admission restored less than
    the whole prompt's cached prefix, or restored nothing (None: nothing was cut short), or
    ``evicted``: it restored nothing although this engine served a prompt with the same first
    block (in the same namespace) before, so what was cached has been evicted (or cleared).
    ``tier_miss_reason`` (engines with tiers) says why the host, disk or shared tier restored
    nothing where it was expected to: ``tier_unavailable`` (a store failed, or its breaker
    skips it), ``tier_timeout``, ``evicted`` (a checkpoint this engine published is gone),
    ``tier_rejected`` (what was fetched failed verification or could not be adopted),
    ``slower_than_recompute`` or ``tier_error``; None otherwise."""

    request_id: int
    prompt_tokens: int
    tokens: list[int]
    cached_tokens: int
    routed_experts: np.ndarray | None = None
    logits: np.ndarray | None = None
    error: HybridCacheError | None = None
    miss_reason: str | None = None
    tier_miss_reason: str | None = None
