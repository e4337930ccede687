"""A request as a router sees it: its prompt tokens, namespace and block hash chains.

Owns: the prompt's tokens (also as an array, to compare prompts) and the chains computed so far, one per block size (a router may front replicas with
different block sizes), so scoring several replicas hashes the prompt once. A key is built only
from what can be hashed: token ids in ``[0, 2**31)`` (what every replica accepts) and names
that encode to UTF-8; anything else raises ``InvalidTokenError``, ``InvalidTypeError`` or
``InvalidNamespaceError`` at construction, so scoring never fails on a client's values.
"""

from __future__ import annotations

import numpy as np

from hybridcache.errors import InvalidNamespaceError
from hybridcache.events.hashing import chain_hashes
from hybridcache.sequence import as_token_array


def _hashable_name(name: str, value: str | None) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidNamespaceError(f"{name} must be a str or None, got {type(value).__name__}")
    try:
        (value or "").encode("utf-8")
    except UnicodeEncodeError as reason:
        raise InvalidNamespaceError(f"{name} is not valid Unicode text ({reason.reason})") from None
    return value


class RequestKey:
    def __init__(self, token_ids: list[int], lora_name: str | None = None, cache_salt: str | None = None) -> None:
        self._tokens = as_token_array(token_ids)
        self.token_ids = self._tokens.tolist()
        self.lora_name = _hashable_name("lora_name", lora_name)
        self.cache_salt = _hashable_name("cache_salt", cache_salt)
        self._chains: dict[int, list[int]] = {}

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
