"""Host, disk and shared tiers behind the device pools: publish last, restore exact, fail closed.

Owns, for one process: its tiers (``host``, ``disk``, ``shared``, each an ``ObjectStore``), its
counters and the measured restore cost model (a
:class:`~hybridcache.tiers.restore_cost.RestoreCost`; the values a lookup and a publish
produce are in ``restore_values``); what it published (a
:class:`~hybridcache.tiers.publish_index.PublishIndex`, for the dead-weight rule) and each
tier's circuit breaker (:class:`~hybridcache.tiers.breaker.CircuitBreaker`) are held here and
own their state. The stores own their contents; the device cache (trie and pools) is not
touched here: a caller adopts a verified restore through ``CacheProtocol.adopt``. One store may
serve several engines on several threads: what a call works on (what it fetched, what it
promotes) is the call's own.

Every store call goes through the tier's breaker: after a timeout or unavailability the tier is
skipped for a back-off window (counted ``<tier>_skipped``), probed once per window
(``<tier>_probes``). A store failure costs a miss (counted by its reason) or a failed publish;
it never raises out of ``store_prefix`` or ``fetch_prefix``.

Write path (``store_prefix``): for one chunk-aligned step, into the host and shared tiers
(write-through): the KV chunks of ``[0, step)`` the tier lacks (put-if-absent), then, only once
every one of them is confirmed stored, the checkpoint. A writer that dies in between leaves
orphan chunks, never a usable partial checkpoint. The host tier's evictions are demoted to the
disk tier (write-back) unless they are dead weight: a checkpoint whose chunks are gone from the
local tiers, or a chunk no local checkpoint needs.

Read path (``fetch_prefix``): the deepest step beyond the local hit whose checkpoint and every
chunk the device cache lacks exist in some tier; each object is fetched, decoded and compared
with the request (fingerprint field by field, range, tokens, multimodal identity, key, payload
checksum). Any doubt falls back to a shallower step, and each rejected step is counted by
reason; a restore the cost model says is slower than recomputing is skipped. An object that
fails verification is removed from the tier that served it (its key names content it does not
hold), so the next publish can put the right one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np

from hybridcache.errors import (
    InvalidArgumentError,
    InvalidKeyError,
    InvalidTypeError,
    LifecycleError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from hybridcache.tiers.backends.base import ObjectStore, PutOutcome, checked_timeout
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.breaker import BreakerDecision, CircuitBreaker
from hybridcache.tiers.keys import Expectation, KeyChain, ObjectKey, ObjectKind
from hybridcache.tiers.objects import check_auth_key, encode_checkpoint, encode_kv_chunk
from hybridcache.tiers.publish_index import PublishIndex
from hybridcache.tiers.restore_cost import RestoreCost
from hybridcache.tiers.restore_values import (
    EVICTED,
    SLOWER_THAN_RECOMPUTE,
    PublishReport,
    Restore,
    RestoreAttempt,
    RestoreLookup,
)
from hybridcache.tiers.verify import FetchMiss, FetchVerdict, verify
from hybridcache.types import as_int

TIER_NAMES = ("host", "disk", "shared")
_CONFIRMED = (PutOutcome.STORED, PutOutcome.PRESENT)
_DEMOTION_COUNTERS = {
    PutOutcome.STORED: "demoted_to_disk",
    PutOutcome.PRESENT: "demoted_already_on_disk",
    PutOutcome.REJECTED: "disk_demotion_refused",  # full, or a read-only disk tier
}
# What the store's own reply says about the object (not about the store): it is not the object
# its key names, so it is removed from the tier that served it.
_REJECTED_OBJECT = frozenset(FetchMiss) - {FetchMiss.MISSING, FetchMiss.TIMEOUT, FetchMiss.UNAVAILABLE}


class _TierSkipped(StoreUnavailableError):
    """A call not made: the tier's breaker is open. Never leaves this module."""


def _failure_reason(error: StoreError) -> FetchMiss:
    return FetchMiss.TIMEOUT if isinstance(error, StoreTimeoutError) else FetchMiss.UNAVAILABLE

ArraysFor = Callable[[int], Mapping[str, np.ndarray]]


