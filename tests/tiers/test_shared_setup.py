"""A Mooncake URL (and MooncakeStore's addresses) is checked whole before anything runs: a bad
IPv6 bracket or a bad port is an InvalidConfigError, never urllib's ValueError traceback."""

from __future__ import annotations

import pytest

from hybridcache.errors import InvalidConfigError, InvalidTypeError
from hybridcache.tiers.backends.mooncake_store import MooncakeLocal, MooncakeStore
from hybridcache.tiers.shared_setup import check_shared_tier, mooncake_address

META = "http://127.0.0.1:8080/metadata"
BAD_URLS = [
    "mooncake://[::1:1234?metadata=" + META,  # unclosed bracket: urllib raised ValueError
    "mooncake://::1:1234?metadata=" + META,  # IPv6 without brackets
    "mooncake://[nothost]:1234?metadata=" + META,
    "mooncake://127.0.0.1:99999?metadata=" + META,
    "mooncake://127.0.0.1:0?metadata=" + META,
    "mooncake://127.0.0.1?metadata=" + META,
    "mooncake://127.0.0.1:abc?metadata=" + META,
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:99999/metadata",  # bad metadata port
    "mooncake://127.0.0.1:50051?metadata=http://[::1/metadata",
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:x/metadata",
    "mooncake://127.0.0.1:50051?metadata=https://127.0.0.1:8080/metadata",
    "mooncake://127.0.0.1:50051?metadata=" + META + "&metadata=" + META,
    "mooncake://127.0.0.1:50051/path?metadata=" + META,
    "mooncake://127.0.0.1:50051?metadata=" + META + "&other=1",
    "mooncake://127.0.0.1:50051",
    "redis://127.0.0.1:50051?metadata=" + META,
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_bad_mooncake_url_is_refused_whole(url):
    with pytest.raises(InvalidConfigError):
        mooncake_address(url)
    with pytest.raises(InvalidConfigError):
        check_shared_tier("mooncake", url)


@pytest.mark.parametrize(
    "url, expected",
    [
        ("mooncake://127.0.0.1:50051?metadata=" + META, ("127.0.0.1:50051", META)),
        ("mooncake://[::1]:50051?metadata=http://[::1]:8080/metadata", ("[::1]:50051", "http://[::1]:8080/metadata")),
        ("mooncake://master.local:50051/?metadata=http://meta.local/metadata", ("master.local:50051", "http://meta.local/metadata")),
    ],
)
def test_good_mooncake_urls_are_read(url, expected):
    assert mooncake_address(url) == expected


@pytest.mark.parametrize(
    "master, metadata",
    [
        ("[::1:50051", META),
        ("127.0.0.1:65536", META),
        ("127.0.0.1:50051", "http://127.0.0.1:99999/metadata"),
        ("127.0.0.1:50051", "http://[::1/metadata"),
        ("127.0.0.1:50051", "ftp://127.0.0.1:8080/metadata"),
    ],
)
def test_mooncake_store_refuses_bad_addresses_before_connecting(master, metadata):
    with pytest.raises(InvalidConfigError):
        MooncakeStore(master, metadata, setup_timeout=0.5)


@pytest.mark.parametrize("field", ["segment_bytes", "local_buffer_bytes"])
def test_mooncake_buffers_larger_than_the_machine_are_refused_before_connecting(field, monkeypatch):
    from hybridcache import machine

    monkeypatch.setattr(machine, "host_memory_bytes", lambda: 1 << 30)
    with pytest.raises(InvalidConfigError, match="more than this machine's memory"):
        MooncakeLocal(**{field: 10**30})


@pytest.mark.parametrize("local", [{"hostname": ""}, {"local_buffer_bytes": 0}, {"segment_bytes": -1}, {"workers": 0}, {"workers": True}])
def test_mooncake_local_side_is_checked_when_built(local):
    with pytest.raises(InvalidConfigError):
        MooncakeLocal(**local)


def test_mooncake_local_hostname_of_another_type_is_a_type_error():
    with pytest.raises(InvalidTypeError):
        MooncakeLocal(hostname=b"127.0.0.1")


def test_mooncake_store_takes_its_local_side_as_a_mooncake_local():
    with pytest.raises(InvalidTypeError, match="MooncakeLocal"):
        MooncakeStore("127.0.0.1:1", META, local={"hostname": "127.0.0.1"}, setup_timeout=0.5)
