"""A server whose engine loop stopped on a bug answers 503 on ``/health`` and ``/metrics`` (the
router's health read), so it is taken out of rotation instead of being sent requests that wait
for a thread that is gone (the loop's own behaviour: tests/serving/test_loop.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from hybridcache.errors import RequestFailedError  # noqa: E402
from hybridcache.serving import app  # noqa: E402


def _call(route, failure):
    runtime = SimpleNamespace(loop=SimpleNamespace(failure=failure), config=SimpleNamespace(served_name="tiny"),
                              metrics=SimpleNamespace(exposition=lambda: b"# served\n"))
    response = asyncio.run(route(SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(runtime=runtime)))))
    return response.status_code, response.body


@pytest.mark.parametrize("route", [app._health, app._metrics])
def test_a_stopped_engine_loop_answers_503(route):
    status, body = _call(route, RequestFailedError("the engine loop stopped: KeyError: 'x'"))
    assert status == 503 and json.loads(body) == {"status": "failed", "model": "tiny"}  # the cause is logged
    assert _call(route, None)[0] == 200
