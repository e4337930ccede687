"""The exception hierarchy: every class is a HybridCacheError and belongs to one builtin family."""

from __future__ import annotations

import inspect

import pytest

from hybridcache import errors
from hybridcache.errors import (
    AdoptionWriteError,
    AlreadyPublishedError,
    BenchmarkSetupError,
    BodyTooLargeError,
    CorruptObjectError,
    DoubleFreeError,
    EventStreamError,
    ForeignSequenceError,
    HybridCacheError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidConfigError,
    InvalidKeyError,
    InvalidNamespaceError,
    InvalidSpanError,
    InvalidStepError,
    InvalidTokenError,
    InvalidTypeError,
    LifecycleError,
    MalformedRequestError,
    ModelLoadError,
    ModelWeightsError,
    OutOfBlocksError,
    OutOfStateSlotsError,
    PayloadChecksumError,
    PinnedError,
    PinUnderflowError,
    RefcountUnderflowError,
    RequestFailedError,
    RequestTooLargeError,
    ResourceExhaustedError,
    SharedWriteError,
    StaleHandleError,
    StoreError,
    StoreLockedError,
    NotAStoreRootError,
    StoreClosedError,
    StoreTimeoutError,
    ServerOverloadedError,
    ServerStartError,
    StoreUnavailableError,
    TopologyError,
    TraceFormatError,
    UnsupportedFormatError,
    UnknownModelError,
    UnsupportedModelError,
    WrongRoleError,
)

# Every concrete class with its direct hybridcache parent and the builtin family it joins.
HIERARCHY = {
    InvalidArgumentError: (HybridCacheError, ValueError),
    InvalidTypeError: (HybridCacheError, TypeError),
    InvalidConfigError: (InvalidArgumentError, ValueError),
    InvalidTokenError: (InvalidArgumentError, ValueError),
    InvalidSpanError: (InvalidArgumentError, ValueError),
    InvalidNamespaceError: (InvalidArgumentError, ValueError),
    InvalidStepError: (InvalidArgumentError, ValueError),
    InvalidBlockIdError: (HybridCacheError, IndexError),
    LifecycleError: (HybridCacheError, RuntimeError),
    DoubleFreeError: (LifecycleError, RuntimeError),
    RefcountUnderflowError: (LifecycleError, RuntimeError),
    WrongRoleError: (LifecycleError, RuntimeError),
    TopologyError: (LifecycleError, RuntimeError),
    StaleHandleError: (LifecycleError, RuntimeError),
    ForeignSequenceError: (LifecycleError, RuntimeError),
    AlreadyPublishedError: (LifecycleError, RuntimeError),
    PinnedError: (LifecycleError, RuntimeError),
    PinUnderflowError: (LifecycleError, RuntimeError),
    SharedWriteError: (LifecycleError, RuntimeError),
    AdoptionWriteError: (LifecycleError, RuntimeError),
    ResourceExhaustedError: (HybridCacheError, MemoryError),
    OutOfBlocksError: (ResourceExhaustedError, MemoryError),
    OutOfStateSlotsError: (ResourceExhaustedError, MemoryError),
    RequestTooLargeError: (ResourceExhaustedError, MemoryError),
    RequestFailedError: (HybridCacheError, RuntimeError),
    ServerOverloadedError: (ResourceExhaustedError, MemoryError),
    MalformedRequestError: (InvalidArgumentError, ValueError),
    BodyTooLargeError: (InvalidArgumentError, ValueError),
    UnknownModelError: (InvalidArgumentError, ValueError),
    ModelLoadError: (InvalidConfigError, ValueError),
    ModelWeightsError: (ModelLoadError, ValueError),
    UnsupportedModelError: (InvalidConfigError, ValueError),
    TraceFormatError: (InvalidArgumentError, ValueError),
    CorruptObjectError: (InvalidArgumentError, ValueError),
    UnsupportedFormatError: (CorruptObjectError, ValueError),
    PayloadChecksumError: (CorruptObjectError, ValueError),
    InvalidKeyError: (InvalidArgumentError, ValueError),
    StoreLockedError: (LifecycleError, RuntimeError),
    StoreError: (HybridCacheError, OSError),
    StoreUnavailableError: (StoreError, OSError),
    StoreTimeoutError: (StoreError, OSError),
    ServerStartError: (StoreError, OSError),
    BenchmarkSetupError: (HybridCacheError, RuntimeError),
    EventStreamError: (HybridCacheError, OSError),
    NotAStoreRootError: (InvalidConfigError, ValueError),
    StoreClosedError: (StoreUnavailableError, OSError),
}
FAMILIES = (ValueError, TypeError, IndexError, RuntimeError, MemoryError, OSError)


def _module_error_classes() -> set[type]:
    return {
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, HybridCacheError) and obj is not HybridCacheError
    }


def test_table_covers_every_error_class_in_the_module():
    assert _module_error_classes() == set(HIERARCHY)


def test_base_class_is_a_plain_exception():
    assert issubclass(HybridCacheError, Exception)
    assert not any(issubclass(HybridCacheError, family) for family in FAMILIES)


@pytest.mark.parametrize("cls", list(HIERARCHY), ids=lambda c: c.__name__)
def test_every_error_is_a_hybridcache_error_with_its_parent(cls):
    parent, _ = HIERARCHY[cls]
    assert issubclass(cls, HybridCacheError)
    assert issubclass(cls, parent)


@pytest.mark.parametrize("cls", list(HIERARCHY), ids=lambda c: c.__name__)
def test_every_error_belongs_to_exactly_one_builtin_family(cls):
    _, family = HIERARCHY[cls]
    assert [f for f in FAMILIES if issubclass(cls, f)] == [family]


@pytest.mark.parametrize("cls", list(HIERARCHY), ids=lambda c: c.__name__)
def test_every_error_can_be_caught_by_its_builtin_family_and_keeps_its_message(cls):
    _, family = HIERARCHY[cls]
    with pytest.raises(family) as info:
        raise cls("boom 42")
    assert isinstance(info.value, HybridCacheError)
    assert str(info.value) == "boom 42"


def test_lifecycle_errors_are_not_input_errors():
    for cls in (DoubleFreeError, RefcountUnderflowError, WrongRoleError, TopologyError, StaleHandleError):
        assert not issubclass(cls, InvalidArgumentError)
        assert not issubclass(cls, ValueError)


def test_exhaustion_errors_are_not_lifecycle_errors():
    for cls in (OutOfBlocksError, OutOfStateSlotsError):
        assert not issubclass(cls, LifecycleError)
        assert not issubclass(cls, InvalidArgumentError)


def test_sibling_errors_are_distinct():
    with pytest.raises(DoubleFreeError):
        try:
            raise DoubleFreeError("x")
        except RefcountUnderflowError:  # must not swallow a sibling
            pytest.fail("DoubleFreeError caught as RefcountUnderflowError")
    assert not issubclass(DoubleFreeError, RefcountUnderflowError)
    assert not issubclass(OutOfBlocksError, OutOfStateSlotsError)
