"""Request traces for hit-rate measurement: readers, token synthesis, the infinite-cache bound.

Owns no state: every function returns immutable records (see ``records``).
"""

from hybridcache.workloads.bound import Bound, infinite_cache_bound
from hybridcache.workloads.readers import FORMATS, read_trace
from hybridcache.workloads.records import Request, Trace, TraceEntry
from hybridcache.workloads.synthesis import DEFAULT_VOCAB, SynthesisStats, SynthesizedTrace, synthesize

__all__ = [
    "DEFAULT_VOCAB",
    "FORMATS",
    "Bound",
    "Request",
    "SynthesisStats",
    "SynthesizedTrace",
    "Trace",
    "TraceEntry",
    "infinite_cache_bound",
    "read_trace",
    "synthesize",
]
