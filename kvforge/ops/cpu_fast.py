"""Fast CPU gather/scatter (``impl="cpu"``): numba kernels that call ``memcpy`` per (row, plane).

Why: torch indexing needs two passes for a gather into column slices of page-first rows
(``index_select`` into a temporary, then a strided copy), reaching about 0.3-0.5 of a plain
contiguous copy. Here each (row, plane) piece is one ``memcpy`` of ``block_bytes_p`` bytes
straight from the plane block to its place in the row (or back), and the pieces are spread over
numba's threads with ``prange`` (contiguous ranges of rows per thread). libc ``memcpy`` picks its
best strategy per size (vector loops, ``rep movsb``), so large pages run at contiguous-copy
speed; see ``benchmarks/bench_ops.py`` for measured ratios.

numba is optional: this module imports it at import time, and ``kvforge.ops`` imports this
module only when ``impl="cpu"`` (or ``"auto"`` on CPU) is used. Without numba, ``"auto"`` falls
back to the torch reference.

Kernels take raw addresses (``int64``) of already validated tensors: a table of plane base
addresses, plane block bytes, plane row offsets, the block ids and the row buffer address.
They are compiled with ``cache=True`` (first use in a fresh environment compiles for ~1-2 s,
later processes load the cache).

Thread safety: numba's default ``workqueue`` threading layer must not run two parallel regions
at once, so parallel launches are serialised by a module lock (serial launches are not).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._common import TransferPlan

__all__ = ["PARALLEL_MIN_BYTES", "gather_blocks_cpu", "scatter_blocks_cpu"]

#: Calls moving fewer bytes than this run on one thread (a parallel launch costs ~5-20 us;
#: measured break-even on a 2-core machine is about 0.5 MiB).
PARALLEL_MIN_BYTES = 1 << 19

_PARALLEL_LOCK = threading.Lock()


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):  # pragma: no cover - compiled by numba
    """``memcpy(dst, src, nbytes)`` on raw ``int64`` addresses (lowered to ``llvm.memcpy``)."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        d, s, n = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), n, 1)
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, nogil=True, cache=True)
def _gather_par(ptrs, nbytes, offs, ids, rows_addr, row_bytes):  # pragma: no cover - numba
    n = ids.shape[0]
    num_planes = ptrs.shape[0]
    for w in prange(n * num_planes):
        i = w // num_planes
        p = w - i * num_planes
        b = ids[i]
        if b >= 0:
            _memcpy(rows_addr + i * row_bytes + offs[p], ptrs[p] + b * nbytes[p], nbytes[p])


@njit(nogil=True, cache=True)
def _gather_ser(ptrs, nbytes, offs, ids, rows_addr, row_bytes):  # pragma: no cover - numba
    n = ids.shape[0]
    num_planes = ptrs.shape[0]
    for i in range(n):
        b = ids[i]
        if b >= 0:
            for p in range(num_planes):
                _memcpy(rows_addr + i * row_bytes + offs[p], ptrs[p] + b * nbytes[p], nbytes[p])


@njit(parallel=True, nogil=True, cache=True)
def _scatter_par(ptrs, nbytes, offs, ids, rows_addr, row_bytes):  # pragma: no cover - numba
    n = ids.shape[0]
    num_planes = ptrs.shape[0]
    for w in prange(n * num_planes):
        i = w // num_planes
        p = w - i * num_planes
        b = ids[i]
        if b >= 0:
            _memcpy(ptrs[p] + b * nbytes[p], rows_addr + i * row_bytes + offs[p], nbytes[p])


@njit(nogil=True, cache=True)
def _scatter_ser(ptrs, nbytes, offs, ids, rows_addr, row_bytes):  # pragma: no cover - numba
    n = ids.shape[0]
    num_planes = ptrs.shape[0]
    for i in range(n):
        b = ids[i]
        if b >= 0:
            for p in range(num_planes):
                _memcpy(ptrs[p] + b * nbytes[p], rows_addr + i * row_bytes + offs[p], nbytes[p])


def _tables(
    planes: Sequence[torch.Tensor], plan: TransferPlan
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    ptrs = np.fromiter((t.data_ptr() for t in planes), dtype=np.int64, count=len(planes))
    nbytes = np.asarray(plan.block_bytes, dtype=np.int64)
    offs = np.asarray(plan.row_offsets, dtype=np.int64)
    return ptrs, nbytes, offs, plan.ids_cpu.numpy()


def _run(par, ser, planes: Sequence[torch.Tensor], plan: TransferPlan, rows: torch.Tensor) -> None:
    if plan.num_valid == 0:
        return
    ptrs, nbytes, offs, ids = _tables(planes, plan)
    args = (ptrs, nbytes, offs, ids, rows.data_ptr(), plan.row_bytes)
    if plan.num_valid * plan.row_bytes < PARALLEL_MIN_BYTES or numba.get_num_threads() == 1:
        ser(*args)
        return
    with _PARALLEL_LOCK:
        par(*args)


def gather_blocks_cpu(
    planes: Sequence[torch.Tensor], plan: TransferPlan, out: torch.Tensor
) -> None:
    """Pack ``planes[p][block_ids[i]]`` into ``out[i]`` with one memcpy per (row, plane).

    Args:
        planes: ``[num_blocks_p, block_bytes_p]`` ``torch.uint8`` CPU tensors, validated.
        plan: the validated transfer plan (``plan.device.type == "cpu"``).
        out: ``[n, row_bytes]`` ``torch.uint8`` CPU, row-contiguous; rows with id -1 untouched.
    """
    _run(_gather_par, _gather_ser, planes, plan, out)


def scatter_blocks_cpu(
    planes: Sequence[torch.Tensor], plan: TransferPlan, src: torch.Tensor
) -> None:
    """Unpack ``src[i]`` into ``planes[p][block_ids[i]]`` with one memcpy per (row, plane).

    Args:
        planes: ``[num_blocks_p, block_bytes_p]`` ``torch.uint8`` CPU tensors, written in place.
        plan: the validated transfer plan (destination ids unique, -1 rows skipped).
        src: ``[n, row_bytes]`` ``torch.uint8`` CPU, row-contiguous.
    """
    _run(_scatter_par, _scatter_ser, planes, plan, src)
