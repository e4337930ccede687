"""The read phase of a ``TieredStore``: one lookup's attempt as a value, the stateless path
that finds, fetches and verifies the deepest restorable step of it, and the values it returns.

Owns the state of exactly one ``lookup_prefix`` (or ``reachable_step``) call, in a
:class:`RestoreAttempt`: which steps it may try, where each object it may need was found, what
it fetched and from where, what it will promote, and why it missed. An attempt is made by that
call, worked on by :class:`RestorePath` (frozen: it holds only the store's collaborators, its
tier calls, cost model, object sizes, publish ledger and deployment key) and dropped when it
returns, so two threads restoring through one ``TieredStore`` never share one. A verified
:class:`Restore` and a :class:`RestoreLookup` are frozen values.

The deepest step beyond the local hit whose checkpoint and every chunk the device cache lacks
exist in some tier is tried first; each object is fetched, decoded and compared with the
request (fingerprint field by field, range, tokens, multimodal identity, key, payload
checksum). Any doubt falls back to a shallower step, each rejected step counted by reason; a
restore the cost model says is slower than recomputing is skipped. An object that fails
verification is removed from the tier that served it (its key names content it does not
hold), so the next publish can put the right one. Objects read from below the host tier are
promoted into it, under the same keys, once the lookup is over.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridcache.errors import InvalidTypeError, StoreError
from hybridcache.tiers.backends.base import PutOutcome
from hybridcache.tiers.keys import Expectation, KeyChain
from hybridcache.tiers.objects import StoredObject
from hybridcache.tiers.publish import PublishLedger
from hybridcache.tiers.restore_cost import ObjectSizes, RestoreCost
from hybridcache.tiers.tier_calls import TierCalls, failure_reason
from hybridcache.tiers.verify import FetchMiss, FetchVerdict, verify
from hybridcache.types import as_int

SLOWER_THAN_RECOMPUTE = "slower_than_recompute"


@dataclass(frozen=True)
class Restore:
    """A verified restore: the checkpoint at ``step`` and the chunks ``[first_chunk, step/C)``
    (by index), the bytes read from each tier, and the tier each object came from."""

    step: int
    first_chunk: int
    checkpoint: StoredObject
    chunks: Mapping[int, StoredObject]
    bytes_by_tier: Mapping[str, int]
    checkpoint_tier: str = ""
    chunk_tiers: Mapping[int, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_tier.values())

    def tokens_by_tier(self, start: int, chunk_size: int) -> dict[str, int]:
        """The tokens of ``[start, step)`` by the tier that served them: a token's KV chunk's
        tier, or the checkpoint's where the device already held its KV (no chunk was read)."""
        counts: Counter[str] = Counter()
        for index in range(start // chunk_size, -(-self.step // chunk_size)):
            low, high = max(start, index * chunk_size), min(self.step, (index + 1) * chunk_size)
            if high > low:
                counts[self.chunk_tiers.get(index, self.checkpoint_tier)] += high - low
        return dict(counts)


EVICTED = "evicted"  # a checkpoint this process published is gone from every tier


@dataclass(frozen=True)
class RestoreLookup:
    """What one ``lookup_prefix`` found: the restore, or (``restore`` None) why the deepest
    step the tiers were expected to serve was not served: a ``FetchMiss`` value,
    ``EVICTED`` or ``SLOWER_THAN_RECOMPUTE``; ``miss`` None when no tier ever held a deeper
    step as far as this process knows."""

    restore: Restore | None
    miss: str | None = None


@dataclass
class RestoreAttempt:
    """``steps``: the checkpoint steps beyond ``local_step``, deepest first; ``first_chunk``:
    the first chunk the device cache lacks; ``names``: every object those steps may need.
    ``where`` (name -> tiers holding it, in tier order) and ``failed`` (tier -> why it could
    not answer) come from ``locate``; ``fetched``, ``served_by`` and ``nbytes`` (name -> the
    verified object, its tier, its size) grow as objects are read; ``promotions`` are the
    objects read from below the host tier, copied into it once the lookup is over."""

    chain: KeyChain
    local_step: int
    steps: list[int]
    first_chunk: int
    names: list[str]
    where: dict[str, list[str]] = field(default_factory=dict)
    failed: dict[str, FetchMiss] = field(default_factory=dict)
    fetched: dict[str, StoredObject] = field(default_factory=dict)
    served_by: dict[str, str] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    promotions: list[tuple[str, bytes]] = field(default_factory=list)
    miss: str | None = None  # why the deepest step expected to be served was not

    @classmethod
    def beyond(cls, chain: object, local_step: object, local_kv_tokens: object) -> RestoreAttempt:
        """An attempt at the steps of ``chain`` beyond ``local_step``, the device cache holding
        the KV of ``[0, local_kv_tokens)``; nothing located yet."""
        if not isinstance(chain, KeyChain):
            raise InvalidTypeError("chain must be a KeyChain")
        local_step = as_int("local_step", local_step, 0)
        local_kv_tokens = as_int("local_kv_tokens", local_kv_tokens, 0)
        size = chain.chunk_size
        steps = [step for step in reversed(chain.steps) if step > local_step]
        if not steps:
            return cls(chain, local_step, steps, 0, [])
        first_chunk = min(max(local_kv_tokens, local_step), steps[0]) // size
        names = [chain.checkpoint_names[step] for step in steps]
        names += chain.chunk_names[first_chunk: steps[0] // size]
        return cls(chain, local_step, steps, first_chunk, names)

    def located_run(self, end: int) -> int:
        """The end of the run of chunks from ``first_chunk`` (below ``end``) that some tier
        still holds. A step is whole when its checkpoint is located and it ends by then: linear
        in the chunks, where checking each step's own chunk list is quadratic (a 20k-token
        prompt has 80 steps of up to 80 chunks)."""
        index = self.first_chunk
        while index < end and self.where.get(self.chain.chunk_names[index]):
            index += 1
        return index

    def checkpoint_located(self, step: int) -> bool:
        return bool(self.where.get(self.chain.checkpoint_names[step]))

    def needed(self, step: int) -> list[Expectation]:
        """What restoring ``step`` reads: its checkpoint, then the chunks the device lacks."""
        chain, end = self.chain, step // self.chain.chunk_size
        return [chain.expect_checkpoint(step)] + [chain.expect_chunk(i) for i in range(self.lowest_chunk(step), end)]

    def lowest_chunk(self, step: int) -> int:
        return min(self.first_chunk, step // self.chain.chunk_size)

    def fetched_object(self, name: str, obj: StoredObject, tier: str, nbytes: int) -> None:
        self.fetched[name] = obj
        self.served_by[name] = tier
        self.nbytes[name] = nbytes

    def restore_at(self, step: int) -> Restore:
        """The restore of ``step``, every object of which was fetched."""
        chain, first = self.chain, self.lowest_chunk(step)
        names = {i: chain.chunk_names[i] for i in range(first, step // chain.chunk_size)}
        checkpoint = chain.checkpoint_names[step]
        bytes_by_tier: dict[str, int] = {}
        for name in (checkpoint, *names.values()):
            tier = self.served_by[name]
            bytes_by_tier[tier] = bytes_by_tier.get(tier, 0) + self.nbytes[name]
        chunks = {i: self.fetched[name] for i, name in names.items()}
        chunk_tiers = {i: self.served_by[name] for i, name in names.items()}
        return Restore(step, first, self.fetched[checkpoint], chunks, bytes_by_tier, self.served_by[checkpoint], chunk_tiers)

    def missed(self, reason: str | None) -> None:
        if self.miss is None:
            self.miss = reason

    def unlocated_reason(self) -> FetchMiss:
        """Why a part was found in no tier: absent, unless a tier could not be asked."""
        if not self.failed:
            return FetchMiss.MISSING
        return FetchMiss.TIMEOUT if FetchMiss.TIMEOUT in self.failed.values() else FetchMiss.UNAVAILABLE

    def check_invariants(self) -> None:
        size = self.chain.chunk_size
        assert self.steps == sorted(self.steps, reverse=True), "steps are not deepest first"
        assert all(step > self.local_step for step in self.steps), "a step at or below the local hit"
        assert not self.steps or self.first_chunk <= self.steps[0] // size, "the first chunk lies beyond every step"
        assert set(self.where) <= set(self.names), "an object located that no step needs"
        assert set(self.fetched) == set(self.served_by) == set(self.nbytes), "fetched, served_by and nbytes disagree"
        assert set(self.fetched) <= set(self.names), "an object fetched that no step needs"
        assert {name for name, _ in self.promotions} <= set(self.fetched), "a promotion of an object not fetched"
        assert all(self.served_by[name] != "host" for name, _ in self.promotions), "a promotion of a host object"


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
