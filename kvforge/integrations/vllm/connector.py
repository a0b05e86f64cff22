"""``KVForgeConnector``: vLLM's ``OffloadingConnector`` with kvforge's spec, for what a spec
alone cannot do.

- **Per-group bytes.** It computes each offloaded group's unpadded bytes per block from vLLM's
  ``KVCacheConfig`` and builds :class:`~kvforge.integrations.vllm.spec.KVForgeOffloadingSpec`
  with them (vLLM's connector hands a spec only totals).
- **Per-layer views of packed blocks.** For packed layouts (DeepSeek-V4: every layer's page of
  a block interleaved in one allocation) vLLM's connector worker registers one whole packed
  block for every group; this one registers each layer's own strided view, so a group's host
  page holds that group's bytes and nothing else.
- **Ids are ints, reports and jobs are outstanding** (:mod:`~kvforge.integrations.vllm.checks`).
  Block ids vLLM hands the scheduler side (``update_state_after_alloc``,
  ``build_connector_meta``, ``request_finished``) and every id of a worker report or job must
  be an int in range: anything else raises ``ArgumentError`` before anything changes. A report
  (``update_connector_output``) for a job that was never issued, or is no longer outstanding,
  and a job a worker was handed before (a replay) are dropped with a warning and counted
  (``refused_reports``, ``refused_jobs``): vLLM calls these hooks mid-step, where a raise
  stops the engine for every request, and the genuine report or job is processed once.
- **Failures do not crash the engine.** vLLM 0.33's connector worker asserts every transfer
  succeeded (``OffloadingConnectorWorker.get_finished``). Here a failed load reports its request
  in ``failed_recving`` (and ``finished_recving``, as vLLM requires), so the scheduler's
  ``_handle_failed_recving`` recomputes it under ``kv_load_failure_policy="recompute"`` (the
  default ``"fail"`` fails the request). A failed store reaches the scheduler side in the worker
  metadata; its pages are forgotten and it is counted (``manager.stores_failed``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
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
    GPULoadStoreSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

from kvforge._checks import ArgumentError
from kvforge.core.model_identity import ModelIdentity
from kvforge.errors import RequestStateError
from kvforge.integrations.vllm.checks import int_id, req_ids
from kvforge.integrations.vllm.identity import model_identity
from kvforge.integrations.vllm.manager import KVForgeOffloadingManager
from kvforge.integrations.vllm.pages import HostPages
from kvforge.integrations.vllm.remote_setup import remote_settings, remote_spec
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


def _block_ids(field_name: str, ids: Iterable[Any], num_blocks: int) -> None:
    """Every id an int in ``[0, num_blocks)`` (a fast path for plain ints), else
    ``ArgumentError`` naming ``field_name[i]`` and the value."""
    ids = list(ids)
    if all(type(b) is int for b in ids) and (not ids or (min(ids) >= 0 and max(ids) < num_blocks)):
        return
    for i, b in enumerate(ids):
        int_id(f"{field_name}[{i}]", b, 0, num_blocks)


def _block_id_groups(field_name: str, groups: object, num_blocks: int) -> None:
    """``groups``: ``None`` or one list of block ids per group, each checked."""
    if groups is None:
        return
    if not isinstance(groups, tuple | list):
        raise ArgumentError(f"{field_name}={groups!r}: must be one list of block ids per group")
    for g, ids in enumerate(groups):
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise ArgumentError(f"{field_name}[{g}]={ids!r}: must be a list of block ids")
        _block_ids(f"{field_name}[{g}]", ids, num_blocks)


class KVForgeConnectorScheduler(OffloadingConnectorScheduler):
    """vLLM's offloading scheduler; a store a worker reported failed is forgotten when it
    completes, never served, and so are the pages of a failed load (vLLM recomputes the request
    and stores it again; a page that failed once is not offered again).

    Block ids from vLLM must be ints in ``[0, num_blocks)`` (``ArgumentError`` before anything
    changes). A worker report for a job never issued or no longer outstanding is dropped,
    logged and counted in :attr:`refused_reports`: the manager never sees it.
    """

    def __init__(self, spec: Any, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        super().__init__(spec, vllm_config, kv_cache_config)
        self._num_blocks = int(kv_cache_config.num_blocks)
        # vLLM 0.32 keeps no fence of jobs issued before a reset: none is outstanding there
        vars(self).setdefault("_reset_fence", {})
        #: worker reports refused: a job never issued, already reported, or over-counted
        self.refused_reports = 0

    # ------------------------------------------------------------------ ids from vLLM

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        int_id("update_state_after_alloc: num_external_tokens", num_external_tokens)
        for g, group in enumerate(blocks.blocks):
            _block_ids(
                f"update_state_after_alloc: blocks.blocks[{g}] block_id",
                (b.block_id for b in group),
                self._num_blocks,
            )
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        int_id("get_num_new_matched_tokens: num_computed_tokens", num_computed_tokens)
        if max_num_new_tokens is not None:
            int_id("get_num_new_matched_tokens: max_num_new_tokens", max_num_new_tokens)
        return super().get_num_new_matched_tokens(
            request, num_computed_tokens, max_num_new_tokens=max_num_new_tokens
        )

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        int_id("get_external_cache_hit_sources: num_external_tokens", num_external_tokens)
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def check_finished_block_ids(self, block_ids: object) -> None:
        """``request_finished``'s block ids (one list, or a tuple of one per group) are ints
        in range, else ``ArgumentError``."""
        if isinstance(block_ids, tuple):
            _block_id_groups("request_finished: block_ids", block_ids, self._num_blocks)
        elif isinstance(block_ids, str | bytes) or not isinstance(block_ids, Iterable):
            raise ArgumentError(f"request_finished: block_ids={block_ids!r}: must be a list")
        else:
            _block_ids("request_finished: block_ids", block_ids, self._num_blocks)

    def _check_scheduler_output(self, so: Any) -> None:
        """Every request id of the step is a string and every block id an int in range; the
        requests it schedules are known (``on_new_request`` saw them)."""
        n = self._num_blocks
        for i, req in enumerate(so.scheduled_new_reqs):
            if req.req_id not in self._req_status:
                raise RequestStateError(
                    f"build_connector_meta: scheduled_new_reqs[{i}].req_id={req.req_id!r} is "
                    "not a request this connector was told of (on_new_request)"
                )
            _block_id_groups(f"scheduled_new_reqs[{i}].block_ids", req.block_ids, n)
        cached = so.scheduled_cached_reqs
        if len(cached.new_block_ids) != len(cached.req_ids):
            raise ArgumentError(
                f"build_connector_meta: scheduled_cached_reqs has {len(cached.req_ids)} "
                f"request ids and {len(cached.new_block_ids)} block id lists"
            )
        for i, (req_id, groups) in enumerate(
            zip(cached.req_ids, cached.new_block_ids, strict=True)
        ):
            if req_id not in self._req_status:
                raise RequestStateError(
                    f"build_connector_meta: scheduled_cached_reqs.req_ids[{i}]={req_id!r} is "
                    "not a request this connector was told of (on_new_request)"
                )
            _block_id_groups(f"scheduled_cached_reqs.new_block_ids[{i}]", groups, n)
        for i, copy in enumerate(so.kv_cache_block_copies or ()):
            _block_ids(f"kv_cache_block_copies[{i}]", (copy.src_block_id, copy.dst_block_id), n)
        req_ids("build_connector_meta: finished_req_ids", so.finished_req_ids)
        req_ids("build_connector_meta: preempted_req_ids", so.preempted_req_ids)
        state = so.kv_connector_block_state
        for req_id, entries in (state.boundary_state_offloads if state else {}).items():
            for j, entry in enumerate(entries):
                where = f"kv_connector_block_state.boundary_state_offloads[{req_id!r}][{j}]"
                if not isinstance(entry, tuple | list) or len(entry) != 3:
                    raise ArgumentError(f"{where}={entry!r}: must be (group, block id, boundary)")
                int_id(f"{where} group", entry[0])
                int_id(f"{where} block id", entry[1], 0, n)
                int_id(f"{where} boundary", entry[2])

    def _build_connector_meta(self, scheduler_output: Any) -> Any:
        self._check_scheduler_output(scheduler_output)  # before anything changes
        meta = super()._build_connector_meta(scheduler_output)
        keep = getattr(self.manager, "keep_requests", None)  # a remote tier's keys
        if keep is not None:
            keep(self._req_status)
        return meta

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        add = getattr(self.manager, "add_request", None)  # a remote tier keys its tokens
        if add is not None:
            add(request.request_id, request)

    # ------------------------------------------------------------------ worker reports

    def _refuse(self, job_id: int, why: str) -> None:
        self.refused_reports += 1
        logger.warning(
            "kvforge: refused a worker report for job %d: %s; nothing changed", job_id, why
        )

    def _screen_report(self, meta: OffloadingWorkerMetadata) -> tuple[dict[int, int], list[int]]:
        """The completions and failures of ``meta`` that name an outstanding job, within its
        outstanding count; the others refused (:meth:`_refuse`).

        Raises:
            ArgumentError: a job id or count that is not an int (nothing changed).
        """
        completed = meta.completed_jobs
        failed = getattr(meta, "failed_jobs", set())
        if (
            not isinstance(completed, Mapping)
            or isinstance(failed, str | bytes)
            or not (isinstance(failed, Iterable))
        ):
            raise ArgumentError(
                f"kv_connector_worker_meta: completed_jobs={completed!r} must be a dict and "
                f"failed_jobs={failed!r} a set of job ids"
            )
        reported = {
            int_id("kv_connector_worker_meta.completed_jobs job id", j): int_id(
                f"kv_connector_worker_meta.completed_jobs[{j!r}]", c, 1
            )
            for j, c in completed.items()
        }
        failures = sorted(
            {int_id("kv_connector_worker_meta.failed_jobs job id", j) for j in failed}
        )
        accepted: dict[int, int] = {}
        for job_id, count in reported.items():
            if job_id >= self._stale_job_threshold:
                status = self._jobs.get(job_id)
                left = None if status is None else status.pending_count
                gone = "never issued" if job_id >= self._job_counter else "already reported"
            else:
                left = self._reset_fence.get(job_id)
                gone = "issued before a cache reset and already reported"
            if left is None:
                self._refuse(job_id, f"the job is not outstanding ({gone})")
            elif count > left:
                self._refuse(job_id, f"{count} completions, {left} outstanding")
            else:
                accepted[job_id] = count
        ok_failures = []
        for job_id in failures:
            if job_id not in accepted:
                self._refuse(job_id, "a failure report for a job not outstanding, or not completed")
            elif job_id >= self._stale_job_threshold:
                ok_failures.append(job_id)
        return accepted, ok_failures

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """vLLM 0.33 calls :meth:`_update_connector_output` from here under its lock; vLLM 0.32
        has no such inner hook, so its reports are screened here (else a failed load's pages
        would never be forgotten on 0.32, and a remote page that did not arrive would be
        served)."""
        if hasattr(OffloadingConnectorScheduler, "_update_connector_output"):
            super().update_connector_output(connector_output)
        else:  # vLLM 0.32
            self._screened_output(connector_output, super().update_connector_output)

    def _update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._screened_output(connector_output, super()._update_connector_output)

    def _screened_output(
        self, connector_output: KVConnectorOutput, forward: Callable[[KVConnectorOutput], None]
    ) -> None:
        """Screen the worker report of ``connector_output``, tell the manager of failed jobs,
        and ``forward`` what is left to vLLM's own handling."""
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            forward(connector_output)
            return
        if not isinstance(meta, OffloadingWorkerMetadata):
            raise ArgumentError(
                f"kv_connector_worker_meta={meta!r}: must be an offloading worker report"
            )
        accepted, failed = self._screen_report(meta)
        manager = self.manager
        if isinstance(manager, KVForgeOffloadingManager):
            for job_id in failed:
                status = self._jobs[job_id]
                manager.mark_failed(status.keys, self._req_status[status.req_id].req_context)
        clean = OffloadingWorkerMetadata(accepted, meta.transfer_stats)
        forward(replace(connector_output, kv_connector_worker_meta=clean))