class TieredStore:
    def __init__(
        self,
        *,
        host: HostMemoryStore | None = None,
        disk: ObjectStore | None = None,
        shared: ObjectStore | None = None,
        timeout: float | None = None,
        cost: RestoreCost | None = None,
        size_hint: Callable[[ObjectKind, int], int] | None = None,
        breaker: CircuitBreaker | None = None,
        deployment_key: bytes | None = None,
    ) -> None:
        """Tiers may be any subset. This store listens to ``host``'s evictions (its write-back
        demotion), so a host store serves one ``TieredStore``. ``timeout`` bounds each batch call
        (None: each store's default). ``size_hint(kind, tokens)``: the bytes an object of that
        kind covering ``tokens`` tokens carries, for the cost model (None: the mean size read so
        far), for callers whose stored payloads stand in for larger ones (the replay).
        ``breaker``: the tiers' circuit breaker (None: a 30 s back-off). ``deployment_key``
        (16 to 64 bytes): seal every object with it and accept only objects sealed with it."""
        if size_hint is not None and not callable(size_hint):
            raise InvalidTypeError("size_hint must be callable")
        given = {"host": host, "disk": disk, "shared": shared}
        for name, store in given.items():
            if store is not None and not isinstance(store, ObjectStore):
                raise InvalidTypeError(f"{name} must be an ObjectStore")
        if host is not None and not isinstance(host, HostMemoryStore):
            raise InvalidTypeError("host must be a HostMemoryStore")
        if cost is not None and not isinstance(cost, RestoreCost):
            raise InvalidTypeError("cost must be a RestoreCost")
        if breaker is not None and not isinstance(breaker, CircuitBreaker):
            raise InvalidTypeError("breaker must be a CircuitBreaker")
        self.timeout = None if timeout is None else checked_timeout(timeout)
        self.deployment_key = check_auth_key(deployment_key)
        self.tiers: dict[str, ObjectStore] = {name: store for name, store in given.items() if store is not None}
        if not self.tiers:
            raise InvalidArgumentError("a TieredStore needs at least one tier")
        self.size_hint = size_hint
        self.cost = RestoreCost() if cost is None else cost
        self.breaker = CircuitBreaker() if breaker is None else breaker
        self.index = PublishIndex()
        self.counters: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self._counting = threading.Lock()  # ``+=`` on a Counter is not atomic across threads
        self._on_change: Callable[[str, list[str], list[str]], None] | None = None
        if host is not None:
            host.listen_evictions(self._demote)
        if isinstance(disk, DiskStore):
            disk.listen_evictions(lambda name: self._changed("disk", [], [name]))

    def listen_changes(self, on_change: Callable[[str, list[str], list[str]], None]) -> None:
        """Install the one callback told ``(tier, stored names, removed names)`` as the tiers
        change: a publish's puts, a host eviction, its demotion to disk, a disk eviction, an
        object removed as rejected (an engine announces its tiers' contents)."""
        if not callable(on_change):
            raise InvalidTypeError("on_change must be callable")
        if self._on_change is not None:
            raise LifecycleError("this tiered store already reports its changes to another listener")
        self._on_change = on_change

    def _changed(self, tier: str, stored: list[str], removed: list[str]) -> None:
        if self._on_change is not None:
            self._on_change(tier, stored, removed)

    # --- every store call ------------------------------------------------------------------------

    def _count(self, counter: Counter, name: str, amount: int = 1) -> None:
        with self._counting:
            counter[name] += amount

    def _call(self, tier: str, operation: str, argument: list):
        """One batch call on ``tier`` through its breaker; raises StoreError (``_TierSkipped``
        when the breaker is open), nothing else."""
        admission = self.breaker.admit(tier)
        if admission is BreakerDecision.SKIP:
            self._count(self.counters, f"{tier}_skipped")
            raise _TierSkipped(f"the {tier} tier is skipped: it failed within the last {self.breaker.backoff_s:g} s")
        if admission is BreakerDecision.PROBE:
            self._count(self.counters, f"{tier}_probes")
        try:
            result = getattr(self.tiers[tier], operation)(argument, timeout=self.timeout)
        except (StoreTimeoutError, StoreUnavailableError):
            if self.breaker.failed(tier):
                self._count(self.counters, f"{tier}_breaker_opened")
            raise
        except StoreError:
            self.breaker.answered(tier)
            raise
        self.breaker.answered(tier)
        return result

    # --- write path ------------------------------------------------------------------------------

    def store_prefix(self, chain: KeyChain, step: int, chunk_arrays: ArraysFor, state_arrays: Callable[[], Mapping]) -> PublishReport:
        """Publish the checkpoint at ``step`` of ``chain`` with the KV chunks of ``[0, step)``
        into the top local tier and the shared tier, chunks first. ``chunk_arrays(i)`` and ``state_arrays()``
        are called only for objects some tier lacks; each object is encoded once."""
        if not isinstance(chain, KeyChain):
            raise InvalidTypeError("chain must be a KeyChain")
        checkpoint_key = chain.checkpoint_key(as_int("step", step, 1))  # validates the step
        chunk_keys = [chain.chunk_key(i).name for i in range(step // chain.chunk_size)]
        index_of = {name: index for index, name in enumerate(chunk_keys)}
        encoded: dict[str, bytes] = {}
        sealed = self.deployment_key

        def chunk_bytes(name: str) -> bytes:
            if name not in encoded:
                encoded[name] = encode_kv_chunk(chain, index_of[name], chunk_arrays(index_of[name]), auth_key=sealed)
            return encoded[name]

        def checkpoint_bytes() -> bytes:
            if checkpoint_key.name not in encoded:
                encoded[checkpoint_key.name] = encode_checkpoint(chain, step, state_arrays(), auth_key=sealed)
            return encoded[checkpoint_key.name]

        stored, published, written = {}, {}, {}
        digest = self.index.begin(chain, step)
        try:
            for tier in self._write_through_tiers():
                stored[tier], published[tier], written[tier] = self._publish_into(
                    tier, checkpoint_key.name, chunk_keys, chunk_bytes, checkpoint_bytes
                )
        finally:
            self.index.end(digest)
        return PublishReport(stored, published, written)

    def _write_through_tiers(self) -> list[str]:
        """The top local tier (host, else disk) and the shared one: disk is otherwise fed by
        the host tier's demotions."""
        local = next((tier for tier in ("host", "disk") if tier in self.tiers), None)
        return [tier for tier in (local, "shared") if tier in self.tiers]

    def _publish_into(self, tier, checkpoint_name, chunk_keys, chunk_bytes, checkpoint_bytes):
        """Missing chunks first (also when the checkpoint is there: a store may have evicted
        one part of the entry on its own), then the checkpoint if absent and every chunk is in."""
        try:
            present = self._call(tier, "exists", [checkpoint_name, *chunk_keys])
            missing = [name for name, here in zip(chunk_keys, present[1:]) if not here]
            items = [(name, chunk_bytes(name)) for name in missing]
            outcomes = self._call(tier, "put_if_absent", items) if items else []
            new_chunks = sum(outcome is PutOutcome.STORED for outcome in outcomes)
            self._changed(tier, [name for (name, _), outcome in zip(items, outcomes) if outcome is PutOutcome.STORED], [])
            written = sum(len(value) for (_, value), outcome in zip(items, outcomes) if outcome is PutOutcome.STORED)
            if any(outcome not in _CONFIRMED for outcome in outcomes):
                self._count(self.counters, f"{tier}_publish_refused")
                return new_chunks, False, written
            published = present[0]
            if not published:
                value = checkpoint_bytes()
                (outcome,) = self._call(tier, "put_if_absent", [(checkpoint_name, value)])
                published = outcome in _CONFIRMED
                if outcome is PutOutcome.STORED:
                    self._changed(tier, [checkpoint_name], [])
                    self._count(self.counters, f"{tier}_checkpoints_stored")
                    written += len(value)
        except _TierSkipped:
            self._count(self.counters, f"{tier}_publish_skipped")
            return 0, False, 0
        except StoreError as error:
            self._count(self.counters, f"{tier}_publish_failed")
            self._count(self.counters, f"{tier}_publish_failed_{_failure_reason(error).value}")
            return 0, False, 0
        self._count(self.counters, f"{tier}_chunks_stored", new_chunks)
        self._count(self.counters, f"{tier}_bytes_written", written)
        return new_chunks, published, written

    def _demote(self, name: str, value: bytes) -> None:
        """The host tier evicted ``name``: write it back to disk unless it is dead weight (the
        disk copy is reported before the host's loss, so a listener never loses sight of it)."""
        self._write_back(name, value)
        self._changed("host", [], [name])

    def _write_back(self, name: str, value: bytes) -> None:
        if "disk" not in self.tiers:
            self._count(self.counters, "host_dropped")
            return
        if self._is_dead_weight(name):
            self._count(self.counters, "host_dropped_dead_weight")
            return
        try:
            (outcome,) = self._call("disk", "put_if_absent", [(name, value)])
            self._count(self.counters, _DEMOTION_COUNTERS[outcome])
        except StoreError:
            self._count(self.counters, "disk_demotion_failed")
            return
        if outcome is PutOutcome.STORED:
            self._changed("disk", [name], [])

    def _is_dead_weight(self, name: str) -> bool:
        """A checkpoint a chunk of whose prefix is gone from every tier, or a chunk that no
        checkpoint in any tier needs, can never serve a hit (as far as this process knows)."""
        try:
            key = ObjectKey.from_name(name)
        except InvalidKeyError:
            return False  # not an object of ours to judge
        if key.kind is ObjectKind.CHECKPOINT:
            chunks = self.index.chunks_needed(key.digest)
            if chunks is None:
                return False
            dead = not all(self._present_anywhere([ObjectKey(ObjectKind.KV_CHUNK, d).name for d in chunks]))
            if dead:
                self.index.forget_checkpoint(key.digest)
            return dead
        users = self.index.checkpoints_needing(key.digest)
        if users is None:
            return False  # not ours to judge (fetched, or another process's), or its checkpoint comes next
        return not any(self._present_anywhere([ObjectKey(ObjectKind.CHECKPOINT, d).name for d in users]))

    def _present_anywhere(self, names: list[str]) -> list[bool]:
        """Which names some tier holds; a tier that cannot answer counts as holding them all
        (never drop what might still serve)."""
        found = [False] * len(names)
        for tier in self.tiers:
            try:
                here = self._call(tier, "exists", names)
            except StoreError:
                return [True] * len(names)
            found = [seen or present for seen, present in zip(found, here)]
        return found

    # --- read path -------------------------------------------------------------------------------

    def fetch_prefix(self, chain: KeyChain, *, local_step: int, local_kv_tokens: int) -> Restore | None:
        """The deepest verified restore beyond ``local_step`` (the device cache's hit), given
        that the device cache holds the KV of ``[0, local_kv_tokens)``; None when no deeper
        step is restorable or worth restoring (each rejected step counted in ``misses``)."""
        return self.lookup_prefix(chain, local_step=local_step, local_kv_tokens=local_kv_tokens).restore

    def lookup_prefix(self, chain: KeyChain, *, local_step: int, local_kv_tokens: int) -> RestoreLookup:
        """``fetch_prefix``, with why nothing was restored when nothing was."""
        steps, first_chunk, names = self._candidates(chain, local_step, local_kv_tokens)
        if not steps:
            return RestoreLookup(None)
        lookup = self._locate(names, list(self.tiers))
        self._count(self.counters, "restore_lookups")
        try:
            restore = self._first_restorable(chain, steps, first_chunk, lookup, local_step)
        finally:
            self._promote(lookup.promotions)  # only now: a promotion may evict from host what this restore reads
        return RestoreLookup(restore, None if restore is not None else lookup.miss)

    def reachable_step(
        self, chain: KeyChain, *, local_step: int, local_kv_tokens: int, shared_located: dict | None = None
    ) -> int:
        """The deepest step ``fetch_prefix`` could try, by existence only (nothing is read,
        verified, promoted or refreshed); ``local_step`` when none. ``shared_located``: what
        ``locate`` found in the shared tier, when one lookup serves many callers (a router
        scoring replicas that share it); the shared tier is then not asked again."""
        steps, first_chunk, names = self._candidates(chain, local_step, local_kv_tokens)
        if not steps:
            return local_step
        asked = [tier for tier in self.tiers if tier != "shared" or shared_located is None]
        where = self.locate(names, asked)
        for name in names if shared_located is not None else ():
            where[name] += shared_located.get(name, [])
        complete = self._located_run(chain, where, first_chunk, steps[0] // chain.chunk_size)
        for step in steps:
            if step // chain.chunk_size <= complete and where[chain.checkpoint_key(step).name]:
                return step
        return local_step

    @staticmethod
    def _candidates(chain: KeyChain, local_step: object, local_kv_tokens: object) -> tuple[list[int], int, list[str]]:
        """The steps beyond ``local_step`` (deepest first), the first chunk the device lacks,
        and the names of every object those steps may need."""
        if not isinstance(chain, KeyChain):
            raise InvalidTypeError("chain must be a KeyChain")
        local_step = as_int("local_step", local_step, 0)
        local_kv_tokens = as_int("local_kv_tokens", local_kv_tokens, 0)
        size = chain.chunk_size
        steps = [step for step in reversed(chain.checkpoint_steps()) if step > local_step]
        if not steps:
            return steps, 0, []
        first_chunk = min(max(local_kv_tokens, local_step), steps[0]) // size
        names = [chain.checkpoint_key(step).name for step in steps]
        names += [chain.chunk_key(index).name for index in range(first_chunk, steps[0] // size)]
        return steps, first_chunk, names

    def _first_restorable(self, chain, steps, first_chunk, lookup: RestoreAttempt, local_step) -> Restore | None:
        size = chain.chunk_size
        where = lookup.where
        # Chunks [first_chunk, complete) are all located: a step is whole when its checkpoint is
        # located and it ends by then. Linear in the chunks, where checking each step's own
        # chunk list is quadratic (a 20k-token prompt has 80 steps of up to 80 chunks). A chunk
        # that fails verification loses its locations, and ``complete`` drops to it.
        complete = self._located_run(chain, where, first_chunk, steps[0] // size)
        for step in steps:
            lowest = min(first_chunk, step // size)
            if step // size > complete or not where.get(chain.checkpoint_key(step).name):
                reason = lookup.unlocated_reason()
                self._count(self.misses, reason.value)
                lookup.missed(self._unlocated_miss(chain, step, reason))
                continue
            needed = [chain.expect_checkpoint(step)] + [chain.expect_chunk(i) for i in range(lowest, step // size)]
            restore = self._fetch_step(chain, step, lowest, needed, lookup, local_step)
            if restore is not None:
                self._count(self.counters, "restores")
                self._count(self.counters, "restored_tokens", step - local_step)
                return restore
            complete = self._located_run(chain, where, first_chunk, complete)
        return None

    def _unlocated_miss(self, chain: KeyChain, step: int, reason: FetchMiss) -> str | None:
        """A step no tier could be found to hold: a tier that could not answer, a checkpoint
        this process published (since evicted), or (None) nothing known."""
        if reason is not FetchMiss.MISSING:
            return reason.value
        return EVICTED if self.index.chunks_needed(chain.checkpoint_key(step).digest) is not None else None

    @staticmethod
    def _located_run(chain: KeyChain, where: dict[str, list[str]], first: int, end: int) -> int:
        """The end of the run of chunks from ``first`` (below ``end``) that some tier still holds."""
        index = first
        while index < end and where.get(chain.chunk_key(index).name):
            index += 1
        return index

    def locate(self, names: list[str], tiers: list[str] | None = None) -> dict[str, list[str]]:
        """Which of ``tiers`` (default: all, in tier order) hold each name: one batch
        ``exists`` per tier; a failing or skipped tier holds nothing (counted)."""
        return self._locate(names, list(self.tiers) if tiers is None else tiers).where

    def _locate(self, names: list[str], tiers: list[str]) -> RestoreAttempt:
        lookup = RestoreAttempt({name: [] for name in names}, {})
        for tier in tiers:
            try:
                present = self._call(tier, "exists", names)
            except StoreError as error:
                self._count(self.counters, f"{tier}_exists_failed")
                lookup.failed[tier] = _failure_reason(error)
                continue
            for name, here in zip(names, present):
                if here:
                    lookup.where[name].append(tier)
        return lookup

    def _fetch_step(self, chain, step, first_chunk, needed, lookup: RestoreAttempt, local_step) -> Restore | None:
        if not self.cost.worth_restoring(self._estimate(needed, lookup.where, chain.chunk_size), step - local_step):
            self._count(self.misses, SLOWER_THAN_RECOMPUTE)
            lookup.missed(SLOWER_THAN_RECOMPUTE)
            self.cost.recover()
            return None
        bytes_by_tier: Counter[str] = Counter()
        for expectation in needed:
            if expectation.key.name not in lookup.fetched and not self._fetch_one(expectation, lookup, bytes_by_tier):
                return None
        fetched = lookup.fetched
        names = {i: chain.chunk_key(i).name for i in range(first_chunk, step // chain.chunk_size)}
        checkpoint = chain.checkpoint_key(step).name
        return Restore(
            step, first_chunk, fetched[checkpoint], {i: fetched[name] for i, name in names.items()}, dict(bytes_by_tier),
            lookup.served_by[checkpoint], {i: lookup.served_by[name] for i, name in names.items()},
        )

    def _fetch_one(self, expectation, lookup: RestoreAttempt, bytes_by_tier) -> bool:
        """Fetch and verify one object from the first tier holding it; a verified object from
        below the host tier is promoted into it (same key). False, counted, when none verifies."""
        key = expectation.key
        name = key.name
        for tier in list(lookup.where[name]):
            began = time.perf_counter()
            data, verdict = self._read(tier, expectation)
            if not verdict.ok:
                self._count(self.misses, verdict.reason.value)
                lookup.missed(verdict.reason.value)
                lookup.where[name].remove(tier)
                if verdict.reason in _REJECTED_OBJECT:
                    self._remove_rejected(tier, name)
                continue
            self.cost.observe_read(tier, len(data), time.perf_counter() - began)
            bytes_by_tier[tier] += len(data)
            self._count(self.counters, f"{tier}_bytes_read", len(data))
            self._count(self.counters, f"read_bytes_{key.kind.tag}", len(data))
            self._count(self.counters, f"read_count_{key.kind.tag}")
            self._count(self.counters, f"{tier}_read_count_{key.kind.tag}")  # what each tier served, by kind
            lookup.fetched[name] = verdict.obj
            lookup.served_by[name] = tier
            if tier != "host" and "host" in self.tiers:
                lookup.promotions.append((name, data))
            return True
        return False

    def _read(self, tier: str, expectation: Expectation):
        try:
            (data,) = self._call(tier, "get", [expectation.key.name])
        except StoreError as error:
            return None, FetchVerdict(_failure_reason(error), str(error))
        return data, verify(data, expectation, auth_key=self.deployment_key)

    def _remove_rejected(self, tier: str, name: str) -> None:
        """A squatter (corrupt, forged or foreign object) under ``name`` goes, so that the next
        publish of the real object is not answered ``PRESENT`` forever."""
        try:
            self._call(tier, "remove", [name])
            self._count(self.counters, f"{tier}_rejected_removed")
            self._changed(tier, [], [name])
        except StoreError:
            self._count(self.counters, f"{tier}_rejected_remove_failed")

    def _promote(self, promotions: list[tuple[str, bytes]]) -> None:
        """Copy what was read from below into the host tier, under the same keys."""
        if not promotions:
            return
        try:
            outcomes = self._call("host", "put_if_absent", promotions)
            self._count(self.counters, "promoted_to_host", sum(outcome is PutOutcome.STORED for outcome in outcomes))
        except StoreError:
            self._count(self.counters, "host_promotion_failed")

    def _estimate(self, needed: list[Expectation], where, chunk_size: int) -> dict[str, int]:
        """Bytes each tier would serve, from the mean object sizes read so far (before any read:
        4 bytes per covered token, the token ids the headers alone carry)."""
        estimate: Counter[str] = Counter()
        for expectation in needed:
            key = expectation.key
            if self.size_hint is not None:
                estimate[where[key.name][0]] += self.size_hint(key.kind, expectation.step - expectation.start)
                continue
            count = self.counters[f"read_count_{key.kind.tag}"]
            mean = self.counters[f"read_bytes_{key.kind.tag}"] // count if count else 4 * chunk_size
            estimate[where[key.name][0]] += mean
        return dict(estimate)

    # --- diagnostics -----------------------------------------------------------------------------

    def stats(self) -> dict:
        return {"counters": dict(self.counters), "misses": dict(self.misses), "tiers": list(self.tiers)}

    def check_invariants(self) -> None:
        self.index.check_invariants()
        self.breaker.check_invariants()
        assert all(value >= 0 for value in self.counters.values()), "a counter went negative"

    def close(self) -> None:
        for store in self.tiers.values():
            store.close()
