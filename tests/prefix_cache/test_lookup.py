"""Exact path lookup (``PathLookup.descend``): a cached path is followed along its run of
consecutive slots by comparing tokens, and keys are computed only beyond where the run leaves
the request; the outcome is the deepest exact path whatever the keys."""

from __future__ import annotations

import pytest

from hybridcache.prefix_cache import BlockKeyer
from hybridcache.sequence import Sequence
from hybridcache.types import MultimodalSpan

from tests.keyers import ConstantKeyer, TwoBitKeyer
from tests.prefix_cache._helpers import B, make_trie, produce, tokens

KEYERS = [lambda: BlockKeyer(B), lambda: ConstantKeyer(B), lambda: TwoBitKeyer(B, secret=b"few-bits")]
KEYER_IDS = ["real", "constant", "two-bit"]


def verified_depth(trie, seq) -> int:
    return trie.cached_prefix_tokens(seq) // B


def test_a_fully_cached_prompt_is_verified_without_hashing_its_blocks():
    pool, trie = make_trie()
    produce(trie, tokens(8 * B))
    seq = Sequence(tokens(8 * B) + [0])
    trie.prepare(seq)
    keys = seq.prefix_state.keys
    assert verified_depth(trie, seq) == 8
    assert (keys.keys_from, keys.num_keys) == (8, 8)  # no key computed for the cached blocks
    txn = trie.match(seq)
    assert txn.hit_tokens == 8 * B
    trie.rollback(txn)
    trie.check_invariants([seq])


@pytest.mark.parametrize("keyer", KEYERS, ids=KEYER_IDS)
def test_a_path_of_several_runs_is_followed_beyond_the_first(keyer):
    pool, trie = make_trie(keyer=keyer())
    produce(trie, tokens(4 * B))
    produce(trie, tokens(3 * B, start=5000))  # takes the slots after the first run
    produce(trie, tokens(8 * B))  # its last four blocks go to later slots: a second run
    seq = Sequence(tokens(8 * B) + [0])
    trie.prepare(seq)
    verified = seq.prefix_state.trie.verified
    assert verified_depth(trie, seq) == 8
    assert len(trie.nodes.path_runs(verified, 0)[0]) == 2
    assert trie.match(seq).hit_tokens == 8 * B
    trie.check_invariants([seq])


@pytest.mark.parametrize("keyer", KEYERS, ids=KEYER_IDS)
def test_a_request_leaving_a_run_midway_continues_on_the_branch_it_shares(keyer):
    pool, trie = make_trie(keyer=keyer())
    shared = tokens(8 * B)
    produce(trie, shared)
    branch = shared[: 3 * B] + tokens(5 * B, start=9000)
    produce(trie, branch)
    on_branch, off_both = Sequence(branch + [0]), Sequence(shared[: 5 * B] + tokens(3 * B, start=7000))
    assert verified_depth(trie, on_branch) == 8
    assert verified_depth(trie, off_both) == 5
    assert verified_depth(trie, Sequence(tokens(B, start=4000))) == 0
    trie.check_invariants([on_branch, off_both])


def test_a_run_with_other_multimodal_identity_is_not_taken():
    pool, trie = make_trie()
    produce(trie, tokens(4 * B))
    image = [MultimodalSpan(2 * B + 1, 2 * B + 5, "image", "cat")]
    with_image = Sequence(tokens(4 * B) + [0], multimodal=image)
    assert verified_depth(trie, with_image) == 2
    produce(trie, tokens(4 * B), multimodal=image)
    assert verified_depth(trie, Sequence(tokens(4 * B) + [0], multimodal=image)) == 4
    assert verified_depth(trie, Sequence(tokens(4 * B) + [0])) == 4  # the plain path is still cached
    other = [MultimodalSpan(2 * B + 1, 2 * B + 5, "image", "dog")]
    assert verified_depth(trie, Sequence(tokens(4 * B) + [0], multimodal=other)) == 2
    trie.check_invariants([])
