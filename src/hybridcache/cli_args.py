"""Option converters and the table style shared by the commands (``hybridcache.cli``,
``hybridcache.replay.cli``).

Owns no state. Each converter is an argparse ``type``: it turns one option's text into a
checked value or raises ``argparse.ArgumentTypeError``, so a bad option is refused by the
parser (usage and message on stderr, exit status 2) before any input is read or any work
starts. Numbers are ASCII: ``int`` and ``float`` would also read other scripts' digits
(``١٢``), which no option means. Output paths are checked the same way: their folder must
exist and take a new file.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from rich import box
from rich.table import Table

from hybridcache.errors import InvalidArgumentError
from hybridcache.profiles import parse_size

MAX_INT_OPTION = 2**62  # every count and length downstream is int64


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _ascii(text: str) -> str:
    """``text`` when it is ASCII; a ValueError (as ``int`` raises for what it cannot read) otherwise."""
    if not text.isascii():
        raise ValueError(text)
    return text


def int_in(minimum: int, maximum: int = MAX_INT_OPTION, even: bool = False) -> Callable[[str], int]:
    """An int in ``[minimum, maximum]`` (an even one when ``even``)."""
    wanted = f"an {'even ' if even else ''}integer in [{minimum:,}, {maximum:,}]"

    def convert(text: str) -> int:
        try:
            value = int(_ascii(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not minimum <= value <= maximum or (even and value % 2):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return convert


def int_list(minimum: int, maximum: int = MAX_INT_OPTION, even: bool = False) -> Callable[[str], list[int]]:
    """A comma-separated, non-empty list of ints as ``int_in`` checks them."""
    one = int_in(minimum, maximum, even)

    def convert(text: str) -> list[int]:
        values = [one(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("expected a comma-separated list of integers, got none")
        return values

    return convert


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(_ascii(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def size(text: str) -> int:
    """Bytes from ``400GB``, ``512MiB`` or ``4096`` (``hybridcache.profiles.parse_size``)."""
    try:
        return parse_size(text)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def size_list(text: str) -> list[int]:
    """A comma-separated, non-empty list of sizes."""
    values = [size(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list of sizes, got none")
    return values


def name_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A comma-separated, non-empty list of names from ``choices``."""

    def convert(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0] if unknown else 'empty list'!r}; choose from {', '.join(choices)}")
        return names

    return convert


def output_path(text: str) -> str:
    """A file the command may create or replace: its folder exists and is writable, and the
    path is not a folder. Checked before the run, so an hour's work is not lost to a typo."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    try:  # a file made and removed: os.access says yes to root, and to /proc, where none can be made
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hybridcache-write-check-"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {error.strerror or error}") from None
    return text


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp", ".eps", ".ps", ".tif", ".tiff")


def plot_path(text: str) -> str:
    """An ``output_path`` whose suffix names an image format matplotlib writes."""
    if Path(text).suffix.lower() not in PLOT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text}: a plot path must end in one of {', '.join(PLOT_SUFFIXES)}")
    return output_path(text)


def compact_table(title: str, columns: list[str], left: tuple[str, ...] = ()) -> Table:
    """A table without vertical rules or edges, fitted to the console's width: a cell too wide
    folds onto more lines of its row, never truncated. Headers break at their spaces and after
    their underscores (``server_rss_before_mb``, a JSON key, stays readable instead of folding
    mid-word), so a column is as wide as its values. ``left`` columns are left-justified, the
    others (numbers) right-justified."""
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    for column in columns:
        table.add_column(header_lines(column), justify="left" if column in left else "right", overflow="fold")
    return table


def header_lines(column: str) -> str:
    """``column`` with a line break at each space and after each underscore."""
    return column.replace(" ", "\n").replace("_", "_\n")


def filled_table(title: str, columns: list[str], rows: list[list[str]], left: tuple[str, ...] = ()) -> Table:
    """A ``compact_table`` of ``rows``, without the columns no row fills."""
    kept = [index for index in range(len(columns)) if any(row[index] for row in rows)]
    table = compact_table(title, [columns[index] for index in kept], left)
    for row in rows:
        table.add_row(*(row[index] for index in kept))
    return table
