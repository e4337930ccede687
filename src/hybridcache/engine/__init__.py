"""The reference engine: a model behind the ``PagedModel`` interface (the tiny hybrid model, or
a local transformers checkpoint named by ``hybridcache.engine.hf.HFModelConfig``) served with
the prefix cache (needs the ``engine`` extra: PyTorch, transformers, safetensors)."""

from hybridcache.engine.engine import Engine
from hybridcache.engine.engine_config import EngineConfig
from hybridcache.engine.model import TinyHybridConfig
from hybridcache.engine.requests import MultimodalInput, Request, Result

__all__ = [
    "Engine",
    "EngineConfig",
    "MultimodalInput",
    "Request",
    "Result",
    "TinyHybridConfig",
]
