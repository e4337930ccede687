"""How far one call travels through the package's modules: stays, rooms, moves, climbs, returns.

Run from the repository root, with the source tree to measure first on ``PYTHONPATH``::

    PYTHONPATH=src python -m tests.tools.call_moves replay [--trace PATH] [--limit N]
    PYTHONPATH=src python -m tests.tools.call_moves engine

The method (mechanical, so two versions of the code are measured alike):

1. ``sys.setprofile`` records every Python call on the main thread while the root runs
   (``replay``: ``hybridcache.replay.cli.run`` on a small tiered, two-replica replay;
   ``engine``: every ``Engine._execute`` of a tiny engine with a host tier serving prompts
   that share prefixes). A frame's room is the module that defines its function; frames
   outside ``hybridcache`` (the standard library, NumPy, rich) are transparent.
2. Calls within one room are one stay. Only ``replay``, ``tiers`` and ``engine`` are followed
   (the code issue 20 is about); every other module of the package (the cache core, the
   policies, the workloads, the profiles, the small helpers) is opaque: the room entered first
   is the stay, calls on from it into other opaque modules stay there, and only calls back into
   the followed packages (callbacks) are followed.
3. Repeated calls collapse: a room's calls into one other room merge into one child (their
   own calls merged the same way), in the order first met. The result is the tree of distinct
   module paths the root ever took, independent of how many requests or chunks repeat them.
4. Walking that tree depth first gives the rooms in the order control passes through them
   (into each child, back to its caller after it). Counted on that walk:

   * **stays**: maximal runs in one room; **rooms**: distinct modules;
   * **moves**: changes of room (stays - 1);
   * **climbs**: moves back up a layer, into a module that imports, directly or not, the one
     left (a return to the caller above, or a callback, a device, a hook calling up);
   * **upcalls**: the climbs made by a call rather than a return (a callback, a device, a hook);
   * **returns**: stays in a room already left earlier on the walk;
   * **entries** of a room: its stays; **entered by a call**: those reached by a call rather
     than a return (a hub is called into from many places).

Only the main thread is followed (store calls a ``DeadlineRunner`` runs on its threads are
not). The counts describe the code's shape, not its speed.

``--follow-request N`` (replay only) follows one request's parameters instead of every call,
the way the counts of issue 20 were taken by reading:

* the **seed** is trace request ``N`` (the record whose ``index`` is ``N``), from the first
  frame of a ``hybridcache.replay`` module other than ``replay.cli`` that receives it, until
  the first such frame that receives request ``N + 1`` (the next request's handling begins:
  what later requests do to objects built for ``N``, say evicting its checkpoints, is theirs);
* a frame is **followed** when one of its arguments (``self`` included; ``*args`` items and
  ``**kwargs`` values too) *is*, by identity, a carried object, or when it is the
  ``__init__``/``__post_init__`` a followed frame calls directly (what it builds);
* the **carried** objects are the seed and what followed frames derive: each object a
  followed frame returns, unless it existed when the seed was first met (so a getter handing
  back a long-lived store or cache does not make the whole store followed); each object a
  followed frame builds (the ``self`` of that ``__init__``); and the items of a carried
  ``tuple``/``list``/``set``/``dict``, two levels deep (a key chain's keys). Numbers, strings,
  ``None``, types, functions and the empty tuple are never carried (their identity means
  nothing: every empty tuple is one object, so a function returning one would otherwise make
  every later frame handed any empty tuple followed);
* frames that are not followed are transparent, as the standard library is in the default
  mode; a followed frame's room hangs below its nearest followed caller (below the seed's
  first room when it has none, e.g. a later pass over the same request).

The tree is collapsed and counted exactly as above.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType

FOLLOWED = ("hybridcache.replay", "hybridcache.tiers", "hybridcache.engine")  # the code issue 20 is about
TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake-synthetic.jsonl"


@dataclass
class Room:
    """One node of the collapsed tree: a module and the distinct rooms it called, in order."""

    module: str
    children: dict[str, Room] = field(default_factory=dict)

    @property
    def opaque(self) -> bool:
        return is_opaque(self.module)

    def child(self, module: str) -> Room:
        return self.children.setdefault(module, Room(module))


def is_opaque(module: str) -> bool:
    """Outside the followed packages: the cache core, the policies, the workloads, the helpers."""
    return not any(module == package or module.startswith(package + ".") for package in FOLLOWED)


class CallRecorder:
    """Builds the collapsed tree of the calls made below ``root_code`` (every time it runs)."""

    def __init__(self, root_code) -> None:
        self.root_code = root_code
        self.tree: Room | None = None
        self._stack: list[tuple[object, Room]] = []

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self._call(frame)
        elif event == "return" and self._stack and self._stack[-1][0] is frame:
            self._stack.pop()

    def _call(self, frame) -> None:
        if not self._stack:
            if frame.f_code is not self.root_code:
                return
            module = frame.f_globals.get("__name__", "")
            self.tree = self.tree or Room(module)
            self._stack.append((frame, self.tree))
            return
        here = self._stack[-1][1]
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("hybridcache") or module == here.module or (here.opaque and is_opaque(module)):
            self._stack.append((frame, here))
        else:
            self._stack.append((frame, here.child(module)))


_NEVER_CARRIED = (type(None), bool, int, float, complex, str, bytes, type, ModuleType, FunctionType,
                  BuiltinFunctionType, MethodType)
_CONTAINERS = (tuple, list, set, frozenset, dict)
_CONSTRUCTORS = ("__init__", "__post_init__")


def arguments(frame) -> list:
    """The values a frame received: its positional and keyword parameters, ``*args`` items and
    ``**kwargs`` values."""
    code = frame.f_code
    named = code.co_argcount + code.co_kwonlyargcount
    local = frame.f_locals
    values = [local[name] for name in code.co_varnames[:named] if name in local]
    if code.co_flags & 0x04:  # CO_VARARGS
        values += list(local.get(code.co_varnames[named], ()))
        named += 1
    if code.co_flags & 0x08:  # CO_VARKEYWORDS
        values += list(local.get(code.co_varnames[named], {}).values())
    return values


def _scalar(value) -> bool:
    """Whether ``value``'s identity means nothing: a number, a string, a type, a function, a
    NumPy scalar, or the empty tuple or frozenset (one shared object each, which the garbage
    collector does not track, so ``gc.get_objects`` never lists it as existing at the seed)."""
    if isinstance(value, _NEVER_CARRIED):
        return True
    if type(value) in (tuple, frozenset):
        return not value
    return type(value).__module__ == "numpy" and not hasattr(value, "__len__")


class ParameterFollower:
    """Builds the collapsed tree of the frames that receive trace request ``index`` or an
    object derived from it (the rules are in the module docstring)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.tree: Room | None = None
        self.carried: dict[int, object] = {}  # id -> object, held so that no id is reused
        self.followed_frames = 0
        self.finished = False
        self._existing: set[int] = set()
        self._alive_at_seed: list = []
        self._stack: list[tuple[object, Room | None, bool]] = []  # frame, room for callees, followed

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self._call(frame)
        elif event == "return" and self._stack and self._stack[-1][0] is frame:
            _, _, followed = self._stack.pop()
            if followed and id(arg) not in self._existing:
                self._carry(arg)

    def _carry(self, value, depth: int = 0) -> None:
        if _scalar(value):
            return
        if isinstance(value, _CONTAINERS) and depth < 2:
            for item in (value.values() if isinstance(value, dict) else value):
                self._carry(item, depth + 1)
        self.carried.setdefault(id(value), value)

    def _request(self, frame, values, index: int) -> object | None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("hybridcache.replay.") or module == "hybridcache.replay.cli":
            return None
        for value in values:
            if type(value).__module__ == "hybridcache.workloads.records" and hasattr(value, "prompt_length") \
                    and getattr(value, "index", None) == index:
                return value
        return None

    def _call(self, frame) -> None:
        module = frame.f_globals.get("__name__", "")
        parent = self._stack[-1] if self._stack else (None, None, False)
        if not module.startswith("hybridcache"):
            self._stack.append((frame, parent[1], False))
            return
        values = arguments(frame)
        if self.finished or self.tree is not None and self._request(frame, values, self.index + 1) is not None:
            self.finished = True
            self._stack.append((frame, None, False))
            return
        if self.tree is None:
            seed = self._request(frame, values, self.index)
            if seed is not None:
                self._alive_at_seed = gc.get_objects()  # held, so that no later object takes one's id
                self._existing = {id(o) for o in self._alive_at_seed}
                self._carry(seed)
                self.tree = Room(module)
                self.followed_frames += 1
            self._stack.append((frame, self.tree, seed is not None))
            return
        builds = frame.f_code.co_name in _CONSTRUCTORS and parent[2] and frame.f_back is parent[0]
        if not builds and not any(id(value) in self.carried for value in values):
            self._stack.append((frame, parent[1], False))
            return
        if builds and values:
            self._carry(values[0])
        self.followed_frames += 1
        here = parent[1] or self.tree
        if module == here.module or (here.opaque and is_opaque(module)):
            self._stack.append((frame, here, True))
        else:
            self._stack.append((frame, here.child(module), True))


