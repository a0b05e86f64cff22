"""``KVForgeOffloadingSpec``: vLLM's ``OffloadingSpec`` for kvforge's per-group compact host
pages; its manager (scheduler side) and worker (each worker process).

The spec needs each offloaded group's unpadded bytes per block, which vLLM's plain
``OffloadingConnector`` does not hand a spec; :class:`~kvforge.integrations.vllm.connector.
KVForgeConnector` computes them from vLLM's ``KVCacheConfig`` (:func:`group_block_bytes`) and
builds the spec. Loading it by ``spec_name`` into vLLM's own connector is refused with an
error that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from kvforge._checks import ArgumentError
from kvforge.integrations.vllm.config import MachineFacts, parse_options
from kvforge.integrations.vllm.manager import KVForgeOffloadingManager
from kvforge.integrations.vllm.pages import HostPagePlan, plan_host_pages
from kvforge.integrations.vllm.worker import KVForgeOffloadingWorker

__all__ = ["KVForgeOffloadingSpec", "group_block_bytes", "layer_unpadded_bytes"]


def layer_unpadded_bytes(spec: Any) -> int:
    """One block of one layer without vLLM's padding: ``unpadded_page_size_bytes`` of an
    attention spec, the unpadded state of a Mamba spec (vLLM's offloading worker reads the
    same)."""
    if isinstance(spec, AttentionSpec):
        return int(spec.unpadded_page_size_bytes)
    if isinstance(spec, MambaSpec):
        return int(replace(spec, page_size_padded=None).page_size_bytes)
    raise ArgumentError(f"kvforge cannot offload a {type(spec).__name__} layer")


def group_block_bytes(kv_cache_config: KVCacheConfig, group_ids: Sequence[int]) -> list[int]:
    """Per offloaded group, the bytes per block the page count is planned with: the group's
    spec, unpadded, times its layers.

    vLLM's scheduler sees one spec per group (``generate_scheduler_kv_cache_config`` keeps the
    first layer's spec of a ``UniformTypeKVCacheSpecs``), so a group whose layers' pages differ
    (DeepSeek-V4's compressor states) is planned from the first layer's page; a worker plans
    from the same spec (same pages on both sides) and its rows hold each layer's own unpadded
    bytes (:class:`~kvforge.integrations.vllm.worker.KVForgeOffloadingWorker`).
    """
    out = []
    for gid in group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        out.append(layer_unpadded_bytes(spec) * len(group.layer_names))
    return out


_METRICS = {
    CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: "pinned by transfers",
    CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: "pinned by stores in flight",
    CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: "pinned by loads in flight",
}


class KVForgeOffloadingSpec(OffloadingSpec):
    """kvforge's offloading spec. ``block_bytes``: each offloaded group's unpadded bytes per
    block, in ``config.groups`` order (given by ``KVForgeConnector``). ``device_type``: where
    the engine's KV caches live (vLLM's ``DeviceConfig.device_type``; ``None``: vLLM's
    platform, else the best device here): the options are checked against it.

    Raises:
        ArgumentError: ``block_bytes`` missing (loaded into vLLM's plain connector) or of the
            wrong length, a bad ``kvforge`` option (its type, or a value this machine cannot
            run: :mod:`kvforge.integrations.vllm.config`), ``sync_load_budget_bytes`` > 0, or a
            host budget below one chunk of every group.
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            name: OffloadingGaugeMetadata(documentation=f"Fraction of kvforge host pages {what}.")
            for name, what in _METRICS.items()
        }

    def __init__(
        self,
        config: OffloadingConfig,
        block_bytes: Sequence[int] | None = None,
        device_type: str | None = None,
    ):
        super().__init__(config)
        if block_bytes is None:
            raise ArgumentError(
                "KVForgeOffloadingSpec needs each group's unpadded block bytes, which vLLM's "
                "OffloadingConnector does not pass: set kv_connector='KVForgeConnector' and "
                "kv_connector_module_path='kvforge.integrations.vllm' instead of spec_name"
            )
        if len(block_bytes) != len(config.groups):
            raise ArgumentError(
                f"block_bytes has {len(block_bytes)} entries, vLLM offloads "
                f"{len(config.groups)} groups"
            )
        sync_budget = self.extra_config.get("sync_load_budget_bytes", 0)
        if sync_budget not in (0, None) or isinstance(sync_budget, bool):
            raise ArgumentError(
                "kv_connector_extra_config['sync_load_budget_bytes'] must be 0 with kvforge: "
                "a failed in-step load cannot be recomputed for a hybrid model in vLLM 0.33, "
                f"got {sync_budget!r}"
            )
        if device_type is None:  # vLLM's platform, else the best device here
            from vllm.platforms import current_platform

            device_type = getattr(current_platform, "device_type", None)
        #: this machine's facts, every ``kvforge`` option checked against them (engine start)
        self.machine = MachineFacts.detect(device_type)
        self.options, host_bytes = parse_options(self.extra_config, self.machine)
        self.plan: HostPagePlan = plan_host_pages(
            [g.group_id for g in config.groups], block_bytes, self.blocks_per_chunk, host_bytes
        )
        self._manager: KVForgeOffloadingManager | None = None
        self._worker: KVForgeOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVForgeOffloadingManager(
                self.plan, enable_events=self.kv_events_config.enable_kv_cache_events
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KVForgeOffloadingWorker(
                kv_caches, self.plan, self.options.gather_impl, self.options.pin_memory
            )
        return self._worker
