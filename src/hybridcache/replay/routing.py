"""Which replica serves a request: the router's own index and cost, fed in process.

Owns, per replica, an ``AnnouncedReplica``: the ``events.Announcer`` of that replica's cache
changes and the ``router.ReplicaIndex`` built from the events it makes, exactly what
``hybridcache router`` builds from a server's streams, without the sockets. The policies and
their cost are the router's (``router.policy``): ``round-robin``, ``kv-overlap`` (whole-block
KV tokens a replica announced) and ``restorable`` (the deepest announced checkpoint on that
KV path; with tiers, the deepest step reachable from the device, host, disk or shared tier).
"""

from __future__ import annotations

from hybridcache.events.announcer import Announcer
from hybridcache.protocol import CacheProtocol
from hybridcache.router.policy import POLICIES, check_policy
from hybridcache.router.replica_index import ReplicaIndex

ROUTINGS = POLICIES
check_routing = check_policy


class AnnouncedReplica:
    def __init__(self, cache: CacheProtocol, block_size: int) -> None:
        self._cache = cache
        self._announcer = Announcer(block_size)
        self.index = ReplicaIndex(block_size)
        cache.record_changes()

    def refresh(self) -> None:
        """Apply what the cache announced since the last call."""
        kv_events, state_events = self._announcer.announce(self._cache.take_changes())
        self.index.apply_kv(kv_events)
        self.index.apply_state(state_events)
