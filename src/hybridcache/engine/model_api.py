"""The model interface the engine, scheduler and copy plans talk to, and its value types.

Owns nothing mutable: the layout types are frozen values a model describes itself with, and the
two protocols name what a model and its cache storage must provide. A model keeps every KV entry
and recurrent state in the caller's storage; ``forward`` reads the KV of ``[0, start)`` from a
chunk's blocks and the state after ``start`` tokens from its slot, and writes the KV of the
positions it computes and the state after the chunk's last token, nothing else.

``ForwardChunk`` and ``ChunkOutput`` are the one kind of chunk the engine builds and reads,
whichever model it serves.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from hybridcache.errors import InvalidConfigError

__all__ = [
    "ATTENTION",
    "ATTENTION_AND_RECURRENT",
    "CHUNK_RESUME",
    "EXPERT_DTYPE",
    "NO_CACHE",
    "RECURRENT",
    "TOKEN_BY_TOKEN_RESUME",
    "CacheStorage",
    "ChunkOutput",
    "ForwardChunk",
    "LayerLayout",
    "ModelLayout",
    "PagedModel",
    "TensorSpec",
]

EXPERT_DTYPE = np.int16  # routed-expert ids as recorded per token


@dataclass
class ForwardChunk:
    """Tokens at positions ``[start, start + len(token_ids))`` of one sequence.

    ``block_table[i]`` holds positions ``[i*B, (i+1)*B)`` and must cover ``start + len``
    positions (entries beyond that are ignored). ``state_slot`` holds the recurrent state after
    ``start`` tokens; it is not read when ``start == 0`` (the state after no tokens is zero) and
    holds the state after the chunk's last token when ``forward`` returns. ``multimodal`` lists
    ``(start, end, content)`` spans in absolute positions, ``content`` being bytes or a str
    content id (``MultimodalSpan`` objects are accepted too, keyed by their ``content_id``).
    ``writable_blocks``, when not None, is the set of blocks this chunk may write KV into.
    """

    token_ids: list[int]
    start: int
    block_table: list[int] | np.ndarray
    state_slot: int
    adapter: str | None = None
    multimodal: list[tuple[int, int, bytes]] = ()
    writable_blocks: frozenset[int] | None = None


@dataclass
class ChunkOutput:
    """What one chunk produced.

    ``routed_experts`` is ``(len(token_ids), routed_expert_width)`` int16: for each token, the
    expert ids of the model's first router call (ascending), then of the next, and so on.
    ``logits`` are the ``(vocab_size,)`` logits at the chunk's last position.
    """

    next_token: int
    routed_experts: np.ndarray
    logits: np.ndarray = field(repr=False, default=None)


# Layer kinds: what a layer keeps between forwards.
ATTENTION = "attention"  # per-token KV only
RECURRENT = "recurrent"  # a fixed-size state only
ATTENTION_AND_RECURRENT = "attention+recurrent"  # both, in one layer (Falcon-H1, Zamba hybrids)
NO_CACHE = "none"  # nothing (an MLP/MoE-only layer)
LAYER_KINDS = (ATTENTION, RECURRENT, ATTENTION_AND_RECURRENT, NO_CACHE)

# How a chunk that starts after position 0 may run.
CHUNK_RESUME = "chunk"  # one multi-token call from the restored state
TOKEN_BY_TOKEN_RESUME = "token_by_token"  # the model's multi-token path ignores a restored state
RESUME_MODES = (CHUNK_RESUME, TOKEN_BY_TOKEN_RESUME)

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
DTYPE_NAMES = tuple(DTYPE_BYTES)


@dataclass(frozen=True)
class TensorSpec:
    """One cached tensor of a layer: ``shape`` is per token for KV, per slot for a state."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidConfigError("a tensor spec needs a non-empty name")
        if not isinstance(self.shape, tuple) or any(
            isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in self.shape
        ):
            raise InvalidConfigError(f"tensor {self.name!r}: shape must be a tuple of positive ints")
        if self.dtype not in DTYPE_NAMES:
            raise InvalidConfigError(f"tensor {self.name!r}: dtype must be one of {DTYPE_NAMES}")

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class LayerLayout:
    """What layer ``index`` caches: ``kv`` per token (paged), ``state`` per sequence (slots)."""

    index: int
    kind: str
    kv: tuple[TensorSpec, ...] = ()
    state: tuple[TensorSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise InvalidConfigError(f"layer {self.index}: kind must be one of {LAYER_KINDS}")
        wants_kv = self.kind in (ATTENTION, ATTENTION_AND_RECURRENT)
        wants_state = self.kind in (RECURRENT, ATTENTION_AND_RECURRENT)
        if bool(self.kv) != wants_kv or bool(self.state) != wants_state:
            raise InvalidConfigError(f"layer {self.index}: a {self.kind!r} layer has the wrong tensors")
        for specs in (self.kv, self.state):
            names = [spec.name for spec in specs]
            if len(set(names)) != len(names):
                raise InvalidConfigError(f"layer {self.index}: duplicate tensor names {names}")


@dataclass(frozen=True)
class ModelLayout:
    """Everything the engine must know about a model to allocate and copy its cache.

    ``routed_expert_width`` ids are recorded per token (0 for a dense model); ``resume`` says
    whether a chunk after position 0 runs as one call or token by token (``RESUME_MODES``).
    ``serves_adapters`` / ``serves_multimodal``: whether ``ForwardChunk.adapter`` and
    ``ForwardChunk.multimodal`` may be set (the engine refuses such requests otherwise).
    """

    layers: tuple[LayerLayout, ...]
    vocab_size: int
    routed_expert_width: int = 0
    resume: str = CHUNK_RESUME
    serves_adapters: bool = False
    serves_multimodal: bool = False

    def __post_init__(self) -> None:
        if not self.layers or [layer.index for layer in self.layers] != list(range(len(self.layers))):
            raise InvalidConfigError("layers must be numbered 0, 1, ... in order")
        if self.vocab_size < 1 or self.routed_expert_width < 0:
            raise InvalidConfigError("vocab_size must be >= 1 and routed_expert_width >= 0")
        if self.resume not in RESUME_MODES:
            raise InvalidConfigError(f"resume must be one of {RESUME_MODES}")

    @property
    def kv_layers(self) -> tuple[LayerLayout, ...]:
        return tuple(layer for layer in self.layers if layer.kv)

    @property
    def state_layers(self) -> tuple[LayerLayout, ...]:
        return tuple(layer for layer in self.layers if layer.state)

    @property
    def is_hybrid(self) -> bool:
        """Whether a prefix hit needs a recurrent-state checkpoint as well as KV blocks."""
        return bool(self.state_layers)

    @property
    def state_bytes(self) -> int:
        """One sequence's recurrent state, every layer's: what a checkpoint slot holds."""
        return sum(spec.nbytes for layer in self.state_layers for spec in layer.state)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(spec.nbytes for layer in self.kv_layers for spec in layer.kv)

    @property
    def state_weight_tokens(self) -> float:
        """How many tokens of KV one checkpoint weighs (infinitely many when no layer attends)."""
        kv = self.kv_bytes_per_token
        return self.state_bytes / kv if kv else math.inf


@runtime_checkable
class CacheStorage(Protocol):
    """The management calls the engine makes on a model's cache tensors (``CacheTensors`` and
    ``PagedStorage`` both provide them). Every call validates its ids before touching a tensor."""

    num_blocks: int
    block_size: int
    num_state_slots: int

    def check_block(self, block: int) -> None: ...

    def check_slot(self, slot: int) -> None: ...

    def zero_state(self, slot: int) -> None: ...

    def copy_states(self, src_slots: list[int], dst_slots: list[int]) -> None: ...

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None: ...

    def poison_block(self, block: int) -> None: ...

    def poison_state(self, slot: int) -> None: ...


@runtime_checkable
class PagedModel(Protocol):
    """A model served over paged KV blocks and recurrent-state slots.

    ``forward`` validates every chunk before it writes anything. ``replay_experts``, when given,
    holds one entry per chunk: ``None`` or a ``(len(token_ids), layout.routed_expert_width)``
    array of expert ids that the routers must use instead of choosing (routed-expert replay);
    each ``ChunkOutput.routed_experts`` holds the ids actually used (capture).

    ``weights_identity`` is a digest of everything that changes what ``forward`` computes (the
    family, the whole config, every parameter and buffer, adapter derivation, library versions):
    models with equal identities compute the same function, so the tiers share state between
    exactly those.
    """

    layout: ModelLayout

    def weights_identity(self) -> str: ...

    def new_storage(self, *, num_blocks: int, block_size: int, num_state_slots: int) -> CacheStorage: ...

    def forward(
        self,
        chunks: Sequence[ForwardChunk],
        storage: CacheStorage,
        *,
        replay_experts: Sequence[np.ndarray | None] | None = None,
    ) -> list[ChunkOutput]: ...
