"""Where the tests find the project's shared material: ``../shared`` beside the repository."""

from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SHARED_TRACE = SHARED / "traces" / "mooncake-synthetic.jsonl"
