"""Build the cache components from one validated ``CacheConfig``: the one composition root,
used by the engine too.

Owns nothing: it only composes the pools and the trie. ``config.hybrid`` decides whether the
trie gets the state pool (every hit then needs a published checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hybridcache.config import CacheConfig
from hybridcache.errors import InvalidTypeError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.trie import BlockTrie


@runtime_checkable
class EvictionScores(Protocol):
    """What an eviction policy gives the trie: a score per KV leaf slot and per checkpoint
    record (lowest goes first; see ``prefix_cache.lru``), and a hook that sees the built trie.
    ``hybridcache.policies`` has the project's policies."""

    def kv_score(self, slot: int) -> object: ...

    def checkpoint_score(self, record: CheckpointRecord) -> object: ...

    def bind(self, trie: BlockTrie) -> None: ...


@dataclass(frozen=True)
class CacheComponents:
    pool: BlockPool
    states: StatePool
    trie: BlockTrie
    eviction: EvictionScores | None = None  # the eviction policy state the trie's heaps score with


def build_cache(
    config: CacheConfig, *, track_pending: bool = False, eviction: EvictionScores | None = None
) -> CacheComponents:
    """``eviction``: an eviction policy state, or None for the library's recency order."""
    if not isinstance(config, CacheConfig):
        raise InvalidTypeError("config must be a CacheConfig")
    if eviction is not None and not isinstance(eviction, EvictionScores):
        raise InvalidTypeError("eviction must be an eviction policy state (kv_score, checkpoint_score, bind)")
    pool = BlockPool(config.num_kv_blocks)
    states = StatePool(config.num_state_slots, checkpoint_budget=config.checkpoint_budget)
    keyer = BlockKeyer.deterministic(config.block_size) if config.deterministic_keys else None
    trie = BlockTrie(
        pool,
        config.block_size,
        enabled=config.prefix_caching,
        keyer=keyer,
        state_pool=states if config.hybrid else None,
        max_checkpoints_per_anchor=config.max_checkpoints_per_anchor,
        track_pending=track_pending,
        kv_score=None if eviction is None else eviction.kv_score,
        checkpoint_score=None if eviction is None else eviction.checkpoint_score,
    )
    if eviction is not None:
        eviction.bind(trie)
    return CacheComponents(pool, states, trie, eviction)
