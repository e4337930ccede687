"""The demo's workload, smaller: every later turn is served from the cache at least up to the
previous turn's prompt plus its reply, minus the one sampled token that was never fed."""

import numpy as np

from hybridcache import demo
from hybridcache.engine import Engine, Request


def test_later_turns_hit_up_to_the_previous_prompt_and_reply(monkeypatch):
    monkeypatch.setattr(demo, "CONVERSATIONS", 3)
    monkeypatch.setattr(demo, "TURNS", 3)
    engine = Engine(demo.engine_config(prefix_caching=True))
    reference = Engine(demo.engine_config(prefix_caching=False))
    rng = np.random.default_rng(5)
    system = rng.integers(0, 512, demo.SYSTEM_PROMPT_TOKENS).tolist()
    histories = [list(system) for _ in range(3)]
    previous_lengths = [None] * 3
    for turn in range(3):
        requests = [Request(prompt=h + rng.integers(0, 512, 10).tolist(), max_new_tokens=demo.REPLY_TOKENS) for h in histories]
        results = engine.generate(requests)
        assert [r.tokens for r in results] == [r.tokens for r in reference.generate(requests)]
        for c, (request, result) in enumerate(zip(requests, results)):
            if previous_lengths[c] is not None:
                assert result.cached_tokens >= previous_lengths[c] - 1
            histories[c] = list(request.prompt) + result.tokens
            previous_lengths[c] = len(histories[c])
        engine.check_invariants()
