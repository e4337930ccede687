"""The exception hierarchy raised at every public boundary.

Every public entry point validates before it mutates: when one of these is raised, no
structure has changed. Input errors are also ``ValueError`` (or ``TypeError`` /
``IndexError``), lifecycle misuse is also ``RuntimeError`` and exhaustion is also
``MemoryError``, so callers can catch either the specific class or the builtin family.
"""

from __future__ import annotations


class HybridCacheError(Exception):
    """Base class of every error raised by hybridcache."""


# --- bad input -------------------------------------------------------------------------------


class InvalidArgumentError(HybridCacheError, ValueError):
    """An argument has a valid type but an invalid value."""


class InvalidTypeError(HybridCacheError, TypeError):
    """An argument has the wrong type (for example float token ids)."""


class InvalidConfigError(InvalidArgumentError):
    """A configuration dataclass was built with an invalid value."""


class InvalidTokenError(InvalidArgumentError):
    """A token id lies outside ``[0, 2**31)``."""


class InvalidSpanError(InvalidArgumentError):
    """A multimodal span is empty, outside the sequence, or overlaps another span."""


class InvalidNamespaceError(InvalidArgumentError):
    """An adapter name or cache salt has an unsupported form."""


class InvalidBlockIdError(HybridCacheError, IndexError):
    """A block id or state slot lies outside its pool."""


class InvalidStepError(InvalidArgumentError):
    """A token position is negative or beyond the sequence."""


# --- lifecycle misuse ------------------------------------------------------------------------


class LifecycleError(HybridCacheError, RuntimeError):
    """An operation is not allowed in the current lifecycle state."""


class DoubleFreeError(LifecycleError):
    """A block or slot that is already free was freed again."""


class RefcountUnderflowError(LifecycleError):
    """A reference was dropped that nobody held."""


class WrongRoleError(LifecycleError):
    """A state slot was freed in a role it was not allocated for."""


class TopologyError(LifecycleError):
    """A trie node was re-attached, replaced, or detached while it still has children."""


class AlreadyPublishedError(LifecycleError):
    """A checkpoint was published twice."""


class PinnedError(LifecycleError):
    """A pinned checkpoint was released, evicted or replaced."""


class PinUnderflowError(LifecycleError):
    """A checkpoint was unpinned more often than it was pinned."""


class SharedWriteError(LifecycleError):
    """A forward tried to write KV into a block it does not own exclusively."""


class ForeignSequenceError(LifecycleError):
    """A sequence that holds blocks of one trie was handed to another."""


class StaleHandleError(LifecycleError):
    """A transaction or handle refers to state that has changed since it was issued."""


# --- exhaustion ------------------------------------------------------------------------------


class ResourceExhaustedError(HybridCacheError, MemoryError):
    """A pool has fewer free entries than requested."""


class OutOfBlocksError(ResourceExhaustedError):
    """The KV block pool has too few free blocks."""


class OutOfStateSlotsError(ResourceExhaustedError):
    """The state pool has too few free slots for the requested role."""


# --- external models -------------------------------------------------------------------------


class UnsupportedModelError(InvalidConfigError):
    """A model's architecture or one of its cache layer kinds cannot be served exactly (for
    example sliding-window attention or a model-specific cache class)."""


class ModelLoadError(InvalidConfigError):
    """A model directory cannot be loaded: no readable config, or no weights."""


class ModelWeightsError(ModelLoadError):
    """A checkpoint's weights are missing, unexpected or of the wrong shape for its config."""
