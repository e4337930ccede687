"""transformers causal LMs behind the engine's ``PagedModel`` interface (needs the ``engine``
extra: torch, transformers, safetensors). Owns nothing at import time."""

from hybridcache.engine.hf.config import HFModelConfig
from hybridcache.engine.hf.model import HFModel

__all__ = ["HFModel", "HFModelConfig"]
