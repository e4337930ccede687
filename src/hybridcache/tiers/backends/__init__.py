"""Object-store backends behind one batch-first interface (:class:`ObjectStore`).

Owns no state. The network stores (:class:`RedisStore`, :class:`MooncakeStore`) import their
clients only when created, so this package imports without the ``redis`` and ``mooncake``
extras installed.
"""

from hybridcache.tiers.backends.base import DEFAULT_TIMEOUT_S, DeadlineRunner, ObjectStore, PutOutcome, check_key
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.backends.mooncake_store import MooncakeLocal, MooncakeStore
from hybridcache.tiers.backends.redis_store import RedisStore

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DeadlineRunner",
    "DiskStore",
    "HostMemoryStore",
    "MooncakeLocal",
    "MooncakeStore",
    "ObjectStore",
    "PutOutcome",
    "RedisStore",
    "check_key",
]
