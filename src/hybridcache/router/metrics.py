"""The router's own counters, rendered in Prometheus' text format.

Owns: decisions by reason and replica, retries, requests that found no replica, and the
comparison of each predicted restorable depth with the ``cached_tokens`` the replica then
reported (``usage.prompt_tokens_details.cached_tokens``), the deepest depth any replica could
have restored at each decision (``deepest_restorable_tokens``: minus the predicted, what a
choice by restorable depth alone would have gained then), and how each answer's settle learnt
its replica's ``next_seq`` (from the answer, or read from ``/kv_events``) and how many settles
ended without the events (``settles_unapplied``), and the waits for a prefill of the same
prefix ahead on the chosen replica (``prefill_waits``; ``prefill_waits_timed_out``), and the
connections turned away past ``max_connections`` (``connections_refused``). Thread safe (one lock).
"""

from __future__ import annotations

import threading
from collections import Counter


class RouterMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decisions: Counter[tuple[str, str]] = Counter()
        self._counters: Counter[str] = Counter()

    def decided(self, replica: str, reason: str) -> None:
        with self._lock:
            self._decisions[(reason, replica)] += 1

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def reported(self, decision, cached_tokens: int) -> None:
        """A routed answer reported ``cached_tokens``; ``decision`` (``policy.Decision``) predicted it."""
        with self._lock:
            predicted = decision.predicted_tokens
            self._counters["predicted_cached_tokens"] += predicted
            self._counters["deepest_restorable_tokens"] += decision.deepest_tokens
            self._counters["reported_cached_tokens"] += cached_tokens
            self._counters["predictions_checked"] += 1
            self._counters["predictions_exact"] += predicted == cached_tokens

    def value(self, name: str) -> int:
        with self._lock:
            return self._counters[name]

    def render(self, replicas: list) -> str:
        """Prometheus text: counters, then each replica's health, load, undecodable batches and
        the last seq applied from each of its streams (-1 before the first); ``replicas`` holds
        ``Fleet.status()`` records."""
        lines = ["# TYPE hybridcache_router_decisions_total counter"]
        with self._lock:
            for (reason, replica), count in sorted(self._decisions.items()):
                lines.append(f'hybridcache_router_decisions_total{{reason="{reason}",replica="{replica}"}} {count}')
            for name in ("requests", "retries", "no_replica", "predictions_checked", "predictions_exact",
                         "predicted_cached_tokens", "reported_cached_tokens", "deepest_restorable_tokens",
                         "settles_from_answer", "settles_read", "settles_unapplied", "prefill_waits", "prefill_waits_timed_out",
                         "connections_refused"):
                lines.append(f"# TYPE hybridcache_router_{name}_total counter")
                lines.append(f"hybridcache_router_{name}_total {self._counters[name]}")
        lines.append("# TYPE hybridcache_router_replica_healthy gauge")
        lines.extend(f'hybridcache_router_replica_healthy{{replica="{r.url}"}} {int(r.healthy)}' for r in replicas)
        lines.append("# TYPE hybridcache_router_replica_load gauge")
        lines.extend(f'hybridcache_router_replica_load{{replica="{r.url}"}} {r.load}' for r in replicas)
        lines.append("# TYPE hybridcache_router_undecodable_batches gauge")
        lines.extend(f'hybridcache_router_undecodable_batches{{replica="{r.url}"}} {r.undecodable}' for r in replicas)
        lines.append("# TYPE hybridcache_router_replica_catch_ups_total counter")
        lines.extend(f'hybridcache_router_replica_catch_ups_total{{replica="{r.url}"}} {r.catch_ups}' for r in replicas)
        lines.append("# TYPE hybridcache_router_replica_index_losses_total counter")
        lines.extend(f'hybridcache_router_replica_index_losses_total{{replica="{r.url}"}} {r.index_losses}' for r in replicas)
        lines.append("# TYPE hybridcache_router_replica_applied_seq gauge")
        for r in replicas:
            for stream, seq in zip(("kv", "state"), r.applied_seqs):
                lines.append(f'hybridcache_router_replica_applied_seq{{replica="{r.url}",stream="{stream}"}} {-1 if seq is None else seq}')
        return "\n".join(lines) + "\n"
