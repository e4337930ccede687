"""Measure the engine serving every tiny hybrid family, for docs/models.md:
``.venv/bin/python -m tests.engine.hf.measure_engine``.

Owns nothing: per family it saves a tiny sensitive float64 checkpoint into a temporary
directory and serves ``test_engine_hf``'s multi-turn workload through ``Engine``: with caching
off; with caching on at both async depths, in the roomy and the small pool; and with every
restored state zeroed (the control). It prints one markdown row per family: caching on vs off,
caching off vs transformers (``generate`` tokens, full-forward logits), and the control.
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch

from hybridcache.engine.hf import HFModel, HFModelConfig
from hybridcache.errors import UnsupportedModelError
from tests.engine.hf.conftest import load_oracle, save_tiny_model
from tests.engine.hf.test_engine_hf import SMALL_POOL, RestoreSpy, engine_for, serve
from tests.engine.hf.tiny_configs import FAMILIES


def _compare(left: list, right: list) -> tuple[bool, float]:
    """(every token equal, max |delta logit| over the requests before the first difference)."""
    gap = 0.0
    for (_, a), (_, b) in zip(left, right):
        if a.tokens != b.tokens:
            return False, gap
        gap = max(gap, float(np.abs(a.logits - b.logits).max()))
    return True, gap


def _against_transformers(directory: str, served: list) -> tuple[bool, float]:
    oracle, same, gap = load_oracle(directory), True, 0.0
    for request, result in served:
        prompt = torch.tensor([request.prompt.tolist()])
        with torch.no_grad():
            generated = oracle.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(result.tokens),
                do_sample=False, pad_token_id=0,
            )
            full = oracle(input_ids=generated[:, :-1]).logits[0, prompt.shape[1] - 1 :].numpy()
        same &= generated[0, prompt.shape[1] :].tolist() == result.tokens
        gap = max(gap, float(np.abs(result.logits - full).max()))
    return same, gap


def _cached_runs(directory: str, experts: bool, reference: list) -> tuple[bool, float, bool, int]:
    """Caching on in four settings vs ``reference``: tokens, logit gap, experts, hit tokens."""
    same, gap, experts_equal, hits = True, 0.0, True, 0
    for depth in (0, 1):
        for pool in ({}, SMALL_POOL):
            cached = serve(engine_for(directory, async_depth=depth, **pool), 0, experts)
            tokens_equal, run_gap = _compare(cached, reference)
            same, gap = same and tokens_equal, max(gap, run_gap)
            hits += sum(result.cached_tokens for _, result in cached)
            if experts:
                experts_equal &= all(
                    np.array_equal(a.routed_experts, b.routed_experts) for (_, a), (_, b) in zip(cached, reference)
                )
    return same, gap, experts_equal, hits


def _control(directory: str, reference: list) -> str:
    engine = engine_for(directory)
    RestoreSpy(engine, zero=True)
    tokens_equal, gap = _compare(serve(engine, 0, False), reference)
    return f"{gap:.1e}" + ("" if tokens_equal else ", tokens change")


def measure(family: str, directory: str) -> str:
    save_tiny_model(family, directory)
    try:
        experts = HFModel(HFModelConfig(directory, "float64")).layout.routed_expert_width > 0
    except UnsupportedModelError:
        return f"| {family} | refused | | | | |"
    reference = serve(engine_for(directory, prefix_caching=False), 0, experts)
    same, gap, experts_equal, hits = _cached_runs(directory, experts, reference)
    oracle_same, oracle_gap = _against_transformers(directory, reference)
    routed = ("equal" if experts_equal else "DIFFER") if experts else "dense"
    on_off = f"{'equal' if same else 'DIFFER'}, {gap:.1e}"
    oracle = f"{'equal' if oracle_same else 'DIFFER'}, {oracle_gap:.1e}"
    return f"| {family} | {hits} | {on_off} | {routed} | {oracle} | {_control(directory, reference)} |"


def main() -> None:
    torch.set_num_threads(1)
    print("| family | hit tokens (4 cached runs) | caching on vs off: tokens, max abs delta logit | routed experts "
          "| caching off vs transformers: tokens, max abs delta logit | zeroed-restore control |")
    print("|---|---|---|---|---|---|")
    for family in FAMILIES:
        with tempfile.TemporaryDirectory() as directory:
            print(measure(family, directory), flush=True)


if __name__ == "__main__":
    main()
