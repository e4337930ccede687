"""KVEventsConfig: vLLM's JSON, validated in full."""

from __future__ import annotations

import pytest

from hybridcache.engine.engine_config import EngineConfig
from hybridcache.errors import InvalidConfigError
from hybridcache.events.config import KVEventsConfig


def test_vllm_json_parses_with_vllm_defaults():
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv@pod@m"}'
    )
    assert config.active and config.buffer_steps == 10_000 and config.hwm == 100_000
    assert config.binds(config.endpoint) and not config.binds("tcp://10.0.0.1:5557")
    assert KVEventsConfig(bind=True).binds("tcp://127.0.0.1:5557")


@pytest.mark.parametrize(
    "text",
    ['[1]', 'not json', '{"enable_kv_cache_events": "yes"}', '{"endpoint": "http://x"}', '{"buffer_steps": 0}',
     '{"unknown": 1}', '{"publisher": "kafka"}', '{"state_replay_endpoint": "tcp://*:1"}', '{"topic": 3}'],
)
def test_bad_config_is_refused(text):
    with pytest.raises(InvalidConfigError):
        KVEventsConfig.from_json(text)


def test_engine_config_holds_it_and_refuses_anything_else():
    assert not EngineConfig().kv_events.active
    with pytest.raises(InvalidConfigError):
        EngineConfig(kv_events={"enable_kv_cache_events": True})
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").active
