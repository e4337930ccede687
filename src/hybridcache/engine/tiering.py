"""The engine's side of the tier client (``hybridcache.tiers.client``): its namespace
fingerprint, and the tensor reads a publish makes and the writes an adoption makes.

Owns: the storage's array layout a fetched payload must match. The ``TierClient`` it builds
owns the restore and publish logic and the statistics; the ``TieredStore`` (the caller's) owns
the tiers and their contents; the device cache is changed only through ``CacheProtocol.adopt``.

Publishing reads the KV blocks and the runtime state slot of a sequence that still holds them
(right after its forward, before the scheduler may release it), so the source blocks and slot
cannot be reused before every store has answered. Adoption writes only blocks the cache hands
out as writable for that purpose, from objects whose tokens were compared with the request's.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hybridcache.engine.engine_config import EngineConfig
from hybridcache.engine.model_api import ModelLayout
from hybridcache.errors import InvalidConfigError, InvalidTypeError
from hybridcache.protocol import Adoption, CacheProtocol
from hybridcache.sequence import Sequence
from hybridcache.tiers.client import TierClient
from hybridcache.tiers.device import DeviceAdoption
from hybridcache.tiers.fingerprint import NamespaceFingerprint
from hybridcache.tiers.restore import Restore
from hybridcache.tiers.tiered import TieredStore

MISSING_LOCAL_CHUNK = "missing_local_chunk"  # a writable block whose chunk the restore did not fetch
LAYOUT_MISMATCH = "layout_mismatch"  # an object's arrays are not exactly this storage's

Layout = dict[str, tuple[tuple[int, ...], np.dtype]]


def layout_text(layout: ModelLayout, kind: str) -> str:
    """The exact description of a layout's KV (``kind="kv"``) or state tensors."""
    layers = layout.kv_layers if kind == "kv" else layout.state_layers
    return ";".join(
        f"{layer.index}.{spec.name}:{spec.dtype}{list(spec.shape)}" for layer in layers for spec in getattr(layer, kind)
    )


def engine_tier_client(store: TieredStore, model: object, storage: object, cache: CacheProtocol, config: EngineConfig) -> TierClient:
    """The tier client of an engine serving ``model`` from ``storage`` through ``cache``."""
    if not isinstance(store, TieredStore):
        raise InvalidTypeError("tiers must be a TieredStore")
    layout = model.layout
    if not layout.is_hybrid:
        raise InvalidConfigError(
            "tiers serve models with recurrent state only: a restore resumes from a state checkpoint, "
            "and this model is attention-only (its device prefix cache serves it without tiers)"
        )
    fingerprint = NamespaceFingerprint(
        model_id=type(model).__name__,
        weights_revision=model.weights_identity(),
        dtype=config.resolved_dtype,
        kv_layout=f"{type(storage).__name__}|{layout_text(layout, 'kv')}",
        state_layout=layout_text(layout, "state"),
        block_size=config.block_size,
        chunk_size=config.tier_chunk_size,
    )
    return TierClient(store, fingerprint, EngineDevice(storage, cache, config.block_size, config.tier_chunk_size))


class _BlockReads:
    """A publish's reads: chunk ``index`` from the sequence's block table, the state from its slot."""

    def __init__(self, storage: object, table: list[int], slot: int, per_chunk: int) -> None:
        self.storage, self.table, self.slot, self.per_chunk = storage, table, slot, per_chunk

    def chunk(self, index: int) -> Mapping[str, np.ndarray]:
        return self.storage.read_blocks(self.table[index * self.per_chunk : (index + 1) * self.per_chunk])

    def state(self) -> Mapping[str, np.ndarray]:
        return self.storage.read_slot(self.slot)


class EngineDevice:
    """The engine's cache storage and prefix cache, as a ``TierDevice``."""

    def __init__(self, storage: object, cache: CacheProtocol, block_size: int, chunk_size: int) -> None:
        self.storage, self.cache = storage, cache
        self.block_size, self.chunk_size = block_size, chunk_size
        self.per_chunk = chunk_size // block_size
        # What a fetched payload must look like to be written here: the storage's own arrays.
        self.chunk_layout: Layout = {
            name: ((self.per_chunk, *a.shape[1:]), a.dtype) for name, a in storage.read_blocks([]).items()
        }
        self.slot_layout: Layout = {name: (a.shape, a.dtype) for name, a in storage.read_slot(0).items()}

    def cached_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        return self.cache.cached_prefix(seq) if self.cache.enabled else None

    def payloads(self, seq: Sequence, slot: int) -> _BlockReads:
        return _BlockReads(self.storage, list(seq.block_table), slot, self.per_chunk)

    def adopt(self, prefix: Sequence, restore: Restore) -> DeviceAdoption:
        refused: list[str] = []

        def write(adoption: Adoption) -> bool:
            reason = self._write(adoption, restore)
            refused.extend([reason] if reason is not None else [])
            return reason is None

        gained = self.cache.adopt(prefix, restore.step, write).gained
        return DeviceAdoption(gained, refused[0] if refused else None)

    def _write(self, adoption: Adoption, restore: Restore) -> str | None:
        """Fill the adoption's writable blocks from the restore's chunks and its slot from the
        checkpoint; the reason when it cannot (checked before anything is written)."""
        writes: dict[int, list[tuple[int, int]]] = {}
        for index in range(adoption.start // self.block_size, adoption.end // self.block_size):
            block = adoption.block_table[index]
            if block not in adoption.writable:
                continue  # shared with the cache: it already holds exactly this KV
            chunk = (index * self.block_size) // self.chunk_size
            if chunk not in restore.chunks:
                return MISSING_LOCAL_CHUNK
            writes.setdefault(chunk, []).append((index - chunk * self.per_chunk, block))
        payloads = [restore.chunks[chunk].payload for chunk in writes]
        if not all(_fits(payload, self.chunk_layout) for payload in payloads) or not _fits(
            restore.checkpoint.payload, self.slot_layout
        ):
            return LAYOUT_MISMATCH
        for payload, pairs in zip(payloads, writes.values()):
            rows = [offset for offset, _ in pairs]
            self.storage.write_blocks([block for _, block in pairs], {n: a[rows] for n, a in payload.items()})
        self.storage.write_slot(adoption.slot, dict(restore.checkpoint.payload))
        return None


def _fits(payload: Mapping[str, np.ndarray], layout: Layout) -> bool:
    """Whether ``payload`` names exactly ``layout``'s arrays, each of exactly its shape and dtype."""
    if set(payload) != set(layout):
        return False
    return all(
        np.shape(payload[name]) == shape and payload[name].dtype == dtype for name, (shape, dtype) in layout.items()
    )
