"""A request as a router sees it: its prompt tokens, namespace and block hash chains.

Owns: the prompt's tokens (also as an array, to compare prompts) and the chains computed so far, one per block size (a router may front replicas with
different block sizes), so scoring several replicas hashes the prompt once.
"""

from __future__ import annotations

import numpy as np

from hybridcache.events.hashing import chain_hashes


class RequestKey:
    def __init__(self, token_ids: list[int], lora_name: str | None = None, cache_salt: str | None = None) -> None:
        self.token_ids = list(token_ids)
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self._chains: dict[int, list[int]] = {}
        try:
            self._tokens = np.asarray(self.token_ids, dtype=np.int64)
        except OverflowError:  # an id no replica accepts; compared all the same
            self._tokens = np.asarray(self.token_ids, dtype=object)

    def shared_prefix(self, other: RequestKey) -> int:
        """How many leading tokens this prompt shares with ``other``'s, in one namespace (0 across two)."""
        if (self.lora_name, self.cache_salt) != (other.lora_name, other.cache_salt):
            return 0
        length = min(len(self._tokens), len(other._tokens))
        differ = np.flatnonzero(self._tokens[:length] != other._tokens[:length])
        return int(differ[0]) if differ.size else length

    def chain(self, block_size: int) -> list[int]:
        chain = self._chains.get(block_size)
        if chain is None:
            chain = chain_hashes(self.token_ids, block_size, self.lora_name, self.cache_salt)
            self._chains[block_size] = chain
        return chain
