"""The tiers of one replay run's fleet: each replica's ``ReplicaTiers`` (``tiering``), the run's
namespace, and the keys the run put into the shared store.

Owns the set of names the run published to the shared store (removed at the end, so a sweep's
runs start from an empty store) and, through ``ReplicaTiers``, each replica's own host and disk
tiers; the shared store itself is the caller's (``TierSetup.shared``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence as SequenceLike

from hybridcache.errors import StoreError
from hybridcache.replay.budgets import mean_prompt_tokens
from hybridcache.replay.run_config import RunConfig
from hybridcache.replay.serving import ServedTurn
from hybridcache.replay.tiering import NominalSizes, ReplicaTiers, replay_fingerprint, restore_limit, tier_report
from hybridcache.tiers.keys import KeyChain
from hybridcache.workloads.records import TraceRequest

_REMOVE_BATCH = 512  # names per shared-store removal at the end of a run


class FleetTiers:
    """``replicas[i]``: replica i's tiers. Built for a config whose tiers are enabled."""

    def __init__(self, config: RunConfig, requests: SequenceLike[TraceRequest]) -> None:
        setup, profile = config.tiers, config.profile
        self.setup, self.chunk = setup, setup.chunk_size
        self.fingerprint = replay_fingerprint(profile, config.block_size, self.chunk, uuid.uuid4().hex[:16])
        self.sizes = NominalSizes(profile, self.chunk)
        mean_prompt = max(1, round(mean_prompt_tokens(requests)))
        flops = config.device_tflops * 1e12
        rate = profile.prefill_flops(0, mean_prompt) / mean_prompt / flops  # mean per-token cost of a mean prompt
        self.published: set[str] = set()
        self.replicas: list[ReplicaTiers] = []
        try:
            for index in range(config.replicas):
                self.replicas.append(ReplicaTiers(setup, self.sizes, self.fingerprint, rate, flops, profile, index))
        except BaseException:
            self.close()
            raise

    def prompt_chain(self, request: TraceRequest) -> KeyChain | None:
        """The chain of the prompt's restorable prefix (None: too short for one chunk)."""
        limit = restore_limit(request.prompt_length, self.chunk)
        return KeyChain(self.fingerprint, request.prompt[:limit]) if limit > 0 else None

    def shared_presence(self, chain: KeyChain) -> dict[str, list[str]] | None:
        """Where the chain's objects are in the shared store: one lookup for every replica
        (None without a shared tier)."""
        if self.setup.shared is None:
            return None
        names = [chain.checkpoint_key(step).name for step in chain.checkpoint_steps()]
        names += [chain.chunk_key(index).name for index in range(chain.num_chunks)]
        return self.replicas[0].store.locate(names, ["shared"])

    def publish(self, index: int, request: TraceRequest, served: ServedTurn) -> None:
        """Publish what replica ``index``'s turn computed beyond its hit: every chunk-aligned
        chunk end (the engine publishes those), the deepest aligned step of the prompt and of
        the turn end."""
        ends = served.ends
        if not ends:
            return
        computed = ends[-1]
        chunk = self.chunk
        wanted = {end for end in ends if end % chunk == 0}
        wanted |= {min(request.prompt_length, computed) // chunk * chunk, computed // chunk * chunk}
        steps = sorted(step for step in wanted if step > served.turn.hit_tokens)
        self.replicas[index].publish(request.tokens, steps, self.published)

    def remote_hit_tokens(self) -> int:
        return sum(replica.counters["remote_hit_tokens"] for replica in self.replicas)

    def report(self) -> dict:
        return tier_report(self.setup, self.sizes, self.replicas)

    def close(self) -> None:
        """Remove this run's objects from the shared store and close every replica's own tiers."""
        shared = self.setup.shared
        if shared is not None and self.published:
            names = sorted(self.published)
            for at in range(0, len(names), _REMOVE_BATCH):
                try:
                    shared.remove(names[at : at + _REMOVE_BATCH])
                except StoreError:
                    break  # the store is gone; so is what it held
        self.published.clear()
        for replica in self.replicas:
            replica.close()
