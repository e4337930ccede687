"""``hybridcache bench routing``: multi-turn chat clients through a real ``hybridcache router``
in front of real ``hybridcache serve`` replicas (the tiny hybrid model), once per policy:
token hit rate, TTFT p50/p99 and how often the router's predicted depth equalled the
``cached_tokens`` the replica reported.

Owns, during a run: the replica and router processes it starts (fresh ones per policy, so no
policy inherits another's caches; stopped by pid) and the client threads. Each conversation
opens with one of a few shared system prompts and its own first message, then per turn the
model's reply and a new user message (token ids, as ``bench serve`` sends them); conversations
are dealt to the clients in turn.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass

import numpy as np

from hybridcache.bench.serve import _get, _Tally, server_process, serving_process, stream_completion
from hybridcache.errors import BenchmarkSetupError
from hybridcache.tiers.local_servers import free_port

POLICIES = ("round-robin", "kv-overlap", "restorable")
_VOCAB = 256  # the tiny model's byte ids
_LOOPBACK = "tcp://127.0.0.1:*"


@dataclass(frozen=True)
class RoutingBench:
    replicas: int = 4
    clients: int = 4
    conversations: int = 16
    turns: int = 4
    system_prompts: int = 2
    system_tokens: int = 256
    opening_tokens: int = 32
    user_tokens: int = 24
    reply_tokens: int = 4
    num_state_slots: int = 8
    checkpoint_budget: int = 4
    num_kv_blocks: int = 2048
    load_tokens: float | None = None  # the router's --load-tokens (None: its default)
    checkpoint_policy: str | None = None  # the replicas' serve --policy (None: serve's default)


def events_config(name: str) -> str:
    """A replica's ``--kv-events-config``: both streams and their replay sockets on free loopback ports."""
    return json.dumps({"enable_kv_cache_events": True, "endpoint": _LOOPBACK, "replay_endpoint": _LOOPBACK, "bind": True,
                       "topic": f"kv@{name}@tiny", "state_endpoint": _LOOPBACK, "state_replay_endpoint": _LOOPBACK,
                       "state_topic": f"hcstate@{name}@tiny"})


def _replica_args(bench: RoutingBench, name: str) -> tuple[str, ...]:
    policy = () if bench.checkpoint_policy is None else ("--policy", bench.checkpoint_policy)
    return ("--model", "tiny", "--num-kv-blocks", str(bench.num_kv_blocks), "--num-state-slots", str(bench.num_state_slots),
            "--checkpoint-budget", str(bench.checkpoint_budget), "--max-running", "4", *policy,
            "--kv-events-config", events_config(name))


@contextmanager
def router_process(urls: list[str], policy: str, load_tokens: float | None):
    """``hybridcache router`` over ``urls`` on a free loopback port: yields its base URL once
    ``/health`` answers; SIGTERM by pid at the end."""
    port = free_port()
    command = [sys.executable, "-m", "hybridcache.cli", "router", "--port", str(port), "--policy", policy,
               "--health-interval", "0.2", *(a for url in urls for a in ("--replica", url))]
    if load_tokens is not None:
        command += ["--load-tokens", str(load_tokens)]
    with serving_process(command, port, 60) as (base, _):
        yield base


def _conversations(bench: RoutingBench) -> list[list[int]]:
    """Each conversation's opening: one of ``system_prompts`` shared prompts (dealt in turn, so
    fewer prompts mean more conversations sharing each prefix), then its own first message."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(2, _VOCAB, bench.system_tokens).tolist() for _ in range(bench.system_prompts)]
    return [systems[i % bench.system_prompts] + rng.integers(2, _VOCAB, bench.opening_tokens).tolist()
            for i in range(bench.conversations)]


def _client(base: str, bench: RoutingBench, openings: list[list[int]], seed: int, tally: _Tally) -> None:
    rng = np.random.default_rng(seed)
    for history in openings:
        for _ in range(bench.turns):
            try:
                turn, reply = stream_completion(base, "tiny", history, bench.reply_tokens)
            except (OSError, RuntimeError, KeyError, ValueError) as error:
                with tally.lock:
                    tally.errors.append(str(error))
                return
            with tally.lock:
                tally.turns.append(turn)
            history = history + reply + rng.integers(2, _VOCAB, bench.user_tokens).tolist()


def _wait_all_healthy(base: str, replicas: int, timeout_s: float = 60.0) -> None:
    """Until the router has checked (and subscribed to) every replica, bounded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = _get(base, "/metrics")[1].decode()
        if sum(line.startswith("hybridcache_router_replica_healthy") and line.endswith(" 1")
               for line in text.splitlines()) == replicas:
            return
        time.sleep(0.1)
    raise BenchmarkSetupError("the router never saw every replica healthy")


