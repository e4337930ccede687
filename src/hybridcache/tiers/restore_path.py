"""The read phase of a ``TieredStore``: find, fetch and verify the deepest restorable step of
one :class:`~hybridcache.tiers.restore_attempt.RestoreAttempt`.

Owns no state: a ``RestorePath`` is frozen and holds only the store's collaborators (its tier
calls, cost model, object sizes, publish ledger and deployment key); everything one lookup finds
lives in the attempt it is handed. The deepest step beyond the local hit whose checkpoint and
every chunk the device cache lacks exist in some tier is tried first; each object is fetched,
decoded and compared with the request (fingerprint field by field, range, tokens, multimodal
identity, key, payload checksum). Any doubt falls back to a shallower step, each rejected step
counted by reason; a restore the cost model says is slower than recomputing is skipped. An
object that fails verification is removed from the tier that served it (its key names content
it does not hold), so the next publish can put the right one. Objects read from below the host
tier are promoted into it, under the same keys, once the lookup is over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hybridcache.errors import StoreError
from hybridcache.tiers.backends.base import PutOutcome
from hybridcache.tiers.keys import Expectation
from hybridcache.tiers.publish_ledger import PublishLedger
from hybridcache.tiers.restore_attempt import RestoreAttempt
from hybridcache.tiers.restore_cost import ObjectSizes, RestoreCost
from hybridcache.tiers.restore_values import EVICTED, SLOWER_THAN_RECOMPUTE, Restore
from hybridcache.tiers.tier_calls import TierCalls, failure_reason
from hybridcache.tiers.verify import FetchMiss, FetchVerdict, verify

# What the store's own reply says about the object (not about the store): it is not the object
# its key names, so it is removed from the tier that served it.
_REJECTED_OBJECT = frozenset(FetchMiss) - {FetchMiss.MISSING, FetchMiss.TIMEOUT, FetchMiss.UNAVAILABLE}


@dataclass(frozen=True)
class RestorePath:
    calls: TierCalls
    cost: RestoreCost
    sizes: ObjectSizes
    ledger: PublishLedger
    deployment_key: bytes | None

    def restore(self, attempt: RestoreAttempt) -> Restore | None:
        """Locate the attempt's objects in every tier, then the deepest verified restore (None,
        with ``attempt.miss`` saying why, when none is restorable or worth restoring)."""
        attempt.where, attempt.failed = self.calls.locate(attempt.names, list(self.calls.tiers))
        self.calls.count("restore_lookups")
        try:
            return self._first_restorable(attempt)
        finally:
            self._promote(attempt.promotions)  # only now: a promotion may evict from host what this restore reads

    def reachable_step(self, attempt: RestoreAttempt, shared_located: dict | None) -> int:
        """The deepest step of ``attempt`` whose objects all exist in some tier (nothing read);
        its local step when none. ``shared_located``: the shared tier's answer, already known."""
        if not attempt.steps:
            return attempt.local_step
        asked = [tier for tier in self.calls.tiers if tier != "shared" or shared_located is None]
        attempt.where, attempt.failed = self.calls.locate(attempt.names, asked)
        for name in attempt.names if shared_located is not None else ():
            attempt.where[name] += shared_located.get(name, [])
        complete = attempt.located_run(attempt.steps[0] // attempt.chain.chunk_size)
        for step in attempt.steps:
            if step // attempt.chain.chunk_size <= complete and attempt.checkpoint_located(step):
                return step
        return attempt.local_step

    def _first_restorable(self, attempt: RestoreAttempt) -> Restore | None:
        size = attempt.chain.chunk_size
        # A chunk that fails verification loses its locations, and ``complete`` drops to it.
        complete = attempt.located_run(attempt.steps[0] // size)
        for step in attempt.steps:
            if step // size > complete or not attempt.checkpoint_located(step):
                reason = attempt.unlocated_reason()
                self.calls.count_miss(reason.value)
                attempt.missed(self._unlocated_miss(attempt, step, reason))
                continue
            restore = self._fetch_step(attempt, step)
            if restore is not None:
                self.calls.count("restores")
                self.calls.count("restored_tokens", step - attempt.local_step)
                return restore
            complete = attempt.located_run(complete)
        return None

    def _unlocated_miss(self, attempt: RestoreAttempt, step: int, reason: FetchMiss) -> str | None:
        """A step no tier could be found to hold: a tier that could not answer, a checkpoint
        this process published (since evicted), or (None) nothing known."""
        if reason is not FetchMiss.MISSING:
            return reason.value
        return EVICTED if self.ledger.was_published(attempt.chain.checkpoint_keys[step]) else None

    def _fetch_step(self, attempt: RestoreAttempt, step: int) -> Restore | None:
        needed = attempt.needed(step)
        estimate = self.sizes.by_tier(needed, attempt.where, attempt.chain.chunk_size)
        if not self.cost.worth_restoring(estimate, step - attempt.local_step):
            self.calls.count_miss(SLOWER_THAN_RECOMPUTE)
            attempt.missed(SLOWER_THAN_RECOMPUTE)
            self.cost.recover()
            return None
        for expectation in needed:
            if expectation.key.name not in attempt.fetched and not self._fetch_one(attempt, expectation):
                return None
        return attempt.restore_at(step)

    def _fetch_one(self, attempt: RestoreAttempt, expectation: Expectation) -> bool:
        """Fetch and verify one object from the first tier holding it; a verified object from
        below the host tier is to be promoted into it. False, counted, when none verifies."""
        key = expectation.key
        name = key.name
        for tier in list(attempt.where[name]):
            began = time.perf_counter()
            data, verdict = self._read(tier, expectation)
            if not verdict.ok:
                self.calls.count_miss(verdict.reason.value)
                attempt.missed(verdict.reason.value)
                attempt.where[name].remove(tier)
                if verdict.reason in _REJECTED_OBJECT:
                    self._remove_rejected(tier, name)
                continue
            self.cost.observe_read(tier, len(data), time.perf_counter() - began)
            self.sizes.observe(key.kind, len(data))
            self._count_read(tier, key.kind.tag, len(data))
            attempt.fetched_object(name, verdict.obj, tier, len(data))
            if tier != "host" and "host" in self.calls.tiers:
                attempt.promotions.append((name, data))
            return True
        return False

    def _count_read(self, tier: str, kind: str, nbytes: int) -> None:
        count = self.calls.count
        count(f"{tier}_bytes_read", nbytes)
        count(f"read_bytes_{kind}", nbytes)
        count(f"read_count_{kind}")
        count(f"{tier}_read_count_{kind}")  # what each tier served, by kind

    def _read(self, tier: str, expectation: Expectation) -> tuple[bytes | None, FetchVerdict]:
        try:
            (data,) = self.calls.call(tier, "get", [expectation.key.name])
        except StoreError as error:
            return None, FetchVerdict(failure_reason(error), str(error))
        return data, verify(data, expectation, auth_key=self.deployment_key)

    def _remove_rejected(self, tier: str, name: str) -> None:
        """A squatter (corrupt, forged or foreign object) under ``name`` goes, so that the next
        publish of the real object is not answered ``PRESENT`` forever."""
        try:
            self.calls.call(tier, "remove", [name])
            self.calls.count(f"{tier}_rejected_removed")
            self.calls.changed(tier, [], [name])
        except StoreError:
            self.calls.count(f"{tier}_rejected_remove_failed")

    def _promote(self, promotions: list[tuple[str, bytes]]) -> None:
        """Copy what was read from below into the host tier, under the same keys."""
        if not promotions:
            return
        try:
            outcomes = self.calls.call("host", "put_if_absent", promotions)
            self.calls.count("promoted_to_host", sum(outcome is PutOutcome.STORED for outcome in outcomes))
        except StoreError:
            self.calls.count("host_promotion_failed")
