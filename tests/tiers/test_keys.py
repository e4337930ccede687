"""Key chaining and the namespace fingerprint: equal prefixes share keys, any change does not."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache import MultimodalSpan, Sequence
from hybridcache.errors import (
    CorruptObjectError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidSpanError,
    InvalidTokenError,
    InvalidTypeError,
)
from hybridcache.tiers import KeyChain, NamespaceFingerprint, ObjectKey, ObjectKind

from .helpers import CHUNK, chain, fingerprint

FINGERPRINT_CHANGES = [
    ("model_id", "other-model"),
    ("weights_revision", "rev-2"),
    ("dtype", "bfloat16"),
    ("kv_layout", "L=2,H=2,D,T"),
    ("state_layout", "L=2,S=8x2"),
    ("block_size", 32),
    ("chunk_size", 64),
    ("adapter", "lora-a"),
    ("cache_salt", "tenant-b"),
    ("format_version", 2),
]


def test_equal_prefixes_give_equal_keys_across_chains():
    tokens = list(range(100, 100 + 3 * CHUNK))
    short, long = chain(tokens[: 2 * CHUNK + 7]), chain(tokens + [5, 6])
    assert [short.chunk_key(i) for i in range(2)] == [long.chunk_key(i) for i in range(2)]
    assert short.checkpoint_key(2 * CHUNK) == long.checkpoint_key(2 * CHUNK)
    assert short.num_chunks == 2 and long.num_chunks == 3


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 3 * CHUNK - 1), st.integers(0, 2**31 - 1))
def test_a_changed_token_changes_its_chunk_key_and_every_later_one(position, value):
    tokens = list(range(1, 3 * CHUNK + 1))
    changed = list(tokens)
    changed[position] = value if value != tokens[position] else value + 1
    before, after = chain(tokens), chain(changed)
    first = position // CHUNK
    for index in range(3):
        assert (before.chunk_key(index) == after.chunk_key(index)) == (index < first)


def test_multimodal_identity_changes_the_keys_of_the_chunks_it_touches_and_later():
    plain = chain()
    image = chain(multimodal=[MultimodalSpan(CHUNK + 2, CHUNK + 9, "image", "sha256:aa")])
    other = chain(multimodal=[MultimodalSpan(CHUNK + 2, CHUNK + 9, "image", "sha256:bb")])
    audio = chain(multimodal=[MultimodalSpan(CHUNK + 2, CHUNK + 9, "audio", "sha256:aa")])
    moved = chain(multimodal=[MultimodalSpan(CHUNK + 3, CHUNK + 9, "image", "sha256:aa")])
    assert plain.chunk_key(0) == image.chunk_key(0)
    keys = {c.chunk_key(1) for c in (plain, image, other, audio, moved)}
    assert len(keys) == 5
    assert len({c.chunk_key(2) for c in (plain, image, other, audio, moved)}) == 5


@pytest.mark.parametrize("field, value", FINGERPRINT_CHANGES, ids=[f for f, _ in FINGERPRINT_CHANGES])
def test_any_fingerprint_field_changes_every_key(field, value):
    base = chain()
    changes = {field: value}
    if field == "block_size":
        changes["chunk_size"] = 64
    other = KeyChain(dataclasses.replace(base.fingerprint, **changes), base.tokens)
    assert base.fingerprint.digest != other.fingerprint.digest
    assert base.chunk_key(0) != other.chunk_key(0)
    assert field in base.fingerprint.differing_fields(other.fingerprint)


def test_a_chunk_and_the_checkpoint_at_its_end_have_different_keys():
    keys = chain()
    assert keys.chunk_key(0).digest == keys.checkpoint_key(CHUNK).digest
    assert keys.chunk_key(0).name != keys.checkpoint_key(CHUNK).name
    assert keys.checkpoint_steps() == (CHUNK, 2 * CHUNK, 3 * CHUNK)


def test_key_names_round_trip_and_are_validated():
    key = chain().checkpoint_key(CHUNK)
    assert ObjectKey.from_name(key.name) == key and key.kind is ObjectKind.CHECKPOINT
    for bad in ("", "hc1-xx-" + "0" * 64, "hc1-kv-" + "0" * 63, 7):
        with pytest.raises(InvalidKeyError):
            ObjectKey.from_name(bad)
    with pytest.raises(InvalidArgumentError):
        ObjectKey(ObjectKind.KV_CHUNK, b"short")
    with pytest.raises(InvalidTypeError):
        ObjectKey(1, b"\0" * 32)


def test_for_sequence_uses_the_sequence_namespace_and_spans():
    span = MultimodalSpan(4, 8, "image", "sha256:aa")
    seq = Sequence(list(range(2 * CHUNK)), adapter="lora-a", cache_salt="t", multimodal=[span])
    keys = KeyChain.for_sequence(fingerprint(), seq)
    assert (keys.fingerprint.adapter, keys.fingerprint.cache_salt) == ("lora-a", "t")
    assert keys.chunk_key(1) == chain(list(range(2 * CHUNK)), [span], adapter="lora-a", cache_salt="t").chunk_key(1)


def test_for_sequence_covers_a_prefix_and_keeps_only_its_spans():
    inside, beyond = MultimodalSpan(4, 8, "image", "sha256:aa"), MultimodalSpan(CHUNK + 4, CHUNK + 8, "image", "sha256:bb")
    seq = Sequence(list(range(2 * CHUNK)), multimodal=[inside, beyond])
    keys = KeyChain.for_sequence(fingerprint(), seq, CHUNK)
    assert keys.num_chunks == 1 and keys.spans == (inside,)
    assert keys.chunk_key(0) == KeyChain.for_sequence(fingerprint(), seq).chunk_key(0)
    assert keys.fingerprint == fingerprint()
    for end, error in ((2 * CHUNK + 1, InvalidArgumentError), (-1, InvalidArgumentError), (1.5, InvalidTypeError)):
        with pytest.raises(error):
            KeyChain.for_sequence(fingerprint(), seq, end)


def test_a_prefix_is_the_chain_made_to_its_end_without_hashing_again():
    inside, beyond = MultimodalSpan(4, 8, "image", "sha256:aa"), MultimodalSpan(CHUNK + 4, CHUNK + 8, "image", "sha256:bb")
    seq = Sequence(list(range(3 * CHUNK + 5)), multimodal=[inside, beyond])
    whole = KeyChain.for_sequence(fingerprint(), seq)
    for end in (0, CHUNK, 2 * CHUNK):
        cut, made = whole.prefix(end), KeyChain.for_sequence(fingerprint(), seq, end)
        assert (cut.steps, cut.chunk_keys, cut.chunk_names, cut.spans) == (made.steps, made.chunk_keys, made.chunk_names, made.spans)
        assert dict(cut.checkpoint_names) == dict(made.checkpoint_names) and cut.tokens.tolist() == made.tokens.tolist()
        assert cut.expect_checkpoint(end).key == made.expect_checkpoint(end).key if end else cut.num_chunks == 0
    assert whole.prefix(3 * CHUNK + 5) is whole
    for end, error in ((CHUNK + 6, InvalidArgumentError), (CHUNK + 5, InvalidArgumentError), (4 * CHUNK, InvalidArgumentError),
                       (-CHUNK, InvalidArgumentError), (float(CHUNK), InvalidTypeError)):
        with pytest.raises(error):
            whole.prefix(end)
    straddling = KeyChain.for_sequence(fingerprint(), Sequence(list(range(2 * CHUNK)), multimodal=[MultimodalSpan(CHUNK - 2, CHUNK + 2, "image", "x")]))
    with pytest.raises(InvalidArgumentError):
        straddling.prefix(CHUNK)


def test_a_fingerprint_in_its_own_namespace_is_itself():
    base = fingerprint(adapter="lora-a")
    assert base.in_namespace("lora-a", None) is base
    assert base.in_namespace("lora-b", None) == dataclasses.replace(base, adapter="lora-b")


def test_fingerprint_round_trips_and_validates():
    base = fingerprint(adapter="lora", cache_salt=None)
    assert NamespaceFingerprint.decode(base.encode()) == base
    with pytest.raises(CorruptObjectError):
        NamespaceFingerprint.decode(base.encode()[:-1])
    with pytest.raises(CorruptObjectError):
        NamespaceFingerprint.decode(base.encode() + b"\0")
    for changes, error in [
        ({"chunk_size": 40}, InvalidArgumentError),  # not a multiple of the block size
        ({"block_size": 0}, InvalidArgumentError),
        ({"block_size": 16.0}, InvalidTypeError),
        ({"model_id": ""}, InvalidArgumentError),
        ({"dtype": None}, InvalidTypeError),
        ({"adapter": ""}, InvalidArgumentError),
        ({"cache_salt": 5}, InvalidTypeError),
        ({"model_id": "x" * 2000}, InvalidArgumentError),
    ]:
        with pytest.raises(error):
            fingerprint(**changes)


def test_bad_chain_inputs_are_refused():
    with pytest.raises(InvalidTypeError):
        KeyChain("fingerprint", [1, 2])
    with pytest.raises(InvalidTokenError):
        chain([-1, 2])
    with pytest.raises(InvalidSpanError):
        chain([1, 2, 3], [MultimodalSpan(1, 9, "image", "x")])
    with pytest.raises(InvalidTypeError):
        chain([1, 2, 3], ["span"])
    with pytest.raises(InvalidTypeError):
        chain().chunk_key(True)