def _router_counters(base: str) -> dict[str, float]:
    _, text = _get(base, "/metrics")
    counters = {}
    for line in text.decode().splitlines():
        if line.startswith("hybridcache_router_") and line.split(" ", 1)[0].endswith("_total"):
            counters[line.split(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
        for summed in ("catch_ups", "index_losses"):  # per replica, summed
            if line.startswith(f"hybridcache_router_replica_{summed}_total{{"):
                counters[summed] = counters.get(summed, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


def run_policy(bench: RoutingBench, policy: str) -> dict:
    """Fresh replicas and router for ``policy``; the clients' conversations through them."""
    with ExitStack() as stack:
        urls = [stack.enter_context(server_process(*_replica_args(bench, f"r{i}")))[0] for i in range(bench.replicas)]
        base = stack.enter_context(router_process(urls, policy, bench.load_tokens))
        _wait_all_healthy(base, bench.replicas)
        openings, tally, began = _conversations(bench), _Tally(), time.perf_counter()
        threads = [threading.Thread(target=_client, args=(base, bench, openings[i::bench.clients], 100 + i, tally))
                   for i in range(bench.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
        counters = _router_counters(base)
    return _summary(policy, tally, wall, counters)


def _summary(policy: str, tally: _Tally, wall: float, counters: dict[str, float]) -> dict:
    turns = tally.turns
    ttft = [turn.ttft_s for turn in turns]
    prompt, cached = sum(t.prompt_tokens for t in turns), sum(t.cached_tokens for t in turns)
    checked = counters.get("hybridcache_router_predictions_checked_total", 0.0)
    return {
        "policy": policy, "requests": len(turns), "errors": len(tally.errors), "first_errors": tally.errors[:3],
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else float("nan"),
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else float("nan"),
        "predictions_exact": counters.get("hybridcache_router_predictions_exact_total", 0.0) / checked if checked else 0.0,
        "predictions": f"{counters.get('hybridcache_router_predictions_exact_total', 0.0):.0f}/{checked:.0f}",
        "hit_depth_mean": cached / len(turns) if turns else 0.0,  # cached tokens a request restored, on average
        "settles_read": counters.get("hybridcache_router_settles_read_total", 0.0),
        "settles_unapplied": counters.get("hybridcache_router_settles_unapplied_total", 0.0),  # answers ended without their events
        "catch_ups": counters.get("catch_ups", 0.0),  # replays asked for announced seqs that had not arrived live
        "index_losses": counters.get("index_losses", 0.0),  # replicas' indexes dropped during the run
        "predicted_cached_tokens": counters.get("hybridcache_router_predicted_cached_tokens_total", 0.0),
        # what choosing by restorable depth alone would have added at each decision, over the prompts
        "headroom": (counters.get("hybridcache_router_deepest_restorable_tokens_total", 0.0)
                     - counters.get("hybridcache_router_predicted_cached_tokens_total", 0.0)) / prompt if prompt else 0.0,
        "reported_cached_tokens": counters.get("hybridcache_router_reported_cached_tokens_total", 0.0),
        "retries": counters.get("hybridcache_router_retries_total", 0.0), "wall_s": wall,
        # requests held until a prefill of their prefix ahead of them on their replica answered
        "prefill_waits": counters.get("hybridcache_router_prefill_waits_total", 0.0),
    }


def run_routing_bench(bench: RoutingBench, policies: tuple[str, ...] = POLICIES) -> list[dict]:
    """One record per policy, each with ``restorable``'s hit rate over it when both ran."""
    records = [run_policy(bench, policy) for policy in policies]
    by_policy = {record["policy"]: record for record in records}
    if "restorable" in by_policy:
        for record in records:
            rate = record["token_hit_rate"]
            record["restorable_over_this"] = by_policy["restorable"]["token_hit_rate"] / rate if rate else float("nan")
    for record in records:
        record["config"] = asdict(bench)
    return records
