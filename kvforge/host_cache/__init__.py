"""Host side of the cache: pinned page-first pools and the swap data path."""

from kvforge.host_cache.host_pool import HostCacheAllocator, HostGroupPool, HostPools, HostViews
from kvforge.host_cache.swap import SwapHandle, contiguous_runs, plane_bytes

__all__ = [
    "HostCacheAllocator",
    "HostGroupPool",
    "HostPools",
    "HostViews",
    "SwapHandle",
    "contiguous_runs",
    "plane_bytes",
]
