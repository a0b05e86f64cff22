#!/usr/bin/env python
"""The vLLM 0.33 side of the per-step and prefix-cache benchmarks, measured in the same process.

kvforge's per-step bookkeeping is compared against vLLM's own code, driven the way vLLM's
scheduler and V1 GPU model runner drive it, on the schedules of :mod:`step_workloads`:

- scheduler side: one ``KVCacheManager`` (prefix caching off) over a ``KVCacheConfig`` with one
  ``KVCacheGroupSpec`` per workload group (``FullAttentionSpec`` / ``SlidingWindowSpec``); per
  step ``new_step_starts``, then per scheduled request what ``Scheduler.schedule`` does: for a
  new request ``get_computed_blocks`` + ``allocate_slots(..., full_sequence_must_fit=True)`` +
  ``get_blocks(...).get_block_ids()`` (``NewRequestData``), for a running one
  ``allocate_slots(request, n)`` + ``get_block_ids(allow_none=True)`` (``CachedRequestData``),
  then ``take_new_block_ids`` and the token counters of ``_update_after_schedule``;
- worker side: one ``MultiGroupBlockTable``; per step what ``GPUModelRunner._update_states`` and
  ``_prepare_inputs`` do with blocks: ``add_row`` / ``append_row`` of the new block ids per
  request, ``commit_block_table``, request indices and positions (numpy, as ``_prepare_inputs``),
  ``query_start_loc``, then the slot mapping of every group.

vLLM computes the slot mapping with a Triton kernel (``ComputeSlotMappingKernel`` in
``vllm/v1/worker/block_table.py``) that cannot run on a CPU-only build. :func:`_slot_mapping_port`
is a faithful torch port: the same inputs (``query_start_loc``, ``positions``, the committed
block table), the same arithmetic (``slot = block_table[req, pos // block_size] * block_size +
pos % block_size``, context parallelism of 1) and the same padding of the rest of the buffer
with ``PAD_SLOT_ID`` (-1), vectorized over all tokens as the kernel is over a request's tokens.

Timings are medians over ``repeats`` runs of the whole schedule (after one warm-up run), on one
torch thread with the garbage collector off, in microseconds. Nothing here imports kvforge, and
vLLM is imported lazily: the module loads (and :func:`vllm_available` says False) without it.

Prefix cache (:func:`run_vllm_prefix_cost`): vLLM's default block hashing of a 2,048-token
prompt and ``KVCacheManager.get_computed_blocks`` on a full hit, on the real KV cache config of
Llama-3-8B (block 16) or DeepSeek-V4-Flash (block 256; vLLM's own DeepSeek-V4 cache layers give
the specs, vLLM's grouping gives five groups: two SWA, the compressed MLA one, two compressor
state ones), built as ``EngineCore`` builds it (:func:`build_prefix_kv_cache_config`). The
models' HF configs are read from kvforge's bundled JSON files, as data.

Usage::

    ~/.venv-vllm/bin/python benchmarks/vllm_baseline.py [--repeats N] [--workloads a,b]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from step_sim import StepTimes

if __package__:
    from .step_workloads import GroupDef, Schedule, Step, StepWorkload, all_workloads, schedule
else:  # run as a script, or imported with benchmarks/ on sys.path
    from step_workloads import GroupDef, Schedule, Step, StepWorkload, all_workloads, schedule

__all__ = [
    "PREFIX_BLOCK_SIZES",
    "PREFIX_MODELS",
    "RETENTION_DEFAULT",
    "RETENTION_DENSE",
    "VLLM_VERSION",
    "VS_BLOCK_SIZES",
    "VS_MODELS",
    "PrefixCacheSetup",
    "VllmCacheSetup",
    "VllmPrefixRounds",
    "build_kv_cache_config",
    "build_prefix_kv_cache_config",
    "build_vllm_cache_setup",
    "build_vllm_engine_config",
    "build_vllm_kv_cache_manager",
    "build_vllm_scheduler",
    "check_port_against_kernel",
    "prefix_prompt",
    "run_vllm_prefix_cost",
    "run_vllm_step",
    "vllm_available",
    "vllm_block_hasher",
    "vllm_layer_specs",
    "vllm_model_dir",
]

VLLM_VERSION = "0.33.0"
STEP_KEYS = ("prefill_alloc", "decode_alloc", "kernel_inputs", "step", "free")


def vllm_available() -> bool:
    """Whether vLLM's KV cache manager and worker block table import here."""
    try:
        _vllm()
    except ImportError:
        return False
    return True


def _vllm() -> Any:
    """Import the vLLM pieces the benchmark drives (lazily: vLLM is optional)."""
    # vLLM logs an INFO line per hybrid config; the figures are the output here.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    import vllm.v1.utils as v1_utils
    from vllm.config import CacheConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    # CpuGpuBuffer.copy_to_gpu pins its source on every copy when vLLM believes pinned memory
    # exists (its platform default); a CPU-only torch cannot pin. The benchmark's buffers are
    # not pinned (pin_memory=False), so copy_to_gpu must copy them as they are.
    v1_utils.PIN_MEMORY = False
    return _Vllm(
        torch=torch,
        CacheConfig=CacheConfig,
        SamplingParams=SamplingParams,
        get_hash_fn_by_name=get_hash_fn_by_name,
        PAD_SLOT_ID=PAD_SLOT_ID,
        KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher,
        init_none_hash=init_none_hash,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        KVCacheTensor=KVCacheTensor,
        SlidingWindowSpec=SlidingWindowSpec,
        Request=Request,
        RequestStatus=RequestStatus,
        MultiGroupBlockTable=MultiGroupBlockTable,
        CpuGpuBuffer=v1_utils.CpuGpuBuffer,
    )


@dataclass(frozen=True)
class _Vllm:
    """The imported vLLM names, passed around instead of module globals."""

    torch: Any
    CacheConfig: Any
    SamplingParams: Any
    get_hash_fn_by_name: Any
    PAD_SLOT_ID: int
    KVCacheManager: Any
    get_request_block_hasher: Any
    init_none_hash: Any
    FullAttentionSpec: Any
    KVCacheConfig: Any
    KVCacheGroupSpec: Any
    KVCacheTensor: Any
    SlidingWindowSpec: Any
    Request: Any
    RequestStatus: Any
    MultiGroupBlockTable: Any
    CpuGpuBuffer: Any


# --- configuration -----------------------------------------------------------------------------


def _kv_cache_spec(v: _Vllm, group: GroupDef) -> Any:
    """The vLLM spec of one group, with ``page_size_bytes == group.bytes_per_block``.

    One head slot whose packed state is ``bytes_per_block // block_size`` bytes per token gives
    the group's exact page size (vLLM's ``page = heads * states * state_content_bytes``).
    """
    if group.bytes_per_block % group.block_size:
        raise ValueError(
            f"GroupDef.bytes_per_block {group.bytes_per_block} is not a multiple of block_size "
            f"{group.block_size} (group {group.name!r})"
        )
    common = {
        "block_size": group.block_size,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": v.torch.uint8,
        "state_content_bytes": group.bytes_per_block // group.block_size,
    }
    if group.kind == "full":
        spec = v.FullAttentionSpec(**common)
    else:
        spec = v.SlidingWindowSpec(sliding_window=group.window, **common)
    assert spec.page_size_bytes == group.bytes_per_block
    return spec


