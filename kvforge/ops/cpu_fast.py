"""Fast CPU gather/scatter (``impl="cpu"``): numba kernels that call ``memcpy`` per (row, plane).

Why: torch indexing needs two passes for a gather into column slices of page-first rows
(``index_select`` into a temporary, then a strided copy) and reaches about 0.1-0.5 of a plain
contiguous copy. Here each (row, plane) piece is one ``memcpy`` of ``block_bytes_p`` bytes
straight from the plane block to its place in the row (or back). A call moving at least
:data:`STREAM_MIN_BYTES` writes with non-temporal (cache-bypassing) stores instead, as a large
contiguous ``memcpy`` does, and prefetches its source (:data:`PREFETCH_BYTES`); smaller calls
use libc ``memcpy``. See ``benchmarks/bench_ops.py``
and ``docs/performance.md`` for measured ratios.

Work items are the (row, plane) pairs in row-major order. A call moving at least
:data:`PARALLEL_MIN_BYTES` splits them into contiguous ranges run on a small Python thread pool
(the kernels are ``nogil``), using up to ``torch.get_num_threads()`` threads, the calling thread
included. No numba threading layer is involved: no OpenMP runtime next to torch's, no global
numba configuration, and concurrent calls from several Python threads are safe.

numba is optional: this module imports it at import time, and ``kvforge.ops`` imports this
module only when ``impl="cpu"`` (or ``"auto"`` on CPU) is used. Without numba, ``"auto"`` falls
back to the torch reference.

Kernels take raw addresses (``int64``) of already validated tensors: one table of plane base
addresses, plane block bytes, plane row offsets and plane block strides, the block ids and the
row buffer address. Block ``b`` of plane ``p`` starts at ``addr_p + b * block_stride_p`` and
exactly ``block_bytes_p`` bytes of it move: padding past them in a strided plane is never
touched.
They are compiled with ``cache=True`` (the first use in a fresh environment compiles for about
a second; later processes load numba's on-disk cache).
"""

from __future__ import annotations

import itertools
import os
import platform
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._common import TransferPlan

__all__ = [
    "MIN_BYTES_PER_THREAD",
    "PARALLEL_MIN_BYTES",
    "STREAM_MIN_BYTES",
    "can_evict",
    "evict_from_caches",
    "gather_blocks_cpu",
    "scatter_blocks_cpu",
]

#: Calls moving fewer bytes than this run on the calling thread only: waking a pool thread
#: costs ~50 us on a small VM, and below a few MiB one thread is as fast (measured on 2 cores).
PARALLEL_MIN_BYTES = 4 << 20
#: Calls moving at least this many bytes write their destination with non-temporal stores.
#: A normal store first reads every destination line it writes (a third more memory traffic)
#: and evicts what the cache held; a swap's destination is not read again soon (host pages
#: until swap in, device blocks until the next step). Measured on 2 cores with an 8 MiB L3
#: (44 planes of 37,376 B): streaming is equal at 1.6 MiB, 2.6x faster at 3 MiB and 1.5x
#: faster from 6 MiB up; a large contiguous ``memcpy`` streams as well.
STREAM_MIN_BYTES = 1 << 20
#: Streaming copies prefetch their source this many bytes ahead, and the first this many bytes
#: of the next (row, plane) piece before each piece. A swap reads many pieces of 8-37 KiB from
#: scattered blocks; the hardware prefetcher retrains at every piece, and without the hint a
#: gather of one request's window (44 pieces of 37,376 B, cold) ran about 15% slower than a
#: contiguous copy of its bytes on 2 cores. 256-1,536 B measured within noise of each other.
PREFETCH_BYTES = 512
#: Each extra thread gets at least this many bytes.
MIN_BYTES_PER_THREAD = 2 << 20
#: Work is cut into about this many chunks per thread, handed out first come first served...
CHUNKS_PER_THREAD = 4
#: ... of at least this many bytes each.
MIN_CHUNK_BYTES = 1 << 20


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


