"""Host, disk and shared tiers behind the device pools: publish last, restore exact, fail closed.

Owns, for one process: its tiers (``host``, ``disk``, ``shared``, each an ``ObjectStore``),
what it published to them (which chunks each of its checkpoints needs, for the dead-weight
rule), its counters, and the measured restore cost model. The stores own their contents; the
device cache (trie and pools) is not touched here: a caller adopts a verified restore through
``CacheProtocol.adopt``.

Write path (``publish``): for one chunk-aligned step, into the host and shared tiers
(write-through): the KV chunks of ``[0, step)`` the tier lacks (put-if-absent), then, only once
every one of them is confirmed stored, the checkpoint. A writer that dies in between leaves
orphan chunks, never a usable partial checkpoint. The host tier's evictions are demoted to the
disk tier (write-back) unless they are dead weight: a checkpoint whose chunks are gone from the
local tiers, or a chunk no local checkpoint needs.

Read path (``find_restore``): the deepest step beyond the local hit whose checkpoint and every
chunk the device cache lacks exist in some tier; each object is fetched, decoded and compared
with the request (fingerprint field by field, range, tokens, multimodal identity, key, payload
checksum). Any doubt falls back to a shallower step, and each rejected step is counted by
reason; a restore the cost model says is slower than recomputing is skipped.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from hybridcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    StoreError,
    StoreTimeoutError,
)
from hybridcache.tiers.backends.base import ObjectStore, PutOutcome
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.keys import Expectation, KeyChain, ObjectKind
from hybridcache.tiers.objects import StoredObject, encode_checkpoint, encode_kv_chunk
from hybridcache.tiers.verify import MissReason, Verdict, verify
from hybridcache.types import as_int

TIER_NAMES = ("host", "disk", "shared")
SLOWER_THAN_RECOMPUTE = "slower_than_recompute"
_CONFIRMED = (PutOutcome.STORED, PutOutcome.PRESENT)
MAX_REMEMBERED_CHECKPOINTS = 1 << 16

ArraysFor = Callable[[int], Mapping[str, np.ndarray]]


@dataclass
class RestoreCost:
    """A measured cost model: seconds per byte and per batch call of each tier (exponential
    averages of the reads done so far, from stated priors), against recompute seconds per token
    (the caller's measurement). ``smoothing`` is the weight of the newest observation."""

    recompute_s_per_token: float = 0.0  # 0: unknown, never skip
    smoothing: float = 0.2
    s_per_byte: dict[str, float] = field(
        default_factory=lambda: {"host": 1 / 10e9, "disk": 1 / 2e9, "shared": 1 / 1e9}
    )
    s_per_call: dict[str, float] = field(default_factory=lambda: {"host": 1e-6, "disk": 1e-4, "shared": 5e-4})

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """One batch read of ``nbytes`` from ``tier`` took ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        latency = self.s_per_call[tier]
        per_byte = max(seconds - latency, seconds / 2) / nbytes
        weight = self.smoothing
        self.s_per_byte[tier] += weight * (per_byte - self.s_per_byte[tier])
        self.s_per_call[tier] += weight * (min(latency, seconds) - latency)

    def observe_recompute(self, tokens: int, seconds: float) -> None:
        """A forward computed ``tokens`` tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        measured = seconds / tokens
        if not self.recompute_s_per_token:
            self.recompute_s_per_token = measured
        else:
            self.recompute_s_per_token += self.smoothing * (measured - self.recompute_s_per_token)

    def restore_s(self, bytes_by_tier: Mapping[str, int]) -> float:
        return sum(self.s_per_call[t] + n * self.s_per_byte[t] for t, n in bytes_by_tier.items() if n)

    def recompute_s(self, tokens: int) -> float:
        return tokens * self.recompute_s_per_token

    def worth_restoring(self, bytes_by_tier: Mapping[str, int], tokens: int) -> bool:
        return not self.recompute_s_per_token or self.restore_s(bytes_by_tier) < self.recompute_s(tokens)


@dataclass(frozen=True)
class Restore:
    """A verified restore: the checkpoint at ``step`` and the chunks ``[first_chunk, step/C)``
    (by index), and the bytes read from each tier."""

    step: int
    first_chunk: int
    checkpoint: StoredObject
    chunks: Mapping[int, StoredObject]
    bytes_by_tier: Mapping[str, int]

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_tier.values())