def walk(tree: Room) -> list[tuple[str, str]]:
    """(how control got there, room) along the depth-first walk: "start", "call" or "return"."""
    steps = [("start", tree.module)]
    for child in tree.children.values():
        steps += [("call", child.module)] + walk(child)[1:] + [("return", tree.module)]
    return steps


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports (anywhere in the file)."""
    root = package_dir.parent
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package_dir.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridcache"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("hybridcache"))
        graph[name] = {t for t in targets if t in modules} - {name}
    return graph


def depends_on(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module's transitive imports."""
    closure: dict[str, set[str]] = {}

    def reach(name: str) -> set[str]:
        if name not in closure:
            closure[name] = set()
            for target in graph.get(name, ()):
                closure[name] |= {target} | reach(target)
        return closure[name]

    for name in graph:
        reach(name)
    return closure


def climbs_back(left: str, entered: str, below: dict[str, set[str]]) -> bool:
    """Whether ``entered`` sits above ``left``: it imports it (for an opaque room, the part of
    the package outside the followed ones), directly or not."""
    imported = below.get(entered, set())
    return left in imported or (is_opaque(left) and not is_opaque(entered) and any(map(is_opaque, imported)))


def count(steps: list[tuple[str, str]], below: dict[str, set[str]]) -> dict:
    """The counts of the module docstring over a walk (consecutive steps in one room merge)."""
    stays: list[tuple[str, str]] = []
    for how, room in steps:
        if not stays or stays[-1][1] != room:
            stays.append((how, room))
    seen: set[str] = set()
    climbs = upcalls = returns = 0
    previous = None
    for how, room in stays:
        returns += room in seen
        if previous is not None and climbs_back(previous, room, below):
            climbs += 1
            upcalls += how == "call"
        if previous is not None:
            seen.add(previous)
        previous = room
    entries = Counter(room for _, room in stays)
    called = Counter(room for how, room in stays if how == "call")
    return {
        "stays": len(stays),
        "rooms": len(entries),
        "moves": len(stays) - 1,
        "climbs": climbs,
        "upcalls": upcalls,
        "returns": returns,
        "entries": dict(entries.most_common()),
        "entered_by_a_call": dict(called.most_common()),
    }


