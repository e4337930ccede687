"""T1 (host RAM) and T2 (disk): byte budgets, LRU eviction, atomic writes, recovery."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError, LifecycleError, StoreLockedError
from hybridcache.tiers.backends import DiskStore, HostMemoryStore, PutOutcome


@pytest.fixture(params=["host", "disk"])
def bounded(request, tmp_path):
    def make(capacity: int, charge=None):
        if request.param == "host":
            return HostMemoryStore(capacity, charge=charge)
        return DiskStore(tmp_path / f"disk-{capacity}", capacity, charge=charge)

    return make


def test_a_charge_counts_what_objects_stand_for(bounded):
    store = bounded(1000, charge=lambda key, size: 400)  # each tiny object stands for 400 bytes
    store.put_if_absent([("a", b"a"), ("b", b"b")])
    assert store.used_bytes == 800
    assert store.put_if_absent([("c", b"c")]) == [PutOutcome.STORED]
    assert store.exists(["a", "b", "c"]) == [False, True, True] and store.used_bytes == 800
    store.remove(["b"])
    assert store.used_bytes == 400
    with pytest.raises(InvalidTypeError):
        bounded(10, charge="400")


def test_least_recently_used_goes_first(bounded):
    store = bounded(30)
    store.put_if_absent([("a", b"a" * 10), ("b", b"b" * 10), ("c", b"c" * 10)])
    store.get(["a"])  # b is now the oldest
    assert store.put_if_absent([("d", b"d" * 10)]) == [PutOutcome.STORED]
    assert store.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert store.used_bytes == 30 and store.evictions == 1


def test_an_object_larger_than_the_budget_is_rejected_and_evicts_nothing(bounded):
    store = bounded(30)
    store.put_if_absent([("a", b"a" * 10)])
    assert store.put_if_absent([("huge", b"h" * 31)]) == [PutOutcome.REJECTED]
    assert store.exists(["a", "huge"]) == [True, False]


def test_usage_never_exceeds_the_budget(bounded):
    store = bounded(100)
    for index in range(60):
        store.put_if_absent([(f"k{index}", bytes([index]) * (1 + index % 37))])
        assert store.used_bytes <= 100
    removed = store.remove([f"k{index}" for index in range(60)])
    assert store.used_bytes == 0 and sum(removed) >= 3


def test_closed_stores_refuse_calls(bounded):
    store = bounded(10)
    store.close()
    store.close()  # idempotent
    with pytest.raises(LifecycleError):
        store.get(["a"])


@pytest.mark.parametrize("capacity, error", [(0, InvalidArgumentError), (-1, InvalidArgumentError), (1.5, InvalidTypeError), (True, InvalidTypeError)])
def test_bad_budgets(tmp_path, capacity, error):
    with pytest.raises(error):
        HostMemoryStore(capacity)
    with pytest.raises(error):
        DiskStore(tmp_path, capacity)


def test_disk_objects_survive_a_restart_with_their_recency(tmp_path):
    with DiskStore(tmp_path, 30) as store:
        store.put_if_absent([("a", b"a" * 10), ("b", b"b" * 10)])
        os.utime(store._path("a"), ns=(1, 1))  # a is older than b on disk
        os.utime(store._path("b"), ns=(2, 2))
    with DiskStore(tmp_path, 30) as store:
        assert store.get(["a", "b"]) == [b"a" * 10, b"b" * 10] and store.used_bytes == 20
    with DiskStore(tmp_path, 15) as store:  # a smaller budget evicts at open, oldest read first
        assert store.exists(["a", "b"]) == [False, True]


def test_one_directory_one_open_store(tmp_path):
    with DiskStore(tmp_path, 100):
        with pytest.raises(StoreLockedError):
            DiskStore(tmp_path, 100)
    DiskStore(tmp_path, 100).close()  # released on close


def _crash_mid_write(root: str) -> None:
    """Child process: the write reaches fsync, then the process dies without cleanup."""
    store = DiskStore(root, 1 << 20)
    os.fsync = lambda fd: os._exit(17)
    store.put_if_absent([("victim", b"v" * 4096)])


def test_a_crash_mid_write_leaves_no_visible_object(tmp_path):
    child = multiprocessing.get_context("spawn").Process(target=_crash_mid_write, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == 17
    assert list((tmp_path / "scratch").iterdir())  # the interrupted write is still there ...
    assert not list((tmp_path / "objects").rglob("*.obj"))  # ... but never under an object name
    with DiskStore(tmp_path, 1 << 20) as store:
        assert store.exists(["victim"]) == [False] and store.get(["victim"]) == [None]
        assert not list((tmp_path / "scratch").iterdir())  # cleaned on open
        assert store.put_if_absent([("victim", b"v" * 4096)]) == [PutOutcome.STORED]


def test_a_file_removed_behind_the_store_is_a_miss(tmp_path):
    with DiskStore(tmp_path, 100) as store:
        store.put_if_absent([("a", b"abc")])
        store._path("a").unlink()
        assert store.get(["a"]) == [None] and store.used_bytes == 0
