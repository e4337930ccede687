"""NodeTable: monotonic topology, namespace roots, key index with collisions, runs."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.errors import TopologyError
from hybridcache.prefix_cache.node import NO_SLOT, RECENT_PATHS, NodePath, NodeTable
from hybridcache.sequence import MultimodalSpan, Namespace

from ._helpers import snapshot


def keys(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def blocks(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def chain(table: NodeTable, parent: int, first_key: int, count: int, first_block: int = 0) -> np.ndarray:
    return table.attach_run(
        parent, keys(*range(first_key, first_key + count)), blocks(*range(first_block, first_block + count)), {}
    )


def test_roots_are_one_per_namespace():
    table = NodeTable()
    base = table.root(Namespace())
    assert table.root(Namespace()) == base
    lora = table.root(Namespace("lora"))
    salt = table.root(Namespace(None, "salt"))
    both = table.root(Namespace("lora", "salt"))
    assert len({base, lora, salt, both}) == 4
    assert all(table.is_root[s] and table.attached[s] and table.depth[s] == 0 for s in (base, lora, salt, both))
    assert table.num_attached == 0
    assert table.attached_slots().size == 0
    table.check_invariants()


def test_attach_child_of_root_and_detach_it():
    table = NodeTable()
    root = table.root(Namespace())
    (child,) = table.attach_run(root, keys(11), blocks(5), {}).tolist()
    assert table.parent[child] == root and table.depth[child] == 1 and table.block[child] == 5
    assert table.num_children[root] == 1 and table.num_children[child] == 0
    assert table.candidates(11) == [child] and table.has_key(11)
    runs, top = table.path_runs(child, 0)
    assert runs == [(child, child)] and top == root
    table.check_invariants()
    generation = int(table.generation[child])
    assert table.is_valid(child, generation)
    assert table.detach_leaf(child) == root
    assert table.num_children[root] == 0
    assert not table.attached[child] and table.parent[child] == NO_SLOT and table.block[child] == NO_SLOT
    assert not table.is_valid(child, generation) and table.generation[child] == generation + 1
    assert table.candidates(11) == [] and not table.has_key(11)
    assert table.num_attached == 0
    table.check_invariants()


def test_chain_is_one_run_and_slots_are_reused_after_detach():
    table = NodeTable()
    root = table.root(Namespace())
    slots = chain(table, root, 100, 4)
    assert slots.tolist() == list(range(slots[0], slots[0] + 4))
    assert table.depth[slots].tolist() == [1, 2, 3, 4]
    assert table.num_children[slots].tolist() == [1, 1, 1, 0]
    assert table.run_head[slots].tolist() == [slots[0]] * 4
    runs, top = table.path_runs(int(slots[-1]), 0)
    assert runs == [(int(slots[0]), int(slots[-1]))] and top == root
    # stop in the middle of the run
    runs, top = table.path_runs(int(slots[-1]), 2)
    assert runs == [(int(slots[2]), int(slots[3]))] and top == slots[1]
    # a negative stop depth stops at the root: the walk never climbs past it
    assert table.path_runs(int(slots[-1]), -1) == table.path_runs(int(slots[-1]), 0)
    assert table.path_runs(root, -5) == ([], root)
    assert NodeTable.slot_at_depth(runs, table.depth, 3) == slots[2]
    with pytest.raises(KeyError):
        NodeTable.slot_at_depth(runs, table.depth, 1)
    # detach the last two and re-attach: the freed slots are reused, in order
    table.detach_leaf(int(slots[3]))
    table.detach_leaf(int(slots[2]))
    again = chain(table, int(slots[1]), 200, 3)
    assert sorted(again.tolist()[:2]) == sorted(slots[2:].tolist())
    assert table.depth[again].tolist() == [3, 4, 5]
    table.check_invariants()


def test_branch_makes_a_second_run():
    table = NodeTable()
    root = table.root(Namespace())
    trunk = chain(table, root, 100, 3)
    branch = chain(table, int(trunk[0]), 200, 2)
    assert table.num_children[trunk[0]] == 2
    runs, top = table.path_runs(int(branch[-1]), 0)
    assert top == root
    assert runs == [(int(branch[0]), int(branch[1])), (int(trunk[0]), int(trunk[0]))]
    assert [NodeTable.slot_at_depth(runs, table.depth, d) for d in (1, 2, 3)] == [trunk[0], branch[0], branch[1]]
    table.check_invariants()


def test_runs_never_cross_a_root():
    table = NodeTable()
    first_root = table.root(Namespace())
    second_root = table.root(Namespace("lora"))
    # second_root is first_root + 1, and its first child lands right after it
    assert second_root == first_root + 1
    (child,) = table.attach_run(second_root, keys(1), blocks(0), {}).tolist()
    assert table.run_head[child] == child
    runs, top = table.path_runs(child, 0)
    assert runs == [(child, child)] and top == second_root


def test_detach_non_leaf_root_and_detached_node_raise_topology_error():
    table = NodeTable()
    root = table.root(Namespace())
    slots = chain(table, root, 100, 3)
    detached = int(slots[2])
    table.detach_leaf(detached)
    before = snapshot(table)
    for bad in (int(slots[0]), root, detached, -1, 10_000):
        with pytest.raises(TopologyError):
            table.detach_leaf(bad)
        assert snapshot(table) == before
    table.check_invariants()


def test_attach_below_a_detached_node_raises():
    table = NodeTable()
    root = table.root(Namespace())
    (leaf,) = chain(table, root, 1, 1).tolist()
    table.detach_leaf(leaf)
    before = snapshot(table)
    with pytest.raises(TopologyError):
        table.attach_run(leaf, keys(2), blocks(3), {})
    assert snapshot(table) == before


def test_colliding_keys_keep_both_nodes():
    """A key collision never replaces or refuses a node: both stay, both are candidates, and
    detaching one leaves the other indexed."""
    table = NodeTable()
    root = table.root(Namespace())
    (first,) = table.attach_run(root, keys(7), blocks(0), {}).tolist()
    (second,) = table.attach_run(root, keys(7), blocks(1), {}).tolist()
    assert first != second and table.num_children[root] == 2
    assert table.candidates(7) == [first, second]
    table.check_invariants()
    # detaching the indexed node promotes the colliding one
    table.detach_leaf(first)
    assert table.candidates(7) == [second]
    table.check_invariants()
    (third,) = table.attach_run(root, keys(7), blocks(2), {}).tolist()
    assert table.candidates(7) == [second, third]
    table.detach_leaf(third)
    assert table.candidates(7) == [second]
    table.detach_leaf(second)
    assert table.candidates(7) == [] and not table.has_key(7)
    table.check_invariants()


def test_duplicate_keys_inside_one_run_are_indexed():
    table = NodeTable()
    root = table.root(Namespace())
    slots = table.attach_run(root, keys(7, 7, 7), blocks(0, 1, 2), {}).tolist()
    assert sorted(table.candidates(7)) == slots
    assert table.depth[slots].tolist() == [1, 2, 3]
    table.check_invariants()
    for slot in reversed(slots):
        table.detach_leaf(slot)
        table.check_invariants()
    assert table.candidates(7) == []


def test_multimodal_identity_and_counts():
    table = NodeTable()
    root = table.root(Namespace())
    span = (MultimodalSpan(16, 40, "image", "img"),)
    slots = table.attach_run(root, keys(1, 2, 3, 4), blocks(0, 1, 2, 3), {1: span, 2: span}).tolist()
    assert table.extra_identity == {slots[1]: span, slots[2]: span}
    assert table.mm_count[slots].tolist() == [0, 1, 2, 2]
    branch = table.attach_run(slots[2], keys(9), blocks(9), {0: span}).tolist()
    assert table.mm_count[branch[0]] == 3
    table.check_invariants()
    table.detach_leaf(branch[0])
    assert branch[0] not in table.extra_identity
    table.check_invariants()


def test_table_grows_beyond_initial_capacity():
    table = NodeTable(capacity=4)
    root = table.root(Namespace())
    slots = chain(table, root, 1000, 50)
    assert table.capacity >= 51
    assert table.depth[slots].tolist() == list(range(1, 51))
    runs, top = table.path_runs(int(slots[-1]), 0)
    assert runs == [(int(slots[0]), int(slots[-1]))] and top == root
    more = chain(table, int(slots[10]), 5000, 20)
    assert table.depth[more[-1]] == 31
    assert table.num_attached == 70
    table.check_invariants()


def test_is_valid_rejects_out_of_range_and_unused_slots():
    table = NodeTable()
    root = table.root(Namespace())
    assert table.is_valid(root, 0)
    assert not table.is_valid(-1, 0)
    assert not table.is_valid(root + 1, 0)
    assert not table.is_valid(10_000, 0)
    assert not table.is_valid(root, 1)


def test_path_to_and_path_blocks():
    """A one-run path keeps its block ids as a read-only view; a path of several runs is
    gathered each time and never kept (no copy of a prefix lives on a path)."""
    table = NodeTable()
    root = table.root(Namespace())
    trunk = chain(table, root, 100, 3, first_block=10)
    branch = chain(table, int(trunk[0]), 200, 2, first_block=20)
    straight = table.path_to(int(trunk[-1]))
    assert (straight.node, straight.depth, straight.root) == (int(trunk[-1]), 3, root)
    assert straight.generation == int(table.generation[trunk[-1]])
    ids = table.path_blocks(straight)
    assert ids.tolist() == [10, 11, 12] and not ids.flags.writeable and straight.blocks is ids
    assert table.path_blocks(straight) is ids
    bent = table.path_to(int(branch[-1]))
    ids = table.path_blocks(bent)
    assert ids.tolist() == [10, 20, 21] and not ids.flags.writeable and bent.blocks is None
    assert bent.slot_at(table, 0) == root and bent.slot_at(table, 2) == int(branch[0])


def fragmented_path(table: NodeTable, root: int, length: int) -> list[int]:
    """A path grown one node at a time into reused, scattered slots: one run per node."""
    spare = chain(table, root, 1000, 2 * length, first_block=1000)
    for slot in spare[::-1].tolist():
        table.detach_leaf(slot)
    table._free_slots[:] = table._free_slots[::2] + table._free_slots[1::2]  # no two in a row
    grown, parent = [], root
    for position in range(length):
        parent = int(chain(table, parent, position + 1, 1, first_block=position)[0])
        grown.append(parent)
    return grown


def test_path_to_resumes_from_a_remembered_ancestor_and_equals_a_walk():
    table = NodeTable()
    root = table.root(Namespace())
    grown = fragmented_path(table, root, 12)
    walks = []
    for slot in grown:
        path = table.path_to(slot)
        runs, top = table.path_runs(slot, 0)
        assert (path.runs, path.root, path.depth) == (runs, top, int(table.depth[slot]))
        walks.append(len(runs))
    assert walks == list(range(1, 13))  # every node its own run: the memo, not the layout, helps
    assert table.path_to(grown[-1]) is table.path_to(grown[-1])  # remembered, shared
    assert table.path_blocks(table.path_to(grown[-1])).tolist() == list(range(12))
    table.check_invariants()


def test_path_to_ignores_a_remembered_path_whose_node_was_detached():
    table = NodeTable()
    root = table.root(Namespace())
    grown = fragmented_path(table, root, 4)
    stale = table.path_to(grown[-1])
    table.detach_leaf(grown[-1])
    table.check_invariants()  # a stale memo entry is skipped, not compared
    other = chain(table, grown[1], 500, 1, first_block=77)
    assert int(other[0]) == grown[-1]  # the freed slot is reused at another place
    path = table.path_to(int(other[0]))
    assert path is not stale and path.runs == table.path_runs(int(other[0]), 0)[0] and path.depth == 3
    assert table.path_blocks(path).tolist() == [0, 1, 77]
    table.check_invariants()


def test_path_memo_is_bounded():
    table = NodeTable()
    root = table.root(Namespace())
    leaves = [int(chain(table, root, 10 * i + 1, 1, first_block=i)[0]) for i in range(RECENT_PATHS + 5)]
    for slot in leaves:
        table.path_to(slot)
    assert len(table._recent_paths) == RECENT_PATHS and leaves[0] not in table._recent_paths
    table.check_invariants()


def test_check_path_catches_a_drifted_path_and_ignores_a_stale_one():
    table = NodeTable()
    root = table.root(Namespace())
    trunk = chain(table, root, 100, 3, first_block=10)
    path = table.path_to(int(trunk[-1]))
    table.path_blocks(path)
    table.check_path(path)
    drifted = NodePath(path.node, path.depth, [(int(trunk[1]), int(trunk[2]))], root, path.generation)
    with pytest.raises(AssertionError):
        table.check_path(drifted)
    wrong_ids = table.path_to(int(trunk[-1]))
    wrong_ids.blocks = np.array([10, 11, 99], dtype=np.int32)
    wrong_ids.blocks.flags.writeable = False
    with pytest.raises(AssertionError):
        table.check_path(wrong_ids)
    table.detach_leaf(int(trunk[-1]))
    table.check_path(drifted)  # its node is gone: a stale path is never reused, so not checked
