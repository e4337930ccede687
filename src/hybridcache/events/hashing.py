"""Content-determined block hashes (nothing mutable).

A block's hash is BLAKE2b with an 8-byte digest (personalization ``hc-block``), read as an
unsigned 64-bit big-endian int, over: ``0x00`` for the first block or ``0x01`` and the parent
hash (8 bytes, big-endian), the block's token ids as little-endian uint32, and, when the block
has any, the msgpack array ``[extra key, lora name]``. Equal content in the same namespace
gives the same hash in every process, so the hashes one replica announces mean the same
prefix on every other and a router can hash a request itself. The chain mirrors vLLM's (each
hash covers the whole prefix through its parent); the cache salt enters as the first block's
extra key and the adapter as ``lora_name``, as vLLM does.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as Seq

import msgspec
import numpy as np

_ENCODE = msgspec.msgpack.Encoder().encode
_PERSON = b"hc-block"
SALT_KEY = "salt"  # the first element of the extra key that carries a cache salt


def _hash(parent: int | None, token_bytes: bytes, extra: tuple | None, lora_name: str | None) -> int:
    hasher = hashlib.blake2b(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "big"), digest_size=8, person=_PERSON)
    hasher.update(token_bytes)
    if extra is not None or lora_name is not None:
        hasher.update(_ENCODE((extra, lora_name)))
    return int.from_bytes(hasher.digest(), "big")


def block_hash(parent: int | None, token_ids: Seq[int], extra: tuple | None = None, lora_name: str | None = None) -> int:
    """The hash of one full block after the chain ending in ``parent`` (None: the first block)."""
    tokens = token_ids if isinstance(token_ids, list) else np.asarray(token_ids, dtype=np.int64).tolist()
    return _hash(parent, struct.pack(f"<{len(tokens)}I", *tokens), extra, lora_name)


def first_block_extra(cache_salt: str | None) -> tuple | None:
    """The extra key of a chain's first block: the cache salt (None when there is none)."""
    return None if cache_salt is None else (SALT_KEY, cache_salt)


def chain_hashes(
    token_ids: Seq[int], block_size: int, lora_name: str | None = None, cache_salt: str | None = None
) -> list[int]:
    """Hashes of every full block of ``token_ids`` from the first token (partial tail ignored)."""
    data = np.asarray(token_ids, dtype="<u4").tobytes()
    width = 4 * block_size
    hashes: list[int] = []
    parent = None
    for index in range(len(data) // width):
        extra = first_block_extra(cache_salt) if index == 0 else None
        parent = _hash(parent, data[index * width : (index + 1) * width], extra, lora_name)
        hashes.append(parent)
    return hashes
