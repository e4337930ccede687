"""``miss_reason: namespace``: a prompt that restored nothing although the same tenant (the same
``cache_salt``, or none) was served its first block under another adapter; never said across
salts, which would tell one tenant what another sent."""

from __future__ import annotations

import json

from tests.serving.conftest import metric, request

PROMPT = "A policy text both adapters of one tenant read, long enough for a few cached blocks."


def _served(base: str, model: str, salt: str | None = None, prompt: str = PROMPT) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    status, _, raw = request(base, "POST", "/v1/completions", body if salt is None else {**body, "cache_salt": salt})
    assert status == 200
    return json.loads(raw)["hybridcache"]


def test_the_same_tenant_under_another_adapter_says_namespace(server):
    before = metric(server, "hybridcache:request_misses_total", reason="namespace") if _has_namespace(server) else 0.0
    assert _served(server, "support-bot", "tenant-n")["miss_reason"] == "no_cached_prefix"
    assert _served(server, "legal-bot", "tenant-n") == {"cached_tokens": 0, "miss_reason": "namespace"}
    assert _served(server, "tiny", "tenant-n") == {"cached_tokens": 0, "miss_reason": "namespace"}  # the base model too
    assert metric(server, "hybridcache:request_misses_total", reason="namespace") == before + 2
    again = _served(server, "legal-bot", "tenant-n")
    assert again["cached_tokens"] > 0 and again["miss_reason"] is None  # its own namespace now holds it


def test_another_tenant_never_hears_of_a_prefix_it_did_not_send(server):
    others = [(salt, model) for salt in ("tenant-q", None) for model in ("support-bot", "legal-bot", "tiny")]
    for number, (salt, model) in enumerate(others):  # another salt, and no salt at all, are other tenants
        prompt = f"Copy {number}: {PROMPT}"  # its own first block: heads are first blocks
        _served(server, "support-bot", "tenant-p", prompt)
        assert _served(server, model, salt, prompt) == {"cached_tokens": 0, "miss_reason": "no_cached_prefix"}


def _has_namespace(base: str) -> bool:
    try:
        metric(base, "hybridcache:request_misses_total", reason="namespace")
    except KeyError:
        return False
    return True
