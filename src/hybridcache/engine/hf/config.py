"""``HFModelConfig``: which local transformers checkpoint to serve, and in which dtype.

Owns nothing mutable (a frozen value).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hybridcache.errors import InvalidConfigError

HF_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class HFModelConfig:
    """A checkpoint directory as ``save_pretrained`` writes it (``config.json`` + weights).

    Nothing is downloaded: the directory is opened with ``local_files_only=True``.
    ``num_threads`` is torch's intra-op thread count inside ``forward`` (the caller's setting is
    restored afterwards). The default 1 suits tiny models: torch's multi-threaded float64
    depthwise conv1d takes ~200 ms per call on a tiny tensor, versus 0.15 ms on one thread.
    """

    path: str | os.PathLike
    dtype: str = "float32"
    num_threads: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.path, bool) or not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise InvalidConfigError("path must be a non-empty str or path")
        if self.dtype not in HF_DTYPES:
            raise InvalidConfigError(f"dtype must be one of {HF_DTYPES}, got {self.dtype!r}")
        if isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise InvalidConfigError(f"num_threads must be an int >= 1, got {self.num_threads!r}")

    @property
    def directory(self) -> Path:
        return Path(self.path)
