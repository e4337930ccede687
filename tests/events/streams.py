"""Helpers for the event tests: loopback endpoints on free ports and bounded waits."""

from __future__ import annotations

import time

LOOPBACK_ANY_PORT = "tcp://127.0.0.1:*"


def receive_until(subscriber, count: int, timeout_s: float = 5.0) -> list:
    """What ``subscriber`` delivers until ``count`` items arrived or ``timeout_s`` passed."""
    items: list = []
    deadline = time.monotonic() + timeout_s
    while len(items) < count and time.monotonic() < deadline:
        items.extend(subscriber.receive(50))
    return items


def wait_connected(publisher, subscriber, timeout_s: float = 5.0) -> None:
    """PUB/SUB joins are asynchronous: publish probes until one arrives, then forget them."""
    from hybridcache.events.schema import KVEventBatch

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        publisher.publish(KVEventBatch(0.0, []))
        if subscriber.receive(50):
            return
    raise AssertionError("the subscriber never connected")
