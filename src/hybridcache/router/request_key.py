"""A request as a router sees it: its prompt tokens, namespace and block hash chains.

Owns: the chains computed so far, one per block size (a router may front replicas with
different block sizes), so scoring several replicas hashes the prompt once.
"""

from __future__ import annotations

from hybridcache.events.hashing import chain_hashes


class RequestKey:
    def __init__(self, token_ids: list[int], lora_name: str | None = None, cache_salt: str | None = None) -> None:
        self.token_ids = list(token_ids)
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self._chains: dict[int, list[int]] = {}

    def chain(self, block_size: int) -> list[int]:
        chain = self._chains.get(block_size)
        if chain is None:
            chain = chain_hashes(self.token_ids, block_size, self.lora_name, self.cache_salt)
            self._chains[block_size] = chain
        return chain
