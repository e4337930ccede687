"""T1 (host RAM) and T2 (disk): byte budgets, LRU eviction, atomic writes, recovery."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from hybridcache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    NotAStoreRootError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)
from hybridcache.tiers.backends import DiskStore, HostMemoryStore, PutOutcome
from hybridcache.tiers.backends.disk import MARKER_NAME
from hybridcache.tiers.backends.disk_root import DiskRoot


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
    with pytest.raises(StoreClosedError):
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
        os.utime(DiskRoot(store.root).path("a"), ns=(1, 1))  # a is older than b on disk
        os.utime(DiskRoot(store.root).path("b"), ns=(2, 2))
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
        DiskRoot(store.root).path("a").unlink()
        assert store.get(["a"]) == [None] and store.used_bytes == 0


# --- issue 19: the disk tier owns only its own files and trusts none of them ------------------


def test_a_root_holding_someone_elses_files_is_refused_and_left_untouched(tmp_path):
    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    (home / "tmp" / "draft.txt").write_text("a user's unsaved work")
    (home / "notes.txt").write_text("keep me")
    with pytest.raises(NotAStoreRootError):
        DiskStore(home, 1 << 20)
    assert (home / "tmp" / "draft.txt").read_text() == "a user's unsaved work"
    assert sorted(path.name for path in home.iterdir()) == ["notes.txt", "tmp"]


def test_a_new_or_empty_root_is_marked_and_reopens(tmp_path):
    (tmp_path / "empty").mkdir()
    for root in (tmp_path / "empty", tmp_path / "new" / "nested"):
        with DiskStore(root, 1 << 20) as store:
            store.put_if_absent([("a", b"abc")])
        assert (root / MARKER_NAME).is_file()
        with DiskStore(root, 1 << 20) as store:
            assert store.get(["a"]) == [b"abc"]


def test_only_scratch_names_the_store_writes_are_deleted_on_open(tmp_path):
    DiskStore(tmp_path, 1 << 20).close()
    leftover, stranger = tmp_path / "scratch" / "123-4.tmp", tmp_path / "scratch" / "mine.txt"
    leftover.write_bytes(b"interrupted")
    stranger.write_bytes(b"not the store's")
    DiskStore(tmp_path, 1 << 20).close()
    assert not leftover.exists() and stranger.read_bytes() == b"not the store's"


@pytest.mark.parametrize("planted", ["fifo", "sparse", "symlink to /dev/zero", "directory"])
def test_a_file_that_is_not_the_stored_object_is_a_miss_never_a_hang_or_an_allocation(tmp_path, planted):
    store = DiskStore(tmp_path, 1 << 20)
    store.put_if_absent([("a", b"abc")])
    path = DiskRoot(store.root).path("a")
    path.unlink()
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "sparse":
        with open(path, "wb") as handle:
            handle.truncate(64 << 30)  # 64 GiB, no blocks
    elif planted == "symlink to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    assert store.get(["a"]) == [None]
    assert store.exists(["a"]) == [False] and store.used_bytes == 0
    store.close()
    with DiskStore(tmp_path, 1 << 20) as reopened:  # nor is it indexed on the next open
        assert reopened.exists(["a"]) == [False] and reopened.used_bytes == 0


def test_a_read_only_store_serves_a_warm_cache_and_writes_nothing(tmp_path):
    with DiskStore(tmp_path, 1 << 20) as store:
        store.put_if_absent([("a", b"abc"), ("b", b"defg")])
    (tmp_path / "lock").unlink()  # as on a medium the writer's lock file never reached

    def snapshot():
        return sorted((str(path), path.lstat().st_mtime_ns) for path in tmp_path.rglob("*"))

    before = snapshot()
    with DiskStore(tmp_path, 5, read_only=True) as reader:  # smaller than its contents: evicts nothing
        assert reader.get(["a", "b", "c"]) == [b"abc", b"defg", None]
        assert reader.put_if_absent([("c", b"x")]) == [PutOutcome.REJECTED]
        assert reader.remove(["a"]) == [False] and reader.exists(["a"]) == [True]
    assert snapshot() == before
    with pytest.raises(NotAStoreRootError):
        DiskStore(tmp_path / "unmarked", 100, read_only=True)


def test_a_read_only_store_and_a_writer_exclude_each_other(tmp_path):
    with DiskStore(tmp_path, 100):
        with pytest.raises(StoreLockedError):
            DiskStore(tmp_path, 100, read_only=True)
    with DiskStore(tmp_path, 100, read_only=True), DiskStore(tmp_path, 100, read_only=True):
        with pytest.raises(StoreLockedError):
            DiskStore(tmp_path, 100)


def test_a_failed_recency_update_does_not_turn_a_read_into_a_failure(tmp_path, monkeypatch):
    with DiskStore(tmp_path, 1 << 20) as store:
        store.put_if_absent([("a", b"abc")])

        def refuse(*args, **kwargs):
            raise PermissionError(13, "read-only file system")

        monkeypatch.setattr(os, "utime", refuse)
        assert store.get(["a"]) == [b"abc"]


def test_a_closed_store_and_a_failing_backend_raise_store_errors_only(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    store.put_if_absent([("a", b"abc")])
    store._files.read = lambda key, size, refresh: (_ for _ in ()).throw(MemoryError("no room"))  # a backend bug
    with pytest.raises(StoreError) as raised:
        store.get(["a"])
    assert not isinstance(raised.value, MemoryError)
    store.close()
    with pytest.raises(StoreClosedError):
        store.get(["a"])


def test_folders_linked_elsewhere_are_never_indexed_or_written(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "ab").mkdir(parents=True)
    (elsewhere / "ab" / "a.obj").write_bytes(b"someone's file")
    root = tmp_path / "store"
    with DiskStore(root, 1 << 20) as store:
        shard = DiskRoot(store.root).path("a").parent
    shard.symlink_to(elsewhere / "ab")
    with DiskStore(root, 1 << 20) as store:
        assert store.exists(["a"]) == [False]  # not indexed through a linked shard
    (root / "scratch").rmdir()
    (root / "scratch").symlink_to(elsewhere)
    with pytest.raises(NotAStoreRootError):
        DiskStore(root, 1 << 20)
    assert (elsewhere / "ab" / "a.obj").read_bytes() == b"someone's file"


def _keys_in_one_shard(count: int) -> list[str]:
    from hybridcache.tiers.backends.disk_root import shard_name as _shard_name

    keys = [f"k{index}" for index in range(4096)]
    target = _shard_name(keys[0])
    return [key for key in keys if _shard_name(key) == target][:count]


def _tree(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_shard_linked_elsewhere_while_open_costs_misses_never_a_file_outside_the_root(tmp_path):
    """Another user swaps a shard for a link to their folder, holding a same-size forgery under
    the object's name: the read is a miss, a put is rejected, a removal unlinks nothing there."""
    stored, fresh, evicted = _keys_in_one_shard(3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{stored}.obj").write_bytes(b"XYZ")  # the size the index recorded for ``stored``
    (elsewhere / f"{evicted}.obj").write_bytes(b"theirs")
    before = _tree(elsewhere)
    with DiskStore(tmp_path / "store", 1 << 20) as store:
        assert store.put_if_absent([(stored, b"abc"), (evicted, b"mine")]) == [PutOutcome.STORED] * 2
        shard = DiskRoot(store.root).path(stored).parent
        for name in os.listdir(shard):
            (shard / name).unlink()
        shard.rmdir()
        shard.symlink_to(elsewhere)
        assert store.get([stored]) == [None]
        assert store.put_if_absent([(fresh, b"new")]) == [PutOutcome.REJECTED]
        assert store.remove([evicted]) == [True]
        assert store.exists([stored, fresh, evicted]) == [False, False, False]
    assert _tree(elsewhere) == before


def test_an_objects_folder_linked_elsewhere_while_open_is_never_written(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "store"
    with DiskStore(root, 1 << 20) as store:
        store.put_if_absent([("a", b"abc")])
        os.rename(root / "objects", tmp_path / "moved")
        (root / "objects").symlink_to(elsewhere)
        assert store.get(["a"]) == [None]
        assert store.put_if_absent([("b", b"new")]) == [PutOutcome.REJECTED]
        (root / "scratch").rename(tmp_path / "scratch-moved")
        (root / "scratch").symlink_to(elsewhere)
        assert store.put_if_absent([("c", b"new")]) == [PutOutcome.REJECTED]
    assert list(elsewhere.iterdir()) == []


def test_a_host_tier_larger_than_the_machine_is_refused_unless_its_budget_is_nominal(monkeypatch):
    from hybridcache import machine
    from hybridcache.errors import InvalidConfigError

    monkeypatch.setattr(machine, "host_memory_bytes", lambda: 1 << 20)
    with pytest.raises(InvalidConfigError, match="more than this machine's memory"):
        HostMemoryStore((1 << 20) + 1)
    assert HostMemoryStore(1 << 20).capacity_bytes == 1 << 20
    nominal = HostMemoryStore(1 << 40, charge=lambda key, size: size * 1000)  # the replay's stand-ins
    assert nominal.capacity_bytes == 1 << 40
