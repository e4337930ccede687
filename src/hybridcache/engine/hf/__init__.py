"""transformers causal LMs behind the engine's ``PagedModel`` interface (needs the ``engine``
extra: torch, transformers, safetensors). Owns nothing.

``HFModelConfig`` is a plain value and imports no transformers code, so an ``EngineConfig`` can
name a checkpoint cheaply; ``HFModel`` (and transformers with it) is imported on first use.
"""

from hybridcache.engine.hf.config import HFModelConfig

__all__ = ["HFModel", "HFModelConfig"]


def __getattr__(name: str) -> object:
    if name == "HFModel":
        from hybridcache.engine.hf.model import HFModel

        return HFModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
