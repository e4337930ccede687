"""What the engine tells a caller about each request: its ``Result`` so far or at the end.

Owns, per unfinished request: the logits kept for it when it asked for them (one row per
generated token), the tier miss reason its restore reported when it was queued, and whether
its prompt head was served before, in its namespace or in another of the same tenant
(``served_heads``); and the engine's record of the prompt
heads it served. Everything per request is dropped when its result is handed out or it is
cancelled.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hybridcache.engine.model_api import ChunkOutput
from hybridcache.engine.requests import Result
from hybridcache.engine.served_heads import ServedHeads
from hybridcache.errors import HybridCacheError
from hybridcache.prefix_cache.stats import MissReason
from hybridcache.scheduler.scheduler import ServingSequence
from hybridcache.tiers.restore import EVICTED

NAMESPACE = "namespace"  # the same tenant computed the prompt's head under another adapter


class Outcomes:
    def __init__(self, block_size: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._logits: dict[int, list[np.ndarray]] = {}  # per request asking for them, one row per token
        self._tier_misses: dict[int, str] = {}  # per unfinished request the tiers served less than expected
        self._heads = ServedHeads(block_size)
        # unfinished requests whose prompt head was served before -> the reason that says so
        self._head_seen: dict[int, str] = {}

    def queued(self, entry: ServingSequence, tier_miss: str | None, caching: bool) -> None:
        """A request was queued; ``tier_miss``: what its tier restore reported (None: nothing)."""
        if tier_miss is not None:
            self._tier_misses[entry.request_id] = tier_miss
        adapters = self._heads.adapters_served(entry.seq) if caching else ()
        if adapters:  # another adapter's entries are ones this namespace can never use
            self._head_seen[entry.request_id] = EVICTED if entry.seq.namespace.adapter in adapters else NAMESPACE

    def keep_logits(self, entry: ServingSequence, output: ChunkOutput) -> None:
        """The logits a generated token was chosen from, for requests that asked for them."""
        if entry.payload.return_logits:
            self._logits.setdefault(entry.request_id, []).append(output.logits)

    def forget(self, request_id: int) -> None:
        """A cancelled request: nothing of it is kept."""
        self._logits.pop(request_id, None)
        self._tier_misses.pop(request_id, None)
        self._head_seen.pop(request_id, None)

    def result(self, entry: ServingSequence, error: HybridCacheError | None = None) -> Result:
        """The finished request's result; its head is recorded as served when it succeeded."""
        rows = self._logits.pop(entry.request_id, [])
        logits = None
        if entry.payload.return_logits:
            logits = np.stack(rows) if rows else np.empty((0, self.vocab_size))
        summary = self.summary(entry)
        self._tier_misses.pop(entry.request_id, None)
        self._head_seen.pop(entry.request_id, None)
        if error is None:
            self._heads.served(entry.seq)
        return replace(summary, routed_experts=entry.final_routed_experts, logits=logits, error=error)

    def summary(self, entry: ServingSequence) -> Result:
        """The tokens generated so far and the cached depth (no logits, no routed experts)."""
        prompt_tokens = entry.payload.prompt.size
        return Result(
            request_id=entry.request_id,
            prompt_tokens=prompt_tokens,
            tokens=entry.seq.tokens[prompt_tokens:].tolist(),
            cached_tokens=entry.cached_tokens,
            miss_reason=self._miss_reason(entry),
            tier_miss_reason=self._tier_misses.get(entry.request_id),
        )

    def _miss_reason(self, entry: ServingSequence) -> str | None:
        """The admission's reason; for a prompt that restored nothing although this engine
        computed its first block before: ``evicted`` (its blocks were evicted, or cleared) or,
        when only another adapter of the same tenant computed it, ``namespace``."""
        if entry.miss_reason == MissReason.NO_CACHED_PREFIX.value:
            return self._head_seen.get(entry.request_id, entry.miss_reason)
        return entry.miss_reason

    def check_invariants(self, unfinished: set[int]) -> None:
        assert self._tier_misses.keys() <= unfinished, "a finished request kept its tier miss"
        assert self._head_seen.keys() <= unfinished, "a finished request kept its served-head mark"
        self._heads.check_invariants()
