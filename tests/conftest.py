"""Session-wide real store servers, shared by the tier and the replay tests: ``redis-server`` on
a free loopback port, and Mooncake (master, segment holder, the client under test) inside a
private network namespace, driven through :class:`tests.tiers.remote.RemoteStore`. Both are
stopped by pid at the end of the session; tests keep apart by key prefix or namespace."""

from __future__ import annotations

import pytest

from hybridcache.tiers import local_servers
from tests.tiers.remote import RemoteStore


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = local_servers.start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_remote(tmp_path_factory):
    remote = RemoteStore(tmp_path_factory.mktemp("mooncake"))
    yield remote
    remote.close()
