"""The one place the engine turns a model config into a ``PagedModel``.

Owns nothing: ``build_model`` returns a fresh model and ``model_dtype`` is a pure rule. The tiny
model is drawn from a seed; a transformers checkpoint is loaded from its directory, importing
transformers only then, so serving the tiny model never pays for it.
"""

from __future__ import annotations

from typing import Union

from hybridcache.engine.hf.config import HFModelConfig
from hybridcache.engine.model import TinyHybridConfig, TinyHybridModel
from hybridcache.engine.model_api import PagedModel
from hybridcache.errors import InvalidConfigError

ModelConfig = Union[TinyHybridConfig, HFModelConfig]
ENGINE_DTYPES = ("float64", "float32")
TINY_DEFAULT_DTYPE = "float64"  # the tiny model's bitwise proofs are written in float64


def model_dtype(model: object, requested: object) -> str:
    """The dtype ``model`` runs in when the engine asks for ``requested`` (None: the model's own).

    A checkpoint's dtype is ``HFModelConfig.dtype``; an engine dtype that says otherwise is
    refused rather than silently overridden, so a config never claims a precision it lacks.
    """
    if requested is not None and requested not in ENGINE_DTYPES:
        raise InvalidConfigError(f"dtype must be None or one of {ENGINE_DTYPES}, got {requested!r}")
    if isinstance(model, HFModelConfig):
        if requested is not None and requested != model.dtype:
            raise InvalidConfigError(
                f"dtype {requested!r} conflicts with the checkpoint's HFModelConfig.dtype {model.dtype!r}; "
                "set the dtype on the HFModelConfig and leave EngineConfig.dtype None"
            )
        return model.dtype
    if isinstance(model, TinyHybridConfig):
        return TINY_DEFAULT_DTYPE if requested is None else requested
    raise InvalidConfigError(f"model must be a TinyHybridConfig or an HFModelConfig, got {type(model).__name__}")


def build_model(model: ModelConfig, *, seed: int, dtype: str | None) -> PagedModel:
    """The model ``model`` describes; ``seed`` draws the tiny model's weights (a checkpoint
    brings its own)."""
    resolved = model_dtype(model, dtype)
    if isinstance(model, HFModelConfig):
        from hybridcache.engine.hf.model import HFModel

        return HFModel(model)
    return TinyHybridModel(model, seed=seed, dtype=resolved)
