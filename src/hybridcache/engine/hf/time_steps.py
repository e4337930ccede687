"""The SSM time-step limit in transformers' single-token path, where it is applied only in the
multi-token scan.

Owns nothing but the forward hooks it installs on a loaded model's mixers (fixed once made).
Mamba2-style mixers (NemotronH, Zamba2, and any family configured with a ``time_step_limit``)
clamp ``dt = softplus(dt_raw + dt_bias)`` to their ``time_step_limit`` in the chunked scan of a
full forward, but their single-token recurrent step does not. The engine decodes through that
step, so without the clamp a state saved after decode differs from the same prefix prefilled,
and caching would change the function. The hook clamps the ``dt_raw`` columns of the mixer's
input projection, for single-token calls only, to the pre-image of the limit under
``softplus(x * scale + dt_bias)``: then the step sees the clamped ``dt`` the scan would use (to
the rounding of one softplus inversion), and multi-token calls are untouched.
"""

from __future__ import annotations

import math

import torch

from hybridcache.errors import UnsupportedModelError

_MIXER_PARTS = ("in_proj", "dt_bias", "num_heads", "time_step_limit")


def clamp_single_token_time_steps(model: torch.nn.Module) -> int:
    """Hook every mixer of ``model`` whose time-step limit is not ``(0, inf)``; returns how many."""
    hooked = 0
    for mixer in model.modules():
        if not all(hasattr(mixer, part) for part in _MIXER_PARTS):
            continue
        low, high = (float(bound) for bound in mixer.time_step_limit)
        if low <= 0.0 and math.isinf(high):
            continue  # softplus is positive: such a limit never changes a time step
        mixer.in_proj.register_forward_hook(_clamp_hook(mixer, low, high))
        hooked += 1
    return hooked


def _inverse_softplus(value: float) -> float:
    """``x`` with ``softplus(x) == value`` (``-inf`` for a bound at or below zero, ``inf`` for inf)."""
    if value <= 0.0:
        return -math.inf
    if math.isinf(value):
        return math.inf
    return value + math.log(-math.expm1(-value))  # log(expm1(value)), stable for small and large values


def _clamp_hook(mixer: torch.nn.Module, low: float, high: float):
    heads = int(mixer.num_heads)
    scale = getattr(mixer, "mup_vector", None)  # Falcon-H1 scales the projection before splitting it
    if scale is not None and not bool((scale[..., -heads:] > 0).all()):
        raise UnsupportedModelError("a time-step limit with a non-positive dt multiplier cannot be applied per token")
    low_raw, high_raw = _inverse_softplus(low), _inverse_softplus(high)

    def hook(module, inputs, output):
        if output.shape[-2] != 1:
            return None  # a multi-token call runs the scan, which clamps itself
        bias = mixer.dt_bias.to(output.dtype)
        multiplier = 1.0 if scale is None else scale[..., -heads:].to(output.dtype)
        dt_raw = output[..., -heads:]
        clamped = torch.clamp(dt_raw, min=(low_raw - bias) / multiplier, max=(high_raw - bias) / multiplier)
        result = output.clone()
        result[..., -heads:] = clamped
        return result

    return hook
