"""``KVForgeConnector``: vLLM's ``OffloadingConnector`` with kvforge's spec, for what a spec
alone cannot do.

- **Per-group bytes.** It computes each offloaded group's unpadded bytes per block from vLLM's
  ``KVCacheConfig`` and builds :class:`~kvforge.integrations.vllm.spec.KVForgeOffloadingSpec`
  with them (vLLM's connector hands a spec only totals).
- **Per-layer views of packed blocks.** For packed layouts (DeepSeek-V4: every layer's page of
  a block interleaved in one allocation) vLLM's connector worker registers one whole packed
  block for every group; this one registers each layer's own strided view, so a group's host
  page holds that group's bytes and nothing else.
- **Failures do not crash the engine.** vLLM 0.33's connector worker asserts every transfer
  succeeded (``OffloadingConnectorWorker.get_finished``). Here a failed load reports its request
  in ``failed_recving`` (and ``finished_recving``, as vLLM requires), so the scheduler's
  ``_handle_failed_recving`` recomputes it under ``kv_load_failure_policy="recompute"`` (the
  default ``"fail"`` fails the request). A failed store reaches the scheduler side in the worker
  metadata; its pages are forgotten and it is counted (``manager.stores_failed``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    UniformTypeKVCacheSpecs,
    group_kernel_blocks,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

from kvforge._checks import ArgumentError
from kvforge.integrations.vllm.manager import KVForgeOffloadingManager
from kvforge.integrations.vllm.spec import (
    KVForgeOffloadingSpec,
    group_block_bytes,
    layer_unpadded_bytes,
)

__all__ = ["KVForgeConnector", "KVForgeWorkerMetadata"]

logger = logging.getLogger(__name__)


@dataclass
class KVForgeWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's completed-jobs report plus the jobs whose transfer failed on some worker."""

    failed_jobs: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = set(self.failed_jobs) | set(getattr(other, "failed_jobs", ()))
        return KVForgeWorkerMetadata(merged.completed_jobs, merged.transfer_stats, failed)


class KVForgeConnectorScheduler(OffloadingConnectorScheduler):
    """vLLM's offloading scheduler; a store a worker reported failed is forgotten when it
    completes, never served, and so are the pages of a failed load (vLLM recomputes the request
    and stores it again; a page that failed once is not offered again)."""

    def _update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        manager = self.manager
        if isinstance(meta, KVForgeWorkerMetadata) and isinstance(
            manager, KVForgeOffloadingManager
        ):
            for job_id in sorted(meta.failed_jobs):
                status = self._jobs.get(job_id)
                if job_id >= self._stale_job_threshold and status is not None:
                    manager.mark_failed(status.keys)
        super()._update_connector_output(connector_output)


class KVForgeConnectorWorker(OffloadingConnectorWorker):
    """vLLM's connector worker with per-layer views of every group (packed blocks included)
    and failed transfers reported instead of asserted."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._connector_worker_meta = KVForgeWorkerMetadata()
        #: requests whose asynchronous load failed since the last report
        self.failed_recving: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self.kv_cache_config
        num_blocks = config.num_blocks
        tensors: list[CanonicalKVCacheTensor] = []
        group_refs: list[list[CanonicalKVCacheRef]] = []
        for gid in get_offloading_group_ids(config):
            group = config.kv_cache_groups[gid]
            spec = group.kv_cache_spec
            per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
            refs = []
            for name in group.layer_names:
                layer_spec = per_layer.get(name, spec)
                cache = group_kernel_blocks(kv_caches[name], num_blocks)
                elem = cache.element_size()
                page = layer_spec.page_size_bytes
                # a packed layout's block stride is the whole packed block (> page)
                stride = cache.stride(0) * elem if isinstance(layer_spec, AttentionSpec) else page
                view = torch.tensor([], dtype=torch.int8, device=cache.device).set_(
                    cache.untyped_storage(),
                    cache.storage_offset() * elem,
                    (num_blocks, page),
                    (stride, 1),
                )
                tensors.append(CanonicalKVCacheTensor(view, page))
                refs.append(CanonicalKVCacheRef(len(tensors) - 1, layer_unpadded_bytes(layer_spec)))
            group_refs.append(refs)
        self._init_worker(CanonicalKVCaches(tensors, group_refs))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        finished_recving: set[str] = set()
        for result in self.worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs
            req_id = self._load_jobs.pop(job_id, None)
            if result.success:
                if result.transfer_time is not None and result.transfer_size is not None:
                    stats = self._connector_worker_meta.transfer_stats
                    (stats.load if is_load else stats.store).record(
                        result.transfer_size, result.transfer_time
                    )
            else:
                assert isinstance(self._connector_worker_meta, KVForgeWorkerMetadata)
                self._connector_worker_meta.failed_jobs.add(job_id)
                if req_id is not None:
                    self.failed_recving.add(req_id)
                logger.warning(
                    "kvforge: %s job %d failed%s",
                    "load" if is_load else "store",
                    job_id,
                    f" (request {req_id} recomputes)" if req_id is not None else "",
                )
            self._connector_worker_meta.mark_completed(job_id)
            if req_id is not None:
                finished_recving.add(req_id)
        return set(), finished_recving

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = self._connector_worker_meta
        assert isinstance(meta, KVForgeWorkerMetadata)
        if not meta.completed_jobs and not meta.failed_jobs:
            return None
        self._connector_worker_meta = KVForgeWorkerMetadata()
        return meta


class KVForgeConnector(OffloadingConnector):
    """vLLM's offloading connector on kvforge's per-group compact host pages.

    Use it with ``kv_connector="KVForgeConnector"`` and
    ``kv_connector_module_path="kvforge.integrations.vllm"``; kvforge's options go under
    ``kv_connector_extra_config["kvforge"]`` (:class:`~kvforge.integrations.vllm.config.
    KVForgeOffloadOptions`).

    Raises:
        ArgumentError: a bad ``kvforge`` option, ``spec_name`` naming another spec,
            ``canonical_layout`` set, or a host budget below one chunk of every group.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        extra = offloading_config.extra_config
        spec_name = extra.get("spec_name", "KVForgeOffloadingSpec")
        if spec_name != "KVForgeOffloadingSpec":
            raise ArgumentError(
                f"kv_connector_extra_config['spec_name'] must be 'KVForgeOffloadingSpec' (or "
                f"left out) with KVForgeConnector, got {spec_name!r}"
            )
        if offloading_config.canonical_layout:
            raise ArgumentError(
                "kv_connector_extra_config['canonical_layout'] must be false with kvforge: its "
                "host pages are per-group compact pages, not vLLM's canonical pages, got True"
            )
        self._canonical_layout = False
        group_ids = [g.group_id for g in offloading_config.groups]
        spec = KVForgeOffloadingSpec(
            offloading_config, group_block_bytes(kv_cache_config, group_ids)
        )
        self.spec = spec
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVForgeConnectorScheduler(spec, vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVForgeConnectorWorker(spec, vllm_config, kv_cache_config)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.connector_worker
        assert isinstance(worker, KVForgeConnectorWorker)
        sending, recving = self.get_finished(finished_req_ids)
        failed, worker.failed_recving = worker.failed_recving, set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )
