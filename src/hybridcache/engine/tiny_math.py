"""The tiny model's small numeric pieces: RMS norm, softmax, top-k routing, one intra-op thread.

Owns nothing.
"""

from __future__ import annotations

import contextlib
import math

import torch

RMS_EPS = 1e-6

# Tensors here are a few dozen elements, so each torch call costs ~1-2 us of dispatch. The helpers
# use few calls and avoid kernels that open an OpenMP region (torch.softmax, batched matmul),
# which cost milliseconds when the machine is busy.


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    inverse_rms = 1.0 / math.sqrt(float(x.dot(x)) / x.numel() + RMS_EPS)
    return x * weight * inverse_rms


@contextlib.contextmanager
def single_thread():
    """Run torch on one intra-op thread, restoring the caller's setting afterwards.

    Reductions over long attention rows are split across threads, and how they are split
    depends on the thread count; pinning one thread makes the bits independent of the caller's
    setting (so separate processes agree too). It is also faster: these tensors are far too
    small to pay for waking a thread pool.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    exp = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return exp / exp.sum(dim=dim, keepdim=True)


def route(scores: list[float], k: int, forced: list[int] | None = None) -> tuple[list[int], list[float]]:
    """The ``k`` best experts (ties go to the lower id), or the ``forced`` ones when replaying,
    and their softmax weights over the chosen scores.

    Forced experts are put in the same best-first order before the weights are computed, so
    replaying the experts a run chose reproduces its weights bit for bit. Router scores are a
    handful of floats, so Python arithmetic is cheaper than torch calls.
    """
    candidates = range(len(scores)) if forced is None else forced
    chosen = sorted(candidates, key=lambda expert: (-scores[expert], expert))[:k]
    best = scores[chosen[0]]
    exps = [math.exp(scores[expert] - best) for expert in chosen]
    total = sum(exps)
    return chosen, [value / total for value in exps]
