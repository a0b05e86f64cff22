"""The variant-agnostic controller: layout, naming, memory planning, block pools and tables."""

from kvforge.cache_controller.block_pool import NULL_BLOCK, BlockPool
from kvforge.cache_controller.block_tables import BlockTables
from kvforge.cache_controller.controller import CacheController, SwapStats
from kvforge.cache_controller.layout import CacheEntry, CacheLayout
from kvforge.cache_controller.memory_plan import (
    GroupPlan,
    MemoryPlan,
    cache_bytes_per_sequence,
    plan_memory,
)
from kvforge.cache_controller.naming import DEFAULT_NAME_TEMPLATE, StorageNamer

__all__ = [
    "DEFAULT_NAME_TEMPLATE",
    "NULL_BLOCK",
    "BlockPool",
    "BlockTables",
    "CacheController",
    "CacheEntry",
    "CacheLayout",
    "GroupPlan",
    "MemoryPlan",
    "StorageNamer",
    "SwapStats",
    "cache_bytes_per_sequence",
    "plan_memory",
]
