"""``hybridcache bench serve``'s table in an 80-column terminal: headers are JSON keys, and
they break after their underscores (``server_rss_`` / ``before_`` / ``mb``), never mid-word."""

from __future__ import annotations

import re

from rich.console import Console

from hybridcache import cli_args

COLUMNS = ["caching", "requests", "errors", "ttft_p50_s", "ttft_p99_s", "generated_tokens_per_s", "token_hit_rate",
           "server_rss_before_mb", "server_rss_after_mb"]  # as cli._serve_bench prints them


def _rendered(width: int) -> list[str]:
    table = cli_args.compact_table("hybridcache bench serve (4 clients, 3 turns)", COLUMNS)
    table.add_row("True", "12", "0", "0.780", "1.320", "25.600", "0.969", "867.000", "867.000")
    table.add_row("False", "12", "0", "17.100", "22.900", "2.240", "0.000", "863.000", "1044.000")
    console = Console(width=width, record=True, color_system=None)
    console.print(table)
    return console.export_text().splitlines()


def test_headers_break_at_underscores_in_80_columns():
    lines = _rendered(80)
    assert all(len(line) <= 80 for line in lines)
    header = lines[1:lines.index(next(line for line in lines if line.startswith("─")))]
    pieces = {piece for line in header for piece in line.split()}
    whole = {part for column in COLUMNS for part in re.findall(r"[^_]+_?", column)}  # "server_", "rss_", "mb"
    assert pieces <= whole, pieces - whole
    assert "1044.000" in lines[-1]  # the values are whole too


def test_header_lines_keep_every_character_of_the_key():
    assert cli_args.header_lines("server_rss_before_mb") == "server_\nrss_\nbefore_\nmb"
    assert cli_args.header_lines("TTFT p50") == "TTFT\np50"
