"""Prefix identity: namespace seeds, keyed block keys and multimodal identity of a block.

Owns: the secret that keys every hash. A keyer computes, for each complete block of a
sequence, a 64-bit *prefix key* that depends on the namespace, every token up to the block's
end and the multimodal identity of every block so far. Keys are cached on the sequence
(``prefix_state.keys.block_keys``) and extended incrementally as tokens arrive.

How a key is made (all vectorized, no Python loop per block):
1. block hash: a multilinear hash of the block's tokens packed in pairs into 64-bit words,
   ``sum_k word_k * K_k mod 2**64`` with secret odd multipliers ``K`` (universal: two
   different blocks collide with probability <= 2**-32 over the secret);
2. the block's position and the hash of its multimodal spans are mixed in, and a keyed
   SplitMix64 finalizer makes it non-linear;
3. the prefix key is the finalized running sum of those values, seeded by the namespace
   (``prefix_keys``: the only place a sum becomes a key, for stored keys and probes alike).
Steps 1-2 are ``block_values`` alone (``value_of`` is its scalar form for one probe, used only
while a subclass has not changed it), as step 3 is ``prefix_keys`` alone.
Nodes keep their running sum, so keys can resume from any verified node (``resume_at``)
without hashing the blocks before it, and a checkpoint is keyed by its step and the value of
its anchor's last block alone (one block hashed per probe).

A key only narrows a lookup: tokens and multimodal identity are always compared exactly, so a
collision can cost time but never correctness. By default the secret is drawn per process;
``BlockKeyer.deterministic`` gives keys that are equal across processes (cross-process sharing).
Nothing outside one process's trie reads these keys: the hashes KV events announce
(``events.hashing``) and the tier object keys (``tiers.keys``) are BLAKE2b chains of their own.
"""

from __future__ import annotations

import hashlib
import itertools
import os

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.sequence import Sequence
from hybridcache.types import MultimodalSpan, Namespace

_keyer_ids = itertools.count()
_DETERMINISTIC_SECRET = b"hybridcache/deterministic-block-keys/v1"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK = 2**64 - 1
_GOLDEN_INT, _MIX1_INT, _MIX2_INT = int(_GOLDEN), int(_MIX1), int(_MIX2)


def _grown(array: np.ndarray, capacity: int) -> np.ndarray:
    grown = np.zeros(capacity, dtype=np.uint64)
    grown[: array.size] = array
    return grown


def _splitmix(values: np.ndarray) -> np.ndarray:
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _splitmix_int(value: int) -> int:
    """``_splitmix`` of one value in Python integers (same result, no array overhead)."""
    z = (value + _GOLDEN_INT) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1_INT) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2_INT) & _MASK
    return z ^ (z >> 31)


