"""Routed-expert capture and replay through forward hooks on a model's router modules.

Owns: the hook handles, and per model call an active flag, the call counter, the override rows (if replaying)
and the expert ids captured so far. A router is any module the probe saw return
``(logits, weights, indices)``; its calls are matched by execution order, so a router shared by
several layers is simply several calls.

Replay replaces a router's indices with recorded ones and recomputes their weights with the
rule that reproduced the router's own weights on the probe (softmax or sigmoid of the logits
at the chosen experts, optionally renormalized, times a constant); a router no rule fits
cannot replay.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from hybridcache.engine.hf.introspect import RouterCall
from hybridcache.engine.model_api import EXPERT_DTYPE
from hybridcache.errors import InvalidArgumentError, UnsupportedModelError

WeightRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_RULE_RTOL = 1e-4


def _gathered(activation: str, renormalize: bool) -> WeightRule:
    def rule(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(logits, dim=-1) if activation == "softmax" else torch.sigmoid(logits)
        chosen = scores.gather(1, indices)
        return chosen / chosen.sum(dim=-1, keepdim=True) if renormalize else chosen

    return rule


_CANDIDATES = [_gathered(a, r) for r in (False, True) for a in ("softmax", "sigmoid")]


def _fit_rule(output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> WeightRule | None:
    """The candidate rule (with a constant scale) that reproduces the router's probe weights."""
    logits, weights, indices = (t.to(torch.float64) if t.is_floating_point() else t for t in output)
    for candidate in _CANDIDATES:
        ratio = weights / candidate(logits, indices)
        scale = float(ratio.mean())
        if torch.isfinite(ratio).all() and torch.allclose(ratio, torch.full_like(ratio, scale), rtol=_RULE_RTOL):
            return lambda lg, ix, c=candidate, s=scale: c(lg.to(torch.float64), ix) * s
    return None


def _replayed_weights(
    recomputed: torch.Tensor, forced: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Where a token's forced experts are the ones the router chose, its own weights (bit for
    bit, in the forced order); elsewhere the weights the fitted rule computes."""
    match = forced.unsqueeze(2) == indices.unsqueeze(1)  # [tokens, forced k, router k]
    own = (match * weights.unsqueeze(1)).sum(dim=2)
    same_set = match.any(dim=2).all(dim=1, keepdim=True)
    return torch.where(same_set, own, recomputed.to(weights.dtype))


class RouterHooks:
    """Capture (always) and replay (when rows are given) of every router call in a model call."""

    def __init__(self, calls: tuple[RouterCall, ...], probe_outputs: tuple) -> None:
        self._calls = calls
        self._rules = [_fit_rule(output) for output in probe_outputs]
        self._columns = np.cumsum([0] + [call.top_k for call in calls]).tolist()
        self.width = self._columns[-1]
        self._active = False  # hooks only act inside begin() ... finish()
        self._count = 0
        self._override: torch.Tensor | None = None
        self._captured: list[torch.Tensor] = []
        unique = {id(call.module): call.module for call in calls}
        self._handles = [module.register_forward_hook(self._on_router) for module in unique.values()]

    @property
    def can_replay(self) -> bool:
        return all(rule is not None for rule in self._rules)

    def begin(self, override: np.ndarray | None) -> None:
        """Start one model call; ``override`` is ``[tokens, width]`` expert ids or None."""
        if override is not None and not self.can_replay:
            raise UnsupportedModelError("a router of this model uses a weighting rule replay cannot reproduce")
        self._active, self._count, self._captured = True, 0, []
        self._override = None if override is None else torch.as_tensor(override, dtype=torch.int64)

    def finish(self, tokens: int) -> np.ndarray:
        """The ``[tokens, width]`` expert ids of the call, ascending within each router call."""
        self._active = False
        if self._count != len(self._calls):
            raise UnsupportedModelError(f"routers ran {self._count} times in a forward, {len(self._calls)} in the probe")
        if not self._captured:
            return np.empty((tokens, 0), dtype=EXPERT_DTYPE)
        rows = torch.cat([ids.sort(dim=-1).values for ids in self._captured], dim=1)
        return rows.numpy().astype(EXPERT_DTYPE)

    def _on_router(self, module: torch.nn.Module, _inputs: tuple, output: tuple) -> tuple | None:
        if not self._active:
            return None
        number = self._count
        self._count += 1
        if number >= len(self._calls) or self._calls[number].module is not module:
            raise UnsupportedModelError("routers ran in a different order than in the probe")
        logits, weights, indices = output
        if self._override is not None:
            forced = self._override[:, self._columns[number] : self._columns[number + 1]]
            self._check_forced(forced, indices.shape, self._calls[number].num_experts)
            weights = _replayed_weights(self._rules[number](logits, forced), forced, weights, indices)
            indices = forced.to(indices.dtype)
            output = (logits, weights, indices)
        self._captured.append(indices.detach().to(torch.int64))
        return output if self._override is not None else None

    @staticmethod
    def _check_forced(forced: torch.Tensor, shape: torch.Size, num_experts: int) -> None:
        if forced.shape != shape:
            raise InvalidArgumentError(f"replayed experts have shape {tuple(forced.shape)}, the router {tuple(shape)}")
        if forced.numel() and (int(forced.min()) < 0 or int(forced.max()) >= num_experts):
            raise InvalidArgumentError(f"replayed expert ids must lie in [0, {num_experts})")
