"""The worker side of the vLLM offloading backend: moves blocks between vLLM's KV caches and
kvforge's compact host pages with kvforge's gather/scatter (:mod:`kvforge.ops`).

A group's *planes* are its layers' caches as vLLM registered them (``CanonicalKVCaches``): one
``uint8 [num_blocks, unpadded page bytes]`` view per layer, whatever vLLM's block stride
(strided, padded and, through :class:`~kvforge.integrations.vllm.connector.KVForgeConnector`,
per-layer views of packed DeepSeek-V4 blocks). A group's host pages are
``uint8 [num_pages * blocks_per_chunk, block_bytes]``: row ``(page - 1) * blocks_per_chunk + b``
holds block ``b`` of the page's chunk, every layer's unpadded page back to back. One
:func:`kvforge.ops.gather_blocks` (store) or :func:`~kvforge.ops.scatter_blocks` (load) per
group moves a transfer.

Transfers run when submitted and are reported by the next :meth:`get_finished`. A transfer
that raises (a bad spec, a failed copy) is reported with ``success=False``, never raised into
the engine: the connector turns a failed load into a recompute and a failed store into a
dropped, counted store. A spec's ids must be ints in range (block ids below the caches' block
count, page ids in the plan): a float is never truncated to a block.

The options are checked against the caches at construction (engine start): ``impl`` must run
where the caches live, ``pin_memory=True`` needs an accelerator, and the host pages must fit in
this machine's memory; each refusal is one error naming the option and the value.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvforge.integrations.vllm.checks import int_array, int_id
from kvforge.integrations.vllm.config import (
    MACHINE_RULES,
    MachineFacts,
    check_gather_impl,
    option_error,
)
from kvforge.integrations.vllm.pages import HostPagePlan, HostPages
from kvforge.ops import PlaneSet, gather_blocks, scatter_blocks

__all__ = ["KVForgeOffloadingWorker", "TransferError"]

logger = logging.getLogger(__name__)


class TransferError(ValueError):
    """A load or store spec that does not fit the registered caches or the host pages."""


def group_planes(kv_caches: CanonicalKVCaches) -> list[PlaneSet]:
    """Each offloaded group's planes: the unpadded bytes of every layer ref, as ``uint8``
    views ``[num_blocks, page_size_bytes]`` over vLLM's tensors (no copy)."""
    out = []
    for refs in kv_caches.group_data_refs:
        planes = []
        for ref in refs:
            t = kv_caches.tensors[ref.tensor_idx].tensor
            planes.append(t.view(torch.uint8)[:, : ref.page_size_bytes])
        out.append(PlaneSet(planes))
    return out


class KVForgeOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` on kvforge's host pages.

    Args:
        kv_caches: vLLM's registered caches; ``group_data_refs[i]`` is group position ``i``.
        plan: the page spaces: their page count (the scheduler's). A row holds group ``i``'s
            layers' own unpadded pages (:attr:`block_bytes`), which differ from
            ``plan.block_bytes[i]`` only where vLLM's scheduler sees one page for unequal
            layers.
        impl: the gather/scatter implementation (``"auto"``: :func:`kvforge.ops.resolve_impl`),
            resolved once here for the caches' device (:attr:`impls`).
        pin_memory: page-lock the host pages (``None``: when the caches are on an
            accelerator).
        machine: this machine's facts (``None``: detected for the caches' device).

    Raises:
        TransferError: the caches do not match the plan (the number of groups).
        ArgumentError: ``impl`` cannot run where the caches live, ``pin_memory=True`` on a
            machine with no accelerator, or host pages beyond this machine's memory (or that
            it fails to allocate); the message names the option and the value.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        plan: HostPagePlan,
        impl: str = "auto",
        pin_memory: bool | None = None,
        machine: MachineFacts | None = None,
    ) -> None:
        self.plan = plan
        self.impl = impl
        self.planes = group_planes(kv_caches)
        if len(self.planes) != len(plan.block_bytes):
            raise TransferError(
                f"vLLM registered {len(self.planes)} offloaded groups, the host plan has "
                f"{len(plan.block_bytes)}"
            )
        device = self.planes[0].device
        machine = machine or MachineFacts.detect(device.type)
        if not isinstance(impl, str):
            raise option_error(
                "gather_impl", impl, "must be one of 'auto', 'torch', 'cpu', 'triton'"
            )
        #: per group position: the concrete gather/scatter implementation for its planes
        self.impls = [check_gather_impl(impl, p.device) for p in self.planes]
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise option_error("pin_memory", pin_memory, "must be true, false or null")
        why = MACHINE_RULES["pin_memory"](pin_memory, machine)
        if why is not None:
            raise option_error("pin_memory", pin_memory, why)
        #: per group position: one block's bytes in a host row, every layer's unpadded page
        self.block_bytes = [planes.row_bytes for planes in self.planes]
        host_bytes = plan.num_pages * plan.blocks_per_chunk * sum(self.block_bytes)
        if host_bytes > plan.host_bytes:
            logger.warning(
                "kvforge host pages take %d B, above the %d B planned: vLLM's scheduler sees one "
                "page for layers whose pages differ",
                host_bytes,
                plan.host_bytes,
            )
        why = MACHINE_RULES["host_bytes"](host_bytes, machine)
        if why is not None:
            raise option_error(
                "host_bytes", plan.host_bytes, f"its pages take {host_bytes:,} B; {why}"
            )
        if pin_memory is None:
            pin_memory = device.type != "cpu"
        self.pin_memory = pin_memory
        #: per group position: ``uint8 [num_pages * blocks_per_chunk, block_bytes]``
        self.host = self._allocate_host(host_bytes, machine)
        self._finished: list[TransferResult] = []
        #: bytes moved by successful stores and loads, and transfers that failed
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.failed_transfers = 0

    def _allocate_host(self, host_bytes: int, machine: MachineFacts) -> list[torch.Tensor]:
        """One host page array per group; a failed allocation names ``host_bytes``."""
        plan, pin_memory = self.plan, self.pin_memory
        bpc = plan.blocks_per_chunk
        try:
            return [
                torch.empty((plan.num_pages * bpc, b), dtype=torch.uint8, pin_memory=pin_memory)
                for b in self.block_bytes
            ]
        except (RuntimeError, MemoryError) as exc:
            raise option_error(
                "host_bytes",
                plan.host_bytes,
                f"allocating {host_bytes:,} B of {'pinned ' if pin_memory else ''}host pages "
                f"failed on this machine ({machine.host_memory or 0:,} bytes of memory): {exc}",
            ) from None

    # ------------------------------------------------------------------ mapping

    def _rows(
        self, gpu: GPULoadStoreSpec, host: LoadStoreSpec, store: bool
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per group with blocks: ``(position, device block ids, host rows)``.

        Block ``j`` of a group is logical block ``block_indices[g] + j`` of its request, in
        chunk ``(block_indices[g] % bpc + j) // bpc`` of the group's pages (vLLM lists a
        transfer's blocks in prefix order, whole chunks for stores: only the first may start
        mid-chunk, where a sliding window's blocks are null; a store may skip whole chunks).

        Raises:
            TransferError: the specs disagree with each other or with the plan.
        """
        sizes, starts, ids = self._check_spec_sizes(gpu, host)
        out = []
        start = 0
        for pos, n in enumerate(sizes):
            blocks, start = ids[start : start + n], start + n
            if n == 0:
                if len(host.pages[pos]):
                    raise TransferError(f"group position {pos}: host pages but no blocks")
                continue
            rows = self._group_rows(pos, blocks, int(starts[pos]), host.pages[pos], store)
            out.append((pos, blocks, rows))
        return out

    def _check_spec_sizes(
        self, gpu: GPULoadStoreSpec, host: LoadStoreSpec
    ) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The group sizes, block indices and device block ids of a transfer, checked to
        agree with each other and with the offloaded groups."""
        if not isinstance(host, HostPages):
            raise TransferError(f"expected kvforge host pages, got {type(host).__name__}")
        sizes = list(gpu.group_sizes)
        if len(sizes) != len(self.planes) or len(host.pages) != len(self.planes):
            raise TransferError(
                f"a transfer names {len(sizes)} device groups and {len(host.pages)} host groups, "
                f"{len(self.planes)} are offloaded"
            )
        sizes = int_array("group_sizes", sizes, 0).tolist()
        starts = int_array("block_indices", gpu.block_indices, 0)
        if len(starts) != len(sizes):
            raise TransferError(
                f"a transfer names {len(starts)} block indices for {len(sizes)} groups"
            )
        ids = int_array("device block ids", gpu.block_ids, None)  # ints; ranges per group below
        if len(ids) != sum(sizes):
            raise TransferError(
                f"a transfer names {len(ids)} device block ids, the group sizes {sizes} add up "
                f"to {sum(sizes)}"
            )
        return sizes, starts, ids

    def _group_rows(
        self, pos: int, blocks: np.ndarray, start: int, host_pages: object, store: bool
    ) -> np.ndarray:
        """The host rows of one group's ``blocks`` (from logical block ``start``), each block
        id and page id checked against the caches and the plan."""
        n = len(blocks)
        bpc = self.plan.blocks_per_chunk
        if blocks.min() < 0:  # -1 would be "skip this row" to the gather/scatter
            raise TransferError(
                f"group position {pos}: device block ids must be >= 0, got "
                f"{blocks[blocks < 0].tolist()}"
            )
        limit = self.planes[pos].min_blocks
        if blocks.max() >= limit:  # past the caches: another allocation's memory
            raise TransferError(
                f"group position {pos}: device block ids must be below {limit}, got "
                f"{blocks[blocks >= limit].tolist()}"
            )
        first = start % bpc
        chunk = (first + np.arange(n)) // bpc
        pages = int_array(f"group position {pos}: host pages", host_pages, None)
        if len(pages) != int(chunk[-1]) + 1:
            raise TransferError(
                f"group position {pos}: {n} blocks span {int(chunk[-1]) + 1} chunks, "
                f"the host spec names {len(pages)} pages"
            )
        if store and n != len(pages) * bpc - first:  # else rows of a later chunk shift
            raise TransferError(
                f"group position {pos}: a store fills whole chunks: {n} blocks from offset "
                f"{first} in {len(pages)} pages"
            )
        if pages.min() < 1 or pages.max() > self.plan.num_pages:
            raise TransferError(
                f"group position {pos}: page ids must be in [1, {self.plan.num_pages}], "
                f"got {pages.tolist()}"
            )
        return (pages[chunk] - 1) * bpc + (first + np.arange(n)) % bpc

    # ------------------------------------------------------------------ transfers

    def _run(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec, store: bool) -> None:
        job_id = int_id("job_id", job_id)  # a report must name the job exactly
        t0 = time.perf_counter()
        moved = 0
        try:
            for pos, blocks, rows in self._rows(gpu, host, store):
                planes = self.planes[pos]
                impl = self.impls[pos]
                if planes.device.type == "cpu":  # straight into / out of the host rows
                    if store:
                        gather_blocks(planes, blocks, self.host[pos], impl, row_ids=rows)
                    else:
                        scatter_blocks(planes, blocks, self.host[pos], impl, row_ids=rows)
                else:  # pragma: no cover - accelerators only: no GPU or NPU in CI
                    self._staged(pos, blocks, rows, store)
                moved += len(blocks) * self.block_bytes[pos]
        except Exception as exc:  # reported, never raised into the engine
            logger.warning(
                "kvforge offload %s job %d failed: %s", "store" if store else "load", job_id, exc
            )
            self._finished.append(TransferResult(job_id, False))
            self.failed_transfers += 1
            return
        if store:
            self.bytes_stored += moved
        else:
            self.bytes_loaded += moved
        self._finished.append(TransferResult(job_id, True, moved, time.perf_counter() - t0))

    def _staged(  # pragma: no cover - accelerators only: no GPU or NPU in CI
        self, pos: int, blocks: np.ndarray, rows: np.ndarray, store: bool
    ) -> None:
        """On an accelerator the kernels read and write device memory: a store gathers into a
        device staging buffer, then copies it to the host rows; a load copies the rows to
        the device, then scatters. Synchronous: the transfer is done when this returns."""
        planes = self.planes[pos]
        idx = torch.from_numpy(rows)
        if store:
            staging = torch.empty(
                (len(blocks), planes.row_bytes), dtype=torch.uint8, device=planes.device
            )
            gather_blocks(planes, blocks, staging, self.impls[pos])
            self.host[pos].index_copy_(0, idx, staging.cpu())
        else:
            staging = self.host[pos].index_select(0, idx).to(planes.device, non_blocking=True)
            scatter_blocks(planes, blocks, staging, self.impls[pos])
        torch.accelerator.synchronize()

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._run(job_id, src_spec, dst_spec, store=True)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        self._run(job_id, dst_spec, src_spec, store=False)
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Transfers complete when submitted: nothing to wait for."""
        return None

    def page_bytes(self, position: int, page: int) -> bytes:
        """The bytes of host page ``page`` (from 1) of group position ``position``."""
        bpc = self.plan.blocks_per_chunk
        return self.host[position][(page - 1) * bpc : page * bpc].numpy().tobytes()


def block_bytes_of(planes: PlaneSet, block: int) -> bytes:
    """One device block of a group, its layers' unpadded pages back to back (what a host row
    holds)."""
    return b"".join(p[block].cpu().numpy().tobytes() for p in planes)
