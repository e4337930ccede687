"""Real shared stores for the multi-replica replay tests, started the way tests/tiers starts them:
``redis-server`` on a free loopback port and Mooncake inside ``unshare -n`` (through
``tests.tiers.remote.RemoteStore``), each stopped by pid at the end of the session."""

from __future__ import annotations

import uuid

import pytest

from hybridcache.tiers import local_servers as servers
from hybridcache.tiers.backends import RedisStore
from tests.tiers.remote import RemoteStore


@pytest.fixture(scope="session")
def replay_redis_server(tmp_path_factory):
    server = servers.start_redis(tmp_path_factory.mktemp("replay-redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_shared(replay_redis_server):
    store = RedisStore(f"redis://127.0.0.1:{replay_redis_server.port}/0", key_prefix=f"r{uuid.uuid4().hex[:8]}:")
    yield store
    store.close()


@pytest.fixture(scope="session")
def mooncake_shared(tmp_path_factory):
    remote = RemoteStore(tmp_path_factory.mktemp("replay-mooncake"))
    yield remote
    remote.close()
