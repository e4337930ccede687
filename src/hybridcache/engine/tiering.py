"""The engine's side of the host, disk and shared tiers: publish chunk-aligned prefixes after
the forward that reaches them, adopt verified ones from the tiers when a request arrives.

Owns: this engine's namespace fingerprint (model class, the model's ``weights_identity``,
dtype, layouts, block and chunk size; each request adds its adapter and cache salt), the
storage's array layout a fetched payload must match, and its tier counters.
The ``TieredStore`` (the caller's) owns the tiers and their contents; the device cache is
changed only through ``CacheProtocol.adopt``.

Publishing reads the KV blocks and the runtime state slot of a sequence that still holds them
(right after its forward, before the scheduler may release it), so the source blocks and slot
cannot be reused before every store has answered. Adoption writes only blocks the cache hands
out as writable for that purpose, from objects whose tokens were compared with the request's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from hybridcache.engine.model_api import ModelLayout
from hybridcache.errors import HybridCacheError, InvalidArgumentError, InvalidConfigError, InvalidTypeError, LifecycleError
from hybridcache.protocol import Adoption, CacheProtocol
from hybridcache.sequence import Sequence
from hybridcache.tiers.fingerprint import DEFAULT_CHUNK_SIZE, NamespaceFingerprint
from hybridcache.tiers.keys import KeyChain
from hybridcache.tiers.restore_values import EVICTED, SLOWER_THAN_RECOMPUTE, PublishReport, Restore
from hybridcache.tiers.tiered import TieredStore
from hybridcache.tiers.verify import FetchMiss
from hybridcache.types import as_int

# Why the tiers served a request less than they were expected to, as a request's miss reason
# (``Result.tier_miss_reason``); every other verification failure is ``tier_rejected``.
TIER_UNAVAILABLE, TIER_TIMEOUT, TIER_REJECTED, TIER_ERROR = "tier_unavailable", "tier_timeout", "tier_rejected", "tier_error"
TIER_MISS_REASONS = {
    FetchMiss.UNAVAILABLE.value: TIER_UNAVAILABLE,  # also a tier its breaker skips
    FetchMiss.TIMEOUT.value: TIER_TIMEOUT,
    EVICTED: EVICTED,
    SLOWER_THAN_RECOMPUTE: SLOWER_THAN_RECOMPUTE,
}


class TierRestore(NamedTuple):
    """What ``EngineTiers.restore`` did for one request: the tokens it gained, or why not."""

    gained: int = 0
    miss_reason: str | None = None


def layout_text(layout: ModelLayout, kind: str) -> str:
    """The exact description of a layout's KV (``kind="kv"``) or state tensors."""
    layers = layout.kv_layers if kind == "kv" else layout.state_layers
    return ";".join(
        f"{layer.index}.{spec.name}:{spec.dtype}{list(spec.shape)}" for layer in layers for spec in getattr(layer, kind)
    )


