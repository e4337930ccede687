"""The long soak of the cache protocol (``make soak``, ``python -m tests.reliability.soak``).

``run_soak(seconds, seed)`` runs ``CacheProtocolMachine`` in batches of examples until the
time is up and returns the steps executed and the violations found (each failing example is
printed, shrunk). ``main`` reads ``SOAK_SECONDS`` (default 600) and ``SOAK_SEED`` (optional)
and ends with the line ``steps executed: N, violations: V``; it exits non-zero on a violation.
Run it from the repository root, where ``tests`` is importable.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import TextIO

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed

from tests.reliability.protocol_machine import COUNTERS, CacheProtocolMachine

__all__ = ["SoakReport", "main", "protocol_settings", "run_soak"]


def protocol_settings(max_examples: int, step_count: int = 50, **overrides) -> settings:
    """Settings for one batch of the machine (no example database, no deadline)."""
    options = dict(
        max_examples=max_examples,
        stateful_step_count=step_count,
        deadline=None,
        derandomize=False,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.target, Phase.shrink],
    )
    options.update(overrides)
    return settings(**options)


@dataclass
class SoakReport:
    seconds: float
    steps: int = 0
    examples: int = 0
    batches: int = 0
    hits: int = 0
    publishes: int = 0
    violations: int = 0
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"steps executed: {self.steps}, violations: {self.violations}"


def _machine_test(test_settings: settings, seed: int | None):
    """The machine as a zero-argument Hypothesis test, optionally with a fixed seed."""
    try:
        from hypothesis.stateful import get_state_machine_test  # not in Hypothesis' public API
    except ImportError:  # pragma: no cover - older or newer Hypothesis
        from hypothesis.stateful import run_state_machine_as_test

        return lambda: run_state_machine_as_test(CacheProtocolMachine, settings=test_settings)
    test = get_state_machine_test(CacheProtocolMachine, settings=test_settings)
    return test if seed is None else hypothesis_seed(seed)(test)


def run_soak(
    seconds: float, seed: int | None = None, *, step_count: int = 50, out: TextIO | None = None
) -> SoakReport:
    """Run the machine until ``seconds`` have passed; each failing example is printed and counted.

    Examples run in batches sized from the measured time per example so the last batch ends
    close to the deadline (a batch already started always finishes, including its shrinking).
    ``seed`` makes the batches reproducible (batch ``i`` uses ``seed + i``).
    """
    out = sys.stdout if out is None else out
    report = SoakReport(seconds=float(seconds))
    before = dict(COUNTERS)
    start = time.monotonic()
    deadline = start + float(seconds)
    batch_size = 4
    while True:
        now = time.monotonic()
        if now >= deadline and report.batches:
            break
        examples_before = COUNTERS["examples"]
        batch_start = now
        test = _machine_test(protocol_settings(batch_size, step_count), None if seed is None else seed + report.batches)
        try:
            test()
        except Exception as error:  # a violation: assertion, unexpected error, flaky machine
            report.violations += 1
            text = "".join(traceback.format_exception(error))
            report.failures.append(text)
            print(f"--- violation {report.violations} (batch {report.batches}) ---\n{text}", file=out, flush=True)
        report.batches += 1
        elapsed = time.monotonic() - batch_start
        per_example = elapsed / max(1, COUNTERS["examples"] - examples_before)
        remaining = deadline - time.monotonic()
        batch_size = int(min(500, max(1, 0.9 * remaining / max(per_example, 1e-4))))
    for name in ("steps", "examples", "hits", "publishes"):
        setattr(report, name, COUNTERS[name] - before[name])
    report.seconds = time.monotonic() - start
    return report


def main() -> int:
    """``python -m tests.reliability.soak`` (``make soak``): ``SOAK_SECONDS`` (default 600),
    optional ``SOAK_SEED``."""
    seconds = float(os.environ.get("SOAK_SECONDS", "600"))
    seed_text = os.environ.get("SOAK_SEED")
    seed = int(seed_text) if seed_text else None
    print(f"soak: cache protocol machine for {seconds:g} s" + (f", seed {seed}" if seed is not None else ""), flush=True)
    report = run_soak(seconds, seed)
    print(
        f"{report.examples} examples in {report.batches} batches, {report.hits} checkpoint hits, "
        f"{report.publishes} publishes, {report.seconds:.1f} s"
    )
    print(report.summary(), flush=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
