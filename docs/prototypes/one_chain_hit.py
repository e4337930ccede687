"""Measurement prototype for docs/benchmarks.md (issue 25, fifth pass); not part of the package.

A 64K cache hit done as one chain of calls on today's structures (same keys, same exact
comparison), without a separate ingest, re-verification or transaction object, timed in CPU
time against the floor (one ``np.array_equal`` per request), best of 12 rounds, GC paused:

    PYTHONPATH=src python docs/prototypes/one_chain_hit.py kv 128          # attention-only
    PYTHONPATH=src python docs/prototypes/one_chain_hit.py kv 128 bytes    # root's child by bytes
    PYTHONPATH=src python docs/prototypes/one_chain_hit.py match 512       # hybrid

It covers full hits of the bench workload only (every prompt cached as one run, text only, no
policy cuts) and is what a merged chain could cost, not a replacement for ``BlockTrie.match``.
"""

import gc
import sys
import time

import numpy as np

from hybridcache.bench.admission_stages import _cached_impl
from hybridcache.bench.scenarios import Case, with_suffix
from hybridcache.prefix_cache.checkpoint_index import HIT

HYBRID, BATCH, BY_BYTES = sys.argv[1] == "match", int(sys.argv[2]), sys.argv[3:] == ["bytes"]
CASE = Case(BATCH, 65536)
IMPL, PROMPTS = _cached_impl(CASE, HYBRID)
TRIE = IMPL.trie
NODES, KEYER, TOKENS, KV, STATS, INDEX = TRIE.nodes, TRIE.keyer, TRIE.tokens, TRIE.kv, TRIE.stats, TRIE.index
SIZE = CASE.block_size


def claim(seq):
    position = seq.prefix_state.trie
    if position.owner != TRIE.trie_id:
        position.owner = TRIE.trie_id
    KEYER.identity(seq)
    return position


def root_child_by_key(seq, root):
    for child in NODES.candidates(KEYER.key_after(seq, 0, NODES.key_sums.item(root))):
        if NODES.parent.item(child) == root:
            return child
    raise SystemExit("not cached")


def kv_hit(seq, first_blocks):
    position = claim(seq)
    root = TRIE.lookup.root(seq.namespace)
    child = first_blocks[seq.token_words(0, SIZE).tobytes()] if BY_BYTES else root_child_by_key(seq, root)
    window = slice(child, child + (seq.num_valid - 1) // SIZE)
    same_run = (NODES.run_head[window] == NODES.run_head.item(child)) & NODES.attached[window]
    length = int(same_run.argmin()) or same_run.size
    last = child + length - 1
    if not TOKENS.equals(child, last, seq, 0):
        raise SystemExit("the prototype covers full hits only")
    KV.pin_path(last)
    seq.place_blocks(0, NODES.block[child : last + 1])
    seq.set_computed(length * SIZE)
    position.cursor, position.cursor_generation = last, NODES.generation.item(last)
    STATS.record_match(seq.num_tokens, length * SIZE, None)
    return last


def hybrid_hit(seq, _):
    position = claim(seq)
    namespace, state = seq.namespace, seq.prefix_state
    for step in INDEX.candidate_steps(namespace, 0, seq.num_valid - 1):
        key = (step, KEYER.value_of(seq, step // SIZE - 1))
        for record in INDEX.bucket(namespace, key):
            path = record.anchor_path
            if INDEX.verify(record, key, seq) is not HIT or len(path.runs) != 1:
                continue
            if not TOKENS.equals(path.runs[0][0], path.runs[0][1], seq, 0):
                continue
            KV.pin_path(record.anchor)
            seq.place_blocks(0, NODES.path_blocks(path))
            seq.set_computed(step)
            position.cursor, position.cursor_generation = record.anchor, record.anchor_generation
            state.checkpoints.restore = record
            state.overlap.fresh_range = (step // SIZE, step // SIZE)
            STATS.record_match(seq.num_tokens, step, None)
            return record.anchor
    raise SystemExit("the prototype covers hits only")


def undo(seq, anchor):
    KV.unpin_path(anchor)
    seq.truncate_blocks(0)
    seq.set_computed(0)
    seq.prefix_state.checkpoints.restore = None


def main():
    first_blocks = {}
    if BY_BYTES:
        for prompt in PROMPTS:
            seq = IMPL.new_requests([prompt])[0]
            first_blocks[seq.token_words(0, SIZE).tobytes()] = root_child_by_key(seq, TRIE.lookup.root(seq.namespace))
    hit = hybrid_hit if HYBRID else kv_hit
    best = {}
    for round_index in range(12):
        tokens = with_suffix(PROMPTS, round_index + 1)
        requests = IMPL.new_requests(tokens)
        gc.disable()
        started = time.process_time()
        anchors = [hit(seq, first_blocks) for seq in requests]
        hit_done = time.process_time()
        [np.array_equal(t[: CASE.context], p) for t, p in zip(tokens, PROMPTS)]
        floor_done = time.process_time()
        gc.enable()
        for seq, anchor in zip(requests, anchors):
            undo(seq, anchor)
        for part, seconds in (("hit", hit_done - started), ("floor", floor_done - hit_done)):
            best[part] = min(best.get(part, seconds), seconds)
    per_request = {part: round(seconds * 1e6 / BATCH, 2) for part, seconds in best.items()}
    print(sys.argv[1:], per_request, "hit / floor %.3f" % (best["hit"] / best["floor"]))


main()
