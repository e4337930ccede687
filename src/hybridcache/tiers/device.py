"""What the side holding the device cache lends a tier client (``tiers.client.TierClient``):
the engine's tensors (``engine.tiering``), or the replay's cache with stand-in payloads
(``replay.adapter.CacheAdapter``). Below the client, so a device's module never imports it.

Owns no state: protocols and one frozen value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import numpy as np

from hybridcache.sequence import Sequence
from hybridcache.tiers.restore import Restore


class DeviceAdoption(NamedTuple):
    """What ``TierDevice.adopt`` made of a restore: the tokens gained (0: refused), and why a
    refused write was refused (None: the device cache itself declined, or nothing was refused)."""

    gained: int
    refused: str | None = None


class Payloads(Protocol):
    """The arrays of one publish: KV chunk ``index`` of the sequence, and its state at the step."""

    def chunk(self, index: int) -> Mapping[str, np.ndarray]: ...

    def state(self) -> Mapping[str, np.ndarray]: ...


class TierDevice(Protocol):
    """What the side holding the device cache lends a tier client."""

    def cached_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        """The device cache's checkpoint step and whole-block KV tokens for ``seq``; None when
        it caches nothing (no restore can be adopted)."""

    def adopt(self, prefix: Sequence, restore: Restore) -> DeviceAdoption:
        """Cache ``prefix`` (exactly ``restore.step`` tokens) from the verified ``restore``."""

    def payloads(self, seq: Sequence, slot: int) -> Payloads:
        """What a publish of ``seq`` reads: its KV blocks, and its state in ``slot``."""
