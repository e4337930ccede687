"""The prefix cache: block trie, identity, KV lifecycle and statistics."""

from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.stats import MissReason, PrefixCacheStats
from hybridcache.prefix_cache.trie import BlockTrie, MatchTxn

__all__ = ["BlockKeyer", "BlockTrie", "MatchTxn", "MissReason", "PrefixCacheStats"]
