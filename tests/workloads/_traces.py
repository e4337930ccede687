"""Small hand-made traces written to temporary files."""

from __future__ import annotations

import json
from pathlib import Path


def write_lines(path: Path, rows: list) -> Path:
    """One line per row: a dict is written as JSON, a str verbatim."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows), encoding="utf-8")
    return path


def mooncake(timestamp: int, input_length: int, output_length: int, hash_ids: list[int]) -> dict:
    return {"timestamp": timestamp, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids}
