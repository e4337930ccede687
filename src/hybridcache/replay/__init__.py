"""Replay request traces through the prefix cache: ``hybridcache replay TRACE``.

Owns no state; ``driver.replay`` runs one ``RunConfig`` (``run_config``) and returns its
``RunRecord`` (``record``). During a run, ``fleet`` owns the replicas (``adapter`` is the only
module that calls the cache library; ``serving`` serves one request, ``tuning`` tunes Marconi's
alpha, ``tier_run`` holds the tiers, through the tier client the engine uses) and ``policies`` holds the admission and eviction
registries.
"""

from hybridcache.replay.budgets import Budget, split_budget
from hybridcache.replay.driver import replay
from hybridcache.replay.policies import Policy, resolve_policy
from hybridcache.replay.record import RunRecord, TraceFacts
from hybridcache.replay.run_config import RunConfig

__all__ = ["Budget", "Policy", "RunConfig", "RunRecord", "TraceFacts", "replay", "resolve_policy", "split_budget"]
