"""The scheduler side: block pools, block tables, the step, the prefix cache and the swap book.

Importing this package loads no concrete backend, no worker module and no kernel, and
allocates no tensor: a scheduler process uses :class:`BlockManager` and the plain values of
:mod:`kvforge.core.values`, which it hands to a worker (:class:`kvforge.worker.CacheStorage`).
"""

from kvforge.scheduler.block_manager import BlockManager, PrefixStats, SwapStats
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool

__all__ = ["NULL_BLOCK", "BlockManager", "BlockPool", "PrefixStats", "SwapStats"]