def measure(run, recorders: list) -> list[tuple[dict, Room]]:
    """The counts of one run of ``run`` as each recorder (a ``CallRecorder`` or a
    ``ParameterFollower``; several watch the same run) builds its tree, and the tree."""

    def every(frame, event, arg) -> None:
        for recorder in recorders:
            recorder(frame, event, arg)

    sys.setprofile(every)
    try:
        run()
    finally:
        sys.setprofile(None)
    import hybridcache

    below = depends_on(import_graph(Path(hybridcache.__file__).parent))
    return [(count(walk(recorder.tree), below), recorder.tree) for recorder in recorders]


def tree_lines(room: Room, depth: int = 0) -> list[str]:
    lines = ["  " * depth + room.module.removeprefix("hybridcache.")]
    for child in room.children.values():
        lines += tree_lines(child, depth + 1)
    return lines


def replay_scenario(trace: Path, limit: int, scratch: Path):
    """A tiered two-replica replay: host and disk tiers per replica, restorable routing."""
    from rich.console import Console

    cli = importlib.import_module("hybridcache.replay.cli")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([
        str(trace), "--limit", str(limit), "--model", "marconi-7b", "--policy", "auto", "--cache-bytes", "2GB",
        "--replicas", "2", "--routing", "restorable", "--host-bytes", "4GB", "--disk-bytes", "8GB",
        "--json", str(scratch / "replay.json"),
    ])
    quiet = Console(file=open(scratch / "replay.txt", "w"), width=200)

    def run() -> None:
        code = cli.run(args, quiet, quiet)
        if code != 0:
            raise SystemExit(f"the replay failed ({code}); see {scratch / 'replay.txt'}")

    return run, cli.run.__code__


