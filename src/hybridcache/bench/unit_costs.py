"""Unit costs of CPython and NumPy on this machine: the bricks the admission floor is built of.

Each figure is CPU time (``time.process_time``, so robust on a loaded machine) per operation,
with the cost of the timing loop itself (a ``pass`` statement) subtracted. An admission that
makes ``n`` Python calls and ``m`` small NumPy operations per request cannot cost less than
``n × call + m × numpy op`` however its work is arranged, which is what these figures bound.
"""

from __future__ import annotations

import time
import timeit

import numpy as np

BLOCK_TOKENS = 64
PROMPT_TOKENS = 131072


class _Holder:
    value = 1

    def method(self) -> None:
        return None


def _empty() -> None:
    return None


def _namespace() -> dict:
    prompt = np.arange(PROMPT_TOKENS, dtype=np.int32)
    return {
        "empty": _empty,
        "holder": _Holder(),
        "counts": np.zeros(1024, dtype=np.int32),
        "small": np.arange(16, dtype=np.int32),
        "block": prompt[:BLOCK_TOKENS].copy(),
        "block_copy": prompt[:BLOCK_TOKENS].copy(),
        "prompt": prompt,
        "prompt_copy": prompt.copy(),
        "np": np,
    }


# What each unit is, and the statement that performs it once.
UNITS: tuple[tuple[str, str], ...] = (
    ("empty Python function call", "empty()"),
    ("method call", "holder.method()"),
    ("attribute read", "holder.value"),
    ("NumPy scalar read (int(a[i]))", "int(counts[7])"),
    ("NumPy scalar write (a[i] = v)", "counts[7] = 3"),
    ("np.empty(0)", "np.empty(0, dtype=np.int32)"),
    ("small NumPy reduction (a.min())", "small.min()"),
    ("np.array_equal, one 64-token block", "np.array_equal(block, block_copy)"),
    ("np.array_equal, one 128K-token prompt", "np.array_equal(prompt, prompt_copy)"),
)


def _cpu_seconds_per_run(statement: str, namespace: dict, number: int, repeats: int) -> float:
    timer = timeit.Timer(statement, globals=namespace, timer=time.process_time)
    return min(timer.repeat(repeat=repeats, number=number)) / number


def measure_unit_costs(number: int = 200_000, repeats: int = 5) -> list[dict]:
    """One record per unit: ``unit``, ``statement`` and ``cpu_ns`` (loop cost subtracted)."""
    namespace = _namespace()
    loop = _cpu_seconds_per_run("pass", namespace, number, repeats)
    records = []
    for unit, statement in UNITS:
        # The whole-prompt comparison is ~2000× a call: fewer runs give the same precision.
        runs = max(1, number // 1000) if "prompt" in statement else number
        cost = _cpu_seconds_per_run(statement, namespace, runs, repeats) - loop
        records.append({"unit": unit, "statement": statement, "cpu_ns": max(cost, 0.0) * 1e9})
    return records
