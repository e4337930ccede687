"""What one replay run is asked to do: ``RunConfig``, validated once, when it is built.

Owns nothing mutable: a frozen value. Every option of ``replay`` is checked here and nowhere
after (the run trusts it); the pools the budget buys are derived here too, so a budget that
buys nothing, or more than this machine can hold, is refused before a request is served. The
tier store it names (``tiers.shared``) is the caller's, borrowed by the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.policies import Policy
from hybridcache.profiles import ModelProfile
from hybridcache.replay.adapter import PoolGeometry
from hybridcache.replay.budgets import Budget, pool_geometry
from hybridcache.replay.routing import check_routing
from hybridcache.replay.tiering import TierSetup
from hybridcache.types import as_int

DEFAULT_BLOCK_SIZE = 32  # Marconi's vLLM+ block; interval:32 checkpoints stay block aligned
DEFAULT_PREFILL_CHUNK = 2048  # the engine's prefill chunk: no chunk allocates more blocks at once
DEFAULT_DEVICE_TFLOPS = 400.0  # ~40 % of an H100's dense BF16 peak: the TTFT estimate's device


@dataclass(frozen=True)
class RunConfig:
    """One run: the model ``profile``, the ``policy``, the ``budget`` each of ``replicas``
    replicas gets, the library ``block_size`` (even), the ``prefill_chunk`` the engine would cut,
    the ``routing`` between replicas, the ``tiers`` (None: none) and the sustained
    ``device_tflops`` of the TTFT estimate. ``geometry``: the pools the budget buys a replica."""

    profile: ModelProfile
    policy: Policy
    budget: Budget
    block_size: int = DEFAULT_BLOCK_SIZE
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    replicas: int = 1
    routing: str = "round-robin"
    tiers: TierSetup | None = None
    device_tflops: float = DEFAULT_DEVICE_TFLOPS
    geometry: PoolGeometry = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for value, kind in ((self.profile, ModelProfile), (self.policy, Policy), (self.budget, Budget)):
            if not isinstance(value, kind):
                raise InvalidTypeError(f"expected a {kind.__name__}, got {type(value).__name__}")
        block_size = as_int("block_size", self.block_size, 2)
        if block_size % 2:
            raise InvalidArgumentError(f"block_size must be an even int >= 2, got {block_size}")
        self._set("block_size", block_size)
        self._set("prefill_chunk", as_int("prefill_chunk", self.prefill_chunk, 1))
        self._set("replicas", as_int("replicas", self.replicas, 1))
        self._set("routing", check_routing(self.routing))
        self._check_tiers()
        tflops = self.device_tflops
        if isinstance(tflops, bool) or not isinstance(tflops, (int, float)) or not tflops > 0:
            raise InvalidArgumentError(f"device_tflops must be > 0, got {tflops!r}")
        self._set("geometry", pool_geometry(self.budget, self.profile, block_size, self.replicas))

    def _check_tiers(self) -> None:
        tiers = self.tiers
        if tiers is None:
            return
        if not isinstance(tiers, TierSetup):
            raise InvalidTypeError(f"tiers must be a TierSetup, got {type(tiers).__name__}")
        if tiers.chunk_size % self.block_size:
            raise InvalidArgumentError(
                f"--tier-chunk {tiers.chunk_size} must be a multiple of the block size {self.block_size}"
            )

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # the checked (normalized) value of a frozen field

    @property
    def tiered(self) -> bool:
        """Whether any tier is enabled (a host tier or a shared store)."""
        return self.tiers is not None and self.tiers.enabled

    @property
    def shared_tier(self) -> str:
        return self.tiers.shared_name if self.tiers is not None else "none"
