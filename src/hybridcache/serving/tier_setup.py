"""The tiers ``hybridcache serve`` runs behind the device pools: host memory, disk and a shared
store (Redis or Mooncake at ``--store-url``, or a local server it starts).

Owns, between ``open_tiers`` and ``ServingTiers.close``: the ``TieredStore``, the shared store
client and the local server processes started for it (stopped by pid on close, after the
stores are closed; a server started here also dies with the serving thread if the process is
killed outright: ``tiers.local_servers``' parent-death signal).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from hybridcache.serving.capacity import check_tier_sizes
from hybridcache.serving.config import ServeConfig
from hybridcache.tiers import TieredStore
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.shared_setup import open_shared_store


class ServingTiers:
    """``store`` None when no tier is configured."""

    def __init__(self, store: TieredStore | None, resources: contextlib.ExitStack) -> None:
        self.store = store
        self._resources = resources

    def close(self) -> None:
        """Close the stores, then stop the servers started for them (idempotent)."""
        if self.store is not None:
            self.store.close()
            self.store = None
        self._resources.close()


def open_tiers(config: ServeConfig) -> ServingTiers:
    """The configured tiers, every one reachable (a shared store is probed); on a failure
    nothing started stays running. A tier larger than the machine could hold is refused first."""
    check_tier_sizes(config.host_bytes, config.disk_bytes, config.disk_root)
    with contextlib.ExitStack() as stack:
        shared = None
        if config.shared_tier != "none":
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridcache-serve-"))
            shared = stack.enter_context(open_shared_store(config.shared_tier, config.store_url, Path(workdir)))
        host = HostMemoryStore(config.host_bytes) if config.host_bytes else None
        disk = DiskStore(Path(config.disk_root), config.disk_bytes) if config.disk_bytes else None
        store = None if host is None and disk is None and shared is None else TieredStore(host=host, disk=disk, shared=shared)
        return ServingTiers(store, stack.pop_all())
