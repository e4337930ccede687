"""Building a transformers ``DynamicCache`` from paged storage, and writing it back.

Owns nothing: ``build_cache`` returns a fresh cache holding copies of a sequence's KV for
``[0, start)`` and its state after ``start`` tokens; ``store_cache`` copies the KV of
``[start, end)`` and the final state back into the sequence's blocks and slot.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from hybridcache.engine.hf.introspect import KEY_NAMES
from hybridcache.engine.model_api import ModelLayout
from hybridcache.engine.paged_storage import PagedStorage


def _restore_state(layer: object, name: str, value: torch.Tensor) -> None:
    """Load one state tensor through the layer's own update path, as after a real forward."""
    kind, number = name.rsplit(".", 1)
    number = int(number)
    batched = value.unsqueeze(0)
    if kind == "conv_states":
        layer.update_conv_state(batched, number, conv_kernel_size=value.shape[-1])
    else:
        layer.update_recurrent_state(batched, number)
    # A layer with a recurrent state but no conv state would otherwise still read as fresh.
    layer.has_previous_state[number] = True


def build_cache(
    model_config: object, layout: ModelLayout, storage: PagedStorage, where: tuple[torch.Tensor, int, int]
) -> DynamicCache:
    """``where`` = (int64 block table, start, state slot); an empty cache when ``start == 0``."""
    table, start, slot = where
    cache = DynamicCache(config=model_config)
    if start == 0:
        return cache
    for spec_layer in layout.kv_layers:
        keys, values = (
            storage.gather_kv((spec_layer.index, name), table, start).movedim(0, -2).unsqueeze(0) for name in KEY_NAMES
        )
        cache.layers[spec_layer.index].update(keys, values)
    for spec_layer in layout.state_layers:
        for spec in spec_layer.state:
            value = storage.read_state((spec_layer.index, spec.name), slot)
            _restore_state(cache.layers[spec_layer.index], spec.name, value)
    return cache


def _state_tensor(layer: object, name: str) -> torch.Tensor:
    kind, number = name.rsplit(".", 1)
    return getattr(layer, kind)[int(number)][0]


def store_cache(
    cache: DynamicCache, layout: ModelLayout, storage: PagedStorage, where: tuple[torch.Tensor, int, int, int]
) -> None:
    """``where`` = (int64 block table, start, end, state slot)."""
    table, start, end, slot = where
    for spec_layer in layout.kv_layers:
        layer = cache.layers[spec_layer.index]
        for name in KEY_NAMES:
            entries = getattr(layer, name)[0].movedim(-2, 0)[start:end]
            storage.scatter_kv((spec_layer.index, name), table, start, entries)
    for spec_layer in layout.state_layers:
        layer = cache.layers[spec_layer.index]
        for spec in spec_layer.state:
            storage.write_state((spec_layer.index, spec.name), slot, _state_tensor(layer, spec.name))