class BlockKeyer:
    """Computes and caches keyed prefix keys of a sequence's complete blocks."""

    def __init__(self, block_size: int, secret: bytes | None = None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
            raise InvalidArgumentError(f"block_size must be an even int >= 2, got {block_size!r}")
        if secret is not None and not isinstance(secret, (bytes, bytearray)):
            raise InvalidTypeError(f"secret must be bytes, got {type(secret).__name__}")
        self.block_size = block_size
        self.keyer_id = next(_keyer_ids)
        self._secret = os.urandom(32) if secret is None else bytes(secret)
        seed = int.from_bytes(hashlib.blake2b(self._secret, digest_size=16).digest(), "little")
        rng = np.random.Generator(np.random.PCG64(seed))
        self._word_keys = rng.integers(0, 2**64, size=block_size // 2, dtype=np.uint64, endpoint=False)
        self._word_keys |= np.uint64(1)
        self._position_key, self._block_key, self._prefix_key = (
            rng.integers(0, 2**64, size=3, dtype=np.uint64, endpoint=False)
        )
        self._namespace_seeds: dict[Namespace, int] = {}
        self._scalar_keys = (int(self._position_key), int(self._block_key))
        # the scalar forms of prefix_keys (finalize) and block_values (value_of), valid only
        # while a subclass has not changed them
        self._scalar_prefix_key = int(self._prefix_key) if type(self).prefix_keys is BlockKeyer.prefix_keys else None
        self._scalar_values = type(self).block_values is BlockKeyer.block_values

    @classmethod
    def deterministic(cls, block_size: int) -> "BlockKeyer":
        """A keyer whose keys are equal in every process (no per-process secret)."""
        return cls(block_size, secret=_DETERMINISTIC_SECRET)

    def _digest(self, payload: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(payload, key=self._secret, digest_size=8).digest(), "little")

    def forget_namespace(self, namespace: Namespace) -> None:
        """Drop the memo of a namespace that no longer caches anything (bounded memory)."""
        self._namespace_seeds.pop(namespace, None)

    def namespace_seed(self, namespace: Namespace) -> int:
        seed = self._namespace_seeds.get(namespace)
        if seed is None:
            seed = self._digest(repr((namespace.adapter, namespace.cache_salt)).encode())
            self._namespace_seeds[namespace] = seed
        return seed

    def spans_hash(self, spans: tuple[MultimodalSpan, ...]) -> int:
        return self._digest(repr(tuple((s.start, s.end, s.modality, s.content_id) for s in spans)).encode())

    def block_values(self, seq: Sequence, blocks: range | np.ndarray) -> np.ndarray:
        """Keyed values of complete blocks ``blocks`` (a range of consecutive blocks, or any
        block indices): multilinear token hash, position and multimodal identity, through a
        non-linear finalizer. The one derivation of a block's value: a prefix key is the
        finalized running sum of these values, and a checkpoint probe hashes one of them
        (``value_of``), so a keyer that changes values (a subclass) changes them everywhere."""
        size = self.block_size
        if isinstance(blocks, range) and blocks.step == 1:
            words = seq.token_words(blocks.start * size, blocks.stop * size).reshape(-1, size // 2)
            indices = np.arange(blocks.start, blocks.stop)
        else:
            indices = np.asarray(blocks, dtype=np.int64)
            if indices.size == 0:
                return np.empty(0, dtype=np.uint64)
            words = seq.token_words(0, (int(indices.max()) + 1) * size).reshape(-1, size // 2)[indices]
        return self._finish(seq, np.einsum("ij,j->i", words, self._word_keys), indices)

    def keys_anew(self, seq: Sequence, blocks: int) -> np.ndarray:
        """The prefix keys of the sequence's first ``blocks`` whole blocks, computed anew in its
        namespace and leaving its cached keys as they are (a run the trie followed by comparing
        tokens has none before ``keys_from``). For an admitted sequence, whose namespace is
        already known, this adds no namespace to the memo."""
        sums = np.cumsum(self.block_values(seq, range(blocks)), dtype=np.uint64)
        sums += np.uint64(self.namespace_seed(seq.namespace))
        return self.prefix_keys(sums)

    def value_of(self, seq: Sequence, index: int) -> int:
        """``block_values`` of one complete block (a single checkpoint probe), in Python
        integers (without NumPy's per-call overhead on tiny arrays) unless a subclass changed
        ``block_values``, which then decides alone."""
        if not self._scalar_values:
            return int(self.block_values(seq, range(index, index + 1))[0])
        size = self.block_size
        words = seq.token_words(index * size, (index + 1) * size)
        position_key, block_key = self._scalar_keys
        value = int(words.dot(self._word_keys)) ^ (((index + 1) * position_key) & _MASK)  # ndarray.dot: no dispatch
        spans = self.identity(seq).get(index)
        if spans is not None:
            value ^= self.spans_hash(spans)
        return _splitmix_int(value ^ block_key)

    def _finish(self, seq: Sequence, hashes: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Mix position and multimodal identity into raw block hashes and finalize them."""
        hashes ^= (indices.astype(np.uint64) + np.uint64(1)) * self._position_key
        identity = self.identity(seq)
        if identity:
            for position, index in enumerate(indices.tolist()):
                spans = identity.get(index)
                if spans is not None:
                    hashes[position] ^= np.uint64(self.spans_hash(spans))
        return _splitmix(hashes ^ self._block_key)

    def prefix_keys(self, block_sums: np.ndarray) -> np.ndarray:
        """The prefix keys of running sums (what the node index stores): the one place a key is
        made from a sum. ``extend`` and ``finalize`` both go through it, so a keyer that
        changes keys (a subclass) cannot make the keys the trie stores and the keys it probes
        with disagree; a probe with a key no node was stored under would read as "not cached"
        and hide what is."""
        return _splitmix(np.asarray(block_sums, dtype=np.uint64) ^ self._prefix_key)

    def finalize(self, block_sum: int) -> int:
        """The prefix key of one running sum: ``prefix_keys`` of one value, in Python integers
        (a one-block probe, without NumPy's per-call overhead) unless a subclass changed
        ``prefix_keys``, which then decides alone."""
        if self._scalar_prefix_key is None:
            return int(self.prefix_keys(np.array([block_sum], dtype=np.uint64))[0])
        return _splitmix_int(block_sum ^ self._scalar_prefix_key)

    def key_after(self, seq: Sequence, index: int, block_sum: int) -> int:
        """The prefix key of complete block ``index`` when the running sum of the blocks
        before it is ``block_sum`` (a node's ``sums`` entry): one block hashed, no extension
        of the sequence's cached keys."""
        block_sum = (block_sum + self.value_of(seq, index)) & _MASK
        if self._scalar_prefix_key is None:
            return self.finalize(block_sum)
        return _splitmix_int(block_sum ^ self._scalar_prefix_key)  # ``finalize``, inline: one call per probe

    def identity(self, seq: Sequence) -> dict[int, tuple[MultimodalSpan, ...]]:
        """Block index -> multimodal spans overlapping it (computed once per sequence)."""
        state = seq.prefix_state
        if state.keys.keyer_id != self.keyer_id:
            state.keys.keyer_id = self.keyer_id
            state.keys.mm_blocks = self._multimodal_blocks(seq)
            state.keys.num_keys = state.keys.keys_from = 0
            state.keys.key_sum = self.namespace_seed(seq.namespace)
        return state.keys.mm_blocks

    def resume_at(self, seq: Sequence, depth: int, block_sum: int) -> None:
        """Continue the sequence's keys from a verified node at ``depth`` whose running sum is
        ``block_sum``, so blocks before it are never hashed. No-op when keys already cover it."""
        state = seq.prefix_state
        self.identity(seq)
        if state.keys.keys_from <= depth <= state.keys.num_keys:
            return
        state.keys.keys_from = state.keys.num_keys = depth
        state.keys.key_sum = block_sum

    def extend(self, seq: Sequence) -> np.ndarray:
        """Prefix keys of the sequence's complete blocks (index i = the block ending at
        (i+1)*B); entries before ``prefix_state.keys.keys_from`` are not computed."""
        state = seq.prefix_state
        self.identity(seq)
        first, end = state.keys.num_keys, seq.num_valid // self.block_size
        if end > first:
            sums = np.cumsum(self.block_values(seq, range(first, end)), dtype=np.uint64)
            sums += np.uint64(state.keys.key_sum)
            if state.keys.block_keys.size < end:
                capacity = max(end, 2 * state.keys.block_keys.size)
                state.keys.block_keys = _grown(state.keys.block_keys, capacity)
                state.keys.block_sums = _grown(state.keys.block_sums, capacity)
            state.keys.block_sums[first:end] = sums
            state.keys.block_keys[first:end] = self.prefix_keys(sums)
            state.keys.key_sum = int(sums[-1])
            state.keys.num_keys = end
        return state.keys.block_keys[:end]

    def _multimodal_blocks(self, seq: Sequence) -> dict[int, tuple[MultimodalSpan, ...]]:
        """Block index -> the spans overlapping that block (only blocks that have any)."""
        if not seq.spans:
            return {}
        size = self.block_size
        indices = sorted({i for span in seq.spans for i in range(span.start // size, (span.end - 1) // size + 1)})
        return {i: seq.spans_overlapping(i * size, (i + 1) * size) for i in indices}