@intrinsic
def _stream_line(typingctx, dst, src):  # pragma: no cover - compiled by numba
    """Copy 64 bytes ``src -> dst`` with non-temporal stores; ``dst`` must be 32-byte aligned.

    Two ``<4 x i64>`` loads (unaligned) and two stores tagged ``!nontemporal``: x86 lowers them
    to ``vmovntdq`` (or pairs of ``movntdq``), AArch64 to ``stnp``.
    """
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        d, s = args
        vec = ir.VectorType(ir.IntType(64), 4)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for offset in (0, 32):
            k = ir.Constant(ir.IntType(64), offset)
            value = builder.load(builder.inttoptr(builder.add(s, k), vec.as_pointer()), align=1)
            store = builder.store(value, builder.inttoptr(builder.add(d, k), vec.as_pointer()), 32)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _prefetch(typingctx, addr):  # pragma: no cover - compiled by numba
    """Hint that the line holding ``addr`` is read soon (``llvm.prefetch``: read, no temporal
    locality, data cache): x86 ``prefetchnta``, AArch64 ``prfm pldl1strm``. Never faults."""
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        read, no_locality, data = (ir.Constant(i32, v) for v in (0, 0, 1))
        builder.call(fn, [builder.inttoptr(args[0], i8p), read, no_locality, data])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):  # pragma: no cover - compiled by numba
    """A sequentially consistent fence: makes non-temporal stores visible to other threads."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@njit(nogil=True, cache=True)
def _stream_copy(dst, src, nbytes):  # pragma: no cover - compiled by numba
    """``memcpy`` that writes around the cache: aligned head and tail by ``memcpy``, body by
    :func:`_stream_line`, reading :data:`PREFETCH_BYTES` ahead. The caller issues
    :func:`_store_fence` once it is done."""
    head = min((-dst) & 31, nbytes)
    if head:
        _memcpy(dst, src, head)
    done = head
    while nbytes - done >= 64:
        if done + PREFETCH_BYTES < nbytes:
            _prefetch(src + done + PREFETCH_BYTES)
        _stream_line(dst + done, src + done)
        done += 64
    if nbytes > done:
        _memcpy(dst + done, src + done, nbytes - done)


@njit(nogil=True, cache=True, inline="always")
def _item(table, ids, row_ids, indirect, rows_addr, row_bytes, w, scatter):  # pragma: no cover
    """Work item ``w`` as ``(dst, src, nbytes)``; ``nbytes == 0`` when its block id is -1.

    Item ``w`` is (transfer row ``i = w // P``, plane ``p = w % P``). ``table`` is ``int64
    [4 * P]``: plane base addresses | block bytes | row offsets | block strides. Transfer row
    ``i`` is buffer row ``row_ids[i]`` if ``indirect``, else ``i``.
    """
    num_planes = table.shape[0] // 4
    i = w // num_planes
    p = w - i * num_planes
    b = ids[i]
    if b < 0:
        return 0, 0, 0
    nbytes = table[num_planes + p]
    block = table[p] + b * table[3 * num_planes + p]
    r = row_ids[i] if indirect else i
    row = rows_addr + r * row_bytes + table[2 * num_planes + p]
    if scatter:
        return block, row, nbytes
    return row, block, nbytes


@njit(nogil=True, cache=True)
def _move_range(  # pragma: no cover - compiled by numba
    table, ids, row_ids, indirect, rows_addr, row_bytes, lo, hi, scatter, stream
):
    """Move work items ``[lo, hi)`` (see :func:`_item`). With ``stream`` the destination is
    written with non-temporal stores (see :data:`STREAM_MIN_BYTES`), and the start of each
    next item's source is prefetched while the current one copies."""
    for w in range(lo, hi):
        dst, src, nbytes = _item(table, ids, row_ids, indirect, rows_addr, row_bytes, w, scatter)
        if nbytes == 0:
            continue
        if not stream:
            _memcpy(dst, src, nbytes)
            continue
        if w + 1 < hi:
            _, ahead, ahead_bytes = _item(
                table, ids, row_ids, indirect, rows_addr, row_bytes, w + 1, scatter
            )
            k = 0
            while k < min(ahead_bytes, PREFETCH_BYTES):
                _prefetch(ahead + k)
                k += 64
        _stream_copy(dst, src, nbytes)
    if stream:
        _store_fence()


@intrinsic
def _flush_line(typingctx, addr):  # pragma: no cover - compiled by numba
    """x86 ``clflush``: write the cache line holding ``addr`` back and drop it everywhere."""
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.clflush")
        builder.call(fn, [builder.inttoptr(args[0], i8p)])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def _evict_range(addr, nbytes):  # pragma: no cover - compiled by numba
    line = addr - (addr & 63)
    end = addr + nbytes
    while line < end:
        _flush_line(line)
        line += 64
    _store_fence()


def can_evict() -> bool:
    """Whether :func:`evict_from_caches` works here (x86-64 only)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def evict_from_caches(tensors: Sequence[torch.Tensor]) -> None:
    """Drop every byte of ``tensors`` (CPU, contiguous) from every cache level.

    For benchmarks: a swap's bytes were last touched long before the swap, while the code
    that runs it is warm; evicting exactly those bytes reproduces that, where flushing whole
    caches would evict the code too. x86-64 only (see :func:`can_evict`).
    """
    if not can_evict():
        raise RuntimeError(f"evict_from_caches needs x86-64; this is {platform.machine()}")
    for i, t in enumerate(tensors):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"tensors[{i}] must be a contiguous cpu tensor; got one on {t.device} with "
                f"strides {tuple(t.stride())} for shape {tuple(t.shape)}"
            )
    for t in tensors:
        _evict_range(t.data_ptr(), t.numel() * t.element_size())


_POOL: ThreadPoolExecutor | None = None
_POOL_PID = -1
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The module's worker pool, created on first use and again in a forked child."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or os.getpid() != _POOL_PID:
            _POOL = ThreadPoolExecutor(
                max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="kvforge-ops"
            )
            _POOL_PID = os.getpid()
        return _POOL


def _num_threads(nbytes: int) -> int:
    if nbytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(torch.get_num_threads(), nbytes // MIN_BYTES_PER_THREAD))


def _worker(
    chunks: Iterator[int],
    bounds: list[int],
    table: np.ndarray,
    ids: np.ndarray,
    row_ids: np.ndarray,
    indirect: bool,
    addr: int,
    row_bytes: int,
    scatter: bool,
    stream: bool,
) -> None:
    # next() on a shared itertools.count is atomic under the GIL; the kernel releases the GIL
    for k in chunks:
        if k + 1 >= len(bounds):
            return
        _move_range(
            table,
            ids,
            row_ids,
            indirect,
            addr,
            row_bytes,
            bounds[k],
            bounds[k + 1],
            scatter,
            stream,
        )


def _run(planes: Sequence[torch.Tensor], plan: TransferPlan, rows: torch.Tensor, scatter: bool):
    if plan.num_valid == 0:
        return
    table = plan.planes.layout_table
    ids = plan.ids
    indirect = plan.row_ids is not None
    row_ids = plan.row_ids if plan.row_ids is not None else ids  # unread when not indirect
    addr = rows.data_ptr()
    total = plan.n * len(planes)
    nbytes = plan.num_valid * plan.row_bytes
    threads = min(_num_threads(nbytes), total)
    stream = nbytes >= STREAM_MIN_BYTES
    if threads == 1:
        _move_range(table, ids, row_ids, indirect, addr, plan.row_bytes, 0, total, scatter, stream)
        return
    # dynamic balance: CHUNKS_PER_THREAD chunks per thread, taken first come first served, so a
    # thread slowed down (a core shared with another process or a spinning OpenMP worker) does
    # less of the work instead of holding everyone up
    num_chunks = min(total, threads * CHUNKS_PER_THREAD, max(threads, nbytes // MIN_CHUNK_BYTES))
    bounds = [total * k // num_chunks for k in range(num_chunks + 1)]
    chunks = itertools.count()
    args = (chunks, bounds, table, ids, row_ids, indirect, addr, plan.row_bytes, scatter, stream)
    pool = _pool()
    futures: list[Future] = [pool.submit(_worker, *args) for _ in range(threads - 1)]
    try:
        _worker(*args)  # the calling thread works too
    finally:
        # every worker must be done with the raw addresses before the caller may free them,
        # even when one of them (or this thread) raised
        wait(futures)
    for f in futures:
        f.result()


def gather_blocks_cpu(
    planes: Sequence[torch.Tensor], plan: TransferPlan, out: torch.Tensor
) -> None:
    """Pack ``planes[p][block_ids[i]]`` into ``out[r_i]`` with one memcpy per (row, plane);
    ``r_i`` is ``plan.row_ids[i]``, or ``i`` without row ids.

    Args:
        planes: ``[num_blocks_p, block_bytes_p]`` ``torch.uint8`` CPU tensors (strides
            ``(block_stride_p, 1)``), validated.
        plan: the validated transfer plan (``plan.device.type == "cpu"``).
        out: ``[num_rows, row_bytes]`` ``torch.uint8`` CPU, row-contiguous; rows not written
            (id -1, or not in ``row_ids``) are untouched.
    """
    _run(planes, plan, out, False)


def scatter_blocks_cpu(
    planes: Sequence[torch.Tensor], plan: TransferPlan, src: torch.Tensor
) -> None:
    """Unpack ``src[r_i]`` into ``planes[p][block_ids[i]]`` with one memcpy per (row, plane).

    Args:
        planes: ``[num_blocks_p, block_bytes_p]`` ``torch.uint8`` CPU tensors, written in place.
        plan: the validated transfer plan (destination ids unique, -1 rows skipped).
        src: ``[num_rows, row_bytes]`` ``torch.uint8`` CPU, row-contiguous.
    """
    _run(planes, plan, src, True)