class EngineTiers:
    def __init__(
        self,
        store: TieredStore,
        *,
        model: object,
        storage: object,
        cache: CacheProtocol,
        model_id: str,
        dtype: str,
        block_size: int,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        if not isinstance(store, TieredStore):
            raise InvalidTypeError("tiers must be a TieredStore")
        layout = model.layout
        if not layout.is_hybrid:
            raise InvalidConfigError(
                "tiers serve models with recurrent state only: a restore resumes from a state checkpoint, "
                "and this model is attention-only (its device prefix cache serves it without tiers)"
            )
        self.store, self.storage, self.cache = store, storage, cache
        self.block_size = block_size
        self.chunk_size = as_int("chunk_size", chunk_size, 1)
        if self.chunk_size % block_size:
            raise InvalidArgumentError(f"tier chunk_size {chunk_size} must be a multiple of block_size {block_size}")
        self.fingerprint = NamespaceFingerprint(
            model_id=model_id,
            weights_revision=model.weights_identity(),
            dtype=dtype,
            kv_layout=f"{type(storage).__name__}|{layout_text(layout, 'kv')}",
            state_layout=layout_text(layout, "state"),
            block_size=block_size,
            chunk_size=self.chunk_size,
        )
        per_chunk = self.chunk_size // block_size
        # What a fetched payload must look like to be written here: the storage's own arrays.
        self._chunk_layout = {name: ((per_chunk, *a.shape[1:]), a.dtype) for name, a in storage.read_blocks([]).items()}
        self._slot_layout = {name: (a.shape, a.dtype) for name, a in storage.read_slot(0).items()}
        self.counters: Counter[str] = Counter()
        self._on_publish: Callable[[Sequence, int, KeyChain, PublishReport], None] | None = None

    def listen_publishes(self, on_publish: Callable[[Sequence, int, KeyChain, PublishReport], None]) -> None:
        """Install the one callback told ``(seq, step, chain, report)`` after each publish (the
        engine's event streams announce what the host and disk tiers confirmed)."""
        if not callable(on_publish):
            raise InvalidTypeError("on_publish must be callable")
        if self._on_publish is not None:
            raise LifecycleError("these tiers already report their publishes to another listener")
        self._on_publish = on_publish

    # --- write path ------------------------------------------------------------------------------

    def after_forward(self, chunks: list, forward_s: float) -> None:
        """A forward computed ``chunks`` in ``forward_s``: feed the cost model, publish every
        chunk that ended on a publish step (its sequence still holds its blocks and slot).
        Never raises: a failing publish is counted (``publish_failed``, and by error class)
        and costs only that publish."""
        computed = sum(chunk.end - chunk.start for chunk in chunks)
        self._guarded("publish_failed", self.store.cost.observe_recompute, computed, forward_s)
        for chunk in chunks:
            self._guarded("publish_failed", self.store_prefix, chunk.entry.seq, chunk.end, chunk.entry.runtime_slot)

    def store_prefix(self, seq: Sequence, step: int, runtime_slot: int) -> None:
        """``seq``'s forward just computed ``[.., step)`` into its blocks and ``runtime_slot``:
        publish the checkpoint at ``step`` with the KV chunks of ``[0, step)``."""
        if step <= 0 or step % self.chunk_size or not seq.is_boundary_safe(step):
            return
        chain = KeyChain(self._fingerprint(seq), seq.tokens[:step], seq.spans_overlapping(0, step))
        per_chunk = self.chunk_size // self.block_size
        table = list(seq.block_table)

        def chunk_arrays(index: int):
            return self.storage.read_blocks(table[index * per_chunk : (index + 1) * per_chunk])

        report = self.store.store_prefix(chain, step, chunk_arrays, lambda: self.storage.read_slot(runtime_slot))
        self.counters["published_steps"] += 1
        self.counters["published_bytes"] += sum(report.bytes_written.values())
        if self._on_publish is not None:
            self._on_publish(seq, step, chain, report)

    # --- read path -------------------------------------------------------------------------------

    def adopt_prefix(self, seq: Sequence) -> TierRestore:
        """Before ``seq`` is queued: adopt the deepest verified restore the tiers hold beyond
        what the device cache holds (never its last token: one must be computed). Returns the
        tokens gained, or why the tiers served less than expected (counted ``miss_<reason>``;
        restored tokens are counted ``restored_tokens_<tier>`` by the tier that served them).
        Never raises: a failing tier is a miss, counted (``restore_failed``, and by error
        class); ``adopt`` leaves nothing held or matchable when a write fails."""
        if seq.want_routed_experts:
            # Tier checkpoints carry no routed-expert rows, so such a request could not hit one.
            self.counters["restores_skipped_routed_experts"] += 1
            return TierRestore()
        outcome = self._guarded("restore_failed", self._restore, seq) or TierRestore(0, TIER_ERROR)
        if outcome.miss_reason is not None:
            self.counters[f"miss_{outcome.miss_reason}"] += 1
        return outcome

    def _restore(self, seq: Sequence) -> TierRestore:
        if not self.cache.enabled:
            return TierRestore()
        local_step, local_kv = self.cache.cached_prefix(seq)
        limit = self._deepest_step(seq)
        if limit <= local_step:
            return TierRestore()
        chain = KeyChain(self._fingerprint(seq), seq.tokens[:limit], seq.spans_overlapping(0, limit))
        lookup = self.store.lookup_prefix(chain, local_step=local_step, local_kv_tokens=local_kv)
        restore = lookup.restore
        if restore is None:
            return TierRestore(0, None if lookup.miss is None else TIER_MISS_REASONS.get(lookup.miss, TIER_REJECTED))
        scratch = Sequence(
            seq.tokens[: restore.step],
            adapter=seq.namespace.adapter,
            cache_salt=seq.namespace.cache_salt,
            multimodal=seq.spans_overlapping(0, restore.step),
        )
        gained = self.cache.adopt(scratch, restore.step, lambda adoption: self._write(adoption, restore)).gained
        if not gained:
            self.counters["adoptions_refused"] += 1
            return TierRestore(0, TIER_REJECTED)
        self.counters["remote_hit_tokens"] += gained
        self.counters["restores"] += 1
        for tier, nbytes in restore.bytes_by_tier.items():
            self.counters[f"restored_bytes_{tier}"] += nbytes
        for tier, tokens in restore.tokens_by_tier(restore.step - gained, self.chunk_size).items():
            self.counters[f"restored_tokens_{tier}"] += tokens
        return TierRestore(gained)

    def _guarded(self, failure: str, call, *args):
        """``call(*args)``, or None when it raises: the tier side may cost a hit or a publish,
        never the engine's requests. Counted as ``failure`` and ``failure_<error class>``."""
        try:
            return call(*args)
        except Exception as error:  # any store, object or bug on the tier side: never the engine's
            self.counters[failure] += 1
            self.counters[f"{failure}_{type(error).__name__}"] += 1
            return None

    def _deepest_step(self, seq: Sequence) -> int:
        """The deepest chunk-aligned step below the prompt's last token that cuts no
        multimodal span (a checkpoint inside an image could not be resumed)."""
        step = ((seq.num_tokens - 1) // self.chunk_size) * self.chunk_size
        while step > 0 and not seq.is_boundary_safe(step):
            step -= self.chunk_size
        return step

    def _write(self, adoption: Adoption, restore: Restore) -> bool:
        """Fill the adoption's writable blocks from the restore's chunks and its slot from the
        checkpoint. False (nothing stays matchable) when a writable block has no fetched chunk
        or an object's arrays are not exactly this storage's (checked before anything is written)."""
        size, per_chunk = self.chunk_size, self.chunk_size // self.block_size
        writes: dict[int, list[tuple[int, int]]] = {}
        for index in range(adoption.start // self.block_size, adoption.end // self.block_size):
            block = adoption.block_table[index]
            if block not in adoption.writable:
                continue  # shared with the cache: it already holds exactly this KV
            chunk = (index * self.block_size) // size
            if chunk not in restore.chunks:
                self.counters["restore_missing_local_chunk"] += 1
                return False
            writes.setdefault(chunk, []).append((index - chunk * per_chunk, block))
        payloads = [restore.chunks[chunk].payload for chunk in writes]
        if not all(_fits(payload, self._chunk_layout) for payload in payloads) or not _fits(
            restore.checkpoint.payload, self._slot_layout
        ):
            self.counters["restore_layout_mismatch"] += 1
            return False
        for payload, pairs in zip(payloads, writes.values()):
            rows = [offset for offset, _ in pairs]
            self.storage.write_blocks([block for _, block in pairs], {n: a[rows] for n, a in payload.items()})
        self.storage.write_slot(adoption.slot, dict(restore.checkpoint.payload))
        return True

    def _fingerprint(self, seq: Sequence) -> NamespaceFingerprint:
        namespace = seq.namespace
        fingerprint = self.fingerprint
        if namespace.adapter == fingerprint.adapter and namespace.cache_salt == fingerprint.cache_salt:
            return fingerprint
        return fingerprint.in_namespace(namespace.adapter, namespace.cache_salt)

    def stats(self) -> dict:
        return {**self.counters, "store": self.store.stats()}


def _fits(payload, layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> bool:
    """Whether ``payload`` names exactly ``layout``'s arrays, each of exactly its shape and dtype."""
    if set(payload) != set(layout):
        return False
    return all(
        np.shape(payload[name]) == shape and payload[name].dtype == dtype for name, (shape, dtype) in layout.items()
    )
