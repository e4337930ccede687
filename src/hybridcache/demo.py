"""``hybridcache demo``: a multi-turn chat served by the reference engine, with and without
prefix caching.

Sixteen conversations share a system prompt; every turn sends the whole conversation so far
(history, the assistant's previous reply, a new user message) and generates a reply. The same
workload runs twice, with prefix caching off and on; the table compares, per turn and overall,
prompt tokens, tokens served from the cache, the hit rate, the prefill tokens actually computed
and the wall time, and the demo checks that every output is identical.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig

CONVERSATIONS = 16
TURNS = 6
SYSTEM_PROMPT_TOKENS = 64
USER_TOKENS = (8, 24)
REPLY_TOKENS = 8


@dataclass
class TurnReport:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)


def engine_config(prefix_caching: bool) -> EngineConfig:
    return EngineConfig(
        block_size=16,
        num_kv_blocks=2048,
        num_state_slots=96,
        checkpoint_budget=64,
        prefix_caching=prefix_caching,
        max_batch_tokens=512,
        max_running=16,
        prefill_chunk=64,
        model=TinyHybridConfig(),
    )


def user_messages(seed: int) -> list[list[list[int]]]:
    """user_messages[turn][conversation]: the new user tokens of each turn."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, 512, int(rng.integers(*USER_TOKENS))).tolist() for _ in range(CONVERSATIONS)]
        for _ in range(TURNS)
    ]


def serve(prefix_caching: bool, system: list[int], users, advance) -> list[TurnReport]:
    engine = Engine(engine_config(prefix_caching))
    histories = [list(system) for _ in range(CONVERSATIONS)]
    reports = []
    for turn in range(TURNS):
        requests = [
            Request(prompt=histories[c] + users[turn][c], max_new_tokens=REPLY_TOKENS) for c in range(CONVERSATIONS)
        ]
        computed_before = engine.stats()["computed_tokens"]
        started = time.perf_counter()
        results = engine.generate(requests)
        report = TurnReport(seconds=time.perf_counter() - started)
        report.computed_tokens = engine.stats()["computed_tokens"] - computed_before
        for c, (request, result) in enumerate(zip(requests, results)):
            report.prompt_tokens += len(request.prompt)
            report.cached_tokens += result.cached_tokens
            report.outputs.append(result.tokens)
            histories[c] = list(request.prompt) + result.tokens
        reports.append(report)
        advance()
    engine.check_invariants()
    return reports


def run_demo(console: Console, seed: int = 0) -> bool:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 512, SYSTEM_PROMPT_TOKENS).tolist()
    users = user_messages(seed + 1)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("serving 16 conversations x 6 turns, caching off then on", total=2 * TURNS)
        uncached = serve(False, system, users, lambda: progress.advance(task))
        cached = serve(True, system, users, lambda: progress.advance(task))
    identical = all(a.outputs == b.outputs for a, b in zip(uncached, cached))
    console.print(_table(uncached, cached))
    later = cached[1:]
    later_rate = sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later)
    console.print(f"hit rate for turns 2-{TURNS}: {later_rate:.1%}")
    verdict = "[bold green]identical[/]" if identical else "[bold red]DIFFERENT[/]"
    console.print(f"outputs with and without prefix caching: {verdict}")
    return identical


def _table(uncached: list[TurnReport], cached: list[TurnReport]) -> Table:
    table = Table(title="multi-turn chat on the tiny hybrid model: prefix caching off vs on")
    for column in ("turn", "prompt tokens", "from cache", "hit rate", "computed off", "computed on", "time off s", "time on s"):
        table.add_column(column, justify="right", no_wrap=True)
    for turn, (off, on) in enumerate(zip(uncached, cached), start=1):
        table.add_row(*_row(str(turn), [off], [on]))
    table.add_section()
    table.add_row(*_row("overall", uncached, cached), style="bold")
    return table


def _row(label: str, off: list[TurnReport], on: list[TurnReport]) -> list[str]:
    prompt = sum(r.prompt_tokens for r in on)
    hit = sum(r.cached_tokens for r in on)
    return [
        label,
        str(prompt),
        str(hit),
        f"{hit / prompt:.1%}",
        str(sum(r.computed_tokens for r in off)),
        str(sum(r.computed_tokens for r in on)),
        f"{sum(r.seconds for r in off):.2f}",
        f"{sum(r.seconds for r in on):.2f}",
    ]
