"""The reference engine's configuration, validated in full when it is built.

Owns nothing mutable: an ``EngineConfig`` is a frozen value; it derives the cache's and the
scheduler's configurations from its fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridcache.config import CacheConfig
from hybridcache.engine.model import TinyHybridConfig
from hybridcache.engine.model_factory import ModelConfig, model_dtype
from hybridcache.errors import HybridCacheError, InvalidConfigError
from hybridcache.events.config import KVEventsConfig
from hybridcache.policies import DEFAULT_POLICY
from hybridcache.scheduler.scheduler import SchedulerConfig
from hybridcache.tiers.fingerprint import DEFAULT_CHUNK_SIZE
from hybridcache.types import as_bool, as_int, as_names


@dataclass(frozen=True)
class EngineConfig:
    """``model`` is the tiny model's shape (weights drawn from ``seed``) or an ``HFModelConfig``
    naming a local checkpoint. ``dtype`` None means the model's own: float64 for the tiny
    model, ``HFModelConfig.dtype`` for a checkpoint (a different explicit dtype is refused)."""

    block_size: int = 16
    num_kv_blocks: int = 512
    num_state_slots: int = 24
    checkpoint_budget: int = 8
    prefix_caching: bool = True
    max_batch_tokens: int = 256
    max_running: int = 8
    prefill_chunk: int = 64
    decode_checkpoint_interval: int = 0
    checkpoint_chunk_ends: bool = True
    async_depth: int = 0
    seed: int = 0
    dtype: str | None = None
    model: ModelConfig = field(default_factory=TinyHybridConfig)
    adapters: tuple[str, ...] | None = None
    shared_write_guard: bool = True
    max_checkpoints_per_anchor: int = 4
    checkpoint_policy: str = DEFAULT_POLICY  # where to checkpoint and what to keep (hybridcache.policies)
    tier_chunk_size: int = DEFAULT_CHUNK_SIZE  # tokens per stored KV chunk when tiers are given
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # the event streams (off by default)

    def __post_init__(self) -> None:
        """Validate every field now (never first at ``Engine`` construction) and refuse
        configurations that could never serve a request."""
        for name, minimum in _INT_FIELDS.items():
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum, error=InvalidConfigError))
        for name in ("prefix_caching", "checkpoint_chunk_ends", "shared_write_guard"):
            object.__setattr__(self, name, as_bool(name, getattr(self, name), error=InvalidConfigError))
        if not isinstance(self.kv_events, KVEventsConfig):
            raise InvalidConfigError("kv_events must be a KVEventsConfig")
        if self.async_depth not in (0, 1):
            raise InvalidConfigError("async_depth must be 0 or 1")
        model_dtype(self.model, self.dtype)  # refuses an unknown model or a conflicting dtype
        if self.block_size % 2:
            raise InvalidConfigError("block_size must be an even int >= 2")
        if self.num_state_slots - 1 - self.checkpoint_budget < 1:
            raise InvalidConfigError(
                "num_state_slots must leave a runtime slot beside the reserved row and the checkpoint budget"
            )
        if self.decode_checkpoint_interval % self.block_size:
            raise InvalidConfigError("decode_checkpoint_interval must be a multiple of block_size")
        if self.tier_chunk_size % self.block_size:
            raise InvalidConfigError("tier_chunk_size must be a multiple of block_size")
        if self.adapters is not None:
            object.__setattr__(self, "adapters", _config_names("adapters", self.adapters))
        self.scheduler_config()  # validates the batching limits now, not at Engine construction

    @property
    def resolved_dtype(self) -> str:
        """The dtype the model runs in (``dtype``, or the model's own when that is None)."""
        return model_dtype(self.model, self.dtype)

    def cache_config(self, *, hybrid: bool) -> CacheConfig:
        """``hybrid`` comes from the built model's layout (``ModelLayout.is_hybrid``): a
        checkpoint's layer kinds are only known once it is loaded, and validating this config
        must stay cheap."""
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            num_state_slots=self.num_state_slots,
            checkpoint_budget=self.checkpoint_budget,
            prefix_caching=self.prefix_caching,
            decode_checkpoint_interval=self.decode_checkpoint_interval,
            hybrid=hybrid,
            max_checkpoints_per_anchor=self.max_checkpoints_per_anchor,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running,
            prefill_chunk=self.prefill_chunk,
            decode_checkpoint_interval=self.decode_checkpoint_interval,
            checkpoint_chunk_ends=self.checkpoint_chunk_ends,
            checkpoint_policy=self.checkpoint_policy,
        )


def _config_names(name: str, value: object) -> tuple[str, ...]:
    try:
        return as_names(name, value)
    except HybridCacheError as error:
        raise InvalidConfigError(str(error)) from None


_INT_FIELDS = {
    "block_size": 2,
    "num_kv_blocks": 1,
    "num_state_slots": 2,
    "checkpoint_budget": 0,
    "max_batch_tokens": 1,
    "max_running": 1,
    "prefill_chunk": 1,
    "decode_checkpoint_interval": 0,
    "async_depth": 0,
    "seed": 0,
    "max_checkpoints_per_anchor": 1,
    "tier_chunk_size": 2,
}
