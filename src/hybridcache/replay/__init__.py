"""Replay request traces through the prefix cache: ``hybridcache replay TRACE``.

Owns no state; ``driver.replay`` owns one run's adapter (``adapter`` is the only module that
calls the cache library) and ``policies`` holds the admission and eviction registries.
"""

from hybridcache.replay.budgets import Budget, split_budget
from hybridcache.replay.driver import replay, with_ttft
from hybridcache.replay.policies import Policy, resolve_policy

__all__ = ["Budget", "Policy", "replay", "resolve_policy", "split_budget", "with_ttft"]
