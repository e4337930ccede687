"""Measure every tiny hybrid family for docs/models.md:
``.venv/bin/python -m tests.engine.hf.measure_families``.

Owns nothing: per family it saves a tiny sensitive float64 checkpoint into a temporary
directory, loads it through ``HFModel`` and prints one markdown table row: the layer kinds, the
resume mode, the max |delta logit| of chunked + restored forwards against transformers' own
uncached forward, the same after zeroing the restored state (the control), and for a
token-by-token family what a multi-token resume would have got wrong.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import replace

import numpy as np
import torch

from hybridcache.engine.hf import HFModel, HFModelConfig
from hybridcache.engine.model_api import CHUNK_RESUME, ForwardChunk
from hybridcache.errors import UnsupportedModelError
from tests.engine.hf.conftest import load_oracle, save_tiny_model
from tests.engine.hf.tiny_configs import FAMILIES, VOCAB

BLOCK, PROMPT, SPLITS, RESTORE_AT = 8, 56, (0, 5, 13, 16, 29, 56), 13


def _chunked_gap(model: HFModel, tokens: list[int], full: np.ndarray) -> float:
    storage = model.new_storage(num_blocks=16, block_size=BLOCK, num_state_slots=2)
    gaps = []
    for start, end in zip(SPLITS, SPLITS[1:]):
        output = model.forward([ForwardChunk(tokens[start:end], start, list(range(1, 9)), 1)], storage)[0]
        gaps.append(np.abs(output.logits - full[end - 1]).max())
    return float(max(gaps))


def _restored_gap(model: HFModel, tokens: list[int], full: np.ndarray, zero: bool) -> float:
    storage = model.new_storage(num_blocks=16, block_size=BLOCK, num_state_slots=3)
    table = list(range(1, 9))
    model.forward([ForwardChunk(tokens[:RESTORE_AT], 0, table, 1)], storage)
    storage.copy_states([1], [2])
    if zero:
        storage.zero_state(2)
    output = model.forward([ForwardChunk(tokens[RESTORE_AT:], RESTORE_AT, table, 2)], storage)[0]
    return float(np.abs(output.logits - full[-1]).max())


def measure(family: str, directory: str) -> str:
    save_tiny_model(family, directory)
    try:
        model = HFModel(HFModelConfig(directory, "float64"))
    except UnsupportedModelError as error:
        return f"| {family} | refused | | | | {error} |"
    tokens = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        full = load_oracle(directory)(input_ids=torch.tensor([tokens])).logits[0].numpy()
    kinds = ", ".join(f"{count}x {kind}" for kind, count in Counter(layer.kind for layer in model.layout.layers).items())
    gap = max(_chunked_gap(model, tokens, full), _restored_gap(model, tokens, full, False))
    control = _restored_gap(model, tokens, full, True)
    resume, note = model.layout.resume, f"experts/token {model.layout.routed_expert_width}"
    if resume != CHUNK_RESUME:
        model.layout = replace(model.layout, resume=CHUNK_RESUME)  # what a multi-token resume gets
        note += f"; a multi-token resume misses by {_restored_gap(model, tokens, full, False):.1e}"
    return f"| {family} | {resume} | {kinds} | {gap:.1e} | {control:.1e} | {note} |"


def main() -> None:
    torch.set_num_threads(1)
    print("| family | status | layers | max abs delta logit | zeroed-state control | notes |")
    print("|---|---|---|---|---|---|")
    for family in FAMILIES:
        with tempfile.TemporaryDirectory() as directory:
            print(measure(family, directory), flush=True)


if __name__ == "__main__":
    main()
