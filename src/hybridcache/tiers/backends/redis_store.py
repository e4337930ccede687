"""T3 on Redis or Valkey: one string value per object, put-if-absent by ``SET NX``.

Owns its client (a connection pool) and its :class:`DeadlineRunner`. The ``redis`` client is
an extra (``pip install hybridcache[redis]``) imported when a store is created.

Every command runs with a socket timeout (the store's default) and no client-side retry; a
per-call timeout shorter than that is enforced by the runner. Eviction is the server's
(``maxmemory`` and ``maxmemory-policy``); a put refused for memory (``OOM``) is ``REJECTED``.

Replies are read by a bounded RESP2 parser: a bulk string announced longer than Redis's own
largest (``MAX_BULK_BYTES``) is refused before a byte of it is buffered, and a call's reads stop
at its deadline, so a store that streams without end costs one call's timeout and the
connection, not the process's memory (the runner abandons a call at its deadline, and without
this its thread would go on reading). Built on redis-py 8.1.0's parser internals
(``_RESP2Parser``'s ``_buffer``, set in ``on_connect``, and ``SocketBuffer``); ``protocol=3``
is refused for that reason.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

from hybridcache.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError, StoreError, StoreTimeoutError, StoreUnavailableError
from hybridcache.tiers.backends.base import DEFAULT_TIMEOUT_S, DeadlineRunner, ObjectStore, PutOutcome, check_key, checked_timeout

_T = TypeVar("_T")
MAX_BULK_BYTES = 512 * 2**20  # Redis's largest string (proto-max-bulk-len's default): none is longer
_deadline = threading.local()  # the monotonic time the call running on this worker thread gives up


def _import_redis():
    try:
        import redis
        import redis.backoff
        import redis.exceptions
        import redis.maint_notifications
        import redis.retry
    except ImportError as error:
        raise InvalidConfigError("RedisStore needs the redis client: pip install 'hybridcache[redis]'") from error
    return redis


def _bounded_parser():
    """The RESP2 parser class whose socket buffer refuses an oversized bulk and stops reading
    at the running call's deadline (both end the connection: redis-py drops a connection whose
    read raised)."""
    from redis._parsers import _RESP2Parser
    from redis._parsers.socket import SocketBuffer
    from redis.exceptions import ConnectionError as ReplyRefused
    from redis.exceptions import TimeoutError as ReplyTimedOut
    from redis.utils import SENTINEL

    class BoundedBuffer(SocketBuffer):
        def _read_from_socket(self, length=None, timeout=SENTINEL, raise_on_timeout=True):
            if time.monotonic() > getattr(_deadline, "at", float("inf")):
                raise ReplyTimedOut("the call's deadline passed while its reply was being read")
            return super()._read_from_socket(length, timeout, raise_on_timeout)

        def read(self, length, timeout=SENTINEL):
            if length > MAX_BULK_BYTES:
                raise ReplyRefused(f"the store announced a {length:,}-byte value; none is over {MAX_BULK_BYTES:,}")
            while self.unread_bytes() < length + 2:  # one receive at a time, each after a deadline check
                self._read_from_socket(None, timeout)
            return super().read(length, timeout)

    class BoundedParser(_RESP2Parser):
        def on_connect(self, connection):
            super().on_connect(connection)
            self._buffer = BoundedBuffer(self._sock, self.socket_read_size, connection.socket_timeout)

    return BoundedParser


class RedisStore(ObjectStore):
    """Objects in a Redis (or Valkey) server at ``url``, e.g. ``redis://127.0.0.1:6379/0``."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "",
        default_timeout: float = DEFAULT_TIMEOUT_S,
        max_connections: int = 8,
    ) -> None:
        super().__init__(default_timeout=default_timeout)
        if not isinstance(url, str) or not isinstance(key_prefix, str):
            raise InvalidTypeError("url and key_prefix must be str")
        if key_prefix:
            check_key(key_prefix)
        redis = _import_redis()
        self._errors = redis.exceptions
        self._prefix = key_prefix
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=self.default_timeout,
                socket_connect_timeout=self.default_timeout,
                retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),  # a failure is a miss, not a wait
                max_connections=max_connections,
                # redis-py 8 speaks RESP3 by default, and its maintenance notifications need RESP3:
                # both off, so replies go through the bounded RESP2 parser
                protocol=2,
                parser_class=_bounded_parser(),
                maint_notifications_config=redis.maint_notifications.MaintNotificationsConfig(enabled=False),
            )
        except (ValueError, TypeError, self._errors.RedisError) as error:
            raise InvalidConfigError(f"bad Redis url {url!r}: {error}") from error
        self._check_url_options(url)
        self._runner = DeadlineRunner("redis-store", workers=max_connections)

    def _check_url_options(self, url: str) -> None:
        """Options the URL's query sets override ours: refuse text replies and timeouts no
        store accepts (a ``socket_timeout`` of 1e10 s overflows in every call)."""
        options = self._client.connection_pool.connection_kwargs
        if options.get("decode_responses"):
            self._client.close()
            raise InvalidConfigError(f"Redis url {url!r} sets decode_responses: objects are bytes, not text")
        if options.get("protocol") not in (None, 2, "2"):
            self._client.close()
            raise InvalidConfigError(f"Redis url {url!r} sets protocol {options['protocol']}: replies are read as RESP2")
        try:
            for name in ("socket_timeout", "socket_connect_timeout"):
                if options.get(name) is not None:
                    checked_timeout(options[name])
        except InvalidArgumentError as error:
            self._client.close()
            raise InvalidConfigError(f"Redis url {url!r}: {error}") from error

    def _call(self, action: Callable[[], _T], timeout: float, what: str) -> _T:
        at = time.monotonic() + timeout
        return self._runner.run(lambda: self._mapped(action, what, at), timeout, what)

    def _mapped(self, action: Callable[[], _T], what: str, deadline: float) -> _T:
        errors = self._errors
        _deadline.at = deadline
        try:
            return action()
        except errors.TimeoutError as error:
            raise StoreTimeoutError(f"redis {what}: {error}") from error
        except errors.ConnectionError as error:
            raise StoreUnavailableError(f"redis {what}: {error}") from error
        except errors.RedisError as error:
            raise StoreError(f"redis {what}: {error}") from error

    def _names(self, keys: list[str]) -> list[str]:
        return [self._prefix + key for key in keys]

    def _exists(self, keys: list[str], timeout: float) -> list[bool]:
        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for name in self._names(keys):
                pipe.exists(name)
            return [count > 0 for count in pipe.execute()]

        return self._call(run, timeout, "exists")

    def _put_if_absent(self, items: list[tuple[str, bytes]], timeout: float) -> list[PutOutcome]:
        def run() -> list[PutOutcome]:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self._prefix + key, value, nx=True)
            return [self._put_outcome(reply) for reply in pipe.execute(raise_on_error=False)]

        return self._call(run, timeout, "put")

    def _put_outcome(self, reply: object) -> PutOutcome:
        if isinstance(reply, self._errors.OutOfMemoryError):
            return PutOutcome.REJECTED
        if isinstance(reply, Exception):
            raise reply  # mapped by _mapped
        return PutOutcome.STORED if reply else PutOutcome.PRESENT

    def _get(self, keys: list[str], timeout: float) -> list[bytes | None]:
        found = self._call(lambda: list(self._client.mget(self._names(keys))), timeout, "get")
        if len(found) != len(keys) or any(value is not None and not isinstance(value, bytes) for value in found):
            raise StoreError("redis get answered something other than one bytes value per key")
        return found

    def _remove(self, keys: list[str], timeout: float) -> list[bool]:
        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for name in self._names(keys):
                pipe.delete(name)
            return [count > 0 for count in pipe.execute()]

        return self._call(run, timeout, "remove")

    def _close(self) -> None:
        self._runner.shutdown()
        self._client.close()
