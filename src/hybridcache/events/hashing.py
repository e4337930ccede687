"""Content-determined block hashes (nothing mutable).

A block's hash is the low 64 bits (unsigned) of BLAKE2b over the msgpack array ``[parent
hash or nil, token ids, extra keys, lora name]``: equal content in the same namespace gives the
same hash in every process, so the hashes one replica announces mean the same prefix on every
other and a router can hash a request itself. The chain mirrors vLLM's (each hash covers the
whole prefix through its parent); the cache salt enters as the first block's extra key and the
adapter as ``lora_name``, as vLLM does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

import msgspec

_ENCODE = msgspec.msgpack.Encoder().encode
SALT_KEY = "salt"  # the first element of the extra key that carries a cache salt


def block_hash(parent: int | None, token_ids: Seq[int], extra: tuple | None = None, lora_name: str | None = None) -> int:
    """The hash of one full block after the chain ending in ``parent`` (None: the first block)."""
    data = _ENCODE((parent, list(token_ids), extra, lora_name))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def first_block_extra(cache_salt: str | None) -> tuple | None:
    """The extra key of a chain's first block: the cache salt (None when there is none)."""
    return None if cache_salt is None else (SALT_KEY, cache_salt)


def chain_hashes(
    token_ids: Seq[int], block_size: int, lora_name: str | None = None, cache_salt: str | None = None
) -> list[int]:
    """Hashes of every full block of ``token_ids`` from the first token (partial tail ignored)."""
    hashes: list[int] = []
    parent = None
    tokens = list(token_ids)
    for index in range(len(tokens) // block_size):
        extra = first_block_extra(cache_salt) if index == 0 else None
        parent = block_hash(parent, tokens[index * block_size : (index + 1) * block_size], extra, lora_name)
        hashes.append(parent)
    return hashes
