"""What a replay budget buys.

Budgets. ``kv_bytes`` buys KV blocks of ``block_size`` tokens, ``state_bytes`` buys checkpoint
slots of one profile state each (the running turn's own state is not charged). One combined
``cache_bytes`` is split so that both pools cover the same number of prompt tokens at the
admission policy's checkpoint density on this trace: state share = S / (S + K * spacing), with
S the checkpoint bytes, K the KV bytes per token and ``spacing`` the policy's tokens per
checkpoint (interval: N; reference: mean prompt / (ceil(mean prompt / chunk) + 1); ``auto``: its
grid as coarsened for the profile's state weight, ``AutoAdmission.for_state_weight``).

A pure recurrent model (no attention layer) keeps no KV: its share is 0 and the whole budget buys
checkpoints. Its KV block pool still indexes the prefixes (the trie names a checkpoint's position
by the blocks before it) but costs nothing, so it must never be what evicts: it is sized for every
checkpoint's path and the running turn's, each ``FREE_KV_PATH_SLACK`` times the mean prompt,
and at least ``MIN_FREE_KV_TOKENS``. Separate ``kv_bytes`` and ``state_bytes`` for such a model
are refused: there is no KV to budget.

Owns nothing: frozen values and pure functions (the host-memory reading is the machine's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass

import numpy as np

from hybridcache import machine
from hybridcache.errors import InvalidArgumentError
from hybridcache.policies import Policy
from hybridcache.profiles import ModelProfile
from hybridcache.replay.adapter import PoolGeometry
from hybridcache.types import as_int, finite_float
from hybridcache.workloads.records import TraceRequest


@dataclass(frozen=True)
class Budget:
    kv_bytes: int
    state_bytes: int
    cache_bytes: int | None = None  # set when the two were split from one budget
    free_kv_tokens: int = 0  # a pure recurrent model's: the tokens its free KV block pool indexes

    def __post_init__(self) -> None:
        for name in ("kv_bytes", "state_bytes", "free_kv_tokens"):
            object.__setattr__(self, name, as_int(name, getattr(self, name), 0))
        if self.cache_bytes is not None:
            object.__setattr__(self, "cache_bytes", as_int("cache_bytes", self.cache_bytes, 0))


def mean_prompt_tokens(requests: SequenceLike[TraceRequest]) -> float:
    return float(np.mean([request.prompt_length for request in requests])) if requests else 0.0


def split_budget(cache_bytes: int, profile: ModelProfile, policy: Policy, mean_prompt: float) -> Budget:
    """Split one budget between KV and checkpoints by the equal-coverage rule (this module's doc)."""
    if finite_float(mean_prompt) is None or mean_prompt < 0:
        raise InvalidArgumentError(f"mean_prompt must be a finite number >= 0, got {mean_prompt!r}")
    if profile.pure_recurrent:
        slots = cache_bytes // profile.state_bytes
        return Budget(0, cache_bytes, cache_bytes, free_kv_tokens(slots, mean_prompt))
    spacing = policy.admission.for_state_weight(profile.state_tokens_equivalent).checkpoint_spacing(mean_prompt)
    state_share = profile.state_bytes / (profile.state_bytes + profile.kv_bytes_per_token * spacing)
    state_bytes = int(cache_bytes * state_share)
    return Budget(cache_bytes - state_bytes, state_bytes, cache_bytes)


FREE_KV_PATH_SLACK = 4
MIN_FREE_KV_TOKENS = 2**20  # 32,768 blocks of 32 tokens: about half a megabyte of pool metadata


def free_kv_tokens(checkpoint_slots: int, mean_prompt: float) -> int:
    """The tokens a free KV pool indexes: every checkpoint's path and the running turn's."""
    path = math.ceil(FREE_KV_PATH_SLACK * max(0.0, mean_prompt))
    return max(MIN_FREE_KV_TOKENS, (checkpoint_slots + 1) * path)


# The pools' host metadata per entry (tracemalloc over a million of each): what a budget
# costs the replay before it serves a request. Block ids and state slots are int32.
POOL_BYTES_PER_KV_BLOCK = 17
POOL_BYTES_PER_STATE_SLOT = 41
MAX_POOL_ENTRIES = 2**31 - 3


def pool_geometry(budget: Budget, profile: ModelProfile, block_size: int, replicas: int) -> PoolGeometry:
    """The pools ``budget`` buys with blocks of ``block_size`` tokens (checked by
    ``run_config.RunConfig``, the only caller). Refused when they hold nothing, or when
    ``replicas`` of them would need more host memory than half this machine's (budgets are
    nominal bytes of device memory; the replay holds only each entry's metadata, yet a
    petabyte buys billions)."""
    kv_blocks = _kv_blocks(budget, profile, block_size)
    slots = budget.state_bytes // profile.state_bytes
    if kv_blocks < 1 or slots < 1:
        raise InvalidArgumentError(
            f"budget too small for {profile.name}: {kv_blocks} KV blocks, {slots} checkpoint slots"
        )
    metadata = replicas * (kv_blocks * POOL_BYTES_PER_KV_BLOCK + slots * POOL_BYTES_PER_STATE_SLOT)
    allowed = machine.host_memory_bytes() // 2
    if max(kv_blocks, slots) > MAX_POOL_ENTRIES or metadata > allowed:
        raise InvalidArgumentError(
            f"budget too large to replay: {kv_blocks:,} KV blocks and {slots:,} checkpoint slots per replica "
            f"need about {metadata / 2**30:,.1f} GiB of host memory for their metadata; this machine allows "
            f"{allowed / 2**30:,.1f} GiB (half its memory) and at most {MAX_POOL_ENTRIES:,} entries a pool"
        )
    return PoolGeometry(block_size, int(kv_blocks), int(slots))


def _kv_blocks(budget: Budget, profile: ModelProfile, block_size: int) -> int:
    if not profile.pure_recurrent:
        return budget.kv_bytes // (profile.kv_bytes_per_token * block_size)
    if budget.kv_bytes or not budget.free_kv_tokens:
        raise InvalidArgumentError(
            f"{profile.name} has no attention layers, so no KV to budget: give one combined budget "
            "(--cache-bytes), all of which buys checkpoints, not --kv-bytes with --state-bytes"
        )
    return -(-budget.free_kv_tokens // block_size)
