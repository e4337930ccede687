"""What the cache needs of its pools, so an engine can hand in its own allocators.

Owns nothing: two protocols, and two optional batch extensions of them
(``BatchBlockAllocator``, ``BatchSlotAllocator``) that let ``CacheProtocol.admit_many`` take a
batch's blocks and slots in one call; a pool without them is admitted one by one.
``BlockPool`` and ``StatePool`` satisfy them; an engine that owns its block ids and state rows
(a serving engine's block manager and state manager) wraps them in objects with the same
calls and passes those to ``build_cache`` or ``BlockTrie``. The calls keep the pools'
contract: ids are validated, a failed call changes nothing, and every holder of a block owns
exactly one reference.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from hybridcache.memory.state_pool import SlotRole
from hybridcache.sequence import Sequence


@runtime_checkable
class KVBlockAllocator(Protocol):
    """Reference-counted KV block ids with recency stamps from one logical clock."""

    num_blocks: int

    @property
    def num_free(self) -> int: ...

    def allocate(self, count: int) -> np.ndarray:
        """``count`` free blocks, each with one reference, stamped now."""

    def ref(self, block_ids: object, *, unique: bool = False) -> None: ...

    def unref(self, block_ids: object, *, unique: bool = False) -> np.ndarray:
        """Drop one reference per occurrence; returns the ids freed."""

    def refcount_of(self, block_id: int) -> int: ...

    def stamp_of(self, block_id: int) -> int: ...

    def stamp_now(self, block_id: int) -> None: ...

    def raise_stamp(self, block_id: int, stamp: int) -> None: ...

    def tick(self) -> int:
        """Advance the logical clock; stamps kept elsewhere compare with block stamps."""

    def grow_table(self, seq: Sequence, num_tokens: int, block_size: int) -> np.ndarray: ...

    def check_invariants(self, expected_refcounts: np.ndarray | None = None) -> None: ...


@runtime_checkable
class StateSlotAllocator(Protocol):
    """Recurrent-state rows in two roles: runtime (running sequences) and checkpoint."""

    @property
    def num_free(self) -> int: ...

    @property
    def num_free_runtime(self) -> int: ...

    @property
    def num_free_checkpoint(self) -> int: ...

    @property
    def num_runtime(self) -> int: ...

    @property
    def num_checkpoint(self) -> int: ...

    def role_of(self, slot: int) -> SlotRole: ...

    def allocate_runtime(self) -> int: ...

    def allocate_checkpoint(self) -> int: ...

    def free_runtime(self, slot: int) -> None: ...

    def free_checkpoint(self, slot: int) -> None: ...

    def check_invariants(self) -> None: ...


@runtime_checkable
class BatchBlockAllocator(Protocol):
    """A ``KVBlockAllocator`` that hands out the blocks of several deferred ``allocate``
    calls at once, in their order and with the stamps their ticks reserved, and reserves
    several ticks at once (a batch's restore pins and allocations)."""

    @property
    def clock(self) -> int: ...

    def allocate_stamped(self, stamps: np.ndarray, beneath: int = 0) -> np.ndarray: ...

    def tick_many(self, count: int) -> int: ...


@runtime_checkable
class BatchSlotAllocator(Protocol):
    """A ``StateSlotAllocator`` that hands out the slots of several deferred
    ``allocate_runtime`` calls at once, in their order."""

    def allocate_runtimes(self, count: int, beneath: int = 0) -> list[int]: ...
