"""The routing cost and the three policies (nothing mutable).

For each replica the router knows its ``Depths`` for the request (``replica_index``) and its
load (running plus waiting requests, from its ``/metrics``). The cost is in tokens:

* ``restorable`` (default): tokens to compute, ``prompt - restorable depth``, plus
  ``load_tokens`` per queued request; equal costs go to the replica holding more of the
  prompt's KV (where the conversation's next checkpoint will land: the engine saves one where
  it computes), then round robin from the request's number.
* ``kv-overlap``: what KV-only routers score, ``prompt - whole-block KV tokens`` plus the
  same load term; ties by round robin. On a hybrid model KV without a checkpoint inside it
  serves no hit.
* ``round-robin``: the request's number modulo the replicas.

Ranking restorable depth first and KV overlap second keeps ``restorable`` from scattering a
conversation whose state is not saved anywhere yet (as ranking by depth alone did: below
``kv-overlap`` in the replay, docs/routing.md), while still taking a replica that can restore
more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridcache.errors import InvalidArgumentError
from hybridcache.router.replica_index import Depths

POLICIES = ("restorable", "kv-overlap", "round-robin")
DEFAULT_LOAD_TOKENS = 512  # cost of one queued request, in prompt tokens to compute


@dataclass(frozen=True)
class Decision:
    index: int
    reason: str  # what decided: "restorable", "kv-overlap", "load", "round-robin"
    predicted_tokens: int  # the chosen replica's restorable depth (what it should report cached)


def check_policy(name: object) -> str:
    if name not in POLICIES:
        raise InvalidArgumentError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return name


def choose(
    policy: str, prompt_tokens: int, depths: Sequence[Depths], loads: Sequence[float], number: int,
    load_tokens: float = DEFAULT_LOAD_TOKENS,
) -> Decision:
    """The replica serving request number ``number`` (see the module docstring)."""
    count = len(depths)
    order = [(number + offset) % count for offset in range(count)]  # round robin among equals
    if policy == "round-robin" or count == 1:
        return Decision(order[0], "round-robin", depths[order[0]].restorable)
    credit = (lambda d: d.restorable) if policy == "restorable" else (lambda d: d.kv_tokens)
    costs = [prompt_tokens - credit(d) + load_tokens * load for d, load in zip(depths, loads)]
    affinity = [d.kv_tokens if policy == "restorable" else 0 for d in depths]
    best = min(order, key=lambda i: (costs[i], -affinity[i]))
    return Decision(best, _reason(policy, best, depths, costs, affinity, loads), depths[best].restorable)


def _reason(policy: str, best: int, depths, costs, affinity, loads) -> str:
    """Which term of the ranking set the chosen replica apart from the others."""
    tied_cost = [i for i, cost in enumerate(costs) if cost == costs[best]]
    if len(tied_cost) == 1:
        credit = [d.restorable if policy == "restorable" else d.kv_tokens for d in depths]
        return "load" if len(set(credit)) == 1 or credit[best] < max(credit) else policy
    if len({affinity[i] for i in tied_cost}) > 1:
        return "kv-overlap"
    return "round-robin"
