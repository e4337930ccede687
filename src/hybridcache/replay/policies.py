"""The replay's policy names: the library's policies (``hybridcache.policies``), re-exported.

Owns no state. The replay and the engine's scheduler use the same admission and eviction
components; this module only keeps the replay's historical import path.
"""

from hybridcache.policies import (
    ADMISSIONS,
    EVICTIONS,
    POLICIES,
    AutoAdmission,
    AutoEviction,
    IntervalAdmission,
    LRUEviction,
    MarconiAdmission,
    MarconiEviction,
    Policy,
    ReferenceAdmission,
    resolve_policy,
)

__all__ = [
    "ADMISSIONS", "EVICTIONS", "POLICIES", "AutoAdmission", "AutoEviction", "IntervalAdmission", "LRUEviction",
    "MarconiAdmission", "MarconiEviction", "Policy", "ReferenceAdmission", "resolve_policy",
]
