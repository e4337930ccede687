"""Reading a transformers model's cache layout and routers from one short probe forward.

Owns nothing: ``probe_model`` runs the model once on a few tokens with its own cache and
returns what it found. Nothing here names a model family: every layer is classified by the
class of the cache layer the model itself created, and routers are found by what they return.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from hybridcache.engine.model_api import ATTENTION, ATTENTION_AND_RECURRENT, NO_CACHE, RECURRENT, LayerLayout, TensorSpec
from hybridcache.errors import UnsupportedModelError

PROBE_TOKENS = 3
# Exact cache-layer classes whose contents this adapter can page and restore. Subclasses are not
# accepted: a sliding-window layer is a DynamicLayer subclass that drops old keys.
_KINDS = {
    DynamicLayer: ATTENTION,
    LinearAttentionLayer: RECURRENT,
    LinearAttentionAndFullAttentionLayer: ATTENTION_AND_RECURRENT,
    DummyLayer: NO_CACHE,
}
KEY_NAMES = ("keys", "values")


@dataclass(frozen=True)
class RouterCall:
    """One router invocation in a forward, in execution order."""

    module: torch.nn.Module
    top_k: int
    num_experts: int


@dataclass(frozen=True)
class Probe:
    layers: tuple[LayerLayout, ...]
    routers: tuple[RouterCall, ...]
    router_outputs: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _kv_specs(layer: DynamicLayer, index: int) -> tuple[TensorSpec, ...]:
    """``[1, *heads, T, dim]`` keys and values become per-token ``(*heads, dim)`` specs."""
    specs = []
    for name in KEY_NAMES:
        tensor = getattr(layer, name, None)
        if tensor is None or tensor.dim() < 3 or tensor.shape[-2] != PROBE_TOKENS:
            raise UnsupportedModelError(f"layer {index} stored no per-token {name} in a probe forward")
        specs.append(TensorSpec(name, (*tensor.shape[1:-2], tensor.shape[-1]), _dtype_name(tensor)))
    return tuple(specs)


def state_name(number: int, kind: str) -> str:
    return f"{kind}.{number}"


def _state_specs(layer: LinearAttentionLayer, index: int) -> tuple[TensorSpec, ...]:
    specs = []
    for number in range(layer.number_of_states):
        for kind in ("conv_states", "recurrent_states"):
            tensor = getattr(layer, kind)[number]
            if tensor is not None:
                specs.append(TensorSpec(state_name(number, kind), tuple(tensor.shape[1:]), _dtype_name(tensor)))
    if not specs:
        raise UnsupportedModelError(f"recurrent layer {index} stored no state in a probe forward")
    return tuple(specs)


def _refusal(layer: object, index: int) -> UnsupportedModelError:
    if isinstance(layer, DynamicSlidingWindowLayer):
        reason = (
            f"its sliding-window (or chunked) attention keeps only the last {layer.sliding_window} tokens' keys, "
            "while blocks page every token's KV"
        )
    elif isinstance(layer, DynamicIndexedLayer):
        reason = "its sparse attention also keeps per-token indexer keys, which this adapter does not page"
    else:
        reason = "this adapter cannot page and restore that cache class exactly"
    return UnsupportedModelError(f"layer {index} keeps a {type(layer).__name__} cache: {reason}")


def _layer_layout(layer: object, index: int) -> LayerLayout:
    kind = _KINDS.get(type(layer))
    if kind is None:
        raise _refusal(layer, index)
    kv = _kv_specs(layer, index) if kind in (ATTENTION, ATTENTION_AND_RECURRENT) else ()
    state = _state_specs(layer, index) if kind in (RECURRENT, ATTENTION_AND_RECURRENT) else ()
    return LayerLayout(index, kind, kv, state)


def _router_shape(output: object) -> tuple[int, int] | None:
    """``(top_k, experts)`` when ``output`` is a router's ``(logits, weights, indices)``."""
    if not isinstance(output, tuple) or len(output) != 3 or not all(isinstance(t, torch.Tensor) for t in output):
        return None
    logits, weights, indices = output
    if logits.dim() != 2 or weights.dim() != 2 or indices.shape != weights.shape:
        return None
    if not (logits.is_floating_point() and weights.is_floating_point()) or indices.is_floating_point():
        return None
    if logits.shape[0] != PROBE_TOKENS or weights.shape[0] != PROBE_TOKENS:
        return None
    return weights.shape[1], logits.shape[1]


def _run_with_router_hooks(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[object, list]:
    found = []

    def record(module, _inputs, output):
        shape = _router_shape(output)
        if shape is not None:
            found.append((RouterCall(module, *shape), tuple(t.detach().clone() for t in output)))

    handles = [module.register_forward_hook(record) for module in model.modules()]
    try:
        with torch.no_grad():
            outputs = model(input_ids=input_ids, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    return outputs, found


def probe_model(model: torch.nn.Module, vocab_size: int) -> Probe:
    """Run ``PROBE_TOKENS`` tokens through ``model`` with the cache it builds itself."""
    input_ids = (torch.arange(PROBE_TOKENS) % vocab_size).unsqueeze(0)
    outputs, found = _run_with_router_hooks(model, input_ids)
    cache = getattr(outputs, "cache", None)
    if cache is None:
        cache = getattr(outputs, "past_key_values", None)
    if type(cache) is not DynamicCache:
        raise UnsupportedModelError(
            f"the model keeps its cache in a {type(cache).__name__}, not a DynamicCache of per-layer objects"
        )
    layers = tuple(_layer_layout(layer, index) for index, layer in enumerate(cache.layers))
    return Probe(layers, tuple(call for call, _ in found), tuple(output for _, output in found))
