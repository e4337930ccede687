"""Fixtures for the tier tests: one store per backend, over the session's real servers
(``tests/conftest.py``). A missing server binary fails the tests that need it.
"""

from __future__ import annotations

import itertools
import uuid

import pytest

from hybridcache.tiers.backends import DiskStore, HostMemoryStore, RedisStore

from hybridcache.tiers import local_servers as servers
from .replicas import ReplicaCluster

BACKENDS = ("host", "disk", "redis", "mooncake")
CAPACITY = 64 << 20


def redis_url(server: servers.Server) -> str:
    return f"redis://127.0.0.1:{server.port}/0"


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    """A store of each backend; the shared servers are isolated by unique keys per test."""
    if request.param == "host":
        opened = HostMemoryStore(CAPACITY)
    elif request.param == "disk":
        opened = DiskStore(tmp_path / "disk", CAPACITY)
    elif request.param == "redis":
        opened = RedisStore(redis_url(request.getfixturevalue("redis_server")), key_prefix=f"t{uuid.uuid4().hex[:8]}:")
    else:
        yield request.getfixturevalue("mooncake_remote")  # shared for the session: not closed here
        return
    yield opened
    opened.close()


@pytest.fixture
def new_key():
    """Fresh keys, unique across tests, so stores shared by the session never collide."""
    run = uuid.uuid4().hex[:12]
    counter = itertools.count()
    return lambda: f"k-{run}-{next(counter)}"


def _replica_cluster(backend: str, workdir, request) -> ReplicaCluster:
    if backend == "mooncake":
        return ReplicaCluster(workdir, "mooncake")
    server = request.getfixturevalue("redis_server")
    return ReplicaCluster(workdir, "redis", redis_url(server), key_prefix=f"r{uuid.uuid4().hex[:8]}:")


@pytest.fixture(params=("redis", "mooncake"))
def replica_cluster(request, tmp_path):
    """Engine processes sharing one store: a key prefix of the session's Redis, or a Mooncake
    cluster of their own inside a private network namespace; stopped by pid at the end."""
    cluster = _replica_cluster(request.param, tmp_path, request)
    yield cluster
    cluster.close()


@pytest.fixture
def redis_replica_cluster(request, tmp_path):
    cluster = _replica_cluster("redis", tmp_path, request)
    yield cluster
    cluster.close()
