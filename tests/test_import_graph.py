"""The package's import graph points downward: no cycle, type-only imports included."""

from __future__ import annotations

from pathlib import Path

from tests.tools.call_moves import import_graph

SRC = Path(__file__).resolve().parents[1] / "src"


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle a depth-first walk meets, as ``a -> b -> a``."""
    found: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                found.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_no_module_imports_itself_through_others():
    graph = import_graph(SRC / "hybridcache")
    assert len(graph) > 50  # the walk saw the whole package
    assert _cycles(graph) == []


def test_the_walk_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a -> b -> c -> a"]
