"""An engine refuses cache storage larger than the machine's memory before allocating any of it
(it used to be torch's builtin RuntimeError from the allocator, or a kill under overcommit)."""

from __future__ import annotations

import pytest
import torch

from hybridcache import machine
from hybridcache.engine import Engine, EngineConfig
from hybridcache.engine.storage_alloc import zeros_within_memory
from hybridcache.errors import InvalidConfigError, ResourceExhaustedError


@pytest.mark.parametrize("change", [dict(num_kv_blocks=10**8), dict(num_state_slots=10**7)])
def test_an_engine_larger_than_the_machine_is_refused(change):
    with pytest.raises(InvalidConfigError, match="GiB needed, this machine has"):
        Engine(EngineConfig(**change))


def test_the_limit_is_the_machines_memory_and_nothing_is_allocated_past_it(monkeypatch):
    allocated = []
    monkeypatch.setattr(machine, "host_memory_bytes", lambda: 1000)
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocated.append(a) or real_zeros(*a, **k))
    with pytest.raises(InvalidConfigError, match="GiB needed"):
        zeros_within_memory([((100,), torch.float64), ((30,), torch.float64)], "pools")
    assert allocated == []
    small = zeros_within_memory([((100,), torch.float64)], "pools")
    assert small[0].shape == (100,) and not small[0].any()


def test_an_allocator_failure_is_a_resource_error(monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "zeros", failing)
    with pytest.raises(ResourceExhaustedError, match="cannot allocate pools"):
        zeros_within_memory([((4,), torch.float32)], "pools")


def test_machine_memory_is_positive():
    assert machine.host_memory_bytes() > 0
