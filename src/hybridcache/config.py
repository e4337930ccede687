"""Validated configuration dataclasses. Invalid values raise ``InvalidConfigError`` at construction."""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.errors import InvalidConfigError
from hybridcache.types import as_bool, as_int

_INT_FIELDS = {
    "block_size": 2,
    "num_kv_blocks": 0,
    "num_state_slots": 1,
    "checkpoint_budget": 0,
    "decode_checkpoint_interval": 0,
    "max_checkpoints_per_anchor": 1,
}


@dataclass(frozen=True)
class CacheConfig:
    """Geometry and budgets shared by the pools and the prefix cache.

    ``block_size`` is the unit of trie identity and KV ownership. It must be even because block
    keys hash token pairs packed into 64-bit words.
    ``hybrid`` is the one rule for "hybrid": the model has recurrent layers, so every hit needs
    a published state checkpoint (and the trie gets the state pool).
    ``num_state_slots`` counts every recurrent-state row including the reserved row 0.
    ``checkpoint_budget`` rows are kept out of the runtime cap so checkpoints always have room.
    ``decode_checkpoint_interval`` (0 = off) must be a multiple of ``block_size``.
    ``deterministic_keys`` makes block keys equal across processes (for cross-process sharing);
    by default keys are keyed by a per-process secret.
    """

    block_size: int = 64
    num_kv_blocks: int = 1024
    num_state_slots: int = 1
    checkpoint_budget: int = 0
    prefix_caching: bool = True
    decode_checkpoint_interval: int = 0
    deterministic_keys: bool = False
    hybrid: bool = False
    max_checkpoints_per_anchor: int = 4

    def __post_init__(self) -> None:
        for name, minimum in _INT_FIELDS.items():
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum, error=InvalidConfigError))
        for name in ("prefix_caching", "deterministic_keys", "hybrid"):
            object.__setattr__(self, name, as_bool(name, getattr(self, name), error=InvalidConfigError))
        if self.block_size % 2:
            raise InvalidConfigError(f"block_size must be even, got {self.block_size}")
        if self.decode_checkpoint_interval % self.block_size:
            raise InvalidConfigError("decode_checkpoint_interval must be a multiple of block_size")
        if self.hybrid and self.num_state_slots < 2:
            raise InvalidConfigError("a hybrid cache needs num_state_slots >= 2 (slot 0 is reserved)")

    @property
    def num_runtime_state_slots(self) -> int:
        """Rows runtime states may hold: all but the reserved row and the checkpoint budget."""
        return max(0, self.num_state_slots - 1 - self.checkpoint_budget)
