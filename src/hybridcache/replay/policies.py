"""The replay's policy names: the library's policies (``hybridcache.policies``), plus ``oracle``.

Owns no state. The replay and the engine's scheduler use the same admission and eviction
components; ``oracle`` (``replay.oracle``) exists only here, because it reads the whole trace
before the first request is served, which no engine can.
"""

from hybridcache.errors import InvalidArgumentError
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
)
from hybridcache.policies import resolve_policy as resolve_library_policy
from hybridcache.replay.oracle import OracleAdmission, OracleEviction

ORACLE = "oracle"


def resolve_policy(
    policy: str = "auto", admission: str | None = None, eviction: str | None = None, prefill_chunk: int = 2048
) -> Policy:
    """``hybridcache.policies.resolve_policy``, and ``oracle``: the offline reference (its
    admission and eviction; neither part can be overridden)."""
    if isinstance(policy, str) and policy.strip() == ORACLE:
        if admission is not None or eviction is not None:
            raise InvalidArgumentError("the oracle's admission and eviction cannot be overridden")
        return Policy(ORACLE, OracleAdmission(), OracleEviction())
    return resolve_library_policy(policy, admission, eviction, prefill_chunk)


__all__ = [
    "ADMISSIONS", "EVICTIONS", "ORACLE", "POLICIES", "AutoAdmission", "AutoEviction", "IntervalAdmission",
    "LRUEviction", "MarconiAdmission", "MarconiEviction", "Policy", "ReferenceAdmission", "resolve_policy",
]