def _num_blocks(v: _Vllm, wl: StepWorkload) -> int:
    """Blocks in the shared pool: every request at its largest footprint, plus the null block.

    Per request a full group needs ``cdiv(max_model_len, block_size)`` blocks and a
    sliding-window group ``SlidingWindowSpec.max_admission_blocks_per_request`` (the bound vLLM
    sizes its own pool with), so no allocation of the schedule can ever be short.
    """
    per_request = 0
    for group in wl.groups:
        spec = _kv_cache_spec(v, group)
        if group.kind == "full":
            per_request += -(-wl.max_model_len // group.block_size)
        else:
            per_request += spec.max_admission_blocks_per_request(
                max_in_flight_tokens=wl.max_num_batched_tokens, max_model_len=wl.max_model_len
            )
    return 1 + wl.num_requests * per_request


def build_kv_cache_config(wl: StepWorkload) -> Any:
    """vLLM's ``KVCacheConfig`` for ``wl``: one group and one cache tensor per workload group.

    All groups share one block pool of :func:`_num_blocks` blocks, as in vLLM's hybrid
    allocator; each group gets one layer whose tensor holds ``num_blocks`` pages of
    ``bytes_per_block`` bytes (the tensors only describe memory: nothing here allocates it).
    """
    v = _vllm()
    num_blocks = _num_blocks(v, wl)
    groups, tensors = [], []
    for group in wl.groups:
        layer = f"{group.name}.layer0"
        groups.append(
            v.KVCacheGroupSpec(layer_names=[layer], kv_cache_spec=_kv_cache_spec(v, group))
        )
        tensors.append(
            v.KVCacheTensor(
                size=num_blocks * group.bytes_per_block,
                layers=[layer],
                layer_stride=num_blocks * group.bytes_per_block,
                block_stride=group.bytes_per_block,
            )
        )
    return v.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _scheduler_block_size(wl: StepWorkload) -> int:
    # resolve_kv_cache_block_sizes: one group -> its block size; several -> the LCM of the group
    # block sizes. With prefix caching off the hash block size equals it.
    return math.lcm(*(g.block_size for g in wl.groups))


# --- the step driver ---------------------------------------------------------------------------


class _VllmStepDriver:
    """One scheduler-side KV cache manager and one worker-side block table, driven per step.

    Rows of the worker's persistent batch are request indices (a request keeps its row from
    admission to its end, as it does in the V1 runner's persistent batch while it keeps being
    scheduled); a step's batch is rows ``[0, max scheduled row]``, with zero scheduled tokens for
    a row not in the step, which the slot-mapping kernel handles as an empty range.
    """

    def __init__(self, v: _Vllm, wl: StepWorkload) -> None:
        self.v, self.wl = v, wl
        torch = v.torch
        block_size = _scheduler_block_size(wl)
        self.manager = v.KVCacheManager(
            build_kv_cache_config(wl),
            max_model_len=wl.max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            max_in_flight_tokens=wl.max_num_batched_tokens,
            enable_caching=False,
        )
        # GPUModelRunner.may_reinitialize_input_batch: one block table per group, rows of
        # cdiv(max_model_len, block_size) entries (AttentionSpec.max_num_blocks_per_req, DCP 1).
        self.block_table = v.MultiGroupBlockTable(
            max_num_reqs=wl.num_requests,
            max_num_batched_tokens=wl.max_num_batched_tokens,
            pin_memory=False,
            device=torch.device("cpu"),
            block_sizes=[g.block_size for g in wl.groups],
            max_num_blocks=[-(-wl.max_model_len // g.block_size) for g in wl.groups],
            cp_kv_cache_interleave_size=1,
        )
        # Requests exist before they are scheduled (EngineCore.add_request); prefix caching is
        # off, so EngineCore gives them no block hasher.
        rng = np.random.default_rng(0)
        self.requests = [
            v.Request(
                request_id=f"req-{i}",
                prompt_token_ids=rng.integers(0, 128_000, wl.prompt_len).tolist(),
                sampling_params=v.SamplingParams(max_tokens=wl.decode_steps + 1),
                pooling_params=None,
                block_hasher=None,
            )
            for i in range(wl.num_requests)
        ]
        self.num_running = 0
        # GPUModelRunner / InputBatch buffers.
        n = max(wl.num_requests + 1, wl.max_num_batched_tokens)
        self.arange_np = np.arange(n, dtype=np.int64)
        self.query_pos = np.zeros(n, dtype=np.int64)
        self.num_computed_tokens_cpu = np.zeros(wl.num_requests, dtype=np.int32)
        self.num_scheduled_tokens = np.zeros(wl.num_requests, dtype=np.int32)
        self.query_start_loc = v.CpuGpuBuffer(
            wl.num_requests + 1, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False
        )
        self.positions = torch.zeros(wl.max_num_batched_tokens, dtype=torch.int64)

    # scheduler side -----------------------------------------------------------------------

    def schedule_blocks(
        self, step: Step
    ) -> tuple[list[tuple[int, tuple[list[int], ...]]], list[tuple[int, Any, int]]]:
        """The block part of ``Scheduler.schedule`` for one step.

        Returns the new requests' ``(row, block ids)`` (``NewRequestData.block_ids``) and the
        running requests' ``(row, new block ids or None, num_computed_tokens)``
        (``CachedRequestData``).
        """
        manager, waiting = self.manager, self.v.RequestStatus.WAITING
        manager.new_step_starts()
        new_reqs: list[tuple[int, tuple[list[int], ...]]] = []
        cached_reqs: list[tuple[int, Any, int]] = []
        for i, num_new_tokens in step.scheduled:
            request = self.requests[i]
            if request.status == waiting:
                computed_blocks, num_local, _ = manager.get_computed_blocks(request)
                new_blocks = manager.allocate_slots(
                    request,
                    num_new_tokens,
                    num_new_computed_tokens=num_local,
                    new_computed_blocks=computed_blocks,
                    num_lookahead_tokens=0,
                    num_external_computed_tokens=0,
                    delay_cache_blocks=False,
                    num_encoder_tokens=0,
                    full_sequence_must_fit=True,  # SchedulerConfig.scheduler_reserve_full_isl
                    reserved_blocks=0,
                    has_scheduled_reqs=self.num_running > 0,
                )
                self._check_allocated(new_blocks, i, num_new_tokens)
                self.num_running += 1
                new_reqs.append((i, manager.get_blocks(request.request_id).get_block_ids()))
                request.status = self.v.RequestStatus.RUNNING
                request.num_computed_tokens = num_local
            else:
                new_blocks = manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=0)
                self._check_allocated(new_blocks, i, num_new_tokens)
                cached_reqs.append(
                    (i, new_blocks.get_block_ids(allow_none=True), request.num_computed_tokens)
                )
        manager.take_new_block_ids()  # Scheduler._get_new_block_ids_to_zero drains every step
        # Scheduler._update_after_schedule
        for i, num_new_tokens in step.scheduled:
            request = self.requests[i]
            request.num_computed_tokens += num_new_tokens
            request.num_in_flight_tokens += num_new_tokens
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        return new_reqs, cached_reqs

    def _check_allocated(self, new_blocks: Any, i: int, n: int) -> None:
        if new_blocks is None:
            raise RuntimeError(
                f"vLLM KVCacheManager could not allocate {n} tokens for request {i} of workload "
                f"{self.wl.name!r}: the pool of {self.manager.block_pool.num_gpu_blocks} blocks "
                "is too small"
            )

    def settle(self, step: Step) -> None:
        """``Scheduler.update_from_output``: in-flight tokens land, finished prefills sample."""
        for i, num_new_tokens in step.scheduled:
            request = self.requests[i]
            request.num_in_flight_tokens -= num_new_tokens
            if request.num_computed_tokens >= request.num_tokens:
                request.append_output_token_ids(1)

    # worker side --------------------------------------------------------------------------

    def kernel_inputs(
        self,
        step: Step,
        new_reqs: Sequence[tuple[int, tuple[list[int], ...]]],
        cached_reqs: Sequence[tuple[int, Any, int]],
    ) -> int:
        """Block-table update, commit, positions and slot mappings; returns the token count."""
        block_table = self.block_table
        num_computed = self.num_computed_tokens_cpu
        # GPUModelRunner._update_states (InputBatch.add_request -> add_row; cached -> append_row)
        for row, block_ids in new_reqs:
            num_computed[row] = 0
            block_table.add_row(block_ids, row)
        for row, new_block_ids, computed in cached_reqs:
            num_computed[row] = computed
            if new_block_ids is not None:
                block_table.append_row(new_block_ids, row)
        # GPUModelRunner._prepare_inputs
        num_reqs = step.scheduled[-1][0] + 1
        num_scheduled = self.num_scheduled_tokens[:num_reqs]
        num_scheduled.fill(0)
        for i, n in step.scheduled:
            num_scheduled[i] = n
        block_table.commit_block_table(num_reqs)
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled)
        cu_num_tokens = np.cumsum(num_scheduled)  # _get_cumsum_and_arange
        total = int(cu_num_tokens[-1])
        offsets = np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        np.subtract(self.arange_np[:total], offsets, out=self.query_pos[:total])
        positions_np = num_computed[req_indices] + self.query_pos[:total]
        qsl = self.query_start_loc
        qsl.np[0] = 0
        qsl.np[1 : num_reqs + 1] = cu_num_tokens
        qsl.np[num_reqs + 1 :].fill(total)
        qsl.copy_to_gpu()
        positions = self.positions[:total]
        positions.copy_(self.v.torch.from_numpy(positions_np))
        query_start_loc = qsl.gpu[: num_reqs + 1]
        for table in block_table.block_tables:  # MultiGroupBlockTable.compute_slot_mapping
            _slot_mapping_port(self.v, table, num_reqs, query_start_loc, positions)
        return total

    def free_all(self, finished: Sequence[int]) -> None:
        """``Scheduler._free_request_blocks`` and ``InputBatch.remove_request`` per request."""
        for i in finished:
            self.manager.free(self.requests[i])
            self.block_table.clear_row(i)

    # checking -----------------------------------------------------------------------------

    def check_slot_mapping(self, step: Step, total: int) -> None:
        """Slot mappings agree with the manager's block ids at every scheduled position."""
        block_ids = {
            i: self.manager.get_block_ids(self.requests[i].request_id) for i, _ in step.scheduled
        }
        pad = self.v.PAD_SLOT_ID
        for g, table in enumerate(self.block_table.block_tables):
            slots = table.slot_mapping.gpu.numpy()
            bs = table.block_size
            start = 0
            for i, n in step.scheduled:
                first = self.requests[i].num_computed_tokens - n
                pos = np.arange(first, first + n)
                expected = np.asarray(block_ids[i][g], dtype=np.int64)[pos // bs] * bs + pos % bs
                got = slots[start : start + n]
                if not np.array_equal(got, expected):
                    raise AssertionError(
                        f"slot mapping of group {g} request {i} differs from the manager's blocks"
                    )
                if (expected // bs == 0).any():
                    raise AssertionError(
                        f"group {g} request {i} maps a live token to the null block"
                    )
                start += n
            if not (slots[total:] == pad).all():
                raise AssertionError(f"group {g}: padding past {total} tokens is not {pad}")


def _slot_mapping_port(
    v: _Vllm, table: Any, num_reqs: int, query_start_loc: Any, positions: Any
) -> None:
    """Torch port of vLLM 0.33's ``ComputeSlotMappingKernel`` (Triton; not runnable on CPU).

    The kernel runs one program per request over ``[query_start_loc[r], query_start_loc[r+1])``
    and one more that pads ``slot_mapping[num_tokens:max_num_tokens]`` with ``PAD_SLOT_ID``.
    Here the same arithmetic runs over all tokens at once: the request of each token comes from
    ``query_start_loc``, ``slot = block_table[req, pos // block_size] * block_size + pos %
    block_size`` with the block table's row stride, and the tail is padded. Context parallelism
    is 1, so every position is local (the kernel's ``is_local`` is always true).
    """
    torch = v.torch
    num_tokens = positions.shape[0]
    block_table = table.block_table.gpu
    block_size = table.block_size
    counts = query_start_loc[1:] - query_start_loc[:-1]
    req_idx = torch.repeat_interleave(
        torch.arange(num_reqs, dtype=torch.int64), counts, output_size=num_tokens
    )
    block_indices = positions // block_size
    block_offsets = positions - block_indices * block_size
    flat = req_idx * block_table.stride(0) + block_indices
    block_numbers = block_table.view(-1).index_select(0, flat).to(torch.int64)
    slot_mapping = table.slot_mapping.gpu
    torch.add(block_numbers * block_size, block_offsets, out=slot_mapping[:num_tokens])
    slot_mapping[num_tokens : table.max_num_batched_tokens].fill_(v.PAD_SLOT_ID)


def check_port_against_kernel(wl: StepWorkload) -> int:
    """Compare :func:`_slot_mapping_port` with vLLM's own Triton kernel, run interpreted.

    Needs ``TRITON_INTERPRET=1`` in the environment before Python starts and the ``triton``
    package. vLLM replaces triton with placeholders when no GPU driver is active, so the
    kernel's source is taken from ``ComputeSlotMappingKernel.kernel`` and compiled with the real
    ``triton.jit``. Checks the last two prefill steps, the first two decode steps and the last
    step, every group; returns how many (step, group) pairs were compared.
    """
    import inspect
    import textwrap

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("check_port_against_kernel needs TRITON_INTERPRET=1 set before start")
    import triton
    import triton.language as tl
    from vllm.v1.worker.block_table import ComputeSlotMappingKernel

    source = textwrap.dedent(inspect.getsource(ComputeSlotMappingKernel.kernel))
    source = "\n".join(line for line in source.splitlines() if line.strip() != "@staticmethod")
    namespace: dict[str, Any] = {"triton": triton, "tl": tl}
    exec(source, namespace)
    kernel = namespace["kernel"]
    v = _vllm()
    sched = schedule(wl)
    driver = _VllmStepDriver(v, wl)
    first_decode = sched.num_prefill_steps
    wanted = {first_decode - 2, first_decode - 1, first_decode, first_decode + 1}
    wanted.add(len(sched.steps) - 1)
    compared = 0
    for k, step in enumerate(sched.steps):
        new_reqs, cached_reqs = driver.schedule_blocks(step)
        total = driver.kernel_inputs(step, new_reqs, cached_reqs)
        if k in wanted:
            num_reqs = step.scheduled[-1][0] + 1
            for table in driver.block_table.block_tables:
                out = v.torch.full_like(table.slot_mapping.gpu, 12345)
                kernel[(num_reqs + 1,)](
                    total,
                    table.max_num_batched_tokens,
                    driver.query_start_loc.gpu[: num_reqs + 1],
                    driver.positions[:total],
                    table.block_table.gpu,
                    table.block_table.gpu.stride(0),
                    out,
                    KV_CACHE_BLOCK_SIZE=table.block_size,
                    TOTAL_CP_WORLD_SIZE=1,
                    TOTAL_CP_RANK=0,
                    CP_KV_CACHE_INTERLEAVE_SIZE=1,
                    PAD_ID=v.PAD_SLOT_ID,
                    BLOCK_SIZE=ComputeSlotMappingKernel.triton_block_size,
                )
                if not v.torch.equal(out, table.slot_mapping.gpu):
                    raise AssertionError(
                        f"{wl.name} step {k} block size {table.block_size}: the port's slot "
                        "mapping differs from vLLM's kernel"
                    )
                compared += 1
        driver.settle(step)
    return compared


def _run_schedule(v: _Vllm, wl: StepWorkload, sched: Schedule, check: bool) -> StepTimes:
    driver = _VllmStepDriver(v, wl)
    times = StepTimes()
    clock = time.perf_counter_ns
    decode_indices = [k for k, s in enumerate(sched.steps) if s.phase == "decode"]
    check_steps = {decode_indices[0], decode_indices[-1]} if decode_indices else set()
    if sched.num_prefill_steps:
        check_steps.add(sched.num_prefill_steps - 1)
    gc.collect()
    gc.disable()
    try:
        for k, step in enumerate(sched.steps):
            t0 = clock()
            new_reqs, cached_reqs = driver.schedule_blocks(step)
            t1 = clock()
            total = driver.kernel_inputs(step, new_reqs, cached_reqs)
            t2 = clock()
            if step.phase == "prefill":
                times.prefill_alloc.append(t1 - t0)
            else:
                times.decode_alloc.append(t1 - t0)
                times.kernel_inputs.append(t2 - t1)
                times.step.append(t2 - t0)
            if check and k in check_steps:
                driver.check_slot_mapping(step, total)
            driver.settle(step)
        t0 = clock()
        driver.free_all(sched.finished)
        times.free = clock() - t0
    finally:
        gc.enable()
    if check and driver.manager.block_pool.get_num_free_blocks() != (
        driver.manager.block_pool.num_gpu_blocks - 1
    ):
        raise AssertionError(f"{wl.name}: blocks leaked after freeing every request")
    return times


def run_vllm_step(wl: StepWorkload, repeats: int = 15) -> dict[str, float]:
    """Median microseconds of vLLM's per-step block bookkeeping on ``wl``'s schedule.

    Keys: ``prefill_alloc`` (scheduler-side allocation of a whole prefill step, mean over prefill
    steps), ``decode_alloc`` (the same per decode step), ``kernel_inputs`` (worker block-table
    update, commit, positions and slot mappings per decode step), ``step`` (both, per decode
    step), ``free`` (freeing every request, scheduler and worker, in total); each the median
    over ``repeats`` runs of the whole schedule, after one warm-up run that also checks every
    slot mapping against the manager's blocks.
    """
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    v = _vllm()
    torch = v.torch
    sched = schedule(wl)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run_schedule(v, wl, sched, check=True)
        runs = [_run_schedule(v, wl, sched, check=False) for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)

    # Out-of-window blocks of sliding-window groups are freed lazily, by the next
    # allocate_slots of their request: the first decode step pays for a whole prompt's.
    return StepTimes.medians(runs)


# --- prefix cache ------------------------------------------------------------------------------

#: models whose prefix-cache cost vLLM's side measures (kvforge's bundled config names)
PREFIX_MODELS = ("llama-3-8b", "deepseek-v4-flash")
#: default vLLM block size (``--block-size``) per model: Llama's 16; DeepSeek-V4's 256, the only
#: kernel block size its sparse-MLA and indexer backends support (vLLM's CPU platform forces it)
PREFIX_BLOCK_SIZES = {"llama-3-8b": 16, "deepseek-v4-flash": 256}
# The HF configs of the models, as kvforge bundles them: both sides measure the same model. Read
# as data (this module never imports kvforge).
_MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "kvforge" / "models" / "configs"


@dataclass(frozen=True)
class PrefixCacheSetup:
    """vLLM's scheduler-side KV cache configuration of one model, as ``EngineCore`` builds it.

    ``kv_cache_config`` is the scheduler's ``KVCacheConfig`` (``generate_scheduler_kv_cache_config``
    of the worker config), ``scheduler_block_size`` / ``hash_block_size`` what
    ``resolve_kv_cache_block_sizes`` gives (the request block hasher hashes every
    ``hash_block_size`` tokens), ``groups`` one line per KV cache group.
    """

    model: str
    vllm_config: Any
    kv_cache_config: Any
    scheduler_block_size: int
    hash_block_size: int
    groups: tuple[str, ...]


def _hf_config(model: str) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(**json.loads((_MODEL_CONFIGS / f"{model}.json").read_text()))


def _llama_layer_specs(cfg: Any, hf: Any) -> tuple[dict[str, Any], list[Any]]:
    """Llama-3-8B's per-layer specs: what ``Attention.get_kv_cache_spec`` returns for a decoder
    layer without a sliding window (``FullAttentionSpec`` at ``cache_config.block_size``, bf16
    KV, ``auto`` cache dtype), and the CUDA FlashAttention backend (for the layout)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    try:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        backends = [FlashAttentionBackend]
    except ImportError:  # the layout does not change what the manager does
        backends = []
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    spec = FullAttentionSpec(
        block_size=cfg.cache_config.block_size,
        num_kv_heads=hf.num_key_value_heads,
        head_size=head_size,
        head_size_v=head_size,
        dtype=torch.bfloat16,
        kv_quant_mode=KVQuantMode.NONE,
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(hf.num_hidden_layers)}
    return specs, backends


def _deepseek_v4_layer_specs(cfg: Any, hf: Any) -> tuple[dict[str, Any], list[Any]]:
    """DeepSeek-V4's per-layer specs, from vLLM's own DeepSeek-V4 code (CUDA, FlashMLA path).

    Per decoder layer ``i`` (compress ratio ``r`` from ``get_compress_ratios``; the MTP layer is
    not built without speculative decoding), what ``DeepseekV4FlashMLAAttention`` and its
    sub-modules register:

    - ``DeepseekV4SWACache`` (every layer): ``SlidingWindowMLASpec``, block 64, window
      ``sliding_window``, fp8_ds_mla pages;
    - ``r > 1``: the attention layer's compressed KV, ``MLAAttentionSpec`` at
      ``cache_config.block_size`` with ``tokens_per_state = r``, and its compressor's
      ``CompressorStateCache`` (``SlidingWindowMLASpec``: block 4 / window 8 for ``r = 4``,
      block 8 / window 128 for ``r = 128``);
    - ``r == 4``: the indexer's ``DeepseekV4IndexerCache`` (``MLAAttentionSpec``,
      ``tokens_per_state = 4``) and its compressor's ``CompressorStateCache``.

    The cache modules are vLLM's own, built under the config and asked for their spec. The
    attention layer itself cannot be built without weights and a distributed setup, so its
    ``get_kv_cache_spec`` runs on a stand-in carrying the four attributes it reads, set as
    its ``__init__`` sets them (``_resolve_dsv4_kv_cache_dtype`` included). The indexer and
    compressor widths are their ``__init__``'s: index K ``head + head / 128 * 4`` bytes (fp8),
    compressor state ``2 * coff * head`` with ``coff = 1 + (r == 4)``.
    """
    from types import SimpleNamespace

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention as Attn
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    if dsa_indexer_uses_fp4(cfg):
        raise NotImplementedError("the MXFP4 indexer cache is not modelled here")
    kv_cache_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(
        Attn.use_fp8_ds_mla_layout, cfg.cache_config.cache_dtype, cfg.cache_config
    )
    ratios = get_compress_ratios(hf)[: hf.num_hidden_layers]
    specs: dict[str, Any] = {}
    backends: set[Any] = {Attn.backend_cls}
    with set_current_vllm_config(cfg):
        for i, ratio in enumerate(ratios):
            r = max(1, int(ratio))
            prefix = f"model.layers.{i}.attn"
            layers: list[Any] = [
                DeepseekV4SWACache(
                    head_dim=hf.head_dim,
                    window_size=hf.sliding_window,
                    dtype=kv_torch_dtype,
                    prefix=f"{prefix}.swa_cache",
                    cache_config=cfg.cache_config,
                    backend_cls=Attn.swa_backend_cls,
                )
            ]
            if r > 1:
                stand_in = SimpleNamespace(
                    compress_ratio=r,
                    kv_cache_dtype=kv_cache_dtype,
                    head_dim=hf.head_dim,
                    kv_cache_torch_dtype=kv_torch_dtype,
                )
                specs[prefix] = Attn.get_kv_cache_spec(stand_in, cfg)
                layers.append(
                    CompressorStateCache(
                        state_dim=2 * (1 + (r == 4)) * hf.head_dim,
                        dtype=torch.float32,
                        compress_ratio=r,
                        prefix=f"{prefix}.compressor.state_cache",
                    )
                )
            if r == 4:
                index_dim = hf.index_head_dim
                layers.append(
                    DeepseekV4IndexerCache(
                        head_dim=index_dim + index_dim // 128 * 4,
                        dtype=torch.uint8,
                        prefix=f"{prefix}.indexer.k_cache",
                        cache_config=cfg.cache_config,
                        compress_ratio=r,
                    )
                )
                layers.append(
                    CompressorStateCache(
                        state_dim=2 * 2 * index_dim,
                        dtype=torch.float32,
                        compress_ratio=r,
                        prefix=f"{prefix}.indexer.compressor.state_cache",
                    )
                )
            for layer in layers:
                specs[layer.prefix] = layer.get_kv_cache_spec(cfg)
                backends.add(layer.get_attn_backend())
    return specs, sorted(backends, key=lambda b: b.__name__)


def _describe_group(group: Any) -> str:
    spec = group.kv_cache_spec
    inner = list(getattr(spec, "kv_cache_specs", {group.layer_names[0]: spec}).values())
    kinds = sorted({type(s).__name__ for s in inner})
    window = {getattr(s, "sliding_window", None) for s in inner} - {None}
    ratio = sorted({s.tokens_per_state for s in inner if getattr(s, "tokens_per_state", 1) != 1})
    text = f"{'/'.join(kinds)} block {spec.block_size}"
    if window:
        text += f" window {'/'.join(map(str, sorted(window)))}"
    if ratio:
        text += f" tokens/state {'/'.join(map(str, ratio))}"
    return f"{text}, {len(group.layer_names)} layers"


def build_prefix_kv_cache_config(
    model: str, block_size: int | None = None, max_model_len: int = 4096
) -> PrefixCacheSetup:
    """vLLM's real scheduler-side KV cache config of ``model`` (one of :data:`PREFIX_MODELS`).

    The path ``EngineCore._initialize_kv_caches`` takes, minus the model weights and memory
    profiling: a ``VllmConfig`` (prefix caching on, the default ``sha256`` key, the hybrid KV
    cache manager on, as vLLM enables it on CUDA; this build's platform is "unspecified"
    and would switch it off), the per-layer specs of the model's layers
    (:func:`_llama_layer_specs`, :func:`_deepseek_v4_layer_specs`), the layout
    (``resolve_kv_cache_layout`` over the layers' backends), vLLM's grouping
    (``get_kv_cache_groups``, what ``DefaultKVCacheConfigBuilder`` runs for a model that does
    not declare its own grouping; DeepSeek-V4 does not), the builder's
    ``get_kv_cache_config_from_groups``, ``generate_scheduler_kv_cache_config``, then
    ``resolve_kv_cache_block_sizes`` and ``resolve_cache_hit_alignment_tokens``. The pool holds
    every group's blocks of two ``max_model_len`` requests, so nothing is evicted.
    """
    if model not in PREFIX_BLOCK_SIZES:
        raise ValueError(f"model must be one of {PREFIX_MODELS}, got {model!r}")
    block_size = PREFIX_BLOCK_SIZES[model] if block_size is None else block_size
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if model == "deepseek-v4-flash" and block_size != 256:
        raise ValueError("DeepSeek-V4's sparse-MLA and indexer kernels support block 256 only")
    _vllm()  # logging level, PIN_MEMORY
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    cfg = VllmConfig(
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"),
    )
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    hf = _hf_config(model)
    if model == "llama-3-8b":
        specs, backends = _llama_layer_specs(cfg, hf)
    else:
        specs, backends = _deepseek_v4_layer_specs(cfg, hf)
    KVCacheSpecRegistry.check_kv_cache_spec_registry(specs)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(cfg, [layouts], specs.values())
    groups = get_kv_cache_groups(cfg, dict(specs))
    num_blocks = 1 + 2 * sum(-(-max_model_len // g.kv_cache_spec.block_size) for g in groups)
    builder = get_kv_cache_config_builder(cfg)
    worker_config = builder.get_kv_cache_config_from_groups(cfg, groups, num_blocks)
    worker_config.kv_cache_layout = cfg.cache_config.kv_cache_layout
    config = generate_scheduler_kv_cache_config([worker_config])
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(config, cfg)
    config.hash_block_size = hash_block_size
    config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        config, cfg, scheduler_block_size, hash_block_size
    )
    return PrefixCacheSetup(
        model=model,
        vllm_config=cfg,
        kv_cache_config=config,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        groups=tuple(_describe_group(g) for g in groups),
    )


def prefix_prompt(prompt_len: int = 2048) -> list[int]:
    """The measured prompt: seeded token ids, the same as ``prefix_sim.measure_cost``'s."""
    return np.random.default_rng(1).integers(0, 128_000, prompt_len).tolist()


class VllmPrefixRounds:
    """vLLM's prefix-cache cost of one prompt, one timed round per call.

    On ``model``'s real KV cache config (:func:`build_prefix_kv_cache_config`; ``block_size``
    None: :data:`PREFIX_BLOCK_SIZES`), with the prompt of :func:`prefix_prompt`. A round:

    - hashing: the request block hasher ``EngineCore`` builds with prefix caching on
      (``get_request_block_hasher(hash_block_size, get_hash_fn_by_name(prefix_caching_hash_algo),
      num_hash_lookahead_tokens)`` after ``init_none_hash``: sha256 of pickled ``(parent hash,
      block tokens, extra keys)``) turning the prompt into ``prompt_len // hash_block_size``
      chained hashes, as ``Request`` computes them;
    - lookup: ``KVCacheManager.get_computed_blocks`` (the hybrid coordinator where there are
      several groups) for a new request with the same prompt, after a first request was
      allocated, cached and freed: the hit is every scheduler block below the last prompt
      token, checked on every round.

    Use it as a context (one torch thread inside) and call it once per round; :meth:`figures`
    gives the medians. Callers interleave its rounds with another side's (``bench_prefix``
    runs them between kvforge's), so both see the same machine load.
    """

    def __init__(self, model: str, prompt_len: int = 2048, block_size: int | None = None) -> None:
        if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 1:
            raise ValueError(f"prompt_len must be a positive int, got {prompt_len!r}")
        v = self._v = _vllm()
        max_model_len = prompt_len + 256
        setup = self.setup = build_prefix_kv_cache_config(model, block_size, max_model_len)
        if prompt_len < setup.scheduler_block_size:
            raise ValueError(
                f"prompt_len {prompt_len} is shorter than the block size "
                f"{setup.scheduler_block_size}"
            )
        cfg = setup.vllm_config
        hash_fn = v.get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        v.init_none_hash(hash_fn)
        self.hasher = v.get_request_block_hasher(
            setup.hash_block_size, hash_fn, cfg.num_hash_lookahead_tokens
        )
        tokens = prefix_prompt(prompt_len)

        def new_request(request_id: str) -> Any:
            return v.Request(
                request_id=request_id,
                prompt_token_ids=list(tokens),
                sampling_params=v.SamplingParams(max_tokens=1),
                pooling_params=None,
                block_hasher=self.hasher,
            )

        self.manager = v.KVCacheManager(
            setup.kv_cache_config,
            max_model_len=max_model_len,
            scheduler_block_size=setup.scheduler_block_size,
            hash_block_size=setup.hash_block_size,
            max_in_flight_tokens=cfg.max_in_flight_tokens,
            enable_caching=True,
        )
        first = new_request("first")
        blocks, hit, _ = self.manager.get_computed_blocks(first)
        assert hit == 0
        if (
            self.manager.allocate_slots(
                first, prompt_len, num_new_computed_tokens=0, new_computed_blocks=blocks
            )
            is None
        ):
            raise RuntimeError("vLLM KVCacheManager could not allocate the first prompt")
        self.manager.free(first)
        self.request = new_request("second")
        step = setup.scheduler_block_size
        self.model = model
        self.hit_tokens = (prompt_len - 1) // step * step
        self.num_hashes = prompt_len // setup.hash_block_size
        self.hash_ns: list[int] = []
        self.lookup_ns: list[int] = []
        self._threads: int | None = None

    def __enter__(self) -> VllmPrefixRounds:
        self._threads = self._v.torch.get_num_threads()
        self._v.torch.set_num_threads(1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._threads is not None:
            self._v.torch.set_num_threads(self._threads)
            self._threads = None

    def __call__(self) -> None:
        """One round: hash the prompt, then look it up; both timed, the hit checked."""
        clock = time.perf_counter_ns
        request = self.request
        request.block_hashes = []
        t0 = clock()
        hashes = self.hasher(request)
        request.block_hashes = hashes
        t1 = clock()
        _, hit, _ = self.manager.get_computed_blocks(request)
        t2 = clock()
        self.hash_ns.append(t1 - t0)
        self.lookup_ns.append(t2 - t1)
        if len(hashes) != self.num_hashes or hit != self.hit_tokens:
            raise AssertionError(
                f"{self.model}: {len(hashes)} hashes and a hit of {hit} tokens; expected "
                f"{self.num_hashes} and {self.hit_tokens}"
            )

    def figures(self, warmup: int = 1) -> dict[str, Any]:
        """Medians (us) over the rounds after the first ``warmup``, and what was measured."""
        if len(self.hash_ns) <= warmup:
            raise ValueError(f"{len(self.hash_ns)} rounds, not more than warmup={warmup}")
        return {
            "hash_us": statistics.median(self.hash_ns[warmup:]) / 1000.0,
            "lookup_us": statistics.median(self.lookup_ns[warmup:]) / 1000.0,
            "rounds": len(self.hash_ns) - warmup,
            "hit_tokens": self.hit_tokens,
            "num_hashes": self.num_hashes,
            "hash_block_size": self.setup.hash_block_size,
            "scheduler_block_size": self.setup.scheduler_block_size,
            "groups": list(self.setup.groups),
            "coordinator": type(self.manager.coordinator).__name__,
        }


def run_vllm_prefix_cost(
    prompt_len: int = 2048,
    block_size: int | None = None,
    repeats: int = 200,
    model: str = "llama-3-8b",
) -> dict[str, Any]:
    """Median microseconds of vLLM's prefix-cache hashing (``hash_us``) and full-hit lookup
    (``lookup_us``) of one prompt: ``repeats`` rounds of :class:`VllmPrefixRounds` after a
    warm-up round, with the garbage collector off. Also returned: ``hit_tokens``,
    ``num_hashes``, ``hash_block_size``, ``scheduler_block_size``, ``groups`` (one line per KV
    cache group), ``coordinator``."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    rounds = VllmPrefixRounds(model, prompt_len, block_size)
    gc.collect()
    gc.disable()
    try:
        with rounds:
            for _ in range(repeats + 1):  # the first round warms up
                rounds()
    finally:
        gc.enable()
    return rounds.figures()


# --- the vs-vLLM benchmarks: vLLM's engine as it starts, at a byte budget -----------------------
#
# ``prefix_vs_vllm.py`` and ``capacity_vs_vllm.py`` drive vLLM's real ``KVCacheManager`` and
# ``Scheduler`` (v1) offline. The functions below build what ``EngineCore.__init__`` builds,
# minus the model: a ``VllmConfig`` from the model's own ``config.json`` (kvforge's bundled
# copy, read by vLLM's ``ModelConfig``), the per-layer ``KVCacheSpec`` objects vLLM's attention
# layers would return, vLLM's grouping and sizing (``get_global_kv_cache_groups``,
# ``get_kv_cache_configs`` with the byte budget as the profiled memory), the block sizes and
# the hasher, then the scheduler or its manager. Nothing is allocated.

#: kvforge bundled config names of the models the vs-vLLM benchmarks drive
VS_MODELS = (
    "llama-3-8b",
    "gpt-oss-20b",
    "gemma-2-9b",
    "mistral-7b-v0.1",
    "deepseek-v4-tiny",
    "deepseek-v4-flash",
)
#: ``--block-size`` per model: 16 for the GQA models (vLLM's CUDA default), 256 for
#: DeepSeek-V4 (its sparse-MLA and indexer kernels support no other)
VS_BLOCK_SIZES = {m: 256 if m.startswith("deepseek-v4") else 16 for m in VS_MODELS}
#: ``CacheConfig.prefix_cache_retention_interval``: vLLM 0.33's default (0: sliding-window
#: blocks are kept only at replay boundaries, the end of each prompt and shared-prefix
#: junctions) and dense retention (``None``: every completed block is kept)
RETENTION_DEFAULT = 0
RETENTION_DENSE = None


def vllm_model_dir(model: str) -> str:
    """A directory holding ``model``'s bundled ``config.json``, for vLLM's ``ModelConfig``
    (which reads a model directory; the weights are never needed)."""
    import tempfile

    if model not in VS_MODELS:
        raise ValueError(f"model must be one of {VS_MODELS}, got {model!r}")
    directory = Path(tempfile.gettempdir()) / f"kvforge-vllm-configs-{os.getuid()}" / model
    directory.mkdir(parents=True, exist_ok=True)
    text = (_MODEL_CONFIGS / f"{model}.json").read_text()
    target = directory / "config.json"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    return str(directory)


def build_vllm_engine_config(
    model: str,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool = True,
    retention_interval: int | None = RETENTION_DEFAULT,
    async_scheduling: bool = False,
    long_prefill_token_threshold: int = 0,
) -> Any:
    """The ``VllmConfig`` an engine for ``model`` starts with, built as ``EngineArgs`` builds it.

    ``ModelConfig`` reads the bundled ``config.json`` (dtype ``auto``: bf16 for every model
    here, vLLM downcasting Gemma-2's float32), ``CacheConfig`` gets the block size of
    :data:`VS_BLOCK_SIZES`, the model-level sliding window only for a model whose layers all
    slide (``EngineArgs.create_engine_config``'s rule), prefix caching and the retention
    interval; ``SchedulerConfig`` chunked prefill, ``max_num_seqs``, ``max_num_batched_tokens``
    and ``async_scheduling`` (vLLM's default on CUDA is True; ``False`` is the synchronous
    ``Scheduler``), and ``long_prefill_token_threshold`` (the per-request chunk cap when
    several requests are eligible; vLLM's default 0 is none). The hybrid KV cache manager is
    switched on as on CUDA (this build's platform is "unspecified" and would switch it off).
    """
    _vllm()  # logging level, PIN_MEMORY
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=vllm_model_dir(model),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="auto",
    )
    layer_types = getattr(model_config.hf_text_config, "layer_types", None)
    sliding_window = None
    if layer_types is None or all(t == "sliding_attention" for t in layer_types):
        sliding_window = model_config.get_sliding_window()
    cache_config = CacheConfig(
        block_size=VS_BLOCK_SIZES[model],
        sliding_window=sliding_window,
        enable_prefix_caching=enable_prefix_caching,
        prefix_cache_retention_interval=retention_interval,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
    )
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    return cfg


def _gqa_layer_specs(cfg: Any, model: str) -> tuple[dict[str, Any], list[Any]]:
    """Per-layer specs of a GQA model (Llama-3, gpt-oss, Gemma-2, Mistral), as vLLM's
    ``Attention.get_kv_cache_spec`` returns them, with the CUDA FlashAttention backend.

    A layer's window is the model code's: gpt-oss slides on even layers
    (``models/gpt_oss.py``), Gemma-2 where ``layer_types`` says ``sliding_attention``
    (``models/gemma2.py``), Llama / Mistral where ``layer_types`` says so, else the model-level
    ``cache_config.sliding_window`` (``per_layer_sliding_window=None``). A full layer gets a
    ``FullAttentionSpec`` at ``cache_config.block_size``; a sliding one a ``SlidingWindowSpec``
    whose block is ``_largest_kernel_block_within`` the primary page (the block size itself
    for these backends). KV in the model dtype (bf16), no quantization.
    """
    import torch
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, SlidingWindowSpec

    hf = cfg.model_config.hf_text_config
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_size = cfg.cache_config.block_size
    dtype = cfg.model_config.dtype
    if dtype != torch.bfloat16:
        raise ValueError(f"{model}: vLLM resolved dtype {dtype}, the benchmarks compare bf16")
    layer_types = getattr(hf, "layer_types", None)
    common = {
        "num_kv_heads": hf.num_key_value_heads,
        "head_size": head,
        "head_size_v": head,
        "dtype": dtype,
        "kv_quant_mode": KVQuantMode.NONE,
    }
    specs: dict[str, Any] = {}
    for i in range(hf.num_hidden_layers):
        if model.startswith("gpt-oss"):
            window = hf.sliding_window if i % 2 == 0 else None
        elif layer_types:
            window = hf.sliding_window if layer_types[i] == "sliding_attention" else None
        else:
            window = None
        if window is None:
            window = cfg.cache_config.sliding_window
        if window is None:
            spec = FullAttentionSpec(block_size=block_size, **common)
        else:
            one = SlidingWindowSpec(block_size=1, sliding_window=window, **common)
            per_token = one.real_page_size_bytes
            sw_block = _largest_kernel_block_within(
                FlashAttentionBackend, per_token, per_token * block_size, block_size, one
            )
            spec = SlidingWindowSpec(
                block_size=sw_block, sliding_window=window, page_size_padded=None, **common
            )
        specs[f"model.layers.{i}.self_attn.attn"] = spec
    return specs, [FlashAttentionBackend]


def vllm_layer_specs(cfg: Any, model: str) -> tuple[dict[str, Any], list[Any]]:
    """``model``'s per-layer KV cache specs and attention backends under ``cfg``: vLLM's
    DeepSeek-V4 cache modules (:func:`_deepseek_v4_layer_specs`), or
    :func:`_gqa_layer_specs`."""
    if model.startswith("deepseek-v4"):
        return _deepseek_v4_layer_specs(cfg, _hf_config(model))
    return _gqa_layer_specs(cfg, model)


@dataclass(frozen=True)
class VllmCacheSetup:
    """vLLM's KV cache of one model at one byte budget, as ``EngineCore`` sets it up.

    ``memory_bytes`` is what vLLM allocates: its one backing allocation,
    ``num_blocks * bytes_per_block`` (every ``KVCacheTensor`` aliases it; ``bytes_per_block``
    is one block of every layer's page, padded as vLLM pads it). Block 0 of it is the null
    block. ``kv_cache_config`` is the scheduler's config.
    """

    model: str
    vllm_config: Any
    kv_cache_config: Any
    num_blocks: int
    bytes_per_block: int
    memory_bytes: int
    scheduler_block_size: int
    hash_block_size: int
    groups: tuple[str, ...]


def build_vllm_cache_setup(model: str, available_memory: int, **config: Any) -> VllmCacheSetup:
    """``EngineCore._initialize_kv_caches`` for ``model`` with ``available_memory`` bytes as the
    profiled KV cache memory.

    ``config`` goes to :func:`build_vllm_engine_config`. In order: the layer specs
    (:func:`vllm_layer_specs`), ``resolve_kv_cache_layout`` over the backends,
    ``get_global_kv_cache_groups``, ``get_kv_cache_configs`` (its memory check included: a
    budget that cannot hold one ``max_model_len`` request raises vLLM's ``ValueError``),
    ``generate_scheduler_kv_cache_config``, ``cache_config.num_gpu_blocks``,
    ``resolve_kv_cache_block_sizes`` and ``resolve_cache_hit_alignment_tokens``. The blocks are
    ``available_memory // bytes_per_block``; the rest of the budget is unused.
    """
    _vllm()
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )

    cfg = build_vllm_engine_config(model, **config)
    specs, backends = vllm_layer_specs(cfg, model)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(cfg, [layouts], specs.values())
    groups = get_global_kv_cache_groups(cfg, [specs])
    [worker] = get_kv_cache_configs(cfg, [specs], [int(available_memory)], groups)
    worker.kv_cache_layout = cfg.cache_config.kv_cache_layout
    config_ = generate_scheduler_kv_cache_config([worker])
    cfg.cache_config.num_gpu_blocks = config_.num_blocks
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(config_, cfg)
    config_.hash_block_size = hash_block_size
    config_.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        config_, cfg, scheduler_block_size, hash_block_size
    )
    sizes = {t.size for t in worker.kv_cache_tensors}
    if len(sizes) != 1:
        raise AssertionError(f"{model}: vLLM gave {len(sizes)} backing sizes, expected one")
    memory = sizes.pop()
    if memory % worker.num_blocks:
        raise AssertionError(f"{model}: backing of {memory} B is not whole blocks")
    return VllmCacheSetup(
        model=model,
        vllm_config=cfg,
        kv_cache_config=config_,
        num_blocks=worker.num_blocks,
        bytes_per_block=memory // worker.num_blocks,
        memory_bytes=memory,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        groups=tuple(_describe_group(g) for g in config_.kv_cache_groups),
    )


def vllm_block_hasher(setup: VllmCacheSetup) -> Any:
    """The request block hasher ``EngineCore.__init__`` builds (None without prefix caching):
    ``get_request_block_hasher(hash_block_size, sha256, num_hash_lookahead_tokens)`` after
    ``init_none_hash``."""
    cfg = setup.vllm_config
    if not cfg.cache_config.enable_prefix_caching:
        return None
    v = _vllm()
    hash_fn = v.get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    v.init_none_hash(hash_fn)
    return v.get_request_block_hasher(setup.hash_block_size, hash_fn, cfg.num_hash_lookahead_tokens)


def build_vllm_scheduler(setup: VllmCacheSetup) -> Any:
    """vLLM's scheduler as ``EngineCore.__init__`` builds it: the class
    ``SchedulerConfig.get_scheduler_cls`` names (``Scheduler``, or ``AsyncScheduler`` with
    async scheduling), a ``StructuredOutputManager``, the scheduler KV cache config and the
    resolved block sizes."""
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = setup.vllm_config
    cls = cfg.scheduler_config.get_scheduler_cls()
    return cls(
        vllm_config=cfg,
        kv_cache_config=setup.kv_cache_config,
        structured_output_manager=StructuredOutputManager(cfg),
        include_finished_set=False,
        log_stats=False,
        block_size=setup.scheduler_block_size,
        hash_block_size=setup.hash_block_size,
    )


def build_vllm_kv_cache_manager(setup: VllmCacheSetup) -> Any:
    """The ``KVCacheManager`` ``Scheduler.__init__`` builds for ``setup`` (no speculative
    decoding, no connector, the scheduler config's watermark)."""
    v = _vllm()
    cfg = setup.vllm_config
    return v.KVCacheManager(
        kv_cache_config=setup.kv_cache_config,
        max_model_len=cfg.model_config.max_model_len,
        max_in_flight_tokens=cfg.max_in_flight_tokens,
        enable_caching=cfg.cache_config.enable_prefix_caching,
        use_eagle=False,
        num_hash_lookahead_tokens=cfg.num_hash_lookahead_tokens,
        num_prefill_lookahead=cfg.num_prefill_lookahead_tokens,
        log_stats=False,
        enable_kv_cache_events=False,
        dcp_world_size=cfg.parallel_config.decode_context_parallel_size,
        pcp_world_size=1,
        scheduler_block_size=setup.scheduler_block_size,
        hash_block_size=setup.hash_block_size,
        watermark=cfg.scheduler_config.watermark,
        enable_mamba_shared_prefix_checkpoint=(
            cfg.cache_config.enable_mamba_shared_prefix_checkpoint
        ),
    )


# --- command line ------------------------------------------------------------------------------


def _environment() -> dict[str, Any]:
    import torch
    import vllm

    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per workload")
    parser.add_argument(
        "--workloads",
        default="",
        help="comma-separated workload names (default: all, scaling set included)",
    )
    parser.add_argument("--prefix-repeats", type=int, default=200)
    parser.add_argument("--json", type=str, default=None, metavar="PATH")
    parser.add_argument(
        "--check-kernel",
        action="store_true",
        help="only compare the slot-mapping port with vLLM's Triton kernel (TRITON_INTERPRET=1)",
    )
    args = parser.parse_args(argv)

    if not vllm_available():
        print(f"vLLM {VLLM_VERSION} is not importable here; see docs/vllm_baseline.md")
        return 1
    from rich.console import Console
    from rich.table import Table

    wanted = [w for w in args.workloads.split(",") if w]
    known = {w.name: w for w in all_workloads()}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(known)}")
    workloads = [known[w] for w in wanted] if wanted else list(all_workloads())

    console = Console(width=150)
    if args.check_kernel:
        for wl in workloads:
            compared = check_port_against_kernel(wl)
            console.print(f"{wl.name}: port == vLLM kernel on {compared} (step, group) pairs")
        return 0
    env = _environment()
    console.print(
        f"vLLM {env['vllm']}, torch {env['torch']}, Python {env['python']}, "
        f"{args.repeats} repeats, one thread"
    )
    table = Table(title="vLLM per-step block bookkeeping (us, median)")
    table.add_column("workload")
    table.add_column("groups", justify="right")
    table.add_column("reqs", justify="right")
    for key in (*STEP_KEYS, "decode_alloc_first"):
        table.add_column(key, justify="right")
    results: dict[str, Any] = {"environment": env, "repeats": args.repeats, "step": {}}
    for wl in workloads:
        t0 = time.perf_counter()
        figures = run_vllm_step(wl, repeats=args.repeats)
        results["step"][wl.name] = figures
        table.add_row(
            wl.name,
            str(len(wl.groups)),
            str(wl.num_requests),
            *(f"{figures[k]:.1f}" for k in (*STEP_KEYS, "decode_alloc_first")),
        )
        console.print(f"  {wl.name}: {time.perf_counter() - t0:.1f} s", style="dim")
    console.print(table)

    results["prefix"] = {}
    for model in PREFIX_MODELS:
        prefix = run_vllm_prefix_cost(repeats=args.prefix_repeats, model=model)
        results["prefix"][model] = prefix
        console.print(
            f"prefix cache, {model}, 2048-token prompt, block "
            f"{prefix['scheduler_block_size']} (hashed every {prefix['hash_block_size']} "
            f"tokens): hash {prefix['hash_us']:.1f} us, full-hit lookup "
            f"{prefix['lookup_us']:.1f} us ({prefix['hit_tokens']} tokens)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
