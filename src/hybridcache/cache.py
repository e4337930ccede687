"""Build the cache components from one validated ``CacheConfig``: the one composition root,
used by the engine too.

Owns nothing: it only composes the pools and the trie. ``config.hybrid`` decides whether the
trie gets the state pool (every hit then needs a published checkpoint). An engine that owns
its block ids and state rows hands in its own allocators (``memory.protocols``) and may ask
for one reference per block per holder (``borrow_paths=False``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.config import CacheConfig
from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.protocols import KVBlockAllocator, StateSlotAllocator
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.eviction_view import EvictionScores
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.trie import BlockTrie


@dataclass(frozen=True)
class CacheComponents:
    pool: KVBlockAllocator
    states: StateSlotAllocator
    trie: BlockTrie
    eviction: EvictionScores | None = None  # the eviction policy state the trie's heaps score with


def build_cache(
    config: CacheConfig,
    *,
    track_pending: bool = False,
    eviction: EvictionScores | None = None,
    pools: tuple[KVBlockAllocator, StateSlotAllocator] | None = None,
    borrow_paths: bool = True,
) -> CacheComponents:
    """``eviction``: an eviction policy state (``EvictionScores``; the trie reads it and binds
    it), or None for the library's recency order.
    ``pools``: the engine's own (KV allocator, state allocator) instead of new ``BlockPool``
    and ``StatePool``; the KV allocator must hold ``config.num_kv_blocks`` blocks.
    ``borrow_paths``: see ``BlockTrie``."""
    if not isinstance(config, CacheConfig):
        raise InvalidTypeError("config must be a CacheConfig")
    pool, states = _pools(config, pools)
    keyer = BlockKeyer.deterministic(config.block_size) if config.deterministic_keys else None
    trie = BlockTrie(
        pool,
        config.block_size,
        enabled=config.prefix_caching,
        keyer=keyer,
        state_pool=states if config.hybrid else None,
        max_checkpoints_per_anchor=config.max_checkpoints_per_anchor,
        track_pending=track_pending,
        borrow_paths=borrow_paths,
        eviction=eviction,
    )
    return CacheComponents(pool, states, trie, eviction)


def _pools(
    config: CacheConfig, pools: tuple[KVBlockAllocator, StateSlotAllocator] | None
) -> tuple[KVBlockAllocator, StateSlotAllocator]:
    if pools is None:
        return BlockPool(config.num_kv_blocks), StatePool(config.num_state_slots, checkpoint_budget=config.checkpoint_budget)
    if not isinstance(pools, tuple) or len(pools) != 2:
        raise InvalidTypeError("pools must be a (KV block allocator, state slot allocator) pair")
    pool, states = pools
    if not isinstance(pool, KVBlockAllocator) or not isinstance(states, StateSlotAllocator):
        raise InvalidTypeError("pools must be a (KV block allocator, state slot allocator) pair")
    if pool.num_blocks != config.num_kv_blocks:
        raise InvalidArgumentError(f"the KV allocator holds {pool.num_blocks} blocks, the config {config.num_kv_blocks}")
    return pool, states
