"""Content-addressed object keys: a BLAKE2b chain over the namespace and each chunk's content.

Owns no shared state. A :class:`KeyChain` owns the validated tokens and spans of one request and
the digests of its complete chunks, computed once at construction.

Chunk ``i`` covers tokens ``[i*C, (i+1)*C)`` for the fingerprint's chunk size ``C``. Its digest is
``d_i = BLAKE2b-256(d_{i-1} || start || tokens || multimodal identity of the chunk)`` with
``d_-1`` the fingerprint digest, so equal prefixes in one namespace give equal keys in every
process, and a change of any token, span or fingerprint field changes every later key. A
checkpoint at step ``s = k*C`` is keyed by ``d_{k-1}``, the digest of the chunk ending at ``s``;
the object kind is part of the key, so a chunk and a checkpoint never share one.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidKeyError, InvalidStepError, InvalidTypeError
from hybridcache.sequence import MultimodalSpan, Sequence, as_token_array
from hybridcache.types import as_int, validated_spans
from hybridcache.tiers import wire
from hybridcache.tiers.fingerprint import DIGEST_BYTES, FORMAT_VERSION, NamespaceFingerprint, tier_text

_CHAIN_PERSON = b"hc-kv-chain"


class ObjectKind(enum.IntEnum):
    """What an object holds; the value is its header byte."""

    KV_CHUNK = 1
    CHECKPOINT = 2

    @property
    def tag(self) -> str:
        return _TAGS[self]


_TAGS = {ObjectKind.KV_CHUNK: "kv", ObjectKind.CHECKPOINT: "ck"}
_KEY_NAME = re.compile(rf"hc{FORMAT_VERSION}-(kv|ck)-([0-9a-f]{{{2 * DIGEST_BYTES}}})")


@dataclass(frozen=True)
class ObjectKey:
    """An object's identity: its kind and its chain digest. ``name`` is the key in every store
    (spelled once, when the key is made: every phase of a lookup reads it)."""

    kind: ObjectKind
    digest: bytes
    name: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ObjectKind):
            raise InvalidTypeError("kind must be an ObjectKind")
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_BYTES:
            raise InvalidArgumentError(f"digest must be {DIGEST_BYTES} bytes")
        object.__setattr__(self, "name", f"hc{FORMAT_VERSION}-{self.kind.tag}-{self.digest.hex()}")

    @classmethod
    def from_name(cls, name: str) -> ObjectKey:
        match = _KEY_NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise InvalidKeyError(f"not an object key name: {name!r}")
        kind = next(k for k, tag in _TAGS.items() if tag == match.group(1))
        return cls(kind, bytes.fromhex(match.group(2)))


def chain_step(previous: bytes, start: int, tokens: np.ndarray, spans: tuple[MultimodalSpan, ...]) -> bytes:
    """The digest of one chunk given the digest before it."""
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_CHAIN_PERSON)
    hasher.update(previous)
    hasher.update(wire.pack_u64(start))
    hasher.update(wire.pack_u32(tokens.size))
    hasher.update(np.ascontiguousarray(tokens, dtype=wire.TOKEN_WIRE_DTYPE).tobytes())
    hasher.update(wire.encode_spans(spans))
    return hasher.digest()


@dataclass(frozen=True)
class Expectation:
    """What a fetched object must be: checked field by field by :func:`hybridcache.tiers.verify`."""

    key: ObjectKey
    fingerprint: NamespaceFingerprint
    start: int
    step: int
    tokens: np.ndarray
    multimodal: tuple[MultimodalSpan, ...]


def _as_carried(span: MultimodalSpan) -> MultimodalSpan:
    """``span`` with its modality and content id as headers carry them (``tier_text``)."""
    modality, content_id = tier_text(span.modality), tier_text(span.content_id)
    if (modality, content_id) == (span.modality, span.content_id):
        return span
    return replace(span, modality=modality, content_id=content_id)


class KeyChain:
    """Keys of every complete chunk and chunk-aligned checkpoint of one request's tokens.

    The keys are made once, at construction, and are plain data the phases of a lookup or a
    publish read (``steps``, ``chunk_keys``/``chunk_names`` by chunk index,
    ``checkpoint_keys``/``checkpoint_names`` by step) rather than derive again; the methods
    are the validating way in for callers holding an index or a step of their own."""

    def __init__(self, fingerprint: NamespaceFingerprint, tokens: object, multimodal: object = ()) -> None:
        if not isinstance(fingerprint, NamespaceFingerprint):
            raise InvalidTypeError("fingerprint must be a NamespaceFingerprint")
        self.fingerprint = fingerprint
        self.tokens = as_token_array(tokens)
        self.tokens.flags.writeable = False
        self.spans = tuple(_as_carried(span) for span in validated_spans(multimodal, self.tokens.size))
        self.chunk_size = fingerprint.chunk_size
        self._digests = self._chain()
        size = self.chunk_size
        self.chunk_keys = tuple(ObjectKey(ObjectKind.KV_CHUNK, digest) for digest in self._digests)
        self.chunk_names = tuple(key.name for key in self.chunk_keys)
        checkpoints = {(i + 1) * size: ObjectKey(ObjectKind.CHECKPOINT, d) for i, d in enumerate(self._digests)}
        self.checkpoint_keys = MappingProxyType(checkpoints)
        self.checkpoint_names = MappingProxyType({step: key.name for step, key in checkpoints.items()})
        self.steps = tuple(checkpoints)

    def prefix(self, end: int) -> KeyChain:
        """The chain of tokens ``[0, end)`` (``end`` a chunk boundary): the digests already
        made, kept, not computed again (one chain per request serves its routing, restore and
        publish). ``self`` when it ends there."""
        if isinstance(end, bool) or not isinstance(end, int):
            raise InvalidTypeError("end must be an int")
        if end == self.tokens.size:
            return self
        if end < 0 or end % self.chunk_size or end > self.tokens.size:
            raise InvalidArgumentError(f"end {end} is not a chunk boundary within the chain's {self.tokens.size} tokens")
        if any(span.start < end < span.end for span in self.spans):
            raise InvalidArgumentError(f"end {end} cuts a multimodal span")
        count = end // self.chunk_size
        chain = object.__new__(KeyChain)
        chain.fingerprint, chain.chunk_size, chain.tokens = self.fingerprint, self.chunk_size, self.tokens[:end]
        chain.spans = tuple(span for span in self.spans if span.start < end)
        chain._digests, chain.chunk_keys, chain.chunk_names = (
            self._digests[:count], self.chunk_keys[:count], self.chunk_names[:count]
        )
        chain.steps = self.steps[:count]
        chain.checkpoint_keys = MappingProxyType({step: self.checkpoint_keys[step] for step in chain.steps})
        chain.checkpoint_names = MappingProxyType({step: self.checkpoint_names[step] for step in chain.steps})
        return chain

    def describes(self, base: NamespaceFingerprint, sequence: Sequence, end: int) -> bool:
        """Whether this chain's first ``end`` tokens, namespace and spans are ``sequence``'s own
        (``base`` with its adapter and cache salt): a chain made earlier may stand in for
        ``for_sequence(base, sequence, end)`` only then."""
        namespace = sequence.namespace
        if self.fingerprint != base.in_namespace(namespace.adapter, namespace.cache_salt):
            return False
        if end > self.tokens.size or end > sequence.num_tokens:
            return False
        own_spans = tuple(_as_carried(span) for span in sequence.spans_overlapping(0, end))
        return (
            tuple(span for span in self.spans if span.start < end) == own_spans
            and np.array_equal(self.tokens[:end], sequence.token_view(0, end))
        )

    @classmethod
    def for_sequence(cls, base: NamespaceFingerprint, sequence: Sequence, end: int | None = None) -> KeyChain:
        """The chain of a sequence's tokens ``[0, end)`` (default: all of them) in its own
        namespace (``base`` with the sequence's adapter and cache salt)."""
        if not isinstance(sequence, Sequence):
            raise InvalidTypeError("sequence must be a hybridcache.Sequence")
        if not isinstance(base, NamespaceFingerprint):
            raise InvalidTypeError("base must be a NamespaceFingerprint")
        end = sequence.num_tokens if end is None else as_int("end", end, 0)
        if end > sequence.num_tokens:
            raise InvalidArgumentError(f"end {end} beyond the sequence's {sequence.num_tokens} tokens")
        namespace = sequence.namespace
        fingerprint = base.in_namespace(namespace.adapter, namespace.cache_salt)
        return cls(fingerprint, sequence.token_view(0, end), sequence.spans_overlapping(0, end))

    def _chain(self) -> tuple[bytes, ...]:
        digests = []
        previous = self.fingerprint.digest
        for index in range(self.num_chunks):
            start, end = self.chunk_range(index)
            previous = chain_step(previous, start, self.tokens[start:end], self.spans_in(start, end))
            digests.append(previous)
        return tuple(digests)

    @property
    def num_chunks(self) -> int:
        """Complete chunks; a partial tail chunk is never stored."""
        return self.tokens.size // self.chunk_size

    def chunk_range(self, index: int) -> tuple[int, int]:
        self._check_index(index)
        return index * self.chunk_size, (index + 1) * self.chunk_size

    def spans_in(self, start: int, end: int) -> tuple[MultimodalSpan, ...]:
        """The request's spans with any position in ``[start, end)``."""
        return tuple(span for span in self.spans if span.end > start and span.start < end)

    def chunk_key(self, index: int) -> ObjectKey:
        self._check_index(index)
        return self.chunk_keys[index]

    def checkpoint_steps(self) -> tuple[int, ...]:
        """Every step a checkpoint of this request may sit at, shallowest first."""
        return self.steps

    def checkpoint_key(self, step: int) -> ObjectKey:
        return self.checkpoint_keys[self.steps[self._checkpoint_index(step)]]

    def expect_chunk(self, index: int) -> Expectation:
        start, end = self.chunk_range(index)
        return Expectation(
            self.chunk_key(index), self.fingerprint, start, end, self.tokens[start:end], self.spans_in(start, end)
        )

    def expect_checkpoint(self, step: int) -> Expectation:
        key = self.checkpoint_key(step)
        return Expectation(key, self.fingerprint, 0, step, self.tokens[:step], self.spans_in(0, step))

    def _check_index(self, index: object) -> None:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise InvalidTypeError("chunk index must be an int")
        if not 0 <= index < self.num_chunks:
            raise InvalidArgumentError(f"chunk index {index} outside [0, {self.num_chunks})")

    def _checkpoint_index(self, step: object) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise InvalidTypeError("step must be an int")
        if step <= 0 or step % self.chunk_size or step > self.num_chunks * self.chunk_size:
            raise InvalidStepError(
                f"checkpoint step {step} must be a positive multiple of {self.chunk_size} "
                f"within the {self.num_chunks} complete chunks"
            )
        return int(step) // self.chunk_size - 1
