"""The measurement method shared by every benchmark scenario.

One pinned CPU, a fixed ``PYTHONHASHSEED`` (the process re-executes itself when it is not
set), one numeric thread, warm-up samples that are discarded, then p50 and p99 over the
measured samples. A scenario supplies an untimed ``prepare`` and a timed ``run`` per sample.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

HASH_SEED = "0"
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def ensure_controlled_process(argv: list[str]) -> None:
    """Re-execute with a fixed hash seed and one numeric thread unless already done."""
    if os.environ.get("PYTHONHASHSEED") == HASH_SEED and all(os.environ.get(v) == "1" for v in _THREAD_VARIABLES):
        return
    environment = dict(os.environ, PYTHONHASHSEED=HASH_SEED, **{v: "1" for v in _THREAD_VARIABLES})
    os.execve(sys.executable, [sys.executable, "-m", "hybridcache.cli", *argv], environment)


def pin_to_one_cpu() -> int | None:
    """Pin this process to its last allowed CPU; returns it (None where pinning is unsupported)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


@dataclass
class Timing:
    samples_ms: list[float] = field(default_factory=list)

    @property
    def p50_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 50))

    @property
    def p99_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 99))


def measure(
    prepare: Callable[[], object],
    run: Callable[[object], None],
    finish: Callable[[object], None],
    *,
    warmups: int,
    samples: int,
) -> Timing:
    """Time ``run(prepare())`` per sample; ``prepare`` and ``finish`` are untimed."""
    timing = Timing()
    for index in range(warmups + samples):
        context = prepare()
        started = time.perf_counter_ns()
        run(context)
        elapsed_ms = (time.perf_counter_ns() - started) / 1e6
        finish(context)
        if index >= warmups:
            timing.samples_ms.append(elapsed_ms)
    return timing
