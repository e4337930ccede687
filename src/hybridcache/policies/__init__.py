"""Checkpoint admission and eviction policies, shared by the engine's scheduler and the replay.

Owns no state itself: ``admission`` policies are frozen descriptions (where to checkpoint a
turn; their union is ``AdmissionPolicy``), ``eviction`` policies make a per-cache state whose
score functions order the library's eviction heaps (the trie reads it when it is built and binds
it to an ``EvictionView``), ``registry`` maps names to them, ``tuning`` autotunes Marconi's weight.
"""

from hybridcache.policies.admission import (
    BRANCH,
    PROMPT_END,
    SPECULATIVE,
    TURN_END,
    AutoAdmission,
    IntervalAdmission,
    MarconiAdmission,
    ReferenceAdmission,
    TurnView,
    branch_step,
    checked_state_weight,
    first_end,
    kind_of_step,
)
from hybridcache.policies.eviction import (
    AutoEviction,
    LRUEviction,
    MarconiEviction,
)
from hybridcache.policies.registry import (
    ADMISSIONS,
    DEFAULT_POLICY,
    EVICTIONS,
    POLICIES,
    Policy,
    resolve_policy,
)

__all__ = [
    "ADMISSIONS", "BRANCH", "DEFAULT_POLICY", "EVICTIONS", "POLICIES", "PROMPT_END", "SPECULATIVE", "TURN_END",
    "AutoAdmission", "AutoEviction", "IntervalAdmission", "LRUEviction", "MarconiAdmission", "MarconiEviction",
    "Policy", "ReferenceAdmission", "TurnView", "branch_step", "checked_state_weight", "first_end", "kind_of_step",
    "resolve_policy",
]
