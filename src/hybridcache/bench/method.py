"""The measurement method shared by every benchmark scenario.

One pinned CPU, a fixed ``PYTHONHASHSEED`` (the process re-executes itself when it is not
set) and one numeric thread. The sampling itself (warm-ups that are discarded, then p50 and
p99 over the measured samples, interleaving implementations) is in ``scenarios``.
"""

from __future__ import annotations

import os
import sys


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
