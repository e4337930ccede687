"""The one tier client of the engine and the replay: which prefix of a sequence may be
restored, its key chain, find-restore then adopt, the publish of computed steps, and what all
of that gained, cost or missed (:class:`TierStats`).

Owns: its base namespace fingerprint (each sequence's adapter and cache salt are added to it)
and its :class:`TierStats`. Borrows the caller's ``TieredStore`` (the tiers and their contents)
and a ``TierDevice`` (``tiers.device``), the side that holds the device cache: the engine's
tensors, the replay's stand-ins. The device cache changes only through ``TierDevice.adopt``. A
client serves one engine or one replica, on one thread (its statistics are not locked; the
store's are, so several clients may share one ``TieredStore``).

Nothing on the tier side raises into the caller: a restore can only cost a miss (the request
goes on with what the device cache holds, its reason counted), a publish only a failed publish
(counted, with the error class). A request is therefore never stranded by a store, an object or
a bug behind this seam.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import NamedTuple

from hybridcache.errors import InvalidArgumentError, InvalidTypeError, LifecycleError
from hybridcache.sequence import Sequence
from hybridcache.tiers.device import TierDevice
from hybridcache.tiers.fingerprint import NamespaceFingerprint
from hybridcache.tiers.keys import KeyChain
from hybridcache.tiers.publish import PublishReport
from hybridcache.tiers.restore import EVICTED, SLOWER_THAN_RECOMPUTE, Restore
from hybridcache.tiers.tiered import TieredStore
from hybridcache.tiers.verify import FetchMiss
from hybridcache.types import NO_SLOT

# Why the tiers served a request less than they were expected to, as a request's miss reason
# (``Result.tier_miss_reason``); every other verification failure is ``tier_rejected``.
TIER_UNAVAILABLE, TIER_TIMEOUT, TIER_REJECTED, TIER_ERROR = "tier_unavailable", "tier_timeout", "tier_rejected", "tier_error"
TIER_MISS_REASONS = {
    FetchMiss.UNAVAILABLE.value: TIER_UNAVAILABLE,  # also a tier its breaker skips
    FetchMiss.TIMEOUT.value: TIER_TIMEOUT,
    EVICTED: EVICTED,
    SLOWER_THAN_RECOMPUTE: SLOWER_THAN_RECOMPUTE,
}
ROUTED_EXPERTS_SKIPPED = "routed_experts"  # a request asking for rows no tier checkpoint carries


class TierRestore(NamedTuple):
    """What one ``TierClient.adopt_prefix`` did: the tokens it gained and the restore adopted, or
    why the tiers served less than expected (None: nothing deeper was expected)."""

    gained: int = 0
    miss_reason: str | None = None
    restore: Restore | None = None


PublishListener = Callable[[Sequence, int, KeyChain, PublishReport], None]


class ForwardEnd(NamedTuple):
    """A forward computed ``seq`` up to ``step``; its state is in ``slot``."""

    seq: Sequence
    step: int
    slot: int


@dataclass
class TierStats:
    """What one client's restores and publishes did. Per-tier and per-reason counts are keyed
    by the tier's name (``host``, ``disk``, ``shared``), the reason, or the error's class."""

    restores: int = 0  # restores adopted
    remote_hit_tokens: int = 0  # the tokens they gained over the device cache
    adoptions_refused: int = 0  # verified restores the device did not take
    restores_skipped: Counter[str] = field(default_factory=Counter)  # lookups not made, by why
    misses: Counter[str] = field(default_factory=Counter)  # requests served less than expected, by reason
    restores_using: Counter[str] = field(default_factory=Counter)  # adopted restores that read from a tier
    restored_bytes: Counter[str] = field(default_factory=Counter)  # bytes adopted restores read, by tier
    restored_tokens: Counter[str] = field(default_factory=Counter)  # tokens gained, by the tier that served them
    write_refusals: Counter[str] = field(default_factory=Counter)  # refused adoptions, by the device's reason
    published_steps: int = 0
    published_bytes: int = 0  # bytes the publishes wrote, over every tier
    restore_failed: Counter[str] = field(default_factory=Counter)  # restores that raised, by error class
    publish_failed: Counter[str] = field(default_factory=Counter)  # publishes that raised, by error class

    def as_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def check_invariants(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            counts = value.values() if isinstance(value, Counter) else (value,)
            assert all(count >= 0 for count in counts), f"tier statistic {f.name} went negative"
        assert self.restored_tokens.total() == self.remote_hit_tokens, "restored tokens by tier do not add up"


def _plain(value: int | Counter) -> int | dict:
    return dict(value) if isinstance(value, Counter) else value


class TierClient:
    def __init__(self, store: TieredStore, fingerprint: NamespaceFingerprint, device: TierDevice) -> None:
        """``fingerprint``: the namespace of sequences with neither adapter nor cache salt."""
        if not isinstance(store, TieredStore):
            raise InvalidTypeError("tiers must be a TieredStore")
        if not isinstance(fingerprint, NamespaceFingerprint):
            raise InvalidTypeError("fingerprint must be a NamespaceFingerprint")
        self.store, self.fingerprint, self.device = store, fingerprint, device
        self.chunk_size = fingerprint.chunk_size
        self.stats = TierStats()
        self._on_publish: PublishListener | None = None

    def listen_publishes(self, on_publish: PublishListener) -> None:
        """Install the one callback told ``(seq, step, chain, report)`` after each publish (the
        engine's event streams announce what the host and disk tiers confirmed); what it raises
        counts as a failed publish."""
        if not callable(on_publish):
            raise InvalidTypeError("on_publish must be callable")
        if self._on_publish is not None:
            raise LifecycleError("these tiers already report their publishes to another listener")
        self._on_publish = on_publish

    # --- keys ------------------------------------------------------------------------------------

    def restore_limit(self, seq: Sequence) -> int:
        """The deepest chunk-aligned step below ``seq``'s last token (one must be computed)
        that cuts no multimodal span (a checkpoint inside an image could not be resumed)."""
        step = ((seq.num_tokens - 1) // self.chunk_size) * self.chunk_size
        while step > 0 and not seq.is_boundary_safe(step):
            step -= self.chunk_size
        return step

    def chain(self, seq: Sequence, end: int) -> KeyChain:
        """The key chain of ``seq``'s tokens ``[0, end)`` in its own namespace: the one
        derivation of keys for everything this client looks up and publishes."""
        return KeyChain.for_sequence(self.fingerprint, seq, end)

    def restore_chain(self, seq: Sequence, made: KeyChain | None = None) -> KeyChain | None:
        """The chain a restore of ``seq`` looks up (None: no whole chunk before its last token).
        ``made``: a chain of ``seq``'s tokens made earlier (longer ones too: a turn's, its output
        included), cut to the restore's limit rather than derived again."""
        limit = self.restore_limit(seq)
        if limit <= 0:
            return None
        return self.chain(seq, limit) if made is None else self._checked(made, seq, limit).prefix(limit)

    def _checked(self, made: KeyChain, seq: Sequence, end: int) -> KeyChain:
        """``made``, once it is a chain of ``seq``'s own tokens to ``end`` in its namespace: one
        of other tokens would adopt, or publish, KV under keys that are not the sequence's."""
        if not isinstance(made, KeyChain):
            raise InvalidTypeError("made must be a KeyChain")
        if not made.describes(self.fingerprint, seq, end):
            raise InvalidArgumentError("made is not a chain of this sequence's tokens in its namespace")
        return made

    # --- read path -------------------------------------------------------------------------------

    def adopt_prefix(self, seq: Sequence, made: KeyChain | None = None) -> TierRestore:
        """Before ``seq`` is served: adopt the deepest verified restore the tiers hold beyond
        what the device cache holds (``made``: as for ``restore_chain``). Never raises: a
        failing tier or device write is a miss (``tier_error`` when something raised, counted
        in ``restore_failed`` by error class)."""
        if seq.want_routed_experts:
            self.stats.restores_skipped[ROUTED_EXPERTS_SKIPPED] += 1
            return TierRestore()
        outcome = self._guarded(self.stats.restore_failed, self._restore, seq, made) or TierRestore(0, TIER_ERROR)
        if outcome.miss_reason is not None:
            self.stats.misses[outcome.miss_reason] += 1
        return outcome

    def _restore(self, seq: Sequence, made: KeyChain | None) -> TierRestore:
        held = self.device.cached_prefix(seq)
        if held is None or self.restore_limit(seq) <= held[0]:
            return TierRestore()
        local_step, local_kv = held
        chain = self.restore_chain(seq, made)
        lookup = self.store.lookup_prefix(chain, local_step=local_step, local_kv_tokens=local_kv)
        restore = lookup.restore
        if restore is None:
            return TierRestore(0, None if lookup.miss is None else TIER_MISS_REASONS.get(lookup.miss, TIER_REJECTED))
        prefix = Sequence(
            seq.tokens[: restore.step],
            adapter=seq.namespace.adapter,
            cache_salt=seq.namespace.cache_salt,
            multimodal=seq.spans_overlapping(0, restore.step),
        )
        adopted = self.device.adopt(prefix, restore)
        if not adopted.gained:
            self.stats.adoptions_refused += 1
            if adopted.refused is not None:
                self.stats.write_refusals[adopted.refused] += 1
            return TierRestore(0, TIER_REJECTED)
        self._count_restore(restore, adopted.gained)
        return TierRestore(adopted.gained, None, restore)

    def _count_restore(self, restore: Restore, gained: int) -> None:
        stats = self.stats
        stats.restores += 1
        stats.remote_hit_tokens += gained
        stats.restores_using.update(restore.bytes_by_tier.keys())
        stats.restored_bytes.update(restore.bytes_by_tier)
        stats.restored_tokens.update(restore.tokens_by_tier(restore.step - gained, self.chunk_size))

    # --- routing: what a restore could reach, by existence only ------------------------------

    def shared_presence(self, chain: KeyChain) -> dict[str, list[str]] | None:
        """Which of ``chain``'s checkpoints and chunks the shared tier holds (one batch
        ``exists``; nothing read or refreshed), for a router scoring several replicas that
        share that tier; None without one."""
        if "shared" not in self.store.tiers:
            return None
        names = [chain.checkpoint_names[step] for step in chain.steps]
        names += chain.chunk_names
        return self.store.locate(names, ["shared"])

    def reachable_step(self, chain: KeyChain, held: tuple[int, int], shared_located: dict | None = None) -> int:
        """The deepest step a restore of ``chain`` could reach beyond ``held`` (the device
        cache's checkpoint step and whole-block KV tokens), by existence only; ``held``'s step
        when none. ``shared_located``: ``shared_presence``'s answer, asked once for many replicas."""
        local_step, local_kv_tokens = held
        return self.store.reachable_step(
            chain, local_step=local_step, local_kv_tokens=local_kv_tokens, shared_located=shared_located
        )

    # --- write path ------------------------------------------------------------------------------

    def after_forward(self, ends: Iterable[ForwardEnd], computed_tokens: int, seconds: float) -> None:
        """A forward computed ``computed_tokens`` in ``seconds`` and reached ``ends``: feed the
        cost model, publish every end on a chunk boundary (its sequence still holds its blocks
        and slot). Never raises."""
        self._guarded(self.stats.publish_failed, self.store.cost.observe_recompute, computed_tokens, seconds)
        for end in ends:
            self.store_prefix(end.seq, [end.step], end.slot)

    def store_prefix(self, seq: Sequence, steps: list[int], slot: int = NO_SLOT,
                     made: KeyChain | None = None) -> KeyChain | None:
        """Publish the checkpoints of ``seq`` at ``steps`` (ascending; those off a chunk
        boundary or inside a multimodal span are left out) with the KV chunks before them,
        read through ``device.payloads(seq, slot)``; ``made``: a chain of ``seq``'s tokens made
        earlier, reaching the last step at least (None: derived here). The chain published
        (None: nothing was, or the publish raised, counted in ``publish_failed``)."""
        return self._guarded(self.stats.publish_failed, self._store_prefix, seq, steps, slot, made)

    def _store_prefix(self, seq: Sequence, steps: list[int], slot: int, made: KeyChain | None) -> KeyChain | None:
        size = self.chunk_size
        steps = [step for step in steps if step > 0 and not step % size and seq.is_boundary_safe(step)]
        if not steps:
            return None
        chain = self.chain(seq, steps[-1]) if made is None else self._checked(made, seq, steps[-1])
        payloads = self.device.payloads(seq, slot)
        for step in steps:
            report = self.store.store_prefix(chain, step, payloads.chunk, payloads.state)
            self.stats.published_steps += 1
            self.stats.published_bytes += sum(report.bytes_written.values())
            if self._on_publish is not None:
                self._on_publish(seq, step, chain, report)
        return chain

    # --- the seam --------------------------------------------------------------------------------

    @staticmethod
    def _guarded(failures: Counter[str], call: Callable, *args):
        """``call(*args)``, or None when it raises: the tier side may cost a hit or a publish,
        never the caller's requests. Counted in ``failures`` by error class."""
        try:
            return call(*args)
        except Exception as error:  # any store, object or bug on the tier side: never the caller's
            failures[type(error).__name__] += 1
            return None

    def stats_dict(self) -> dict:
        """The statistics as plain values, with the store's own under ``store``."""
        return {**self.stats.as_dict(), "store": self.store.stats()}

    def check_invariants(self) -> None:
        self.stats.check_invariants()
        self.store.check_invariants()
