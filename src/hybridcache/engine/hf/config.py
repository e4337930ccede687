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
    """

    path: str | os.PathLike
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.path, bool) or not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise InvalidConfigError("path must be a non-empty str or path")
        if self.dtype not in HF_DTYPES:
            raise InvalidConfigError(f"dtype must be one of {HF_DTYPES}, got {self.dtype!r}")

    @property
    def directory(self) -> Path:
        return Path(self.path)
