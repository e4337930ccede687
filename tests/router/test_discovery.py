"""What the router reads from a replica's answer: the ``next_seq`` it settles its index on."""

from __future__ import annotations

import json

from hybridcache.router.discovery import answer_next_seqs, next_seqs_from


def test_the_header_is_read_before_the_body():
    body = json.dumps({"hybridcache": {"next_seq": {"kv": 3, "state": 1}}}).encode()
    assert answer_next_seqs('{"kv":9,"state":4}', body) == (9, 4)
    assert answer_next_seqs(None, body) == (3, 1)


def test_a_replica_without_a_checkpoint_stream_says_none_for_it():
    assert answer_next_seqs('{"kv":5,"state":null}', None) == (5, None)


def test_an_answer_without_next_seq_gives_none_so_the_router_reads_it():
    assert answer_next_seqs(None, json.dumps({"hybridcache": {"cached_tokens": 8}}).encode()) is None
    assert answer_next_seqs("not json", b"[1, 2]") is None
    assert answer_next_seqs(None, None) is None


def test_malformed_seqs_are_refused():
    for bad in ({"kv": -1}, {"kv": True}, {"kv": "3"}, {"state": 2}, [1, 2], None):
        assert next_seqs_from(bad) is None
