"""Request traces for hit-rate measurement: readers, token synthesis, the infinite-cache bound,
multi-turn trace shapes (``generator``) and held-out halves (``split``).

Owns no state: every function returns immutable records (see ``records``).
"""

from hybridcache.workloads.bound import Bound, infinite_cache_bound
from hybridcache.workloads.generator import SHAPES, generate, write_trace
from hybridcache.workloads.readers import FORMATS, read_trace
from hybridcache.workloads.records import Trace, TraceEntry, TraceRequest
from hybridcache.workloads.split import HALVES, half
from hybridcache.workloads.synthesis import DEFAULT_VOCAB, SynthesisStats, SynthesizedTrace, synthesize

__all__ = [
    "DEFAULT_VOCAB",
    "FORMATS",
    "HALVES",
    "SHAPES",
    "Bound",
    "SynthesisStats",
    "SynthesizedTrace",
    "Trace",
    "TraceEntry",
    "TraceRequest",
    "generate",
    "half",
    "infinite_cache_bound",
    "read_trace",
    "synthesize",
    "write_trace",
]