@dataclass(frozen=True)
class PublishReport:
    """What one ``publish`` did, per tier: chunks newly stored, and whether the checkpoint is
    stored there (False: a chunk was refused or the store failed, so it was never put)."""

    chunks_stored: Mapping[str, int]
    checkpoint_stored: Mapping[str, bool]
    bytes_written: Mapping[str, int]


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
    ) -> None:
        """Tiers may be any subset. This store listens to ``host``'s evictions (its write-back
        demotion), so a host store serves one ``TieredStore``. ``timeout`` bounds each batch call
        (None: each store's default). ``size_hint(kind, tokens)``: the bytes an object of that
        kind covering ``tokens`` tokens carries, for the cost model (None: the mean size read so
        far), for callers whose stored payloads stand in for larger ones (the replay)."""
        if size_hint is not None and not callable(size_hint):
            raise InvalidTypeError("size_hint must be callable")
        self.size_hint = size_hint
        given = {"host": host, "disk": disk, "shared": shared}
        for name, store in given.items():
            if store is not None and not isinstance(store, ObjectStore):
                raise InvalidTypeError(f"{name} must be an ObjectStore")
        if host is not None and not isinstance(host, HostMemoryStore):
            raise InvalidTypeError("host must be a HostMemoryStore")
        if cost is not None and not isinstance(cost, RestoreCost):
            raise InvalidTypeError("cost must be a RestoreCost")
        self.tiers: dict[str, ObjectStore] = {name: store for name, store in given.items() if store is not None}
        if not self.tiers:
            raise InvalidArgumentError("a TieredStore needs at least one tier")
        if host is not None:
            host.listen_evictions(self._demote)
        self.timeout = timeout
        self.cost = RestoreCost() if cost is None else cost
        self._needs: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # checkpoint -> chunks it needs, oldest first
        self._needed_by: dict[str, set[str]] = {}  # chunk name -> checkpoint names needing it
        self._publishing: set[str] = set()  # checkpoints whose chunks are being put right now
        self._promotions: list[tuple[str, bytes]] = []  # objects read from below, during a restore
        self.counters: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()

    # --- write path ------------------------------------------------------------------------------

    def publish(self, chain: KeyChain, step: int, chunk_arrays: ArraysFor, state_arrays: Callable[[], Mapping]) -> PublishReport:
        """Publish the checkpoint at ``step`` of ``chain`` with the KV chunks of ``[0, step)``
        into the top local tier and the shared tier, chunks first. ``chunk_arrays(i)`` and ``state_arrays()``
        are called only for objects some tier lacks; each object is encoded once."""
        if not isinstance(chain, KeyChain):
            raise InvalidTypeError("chain must be a KeyChain")
        checkpoint_key = chain.checkpoint_key(as_int("step", step, 1))  # validates the step
        chunk_keys = [chain.chunk_key(i).name for i in range(step // chain.chunk_size)]
        index_of = {name: index for index, name in enumerate(chunk_keys)}
        self._remember(checkpoint_key.name, chunk_keys)
        encoded: dict[str, bytes] = {}

        def chunk_bytes(name: str) -> bytes:
            if name not in encoded:
                encoded[name] = encode_kv_chunk(chain, index_of[name], chunk_arrays(index_of[name]))
            return encoded[name]

        def checkpoint_bytes() -> bytes:
            if checkpoint_key.name not in encoded:
                encoded[checkpoint_key.name] = encode_checkpoint(chain, step, state_arrays())
            return encoded[checkpoint_key.name]

        stored, published, written = {}, {}, {}
        self._publishing.add(checkpoint_key.name)
        try:
            for tier in self._write_through_tiers():
                stored[tier], published[tier], written[tier] = self._publish_into(
                    tier, self.tiers[tier], checkpoint_key.name, chunk_keys, chunk_bytes, checkpoint_bytes
                )
        finally:
            self._publishing.discard(checkpoint_key.name)
        return PublishReport(stored, published, written)

    def _write_through_tiers(self) -> list[str]:
        """The top local tier (host, else disk) and the shared one: disk is otherwise fed by
        the host tier's demotions."""
        local = next((tier for tier in ("host", "disk") if tier in self.tiers), None)
        return [tier for tier in (local, "shared") if tier in self.tiers]

    def _publish_into(self, tier, store, checkpoint_name, chunk_keys, chunk_bytes, checkpoint_bytes):
        """Missing chunks first (also when the checkpoint is there: a store may have evicted
        one part of the entry on its own), then the checkpoint if absent and every chunk is in."""
        try:
            present = store.exists([checkpoint_name, *chunk_keys], timeout=self.timeout)
            missing = [name for name, here in zip(chunk_keys, present[1:]) if not here]
            items = [(name, chunk_bytes(name)) for name in missing]
            outcomes = store.put_if_absent(items, timeout=self.timeout) if items else []
            new_chunks = sum(outcome is PutOutcome.STORED for outcome in outcomes)
            written = sum(len(value) for (_, value), outcome in zip(items, outcomes) if outcome is PutOutcome.STORED)
            if any(outcome not in _CONFIRMED for outcome in outcomes):
                self.counters[f"{tier}_publish_refused"] += 1
                return new_chunks, False, written
            published = present[0]
            if not published:
                value = checkpoint_bytes()
                (outcome,) = store.put_if_absent([(checkpoint_name, value)], timeout=self.timeout)
                published = outcome in _CONFIRMED
                if outcome is PutOutcome.STORED:
                    self.counters[f"{tier}_checkpoints_stored"] += 1
                    written += len(value)
        except StoreError:
            self.counters[f"{tier}_publish_failed"] += 1
            return 0, False, 0
        self.counters[f"{tier}_chunks_stored"] += new_chunks
        self.counters[f"{tier}_bytes_written"] += written
        return new_chunks, published, written

    def _remember(self, checkpoint_name: str, chunk_names: list[str]) -> None:
        if checkpoint_name in self._needs:
            return
        if len(self._needs) >= MAX_REMEMBERED_CHECKPOINTS:  # bounded: the oldest is forgotten, not judged
            self._forget(next(iter(self._needs)))
        self._needs[checkpoint_name] = tuple(chunk_names)
        for name in chunk_names:
            self._needed_by.setdefault(name, set()).add(checkpoint_name)

    def _forget(self, checkpoint_name: str) -> None:
        for name in self._needs.pop(checkpoint_name, ()):
            users = self._needed_by.get(name)
            if users is not None:
                users.discard(checkpoint_name)
                if not users:
                    del self._needed_by[name]

    def _demote(self, name: str, value: bytes) -> None:
        """The host tier evicted ``name``: write it back to disk unless it is dead weight."""
        disk = self.tiers.get("disk")
        if disk is None:
            self.counters["host_dropped"] += 1
            self._forget(name)
            return
        if self._is_dead_weight(name):
            self.counters["host_dropped_dead_weight"] += 1
            return
        try:
            disk.put_if_absent([(name, value)], timeout=self.timeout)
            self.counters["demoted_to_disk"] += 1
        except StoreError:
            self.counters["disk_demotion_failed"] += 1

    def _is_dead_weight(self, name: str) -> bool:
        """A checkpoint a chunk of whose prefix is gone from every tier, or a chunk that no
        checkpoint in any tier needs, can never serve a hit (as far as this process knows)."""
        if name in self._needs:
            needed = list(self._needs[name])
            dead = bool(needed) and not all(self._present_anywhere(needed))
            if dead:
                self._forget(name)
            return dead
        users = self._needed_by.get(name)
        if users is None or users & self._publishing:
            return False  # not ours to judge (fetched, or another process's), or its checkpoint comes next
        return not any(self._present_anywhere(sorted(users)))

    def _present_anywhere(self, names: list[str]) -> list[bool]:
        found = [False] * len(names)
        for store in self.tiers.values():
            try:
                found = [seen or here for seen, here in zip(found, store.exists(names, timeout=self.timeout))]
            except StoreError:
                continue
        return found

    # --- read path -------------------------------------------------------------------------------

    def find_restore(self, chain: KeyChain, *, local_step: int, local_kv_tokens: int) -> Restore | None:
        """The deepest verified restore beyond ``local_step`` (the device cache's hit), given
        that the device cache holds the KV of ``[0, local_kv_tokens)``; None when no deeper
        step is restorable or worth restoring (each rejected step counted in ``misses``)."""
        steps, first_chunk, names = self._candidates(chain, local_step, local_kv_tokens)
        if not steps:
            return None
        where = self.locate(names)
        fetched: dict[str, StoredObject] = {}
        self._promotions = []
        self.counters["restore_lookups"] += 1
        try:
            return self._first_restorable(chain, steps, first_chunk, where, fetched, local_step)
        finally:
            self._promote()  # only now: a promotion may evict from host what this restore reads

    def reachable_step(
        self, chain: KeyChain, *, local_step: int, local_kv_tokens: int, shared_located: dict | None = None
    ) -> int:
        """The deepest step ``find_restore`` could try, by existence only (nothing is read,
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

    def _first_restorable(self, chain, steps, first_chunk, where, fetched, local_step) -> Restore | None:
        size = chain.chunk_size
        # Chunks [first_chunk, complete) are all located: a step is whole when its checkpoint is
        # located and it ends by then. Linear in the chunks, where checking each step's own
        # chunk list is quadratic (a 20k-token prompt has 80 steps of up to 80 chunks). A chunk
        # that fails verification loses its locations, and ``complete`` drops to it.
        complete = self._located_run(chain, where, first_chunk, steps[0] // size)
        for step in steps:
            lowest = min(first_chunk, step // size)
            if step // size > complete or not where.get(chain.checkpoint_key(step).name):
                self.misses[MissReason.MISSING.value] += 1
                continue
            needed = [chain.expect_checkpoint(step)] + [chain.expect_chunk(i) for i in range(lowest, step // size)]
            restore = self._fetch_step(chain, step, lowest, needed, where, fetched, local_step)
            if restore is not None:
                self.counters["restores"] += 1
                self.counters["restored_tokens"] += step - local_step
                return restore
            complete = self._located_run(chain, where, first_chunk, complete)
        return None

    @staticmethod
    def _located_run(chain: KeyChain, where: dict[str, list[str]], first: int, end: int) -> int:
        """The end of the run of chunks from ``first`` (below ``end``) that some tier still holds."""
        index = first
        while index < end and where.get(chain.chunk_key(index).name):
            index += 1
        return index

    def locate(self, names: list[str], tiers: list[str] | None = None) -> dict[str, list[str]]:
        """Which of ``tiers`` (default: all, in tier order) hold each name: one batch
        ``exists`` per tier; a failing tier holds nothing (counted)."""
        where: dict[str, list[str]] = {name: [] for name in names}
        for tier in self.tiers if tiers is None else tiers:
            store = self.tiers[tier]
            try:
                present = store.exists(names, timeout=self.timeout)
            except StoreError:
                self.counters[f"{tier}_exists_failed"] += 1
                continue
            for name, here in zip(names, present):
                if here:
                    where[name].append(tier)
        return where

    def _fetch_step(self, chain, step, first_chunk, needed, where, fetched, local_step) -> Restore | None:
        if not self.cost.worth_restoring(self._estimate(needed, where, chain.chunk_size), step - local_step):
            self.misses[SLOWER_THAN_RECOMPUTE] += 1
            return None
        bytes_by_tier: Counter[str] = Counter()
        for expectation in needed:
            if expectation.key.name not in fetched and not self._fetch_one(expectation, where, fetched, bytes_by_tier):
                return None
        chunks = {i: fetched[chain.chunk_key(i).name] for i in range(first_chunk, step // chain.chunk_size)}
        return Restore(step, first_chunk, fetched[chain.checkpoint_key(step).name], chunks, dict(bytes_by_tier))

    def _fetch_one(self, expectation, where, fetched, bytes_by_tier) -> bool:
        """Fetch and verify one object from the first tier holding it; a verified object from
        below the host tier is promoted into it (same key). False, counted, when none verifies."""
        key = expectation.key
        name = key.name
        for tier in list(where[name]):
            began = time.perf_counter()
            data, verdict = self._read(tier, expectation)
            if not verdict.ok:
                self.misses[verdict.reason.value] += 1
                where[name].remove(tier)
                continue
            self.cost.observe_read(tier, len(data), time.perf_counter() - began)
            bytes_by_tier[tier] += len(data)
            self.counters[f"{tier}_bytes_read"] += len(data)
            self.counters[f"read_bytes_{key.kind.tag}"] += len(data)
            self.counters[f"read_count_{key.kind.tag}"] += 1
            self.counters[f"{tier}_read_count_{key.kind.tag}"] += 1  # what each tier served, by kind
            fetched[name] = verdict.obj
            if tier != "host" and "host" in self.tiers:
                self._promotions.append((name, data))
            return True
        return False

    def _read(self, tier: str, expectation: Expectation):
        try:
            (data,) = self.tiers[tier].get([expectation.key.name], timeout=self.timeout)
        except StoreTimeoutError as error:
            return None, Verdict(MissReason.TIMEOUT, str(error))
        except StoreError as error:
            return None, Verdict(MissReason.UNAVAILABLE, str(error))
        return data, verify(data, expectation)

    def _promote(self) -> None:
        """Copy what was read from below into the host tier, under the same keys."""
        promotions, self._promotions = self._promotions, []
        if not promotions:
            return
        try:
            outcomes = self.tiers["host"].put_if_absent(promotions, timeout=self.timeout)
            self.counters["promoted_to_host"] += sum(outcome is PutOutcome.STORED for outcome in outcomes)
        except StoreError:
            self.counters["host_promotion_failed"] += 1

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
        for checkpoint, chunks in self._needs.items():
            for name in chunks:
                assert checkpoint in self._needed_by.get(name, ()), "needs and needed_by disagree"
        for name, users in self._needed_by.items():
            assert users, "a chunk is remembered with no checkpoint needing it"
            for checkpoint in users:
                assert name in self._needs.get(checkpoint, ()), "needed_by names a checkpoint that does not need it"
        assert all(value >= 0 for value in self.counters.values()), "a counter went negative"
        assert not self._publishing, "a publish is still marked in progress"

    def close(self) -> None:
        for store in self.tiers.values():
            store.close()

