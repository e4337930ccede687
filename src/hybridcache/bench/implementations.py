"""Which implementation a benchmark runs, by name. Owns nothing."""

from __future__ import annotations

from hybridcache.bench.impl import HybridcacheImpl, Impl
from hybridcache.errors import InvalidArgumentError


def make_impl(name: str) -> Impl:
    """``hybridcache`` or the reference ``lmdeploy`` (imported only when asked for)."""
    if name == "hybridcache":
        return HybridcacheImpl()
    if name == "lmdeploy":
        from hybridcache.bench.lmdeploy_impl import LmdeployImpl

        return LmdeployImpl()
    raise InvalidArgumentError(f"unknown implementation {name!r}")
