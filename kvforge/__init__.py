"""kvforge: attention-backend-centric KV cache allocation, paging and offload.

Import cost is torch + pydantic only: Triton, ``torch_npu`` and ``triton-ascend`` are imported
lazily when a kernel or an NPU is first used.
"""

from kvforge.attn_backends import (
    AttentionBackend,
    DeepseekV4Backend,
    DSABackend,
    GQABackend,
    MHABackend,
    MLABackend,
)
from kvforge.cache_controller import (
    NULL_BLOCK,
    CacheController,
    MemoryPlan,
    cache_bytes_per_sequence,
    plan_memory,
)
from kvforge.errors import ControllerClosedError, OutOfBlocksError, RequestStateError
from kvforge.host_cache import SwapHandle
from kvforge.specs import CacheGroup, CacheRole, GroupKind, SwapPurpose, TokenRange

__version__ = "0.1.0"

__all__ = [
    "NULL_BLOCK",
    "AttentionBackend",
    "CacheController",
    "CacheGroup",
    "CacheRole",
    "ControllerClosedError",
    "DSABackend",
    "DeepseekV4Backend",
    "GQABackend",
    "GroupKind",
    "MHABackend",
    "MLABackend",
    "MemoryPlan",
    "OutOfBlocksError",
    "RequestStateError",
    "SwapHandle",
    "SwapPurpose",
    "TokenRange",
    "cache_bytes_per_sequence",
    "plan_memory",
]
