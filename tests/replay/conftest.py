"""Shared stores for the multi-replica replay tests, over the session's real servers
(``tests/conftest.py``): a key prefix of their own on Redis. Mooncake is the session's client
(``mooncake_remote``) as it is: each replay run has its own namespace and removes its objects."""

from __future__ import annotations

import uuid

import pytest

from hybridcache.tiers.backends import RedisStore


@pytest.fixture
def redis_shared(redis_server):
    store = RedisStore(f"redis://127.0.0.1:{redis_server.port}/0", key_prefix=f"r{uuid.uuid4().hex[:8]}:")
    yield store
    store.close()
