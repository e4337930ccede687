"""The exception hierarchy raised at every public boundary.

Every public entry point validates before it mutates: when one of these is raised, no
structure has changed. Input errors are also ``ValueError`` (or ``TypeError`` /
``IndexError``), lifecycle misuse is also ``RuntimeError``, exhaustion is also
``MemoryError`` and a failing object store is also ``OSError``, so callers can catch either
the specific class or the builtin family.
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


class TraceFormatError(InvalidArgumentError):
    """A request trace has a malformed line; the message names the file and the line."""


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


class AdoptionWriteError(LifecycleError):
    """The ``write`` callback of ``CacheProtocol.adopt`` raised something other than a
    hybridcache error (its ``__cause__``); the adoption was failed and freed first, so nothing
    it touched is held or matchable."""


class StaleHandleError(LifecycleError):
    """A transaction or handle refers to state that has changed since it was issued."""


# --- exhaustion ------------------------------------------------------------------------------


class ResourceExhaustedError(HybridCacheError, MemoryError):
    """A pool has fewer free entries than requested."""


class OutOfBlocksError(ResourceExhaustedError):
    """The KV block pool has too few free blocks."""


class OutOfStateSlotsError(ResourceExhaustedError):
    """The state pool has too few free slots for the requested role."""


class RequestTooLargeError(ResourceExhaustedError):
    """A request cannot fit even alone in empty pools (its prompt plus decode budget needs
    more KV blocks than exist); it is refused instead of retried."""


# --- serving ---------------------------------------------------------------------------------


class RequestFailedError(HybridCacheError, RuntimeError):
    """The engine gave up on one request: its forwards kept failing when it ran alone. The
    underlying error is its ``__cause__``; the other requests keep being served."""


class BenchmarkSetupError(HybridCacheError, RuntimeError):
    """A benchmark's set-up did not produce the state it measures (a checkpoint not published,
    a request not admitted with its hit, a server that never became healthy)."""


class EventStreamError(HybridCacheError, OSError):
    """An event stream's sockets could not be opened or used (a port taken, a closed
    publisher), or a replica's stream description could not be read."""


class ServerOverloadedError(ResourceExhaustedError):
    """The HTTP server's bounded queue is full: the request is refused now (503 with
    ``Retry-After``) rather than queued without bound."""


class MalformedRequestError(InvalidArgumentError):
    """An HTTP request body is not valid UTF-8 JSON of the expected shape."""


class BodyTooLargeError(InvalidArgumentError):
    """An HTTP request body is larger than the server accepts (413)."""


class UnknownModelError(InvalidArgumentError):
    """A request names a model (or adapter) the server does not serve (404)."""


# --- external models -------------------------------------------------------------------------


class UnsupportedModelError(InvalidConfigError):
    """A model's architecture or one of its cache layer kinds cannot be served exactly (for
    example sliding-window attention or a model-specific cache class)."""


class ModelLoadError(InvalidConfigError):
    """A model directory cannot be loaded: no readable config, or no weights."""


class ModelWeightsError(ModelLoadError):
    """A checkpoint's weights are missing, unexpected or of the wrong shape for its config."""


# --- stored objects and object stores (hybridcache.tiers) ------------------------------------


class CorruptObjectError(InvalidArgumentError):
    """Bytes read as a stored object are truncated, garbled or fail their header checksum."""


class UnsupportedFormatError(CorruptObjectError):
    """A stored object carries a format version this build does not read."""


class PayloadChecksumError(CorruptObjectError):
    """A stored object's payload does not match the checksum in its header."""


class InvalidKeyError(InvalidArgumentError):
    """An object-store key is empty, too long or uses characters outside the portable set."""


class StoreLockedError(LifecycleError):
    """A disk tier directory is already owned by another open store."""


class NotAStoreRootError(InvalidConfigError):
    """A disk tier root is a non-empty directory without the store's marker: it holds someone
    else's files, and a store opened there could delete or overwrite them."""


class StoreError(HybridCacheError, OSError):
    """An object store failed an operation; nothing it returned may be trusted.

    Unlike the other classes, a failed batch may have been partly applied: stored objects are
    immutable and content-addressed, so a repeated put of the same item is harmless.
    """


class StoreUnavailableError(StoreError, ConnectionError):
    """The store cannot be reached, refused the connection or dropped it."""


class ServerStartError(StoreError):
    """A local store server could not be found, started or stopped."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store operation did not finish within its timeout."""


class StoreClosedError(StoreUnavailableError):
    """An operation reached an object store after it was closed. A store failure like any
    other (a tiered caller counts it as ``unavailable``), not a ``LifecycleError``: a store
    can be closed under a running engine by code the engine does not control."""
