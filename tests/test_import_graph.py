"""The package's import graph points downward: no cycle, type-only imports included."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "hybridcache").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridcache"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                targets.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name.startswith("hybridcache"))
    return {t for t in targets if t in modules}


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
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert len(graph) > 50  # the walk saw the whole package
    assert _cycles(graph) == []


def test_the_walk_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a -> b -> c -> a"]
