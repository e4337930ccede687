"""Real failures of the network stores: a paused server times out, a stopped one is unavailable."""

from __future__ import annotations

import re

import pytest
import redis

from hybridcache.errors import InvalidConfigError, InvalidKeyError, StoreTimeoutError, StoreUnavailableError
from hybridcache.tiers.backends import MooncakeStore, PutOutcome, RedisStore

from hybridcache.tiers import local_servers as servers
from .conftest import redis_url
from .faults import paused
from .remote import RemoteStore


def test_redis_paused_server_times_out_then_recovers(redis_server, new_key):
    key = new_key()
    with RedisStore(redis_url(redis_server), default_timeout=5) as store:
        store.put_if_absent([(key, b"v")])
        with paused(redis_server), pytest.raises(StoreTimeoutError):
            store.get([key], timeout=0.2)
        assert store.get([key]) == [b"v"]


def test_redis_stopped_server_is_unavailable(tmp_path, new_key):
    server = servers.start_redis(tmp_path)
    store = RedisStore(redis_url(server), default_timeout=2)
    assert store.put_if_absent([(new_key(), b"v")]) == [PutOutcome.STORED]
    server.stop()
    for call in (lambda: store.get(["a"]), lambda: store.exists(["a"]), lambda: store.put_if_absent([("a", b"v")]), lambda: store.remove(["a"])):
        with pytest.raises(StoreUnavailableError):
            call()
    store.close()


def test_redis_out_of_memory_put_is_rejected(tmp_path, new_key):
    server = servers.start_redis(tmp_path, maxmemory="4mb")
    admin = redis.Redis(host="127.0.0.1", port=server.port)
    admin.config_set("maxmemory-policy", "noeviction")
    try:
        with RedisStore(redis_url(server)) as store:
            outcomes = store.put_if_absent([(new_key(), b"x" * (512 << 10)) for _ in range(16)])
            assert PutOutcome.STORED in outcomes and outcomes[-1] is PutOutcome.REJECTED
    finally:
        admin.close()
        server.stop()


def test_redis_bad_configuration():
    with pytest.raises(InvalidConfigError):
        RedisStore("nonsense://x")
    with pytest.raises(InvalidKeyError):
        RedisStore("redis://127.0.0.1:1/0", key_prefix="bad prefix")


def test_mooncake_paused_then_stopped_master(tmp_path, new_key):
    remote = RemoteStore(tmp_path)
    try:
        key = new_key()
        assert remote.put_if_absent([(key, b"v")]) == [PutOutcome.STORED]
        remote.control("pause_master")
        try:
            with pytest.raises(StoreTimeoutError):
                remote.exists([key], timeout=0.3)
            with pytest.raises(StoreUnavailableError, match="did not answer within 1 s"):
                remote.control("open_another", setup_timeout=1)  # the probe, not 90 s of native retries
        finally:
            remote.control("resume_master")
        assert remote.get([key], timeout=30) == [b"v"]
        remote.control("stop_master")
        with pytest.raises((StoreUnavailableError, StoreTimeoutError)):
            remote.exists([key], timeout=10)
        with pytest.raises((StoreUnavailableError, StoreTimeoutError)):
            remote.put_if_absent([(new_key(), b"w")], timeout=1)
    finally:
        remote.close()


def test_mooncake_evicts_under_memory_pressure(mooncake_remote, new_key):
    keys = [new_key() for _ in range(100)]
    outcomes = [mooncake_remote.put_if_absent([(key, bytes([i % 251]) * (1 << 20))])[0] for i, key in enumerate(keys)]
    assert set(outcomes) <= {PutOutcome.STORED, PutOutcome.REJECTED}
    present = mooncake_remote.exists(keys)
    assert 0 < sum(present) < len(keys)  # 100 MiB do not fit a 64 MiB segment
    for key, here, data in zip(keys, present, mooncake_remote.get(keys)):
        assert (data is not None) <= here
    mooncake_remote.remove(keys)


def test_a_redis_url_decoding_replies_to_text_is_refused(redis_server):
    with pytest.raises(InvalidConfigError, match="decode_responses"):
        RedisStore(redis_url(redis_server) + "?decode_responses=True")


def test_an_unreachable_mooncake_cluster_fails_the_probe_not_the_setup():
    master, metadata = servers.free_port(), servers.free_port()  # nothing listens on either
    with pytest.raises(StoreUnavailableError, match="did not answer within 1 s"):
        MooncakeStore(f"127.0.0.1:{master}", f"http://127.0.0.1:{metadata}/metadata", setup_timeout=1)
    for bad in (0, -1, float("nan"), "5"):
        with pytest.raises((InvalidConfigError, InvalidKeyError, ValueError, TypeError)):
            MooncakeStore(f"127.0.0.1:{master}", f"http://127.0.0.1:{metadata}/metadata", setup_timeout=bad)


def test_mooncake_clients_log_errors_only(mooncake_remote):
    """Mooncake's native client logs about 125 info lines per setup unless ``MC_LOG_LEVEL`` is
    lowered before the library loads; MooncakeStore sets ERROR unless the caller chose a level."""
    mooncake_remote.control("open_another")  # one more full native setup and teardown, logged here
    glog_lines = [line for line in mooncake_remote.log_tail(200_000).splitlines() if re.match(r"[IWEF]\d{4} ", line)]
    assert not [line for line in glog_lines if line[0] in "IW"]
