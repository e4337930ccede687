"""Resource pools: KV blocks and recurrent-state slots."""

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import SlotRole, StatePool

__all__ = ["BlockPool", "SlotRole", "StatePool"]
