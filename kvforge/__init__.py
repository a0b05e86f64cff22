"""kvforge: attention-backend-centric KV cache allocation, paging and offload.

Import cost is torch + pydantic only, and names are loaded on first use: a scheduler process
that imports :mod:`kvforge.scheduler` never loads the worker side, the host cache or
the kernels. Triton, ``torch_npu`` and ``triton-ascend`` are imported when first used.
"""

from __future__ import annotations

from kvforge._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it, loaded on first attribute access
_EXPORTS: dict[str, str] = {
    "AttentionBackend": "kvforge.attn_backends.base",
    "DeclaredBackend": "kvforge.attn_backends.base",
    "SwapContext": "kvforge.attn_backends.base",
    "DeepseekV4Backend": "kvforge.attn_backends.deepseek_v4",
    "DSABackend": "kvforge.attn_backends.dsa",
    "GQABackend": "kvforge.attn_backends.gqa",
    "MHABackend": "kvforge.attn_backends.gqa",
    "MLABackend": "kvforge.attn_backends.mla",
    "LinearAttentionBackend": "kvforge.attn_backends.linear_attention",
    "PrefixQuery": "kvforge.core.values",
    "PrefixMatch": "kvforge.core.values",
    "ModelIdentity": "kvforge.core.model_identity",
    "config_digest": "kvforge.core.model_identity",
    "from_hf_config": "kvforge.models.hf_config",
    "register_backend": "kvforge.models.registry",
    "register_model_type": "kvforge.models.registry",
    "NULL_BLOCK": "kvforge.scheduler.block_pool",
    "BlockManager": "kvforge.scheduler.block_manager",
    "CacheLayout": "kvforge.core.layout",
    "MemoryPlan": "kvforge.core.memory_plan",
    "cache_bytes_per_sequence": "kvforge.core.memory_plan",
    "plan_memory": "kvforge.core.memory_plan",
    "StepAllocation": "kvforge.core.values",
    "SwapPlan": "kvforge.core.values",
    "SwapResult": "kvforge.core.values",
    "CacheController": "kvforge.controller",
    "ScheduledStep": "kvforge.controller",
    "CacheOptions": "kvforge.options",
    "HostTierOptions": "kvforge.options",
    "PlanOptions": "kvforge.options",
    "Unset": "kvforge.options",
    "ArgumentError": "kvforge._checks",
    "Platform": "kvforge.platform",
    "PrefixStats": "kvforge.scheduler.block_manager",
    "SwapStats": "kvforge.scheduler.block_manager",
    "Retention": "kvforge.scheduler.prefix",
    "HostTier": "kvforge.scheduler.host_tier",
    "HostTierPolicy": "kvforge.scheduler.host_tier",
    "SnapshotPolicy": "kvforge.scheduler.host_tier",
    "RemoteTier": "kvforge.remote_tier",
    "RemoteStore": "kvforge.store.protocol",
    "StoreConfig": "kvforge.store.config",
    "StepInputs": "kvforge.worker.storage",
    "CacheStorage": "kvforge.worker.storage",
    "ControllerClosedError": "kvforge.errors",
    "OutOfBlocksError": "kvforge.errors",
    "RequestStateError": "kvforge.errors",
    "StepError": "kvforge.errors",
    "WorkerRefusedError": "kvforge.errors",
    "ExtraKeys": "kvforge.core.prefix_keys",
    "MultimodalKey": "kvforge.core.prefix_keys",
    "SwapHandle": "kvforge.worker.transfer",
    "CacheGroup": "kvforge.specs",
    "CacheRole": "kvforge.specs",
    "GroupKind": "kvforge.specs",
    "SwapPurpose": "kvforge.specs",
    "TokenRange": "kvforge.specs",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("kvforge", globals(), _EXPORTS)
