"""hybridcache: exact prefix caching for hybrid attention/SSM language-model serving."""

from hybridcache.config import CacheConfig
from hybridcache.sequence import MultimodalSpan, Namespace, Sequence

__all__ = ["CacheConfig", "MultimodalSpan", "Namespace", "Sequence"]
__version__ = "0.1.0"
