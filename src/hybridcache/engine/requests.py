"""What callers hand the engine and what they get back."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidSpanError, InvalidTypeError


@dataclass(frozen=True)
class MultimodalInput:
    """Placeholder positions ``[start, end)`` of the prompt whose embeddings come from ``data``
    (for example an image's bytes). Equal data means equal content."""

    start: int
    end: int
    data: bytes
    modality: str = "image"

    def __post_init__(self) -> None:
        if not isinstance(self.data, (bytes, bytearray)):
            raise InvalidTypeError("multimodal data must be bytes")
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidTypeError(f"multimodal {name} must be an int")
        if self.start < 0 or self.end <= self.start:
            raise InvalidSpanError(f"multimodal span [{self.start}, {self.end}) is empty or negative")

    @property
    def content_id(self) -> str:
        return hashlib.sha256(bytes(self.data)).hexdigest()


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int = 8
    adapter: str | None = None
    cache_salt: str | None = None
    multimodal: tuple[MultimodalInput, ...] | list[MultimodalInput] = ()
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        value = self.max_new_tokens
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidTypeError("max_new_tokens must be an int")
        if value < 1:
            raise InvalidArgumentError("max_new_tokens must be >= 1")
        if isinstance(self.multimodal, MultimodalInput) or any(
            not isinstance(item, MultimodalInput) for item in self.multimodal
        ):
            raise InvalidTypeError("multimodal must be a list of MultimodalInput")


@dataclass
class Result:
    request_id: int
    prompt_tokens: int
    tokens: list[int]
    cached_tokens: int
    routed_experts: np.ndarray | None = None
    extra: dict = field(default_factory=dict)
