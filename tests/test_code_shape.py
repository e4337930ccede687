"""The size limits of the code around the cache core (issue 20): in ``tiers``, ``replay`` and
``engine`` (their subpackages included) no module over 350 lines, no function over 50 lines,
none taking more than 5 parameters (positional and keyword, ``*args``/``**kwargs`` each count
as one; ``self``/``cls`` do not). Read with ``ast``, so nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = ("tiers", "replay", "engine")
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 50
MAX_PARAMETERS = 5

SOURCE = Path(__file__).resolve().parents[1] / "src" / "hybridcache"


def _modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (SOURCE / package).rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(SOURCE.parent).as_posix()


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    arguments = function.args
    names = [argument.arg for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    names += [star.arg for star in (arguments.vararg, arguments.kwarg) if star is not None]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_the_packages_exist():
    assert all((SOURCE / package / "__init__.py").is_file() for package in PACKAGES)
    assert len(_modules()) > 3 * len(PACKAGES)


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_module_length(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_name(path)}: {lines} lines (at most {MAX_MODULE_LINES})"


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_function_length_and_parameters(path: Path):
    too_long, too_many = [], []
    for function in _functions(path):
        lines = function.end_lineno - function.lineno + 1  # decorators excluded, docstring included
        if lines > MAX_FUNCTION_LINES:
            too_long.append(f"{function.name} (line {function.lineno}): {lines} lines")
        parameters = _parameters(function)
        if len(parameters) > MAX_PARAMETERS:
            too_many.append(f"{function.name} (line {function.lineno}): {len(parameters)} parameters {parameters}")
    assert not too_long, f"{_name(path)}: functions over {MAX_FUNCTION_LINES} lines: {too_long}"
    assert not too_many, f"{_name(path)}: functions over {MAX_PARAMETERS} parameters: {too_many}"


def test_the_checker_counts_what_it_claims(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class C:\n"
        "    def method(self, a, b, /, c, *rest, d, **options):\n"
        "        return a\n"
        "def free(a, b, c, d, e):\n"
        "    pass\n"
    )
    counted = {function.name: _parameters(function) for function in _functions(sample)}
    assert counted == {"method": ["a", "b", "c", "d", "rest", "options"], "free": ["a", "b", "c", "d", "e"]}
