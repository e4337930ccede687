"""One lookup's restore attempt, as a value: which steps it may try, where each object it may
need was found, what it fetched and from where, what it will promote, and why it missed.

Owns the state of exactly one ``lookup_prefix`` (or ``reachable_step``) call: an attempt is
made by that call, worked on by :class:`~hybridcache.tiers.restore_path.RestorePath` (which
holds no per-lookup state itself), and dropped when it returns. Two threads restoring through
one ``TieredStore`` therefore never share an attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridcache.errors import InvalidTypeError
from hybridcache.tiers.keys import Expectation, KeyChain
from hybridcache.tiers.objects import StoredObject
from hybridcache.tiers.restore_values import Restore
from hybridcache.tiers.verify import FetchMiss
from hybridcache.types import as_int


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