class KVForgeConnectorWorker(OffloadingConnectorWorker):
    """vLLM's connector worker with per-layer views of every group (packed blocks included)
    and failed transfers reported instead of asserted.

    Every job of a metadata is checked at first sight (``handle_preemptions``,
    ``start_load_kv`` or ``wait_for_save``): ids are ints and specs are a device spec and
    kvforge host pages (``ArgumentError`` otherwise, nothing run). A job runs at most once:
    vLLM's job ids only grow, so a job at or below the highest id of an earlier metadata, or
    one already handed over from this one, is a replay: dropped, logged, counted in
    :attr:`refused_jobs`. A result for a job never submitted is refused the same way.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._connector_worker_meta = KVForgeWorkerMetadata()
        #: requests whose asynchronous load failed since the last report
        self.failed_recving: set[str] = set()
        #: the metadata last screened, and the job ids of it handed over so far
        self._meta: object | None = None
        self._taken: set[int] = set()
        #: the highest job id of every earlier metadata: a job at or below it is a replay
        self._max_job_id = -1
        #: jobs submitted to the worker whose result has not come yet
        self._issued: set[int] = set()
        #: jobs refused: a replayed job, or a result for a job never submitted
        self.refused_jobs = 0

    # ------------------------------------------------------------------ jobs from vLLM

    def _screen(self, meta: object) -> None:
        """Check ``meta`` the first time it is seen (ids and spec types; nothing runs if one
        is wrong) and start counting its jobs."""
        if meta is self._meta:
            return
        if not isinstance(meta, OffloadingConnectorMetadata) or not (
            isinstance(meta.load_jobs, dict) and isinstance(meta.store_jobs, dict)
        ):
            raise ArgumentError(
                f"kv_connector_metadata={meta!r}: must be an OffloadingConnectorMetadata with "
                "load_jobs and store_jobs dicts"
            )
        for kind, jobs in (("load_jobs", meta.load_jobs), ("store_jobs", meta.store_jobs)):
            for job_id, job in jobs.items():
                int_id(f"kv_connector_metadata.{kind} job id", job_id)
                if not isinstance(job, TransferJob) or not isinstance(job.req_id, str):
                    raise ArgumentError(
                        f"kv_connector_metadata.{kind}[{job_id!r}]={job!r}: must be a "
                        "TransferJob of a request id (a string)"
                    )
                device, host = (
                    (job.dst_spec, job.src_spec)
                    if kind == "load_jobs"
                    else (job.src_spec, job.dst_spec)
                )
                if not isinstance(device, GPULoadStoreSpec) or not isinstance(host, HostPages):
                    raise ArgumentError(
                        f"kv_connector_metadata.{kind}[{job_id!r}]: must move between a "
                        f"GPULoadStoreSpec and kvforge host pages, got "
                        f"{type(job.src_spec).__name__} -> {type(job.dst_spec).__name__}"
                    )
        for job_id in meta.jobs_to_flush or ():
            int_id("kv_connector_metadata.jobs_to_flush job id", job_id)
        if self._taken:
            self._max_job_id = max(self._max_job_id, *self._taken)
        self._taken = set()
        self._meta = meta

    def _take(
        self, jobs: dict[int, Any], only: Iterable[int] | None = None, submit: bool = True
    ) -> None:
        """Hand over the jobs of ``jobs`` (those in ``only``), each at most once: a replay is
        removed from ``jobs``, logged and counted."""
        for job_id in [j for j in (jobs if only is None else only) if j in jobs]:
            if job_id in self._taken or job_id <= self._max_job_id:
                del jobs[job_id]
                self.refused_jobs += 1
                logger.warning(
                    "kvforge: refused job %d: a replay (this worker was handed it before); it "
                    "does not run again",
                    job_id,
                )
                continue
            self._taken.add(job_id)
            if submit:
                self._issued.add(job_id)

    def handle_preemptions(self, kv_connector_metadata: OffloadingConnectorMetadata) -> None:
        self._screen(kv_connector_metadata)
        flush = kv_connector_metadata.jobs_to_flush
        if flush:
            self._take(kv_connector_metadata.store_jobs, flush, submit=self._is_store_writer)
        super().handle_preemptions(kv_connector_metadata)

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        self._screen(metadata)
        self._take(metadata.load_jobs)
        super().start_kv_transfers(metadata)

    def prepare_store_kv(self, metadata: OffloadingConnectorMetadata) -> None:
        self._screen(metadata)
        self._take(metadata.store_jobs, submit=self._is_store_writer)
        super().prepare_store_kv(metadata)

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
        req_ids("get_finished: finished_req_ids", finished_req_ids)
        finished_recving: set[str] = set()
        for result in self.worker.get_finished():
            job_id = result.job_id
            if job_id not in self._issued:
                self.refused_jobs += 1
                logger.warning(
                    "kvforge: refused a result for job %r: no such job was submitted, or its "
                    "result came already",
                    job_id,
                )
                continue
            self._issued.discard(job_id)
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
        block_bytes = group_block_bytes(kv_cache_config, group_ids)
        device_type = getattr(vllm_config.device_config, "device_type", None)
        remote = remote_settings(vllm_config, extra)
        if remote is None:
            spec = KVForgeOffloadingSpec(offloading_config, block_bytes, device_type=device_type)
        else:  # the remote tier behind the host pages (.remote)
            spec = remote_spec(vllm_config, offloading_config, block_bytes, device_type, remote)
        self.spec = spec
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVForgeConnectorScheduler(spec, vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVForgeConnectorWorker(spec, vllm_config, kv_cache_config)

    @functools.cached_property
    def model_identity(self) -> ModelIdentity:
        """This engine's :class:`~kvforge.ModelIdentity` (:mod:`.identity`): what a remote tier
        puts in every key and value header, so engines serving other weights never share."""
        return model_identity(self._vllm_config)

    # worker role: the metadata goes to the connector worker, which checks it (a typed error,
    # not vLLM's assert, for one that is not an offloading metadata)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_kv_transfers(self._connector_metadata)  # type: ignore[arg-type]

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.prepare_store_kv(self._connector_metadata)  # type: ignore[arg-type]

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert isinstance(self.connector_scheduler, KVForgeConnectorScheduler)
        self.connector_scheduler.check_finished_block_ids(block_ids)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert isinstance(self.connector_scheduler, KVForgeConnectorScheduler)
        if not isinstance(block_ids, tuple):
            raise ArgumentError(
                f"request_finished_all_groups: block_ids={block_ids!r}: must be a tuple of one "
                "list of block ids per group"
            )
        self.connector_scheduler.check_finished_block_ids(block_ids)
        return super().request_finished_all_groups(request, block_ids)

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
