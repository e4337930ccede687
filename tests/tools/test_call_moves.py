"""The counting of tests/tools/call_moves.py on hand-built trees (the tool itself runs a replay)."""

from __future__ import annotations

import sys

from tests.tools.call_moves import CallRecorder, Room, count, walk

BELOW = {  # each module's transitive imports
    "hybridcache.replay.a": {"hybridcache.replay.b", "hybridcache.tiers.c", "hybridcache.types"},
    "hybridcache.replay.b": {"hybridcache.tiers.c", "hybridcache.types"},
    "hybridcache.tiers.c": {"hybridcache.types"},
}


def _tree(*edges: tuple[str, str]) -> Room:
    rooms: dict[str, Room] = {}
    root = None
    for parent, child in edges:
        node = rooms.setdefault(parent, Room(parent))
        root = root or node
        rooms[child] = node.child(child)
    return root


def test_a_walk_goes_into_each_child_and_back():
    tree = _tree(("hybridcache.replay.a", "hybridcache.replay.b"), ("hybridcache.replay.b", "hybridcache.tiers.c"))
    assert [room for _, room in walk(tree)] == [
        "hybridcache.replay.a", "hybridcache.replay.b", "hybridcache.tiers.c", "hybridcache.replay.b", "hybridcache.replay.a"
    ]
    counts = count(walk(tree), BELOW)
    assert (counts["stays"], counts["rooms"], counts["moves"]) == (5, 3, 4)
    assert counts["climbs"] == 2 and counts["upcalls"] == 0  # the two returns up to an importer
    assert counts["returns"] == 2  # b and a, each left once before
    assert counts["entered_by_a_call"] == {"hybridcache.replay.b": 1, "hybridcache.tiers.c": 1}


def test_a_callback_into_an_importer_is_a_climb():
    tree = _tree(("hybridcache.replay.a", "hybridcache.tiers.c"), ("hybridcache.tiers.c", "hybridcache.replay.b"))
    counts = count(walk(tree), BELOW)
    # a -> c (down), c -> b (up: a callback into a module importing c), b -> c (down), c -> a (up)
    assert counts["climbs"] == 2 and counts["upcalls"] == 1
    assert counts["returns"] == 2


def _leaf():
    return None


def _middle():
    _leaf()
    _leaf()  # a repeated call collapses into the first


def test_the_recorder_follows_only_the_root_and_collapses_repeated_calls():
    recorder = CallRecorder(_middle.__code__)
    sys.setprofile(recorder)
    try:
        _leaf()  # before the root runs: not recorded
        _middle()
        _middle()
    finally:
        sys.setprofile(None)
    assert recorder.tree.module == __name__ and recorder.tree.children == {}  # one module, outside the package


_TIERS = """
class Chain:
    def __init__(self, tokens):
        self.tokens = tokens

    def keys(self):
        return [("key", i) for i in range(2)]


def make(prompt):
    return Chain(prompt)


def fetch(key):
    return None
"""

_ENGINE = """
def unrelated(value):
    return value
"""

_REPLAY = """
def handle(request, shared):
    chain = tiers["make"](request.prompt)
    for key in chain.keys():
        tiers["fetch"](key)
    engine["unrelated"](shared)  # receives nothing derived from the request: not followed
    return chain
"""


def _fake_module(name: str, source: str, **names) -> dict:
    namespace = {"__name__": name, **names}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace


def test_the_follower_records_only_frames_receiving_the_request_or_what_derives_from_it():
    import numpy as np

    from hybridcache.workloads.records import TraceRequest
    from tests.tools.call_moves import ParameterFollower

    tiers = _fake_module("hybridcache.tiers.fake", _TIERS)
    engine = _fake_module("hybridcache.engine.fake", _ENGINE)
    replay = _fake_module("hybridcache.replay.fake", _REPLAY, tiers=tiers, engine=engine)
    requests = [TraceRequest(i, 0.0, 3, np.arange(4, dtype=np.int32)) for i in range(3)]
    follower = ParameterFollower(1)
    sys.setprofile(follower)
    try:
        for request in requests:
            replay["handle"](request, [1])
    finally:
        sys.setprofile(None)
    tree = follower.tree
    assert tree.module == "hybridcache.replay.fake"
    # the prompt property (records), the chain built from it and its keys (tiers), not the engine
    assert list(tree.children) == ["hybridcache.workloads.records", "hybridcache.tiers.fake"]
    assert tree.children["hybridcache.tiers.fake"].children == {}
    assert follower.finished  # request 2's handling ended the following
    # handle, prompt, make, Chain.__init__, keys, fetch twice (each receives a derived key)
    assert follower.followed_frames == 7


_SPANS = """
def spans_of(request):
    return ()  # the one empty tuple every empty tuple is


def encode(spans):
    return b""
"""

_REPLAY_SPANS = """
def handle(request):
    tiers["spans_of"](request)
    engine["encode"](())  # an empty tuple: nothing derived from the request
"""


def test_an_empty_tuple_a_followed_frame_returns_is_not_carried():
    import numpy as np

    from hybridcache.workloads.records import TraceRequest
    from tests.tools.call_moves import ParameterFollower

    tiers = _fake_module("hybridcache.tiers.spans", _SPANS)
    engine = _fake_module("hybridcache.engine.spans", _SPANS)
    replay = _fake_module("hybridcache.replay.spans", _REPLAY_SPANS, tiers=tiers, engine=engine)
    follower = ParameterFollower(0)
    sys.setprofile(follower)
    try:
        replay["handle"](TraceRequest(0, 0.0, 3, np.arange(4, dtype=np.int32)))
    finally:
        sys.setprofile(None)
    assert list(follower.tree.children) == ["hybridcache.tiers.spans"]
