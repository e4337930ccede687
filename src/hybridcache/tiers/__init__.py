"""Tiered and shared caching of KV chunks and recurrent-state checkpoints, exact on fetch.

Owns no state itself. The object model (:mod:`~hybridcache.tiers.fingerprint`,
:mod:`~hybridcache.tiers.keys`, :mod:`~hybridcache.tiers.objects`,
:mod:`~hybridcache.tiers.verify`) needs only NumPy; the stores live in
:mod:`hybridcache.tiers.backends`; :class:`TieredStore` stores prefixes into them and fetches
verified ones back, each tier behind a :class:`CircuitBreaker`, its phases in their own modules
(``tier_calls``, ``publish`` for the write phase, ``restore`` for the read phase, ``restore_cost``);
:class:`TierClient` is what the engine and the replay call (adopt a prefix, store the computed
steps, :class:`TierStats`), each lending it a device side (``device``: :class:`TierDevice`).
The format and the failure rules are in ``docs/tiers.md``.
"""

from hybridcache.tiers.breaker import CircuitBreaker
from hybridcache.tiers.client import TierClient, TierStats
from hybridcache.tiers.device import TierDevice
from hybridcache.tiers.fingerprint import DEFAULT_CHUNK_SIZE, FORMAT_VERSION, NamespaceFingerprint
from hybridcache.tiers.keys import Expectation, KeyChain, ObjectKey, ObjectKind
from hybridcache.tiers.objects import (
    ROUTED_EXPERTS,
    ObjectHeader,
    StoredObject,
    decode,
    decode_header,
    encode_checkpoint,
    encode_kv_chunk,
)
from hybridcache.tiers.publish import PublishReport
from hybridcache.tiers.restore import Restore
from hybridcache.tiers.restore_cost import RestoreCost
from hybridcache.tiers.tier_calls import TierAccess
from hybridcache.tiers.tiered import TieredStore
from hybridcache.tiers.verify import FetchMiss, FetchVerdict, verify

__all__ = [
    "CircuitBreaker",
    "DEFAULT_CHUNK_SIZE",
    "FORMAT_VERSION",
    "ROUTED_EXPERTS",
    "Expectation",
    "KeyChain",
    "FetchMiss",
    "NamespaceFingerprint",
    "ObjectHeader",
    "ObjectKey",
    "ObjectKind",
    "PublishReport",
    "Restore",
    "RestoreCost",
    "StoredObject",
    "TierAccess",
    "TierClient",
    "TierDevice",
    "TierStats",
    "TieredStore",
    "FetchVerdict",
    "decode",
    "decode_header",
    "encode_checkpoint",
    "encode_kv_chunk",
    "verify",
]
