"""The reference engine: a tiny hybrid model served with the prefix cache (needs the ``engine``
extra, PyTorch)."""

from hybridcache.engine.engine import FAULT_STAGES, Engine, EngineConfig, InjectedFault
from hybridcache.engine.model import TinyHybridConfig
from hybridcache.engine.requests import MultimodalInput, Request, Result

__all__ = [
    "FAULT_STAGES",
    "Engine",
    "EngineConfig",
    "InjectedFault",
    "MultimodalInput",
    "Request",
    "Result",
    "TinyHybridConfig",
]
