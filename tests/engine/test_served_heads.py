"""``evicted``: a prompt the cache restores nothing for, although the engine served its first
block before, is told apart from one never cached (``no_cached_prefix``); namespaces, caching
off and multimodal heads never claim it; the record of served heads stays bounded."""

from __future__ import annotations

import numpy as np

from hybridcache.engine import Engine, Request
from hybridcache.engine.served_heads import ServedHeads
from hybridcache.sequence import Sequence
from tests.engine.test_engine_tiers import config, prompt, uncached


def _one(engine: Engine, request: Request):
    (result,) = engine.generate([request])
    assert result.tokens == uncached([request])[0]
    engine.check_invariants()
    return result


def test_a_prompt_whose_cached_prefix_was_evicted_says_evicted():
    engine = Engine(config())
    base = prompt(60, 61)
    assert _one(engine, Request(base, max_new_tokens=2)).miss_reason == "no_cached_prefix"
    assert _one(engine, Request(base + prompt(9, 62), max_new_tokens=2)).cached_tokens > 0
    engine.clear_cache()
    evicted = _one(engine, Request(base + prompt(9, 63), max_new_tokens=2))
    assert evicted.cached_tokens == 0 and evicted.miss_reason == "evicted"
    assert engine.stats()["misses"]["no_cached_prefix"] == 2  # the cache's own count is unchanged


def test_another_namespace_or_caching_off_never_claims_evicted():
    engine = Engine(config())
    base = prompt(60, 64)
    _one(engine, Request(base, max_new_tokens=2))
    engine.clear_cache()
    assert _one(engine, Request(base, max_new_tokens=2, cache_salt="other")).miss_reason == "no_cached_prefix"
    off = Engine(config(prefix_caching=False))
    _one(off, Request(base, max_new_tokens=2))
    assert _one(off, Request(base, max_new_tokens=2)).miss_reason != "evicted"


def test_served_heads_are_bounded_and_skip_short_prompts():
    heads = ServedHeads(block_size=4, max_heads=2)
    sequences = [Sequence(np.arange(i, i + 9)) for i in range(3)]
    for seq in sequences:
        heads.served(seq)
        heads.check_invariants()
    assert [heads.seen(seq) for seq in sequences] == [False, True, True]  # the oldest was forgotten
    short = Sequence(np.arange(4))
    heads.served(short)
    assert not heads.seen(short)
