"""One request served on one replica's cache, as the engine's scheduler would serve it.

Owns nothing between calls; during ``serve_turn``, the turn being served (its sequence and
runtime slot, released before it returns). A turn is: admission (the cache reuses the deepest
exact checkpoint), then virtual chunks to the ends its admission policy plans, checkpoints where
the plan asks, its output appended at the prompt end and processed as one more virtual chunk (or
several, when the policy checkpoints inside it), and release. A turn the pools cannot hold even
when empty is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridcache.policies import Policy
from hybridcache.policies.turn_plan import TurnPlan
from hybridcache.replay.adapter import CacheAdapter, Turn


@dataclass
class ServedTurn:
    """What serving one request did: the turn (its hit), the end of every chunk it computed,
    the checkpoints it published, and whether it was dropped."""

    turn: Turn
    ends: list[int] = field(default_factory=list)
    checkpoints_written: int = 0
    dropped: bool = False


def serve_turn(adapter: CacheAdapter, prompt: np.ndarray, output: np.ndarray, policy: Policy, chunk: int) -> ServedTurn:
    """One turn of a request's ``prompt`` and ``output`` (read from the trace once, by the
    caller): admission, prefill chunks of at most ``chunk`` tokens from the resume point
    (as the engine's scheduler cuts them) also ended at every planned checkpoint, the output
    as one more chunk, release. A tier restore, if any, was adopted before."""
    served = ServedTurn(adapter.start_turn(prompt))
    plan = TurnPlan(policy.admission, chunk, prompt.size, prompt.size + max(0, output.size - 1), served.turn.branch,
                    adapter.geometry.block_size)
    first = adapter.admit(served.turn, prompt.size, plan.stop_at)
    if first is None:
        served.dropped = True
    else:
        _forward(adapter, output, plan, first, served)
    adapter.finish(served.turn)
    return served


def _forward(adapter: CacheAdapter, output: np.ndarray, plan: TurnPlan, first: int, served: ServedTurn) -> None:
    """The prompt's chunks, then the output's; stops (dropped) where blocks cannot be freed."""
    turn = served.turn
    prompt_ends, output_ends, kinds = plan.ends(turn.hit_tokens, first)
    parent = turn.hit_tokens
    for group, chunk_ends in enumerate((prompt_ends, output_ends)):
        if not chunk_ends:
            continue
        if group and not adapter.grow(turn, chunk_ends[0]):
            served.dropped = True
            return
        published = adapter.forward(turn, chunk_ends, kinds, parent)
        served.checkpoints_written += sum(published)
        parent = max((end for end, done in zip(chunk_ends, published) if done), default=parent)
        served.ends.extend(chunk_ends[: len(published)])
        if len(published) < len(chunk_ends):
            served.dropped = True
            return
        if chunk_ends[-1] == plan.prompt_length:
            adapter.append(turn, output)
