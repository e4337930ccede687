"""The indexes a consumer builds from a replica's events."""

from __future__ import annotations

from hybridcache.events.index import MAX_MEDIA, AnnouncedBlocks, AnnouncedCheckpoints
from hybridcache.events.schema import (
    AllBlocksCleared,
    AllCheckpointsCleared,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
)


def _stored(hashes, parent=None, medium="GPU", **extra):
    return BlockStored(hashes, parent, [0] * (4 * len(hashes)), 4, None, medium, None, **extra)


def test_chains_are_matched_from_the_first_block_and_copies_counted_per_medium():
    blocks = AnnouncedBlocks()
    blocks.apply([_stored([1, 2, 3]), _stored([2], 1, medium="CPU"), _stored([3], 2)])
    assert blocks.matched_blocks([1, 2, 3, 4]) == 3 and blocks.matched_blocks([9, 2]) == 0
    blocks.apply([BlockRemoved([3], "GPU")])
    assert blocks.matched_blocks([1, 2, 3]) == 3  # a second copy of 3 is still there
    blocks.apply([BlockRemoved([3], "GPU"), BlockRemoved([2], "GPU")])
    assert blocks.matched_blocks([1, 2, 3]) == 2 and blocks.media(2) == {"CPU"}
    blocks.check_invariants()
    blocks.apply([AllBlocksCleared()])
    assert len(blocks) == 0


def test_non_dense_and_non_attention_events_are_skipped():
    blocks = AnnouncedBlocks()
    blocks.apply([
        BlockStored([1], None, [0, 0, 0], 4, None, "GPU", None),
        _stored([2], kv_cache_spec_kind="mamba", group_idx=1),
        BlockRemoved([7], "GPU", group_idx=1),
    ])
    assert len(blocks) == 0 and blocks.skipped == 3


def test_checkpoints_are_found_by_anchor_and_removed_by_id():
    checkpoints = AnnouncedCheckpoints()
    a = CheckpointStored(1, 6, 11, [5, 6], 4, "GPU", None)
    b = CheckpointStored(2, 2, None, [7, 8], 4, "GPU", None)
    checkpoints.apply([a, b])
    assert list(checkpoints.at_anchor(11)) == [a] and list(checkpoints.at_anchor(None)) == [b]
    checkpoints.apply([CheckpointRemoved([1, 99], "GPU")])
    assert list(checkpoints.at_anchor(11)) == [] and len(checkpoints) == 1
    checkpoints.check_invariants()
    checkpoints.apply([AllCheckpointsCleared()])
    assert len(checkpoints) == 0


def test_a_replica_announcing_past_the_bounds_costs_skipped_stores_not_memory():
    blocks = AnnouncedBlocks(block_size=4, max_blocks=3)
    blocks.apply([_stored([1, 2]), _stored([3, 4, 5], 2), _stored([1], medium="CPU")])
    assert len(blocks) == 3 and blocks.matched_blocks([1, 2, 3, 4]) == 3 and blocks.skipped == 1
    blocks.apply([_stored([1], medium=f"tier-{i}") for i in range(20)])
    assert len(blocks.media(1)) == MAX_MEDIA and blocks.skipped == 1 + 20 - (MAX_MEDIA - 2)
    checkpoints = AnnouncedCheckpoints(max_checkpoints=2)
    checkpoints.apply([CheckpointStored(i, 2, None, [7, 8], 4, "GPU", None) for i in range(5)])
    assert len(checkpoints) == 2 and checkpoints.skipped == 3
    blocks.check_invariants()
    checkpoints.check_invariants()


def test_blocks_of_another_size_than_the_stream_or_of_no_size_are_skipped():
    blocks = AnnouncedBlocks(block_size=4)
    blocks.apply([BlockStored([1], None, [0] * 8, 8, None, "GPU", None), BlockStored([2, 3], None, [], 0, None, "GPU", None)])
    assert len(blocks) == 0 and blocks.skipped == 2
