"""The routing cost and the three policies (nothing mutable).

For each replica the router knows its ``Depths`` for the request (``replica_index``) and the
tokens it must compute before it can start this request's prefill (``queued_tokens``, see
``fleet.Replica.queued_tokens``). The cost is in tokens, the unit both terms share:

* ``restorable`` (default): among the replicas restoring at least as deep as ``kv-overlap``'s
  choice would (so it never restores less than ``kv-overlap`` for the same state), tokens to
  compute, ``prompt - restorable depth``, plus the replica's queued tokens; equal costs go to the replica holding more of the prompt's KV (where
  the conversation's next checkpoint will land: the engine saves one where it computes, and
  where its KV is it can place one at the prompt's branch point), then round robin from the
  request's number.
* ``kv-overlap``: what KV-only routers score, ``prompt - whole-block KV tokens`` plus the
  same queued tokens; ties by round robin. On a hybrid model KV without a checkpoint inside it
  serves no hit.
* ``round-robin``: the request's number modulo the replicas.

Ranking restorable depth first and KV overlap second keeps ``restorable`` from scattering a
conversation whose state is not saved anywhere yet (as ranking by depth alone did: below
``kv-overlap`` in the replay, docs/routing.md), while still taking a replica that can restore
more. Load counts as the tokens ahead of the request, not as a price per queued request: a
fixed price (512 tokens a request, before) outweighed the whole hit of a short chat turn and
sent turns away from the replica holding their state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridcache.errors import InvalidArgumentError
from hybridcache.router.replica_index import Depths

POLICIES = ("restorable", "kv-overlap", "round-robin")


@dataclass(frozen=True)
class Decision:
    index: int
    reason: str  # what decided: "restorable", "kv-overlap", "load", "round-robin"
    predicted_tokens: int  # the chosen replica's restorable depth (what it should report cached)
    deepest_tokens: int = 0  # the deepest restorable depth on any replica (what the best choice restores)


def check_policy(name: object) -> str:
    if name not in POLICIES:
        raise InvalidArgumentError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return name


def choose(policy: str, prompt_tokens: int, depths: Sequence[Depths], queued_tokens: Sequence[float], number: int) -> Decision:
    """The replica serving request number ``number`` (see the module docstring)."""
    count = len(depths)
    order = [(number + offset) % count for offset in range(count)]  # round robin among equals
    deepest = max((d.restorable for d in depths), default=0)
    if policy == "round-robin" or count == 1:
        return Decision(order[0], "round-robin", depths[order[0]].restorable, deepest)
    credit = [d.restorable if policy == "restorable" else d.kv_tokens for d in depths]
    costs = [prompt_tokens - hit + queued for hit, queued in zip(credit, queued_tokens)]
    affinity = [d.kv_tokens if policy == "restorable" else 0 for d in depths]
    eligible = order
    if policy == "restorable":  # never a shallower restore than kv-overlap's own choice would get
        floor = depths[choose("kv-overlap", prompt_tokens, depths, queued_tokens, number).index].restorable
        eligible = [i for i in order if depths[i].restorable >= floor]
    best = min(eligible, key=lambda i: (costs[i], -affinity[i]))
    return Decision(best, _reason(policy, best, credit, costs, affinity), depths[best].restorable, deepest)


def _reason(policy: str, best: int, credit: list[int], costs: list[float], affinity: list[int]) -> str:
    """Which term of the ranking set the chosen replica apart from the others."""
    tied_cost = [i for i, cost in enumerate(costs) if cost == costs[best]]
    if len(tied_cost) == 1:
        return "load" if len(set(credit)) == 1 or credit[best] < max(credit) else policy
    if len({affinity[i] for i in tied_cost}) > 1:
        return "kv-overlap"
    return "round-robin"
