"""The scheduler side and the arithmetic both sides share.

Importing this package loads no concrete backend, no host-cache module and no kernel: a
scheduler process uses :class:`BlockManager`, :class:`CacheLayout` and the plain values of
:mod:`~kvforge.cache_controller.values`. :class:`CacheController` (the one-process facade,
which also loads the worker side) is imported on first use.
"""

from typing import Any

from kvforge.cache_controller.block_manager import BlockManager, SwapStats, live_start
from kvforge.cache_controller.block_pool import NULL_BLOCK, BlockPool
from kvforge.cache_controller.layout import CacheBuffer, CacheLayout
from kvforge.cache_controller.memory_plan import (
    GroupPlan,
    MemoryPlan,
    cache_bytes_per_sequence,
    plan_memory,
    shared_pool_blocks,
)
from kvforge.cache_controller.naming import DEFAULT_NAME_TEMPLATE, StorageNamer
from kvforge.cache_controller.values import (
    Refusal,
    RequestMove,
    StepAllocation,
    SwapFailure,
    SwapPlan,
    SwapResult,
    TableDelta,
)

__all__ = [
    "DEFAULT_NAME_TEMPLATE",
    "NULL_BLOCK",
    "BlockManager",
    "BlockPool",
    "CacheBuffer",
    "CacheController",
    "CacheLayout",
    "GroupPlan",
    "MemoryPlan",
    "Refusal",
    "RequestMove",
    "StepAllocation",
    "StorageNamer",
    "SwapFailure",
    "SwapPlan",
    "SwapResult",
    "SwapStats",
    "TableDelta",
    "cache_bytes_per_sequence",
    "live_start",
    "plan_memory",
    "shared_pool_blocks",
]


def __getattr__(name: str) -> Any:
    if name in ("CacheController", "ScheduledStep"):
        from kvforge.cache_controller import controller

        return getattr(controller, name)
    raise AttributeError(f"module 'kvforge.cache_controller' has no attribute {name!r}")
