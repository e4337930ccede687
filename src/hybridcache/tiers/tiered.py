"""Host, disk and shared tiers behind the device pools: publish last, restore exact, fail closed.

Owns no mutable state of its own: it validates what callers hand in and wires the phases, each
in its module and owning its state. Every store call goes through
:class:`~hybridcache.tiers.tier_calls.TierCalls` (each tier's circuit breaker; the counters and
miss counts). The write phase, :mod:`~hybridcache.tiers.publish` (``PublishLedger``), stores a
prefix write-through, chunks before the checkpoint, and owns the ledger of what this process
published (needs, needed-by, in flight) by which the host tier's evictions are demoted to disk
or dropped as dead weight. The read phase, :mod:`~hybridcache.tiers.restore`, works on one
``RestoreAttempt`` per lookup with a stateless ``RestorePath``, so one store serves several
engines on several threads; the values a lookup returns are there too. The cost model
(``RestoreCost``, ``ObjectSizes``) is :mod:`~hybridcache.tiers.restore_cost`. The stores own
their contents; the device cache (trie and pools) is not touched here: a caller adopts a
verified restore through ``CacheProtocol.adopt``.

A store failure costs a miss (counted by its reason) or a failed publish; it never raises out
of ``store_prefix``, ``fetch_prefix`` or ``lookup_prefix``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hybridcache.errors import InvalidArgumentError, InvalidStepError, InvalidTypeError, LifecycleError
from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.breaker import CircuitBreaker
from hybridcache.tiers.keys import KeyChain
from hybridcache.tiers.publish import ArraysFor, EncodedPrefix, PublishLedger, PublishReport
from hybridcache.tiers.restore import Restore, RestoreAttempt, RestoreLookup, RestorePath
from hybridcache.tiers.restore_cost import ObjectSizes, RestoreCost
from hybridcache.tiers.tier_calls import TierAccess, TierCalls
from hybridcache.types import as_int


class TieredStore:
    def __init__(
        self,
        *,
        host: HostMemoryStore | None = None,
        disk: ObjectStore | None = None,
        shared: ObjectStore | None = None,
        access: TierAccess | None = None,
        cost: RestoreCost | None = None,
    ) -> None:
        """Tiers may be any subset. This store listens to ``host``'s evictions (its write-back
        demotion), so a host store serves one ``TieredStore``. ``access``: each call's timeout,
        the circuit breaker and the deployment key (``TierAccess``; None: the defaults).
        ``cost``: the restore cost model, with the object sizes it assumes (None: measured)."""
        given = {"host": host, "disk": disk, "shared": shared}
        for name, store in given.items():
            if store is not None and not isinstance(store, ObjectStore):
                raise InvalidTypeError(f"{name} must be an ObjectStore")
        if host is not None and not isinstance(host, HostMemoryStore):
            raise InvalidTypeError("host must be a HostMemoryStore")
        access = TierAccess() if access is None else access
        if not isinstance(access, TierAccess):
            raise InvalidTypeError(f"access must be a TierAccess, got {type(access).__name__}")
        if cost is not None and not isinstance(cost, RestoreCost):
            raise InvalidTypeError("cost must be a RestoreCost")
        tiers = {name: store for name, store in given.items() if store is not None}
        if not tiers:
            raise InvalidArgumentError("a TieredStore needs at least one tier")
        self.deployment_key, self.timeout = access.deployment_key, access.timeout
        self.calls = TierCalls(tiers, CircuitBreaker() if access.breaker is None else access.breaker, access.timeout)
        self.tiers, self.breaker = self.calls.tiers, self.calls.breaker
        self.counters, self.misses = self.calls.counters, self.calls.misses
        self.cost = RestoreCost() if cost is None else cost
        self.sizes = ObjectSizes(self.cost.stand_in)
        self.ledger = PublishLedger(self.calls)
        self.reader = RestorePath(self.calls, self.cost, self.sizes, self.ledger, self.deployment_key)
        if host is not None:
            host.listen_evictions(self.ledger.demote)
        if isinstance(disk, DiskStore):
            disk.listen_evictions(lambda name: self.calls.changed("disk", [], [name]))

    def listen_changes(self, on_change: Callable[[str, list[str], list[str]], None]) -> None:
        """Install the one callback told ``(tier, stored names, removed names)`` as the tiers
        change: a publish's puts, a host eviction, its demotion to disk, a disk eviction, an
        object removed as rejected (an engine announces its tiers' contents)."""
        if not callable(on_change):
            raise InvalidTypeError("on_change must be callable")
        if self.calls.on_change is not None:
            raise LifecycleError("this tiered store already reports its changes to another listener")
        self.calls.on_change = on_change

    # --- write phase -----------------------------------------------------------------------------

    def store_prefix(self, chain: KeyChain, step: int, chunk_arrays: ArraysFor, state_arrays: Callable[[], Mapping]) -> PublishReport:
        """Publish the checkpoint at ``step`` of ``chain`` with the KV chunks of ``[0, step)``
        into the top local tier and the shared tier, chunks first. ``chunk_arrays(i)`` and ``state_arrays()``
        are called only for objects some tier lacks; each object is encoded once."""
        if not isinstance(chain, KeyChain):
            raise InvalidTypeError("chain must be a KeyChain")
        if as_int("step", step, 1) not in chain.checkpoint_keys:
            raise InvalidStepError(f"step {step} is not a checkpoint step of the chain's {chain.num_chunks} complete chunks")
        return self.ledger.store(EncodedPrefix(chain, step, chunk_arrays, state_arrays, self.deployment_key))

    # --- read phase ------------------------------------------------------------------------------

    def fetch_prefix(self, chain: KeyChain, *, local_step: int, local_kv_tokens: int) -> Restore | None:
        """The deepest verified restore beyond ``local_step`` (the device cache's hit), given
        that the device cache holds the KV of ``[0, local_kv_tokens)``; None when no deeper
        step is restorable or worth restoring (each rejected step counted in ``misses``)."""
        return self.lookup_prefix(chain, local_step=local_step, local_kv_tokens=local_kv_tokens).restore

    def lookup_prefix(self, chain: KeyChain, *, local_step: int, local_kv_tokens: int) -> RestoreLookup:
        """``fetch_prefix``, with why nothing was restored when nothing was."""
        attempt = RestoreAttempt.beyond(chain, local_step, local_kv_tokens)
        if not attempt.steps:
            return RestoreLookup(None)
        restore = self.reader.restore(attempt)
        return RestoreLookup(restore, None if restore is not None else attempt.miss)

    def reachable_step(
        self, chain: KeyChain, *, local_step: int, local_kv_tokens: int, shared_located: dict | None = None
    ) -> int:
        """The deepest step ``fetch_prefix`` could try, by existence only (nothing is read,
        verified, promoted or refreshed); ``local_step`` when none. ``shared_located``: what
        ``locate`` found in the shared tier, when one lookup serves many callers (a router
        scoring replicas that share it); the shared tier is then not asked again."""
        attempt = RestoreAttempt.beyond(chain, local_step, local_kv_tokens)
        return self.reader.reachable_step(attempt, shared_located)

    def locate(self, names: list[str], tiers: list[str] | None = None) -> dict[str, list[str]]:
        """Which of ``tiers`` (default: all, in tier order) hold each name: one batch
        ``exists`` per tier; a failing or skipped tier holds nothing (counted)."""
        return self.calls.locate(names, list(self.tiers) if tiers is None else tiers)[0]

    # --- diagnostics -----------------------------------------------------------------------------

    def stats(self) -> dict:
        return {"counters": dict(self.counters), "misses": dict(self.misses), "tiers": list(self.tiers)}

    def check_invariants(self) -> None:
        self.calls.check_invariants()
        self.ledger.check_invariants()
        self.sizes.check_invariants()

    def close(self) -> None:
        for store in self.tiers.values():
            store.close()