def engine_scenario():
    """A tiny engine with a host tier: four prompts on two shared prefixes, then the same
    prompts again after the device cache is cleared (publishes, then restores)."""
    import numpy as np

    from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig
    from hybridcache.engine.engine import Engine as EngineClass
    from hybridcache.tiers.backends import HostMemoryStore
    from hybridcache.tiers.tiered import TieredStore

    model = TinyHybridConfig(vocab_size=64, hidden_size=16, attention_head_dim=8, ssm_head_dim=8, expert_hidden_size=16)
    config = EngineConfig(block_size=8, num_kv_blocks=96, num_state_slots=10, checkpoint_budget=6, max_batch_tokens=64,
                          prefill_chunk=24, tier_chunk_size=32, model=model)
    rng = np.random.default_rng(7)
    bases = [rng.integers(1, 64, 70).tolist() for _ in range(2)]
    prompts = [base + rng.integers(1, 64, 12).tolist() for base in bases for _ in range(2)]

    def run() -> None:
        engine = Engine(config, tiers=TieredStore(host=HostMemoryStore(1 << 26)))
        engine.generate([Request(p, max_new_tokens=3) for p in prompts])
        engine.clear_cache()
        engine.generate([Request(p, max_new_tokens=3) for p in prompts])
        engine.close()

    return run, EngineClass._execute.__code__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=["replay", "engine"])
    parser.add_argument("--trace", type=Path, default=TRACE, help="the replay's trace (default: the shared one)")
    parser.add_argument("--limit", type=int, default=60, help="the replay's requests (default: 60)")
    parser.add_argument("--follow-request", type=int, nargs="+", metavar="N",
                        help="replay: follow these trace requests' parameters (each alone) instead of every call")
    parser.add_argument("--tree", action="store_true", help="also print the collapsed tree")
    options = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        if options.scenario == "replay":
            run, root = replay_scenario(options.trace, options.limit, Path(scratch))
        else:
            run, root = engine_scenario()
        if options.follow_request is None:
            recorders = [CallRecorder(root)]
        else:
            recorders = [ParameterFollower(index) for index in options.follow_request]
        results = measure(run, recorders)
    for recorder, (counts, tree) in zip(recorders, results):
        if isinstance(recorder, ParameterFollower):
            counts = {"request": recorder.index, "followed_frames": recorder.followed_frames, **counts}
        if options.tree:
            print("\n".join(tree_lines(tree)))
        print(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
