"""Validated configuration dataclasses. Invalid values raise ``InvalidConfigError`` at construction."""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.errors import InvalidConfigError


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfigError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    """Geometry and budgets shared by the pools and the prefix cache.

    ``block_size`` is the unit of trie identity and KV ownership. It must be even because block
    keys hash token pairs packed into 64-bit words.
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

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 2)
        if self.block_size % 2:
            raise InvalidConfigError(f"block_size must be even, got {self.block_size}")
        _require_int("num_kv_blocks", self.num_kv_blocks, 0)
        _require_int("num_state_slots", self.num_state_slots, 1)
        _require_int("checkpoint_budget", self.checkpoint_budget, 0)
        _require_int("decode_checkpoint_interval", self.decode_checkpoint_interval, 0)
        if self.decode_checkpoint_interval % self.block_size:
            raise InvalidConfigError("decode_checkpoint_interval must be a multiple of block_size")
        for flag in ("prefix_caching", "deterministic_keys"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidConfigError(f"{flag} must be a bool")

    @property
    def num_runtime_state_slots(self) -> int:
        """Rows runtime states may hold: all but the reserved row and the checkpoint budget."""
        return max(0, self.num_state_slots - 1 - self.checkpoint_budget)
