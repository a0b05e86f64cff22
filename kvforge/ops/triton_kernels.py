"""Triton gather/scatter kernels (``impl="triton"``): one launch moves every plane.

The same source runs on CUDA (triton), on Ascend NPU (triton-ascend) and on CPU tensors under
the Triton interpreter (``TRITON_INTERPRET=1``, set before this module is first imported).

Layout of the work:

- A row of ``out`` / ``src`` is the concatenation of one block of every plane. Each plane's block
  is cut into tiles of ``BLOCK`` elements; ``num_tiles`` tiles cover one row. A work item is
  ``(row i, tile c)``; tile ``c`` belongs to plane ``tile_plane[c]`` and starts at element
  ``tile_start[c]`` of that plane's block. ``n * num_tiles`` work items in all.
- Bounded persistent grid: ``min(n * num_tiles, cap)`` programs, ``cap <= 65535`` (the
  triton-ascend limit); program ``pid`` handles items ``pid, pid + grid, pid + 2 * grid, ...``.
- One int64 table on the device, in six segments of lengths ``P, P, P, P, C, C``
  (``P`` planes, ``C`` tiles per row): plane base addresses (``data_ptr()``), plane block
  elements, plane row offsets (elements), plane block strides (elements), tile plane index, tile
  start (elements). A base address is loaded and cast to a pointer with
  ``.to(tl.pointer_type(...))``.
- Strided planes: block ``b`` of plane ``p`` starts at element ``b * stride_p``; tiles cover
  only its ``block_elems_p`` elements (masked past them), so padding between ``block_bytes``
  and the block stride is never loaded or stored.
- Vectorised tiles: ``w``, the widest of 16/8/4/2/1 bytes that divides every block size, every
  block stride, ``row_bytes`` (hence every row offset) and every base address (planes and
  rows), sets the
  element type: ``ELEM = min(w, 8)`` bytes (int64/int32/int16/uint8 pointers) and
  ``VEC = w // ELEM`` (2 when w == 16). With ``VEC == 2`` the kernel tells the compiler that
  every tile starts 16-byte aligned (``tl.multiple_of`` / ``tl.max_contiguous``), so CUDA moves
  16 bytes per thread access (``ld.global.v2.b64``) even though plane addresses come from a
  table. Odd sizes such as 1 or 3 bytes use ``w == 1``.
- All offsets are int64 (block id times block elements can exceed 2**31 for planes > 2 GiB).
- A row whose id is -1 is masked out entirely (no load, no store).
- With ``row_ids`` (``ROW_IDS``), transfer row ``i`` reads or writes buffer row
  ``row_ids[i]`` instead of row ``i``; without it the kernel never reads ``row_ids``.

Importing this module imports triton; ``kvforge.ops`` does so lazily.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import triton
import triton.language as tl

from ._common import ELEM_DTYPES, TransferPlan, elem_width, to_device

__all__ = [
    "MAX_GRID",
    "gather_blocks_triton",
    "interpreted",
    "scatter_blocks_triton",
]

#: Hard cap on the number of programs of one launch (triton-ascend rejects more than 65535).
MAX_GRID = 65535
#: Elements per tile on accelerators.
DEFAULT_BLOCK = 1024
#: Elements per tile under the interpreter (fewer, larger tiles: each interpreted op is slow).
INTERPRET_BLOCK = 4096
#: Programs per streaming multiprocessor on CUDA.
CUDA_PROGRAMS_PER_SM = 8
#: Programs under the interpreter (small on purpose: exercises the persistent loop).
INTERPRET_GRID = 3


@triton.jit
def _as_ptr(addr, ELEM: tl.constexpr):
    """Cast an int64 address to a pointer to ``ELEM``-byte integers."""
    if ELEM == 8:
        return addr.to(tl.pointer_type(tl.int64))
    elif ELEM == 4:
        return addr.to(tl.pointer_type(tl.int32))
    elif ELEM == 2:
        return addr.to(tl.pointer_type(tl.int16))
    else:
        return addr.to(tl.pointer_type(tl.uint8))


@triton.jit
def _move_kernel(
    table,  # *int64 [4P + 2C]: plane addr | elems | row off | block stride | tile plane | start
    ids,  # *int64: [n]
    row_ids,  # *int64: [n] buffer row of each transfer row (read only when ROW_IDS)
    rows,  # *elem: [num_rows, row_elems] page-first rows (out of a gather, src of a scatter)
    total_items,  # n * C
    row_elems,
    num_planes,
    num_tiles,
    ELEM: tl.constexpr,  # element bytes: 8, 4, 2 or 1
    VEC: tl.constexpr,  # 2: every size/offset/address is a multiple of 2 elements (16 bytes)
    BLOCK: tl.constexpr,  # elements per tile (a multiple of VEC)
    SCATTER: tl.constexpr,
    ROW_IDS: tl.constexpr,  # transfer row i is buffer row row_ids[i] (else row i)
):
    pid = tl.program_id(0).to(tl.int64)
    grid = tl.num_programs(0).to(tl.int64)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    for item in range(pid, total_items, grid):
        row = item // num_tiles
        tile = item - row * num_tiles
        block = tl.load(ids + row).to(tl.int64)
        plane = tl.load(table + 4 * num_planes + tile)
        start = tl.load(table + 4 * num_planes + num_tiles + tile)
        base = tl.load(table + plane)
        elems = tl.load(table + num_planes + plane)
        row_off = tl.load(table + 2 * num_planes + plane)
        stride = tl.load(table + 3 * num_planes + plane)
        limit = tl.where(block >= 0, elems, 0)  # a -1 row moves nothing
        if VEC > 1:  # true by construction (host side): lets the compiler vectorise
            elems = tl.multiple_of(elems, VEC)
            stride = tl.multiple_of(stride, VEC)
            row_off = tl.multiple_of(row_off, VEC)
            start = tl.multiple_of(start, VEC)
            limit = tl.multiple_of(limit, VEC)
        offs = start + lane
        mask = offs < limit
        block_ptr = _as_ptr(base, ELEM) + tl.maximum(block, 0) * stride + offs
        if ROW_IDS:  # noqa: SIM108 - a static if on a constexpr, as elsewhere in this kernel
            buffer_row = tl.load(row_ids + row).to(tl.int64)
        else:
            buffer_row = row
        row_ptr = rows + buffer_row * row_elems + row_off + offs
        if VEC > 1:
            block_ptr = tl.max_contiguous(tl.multiple_of(block_ptr, ELEM * VEC), BLOCK)
            row_ptr = tl.max_contiguous(tl.multiple_of(row_ptr, ELEM * VEC), BLOCK)
        if SCATTER:
            tl.store(block_ptr, tl.load(row_ptr, mask=mask), mask=mask)
        else:
            tl.store(row_ptr, tl.load(block_ptr, mask=mask), mask=mask)


def interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return type(_move_kernel).__name__ == "InterpretedFunction"


def default_grid_cap(device: torch.device) -> int:
    """Programs a persistent launch on ``device`` uses when the caller gives no cap: the
    interpreter's small grid on CPU, a few per SM on CUDA, one per vector core on Ascend,
    never more than :data:`MAX_GRID`."""
    if device.type == "cpu":
        return INTERPRET_GRID
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return min(MAX_GRID, CUDA_PROGRAMS_PER_SM * sms)
    try:  # Ascend (triton-ascend): one program per vector core.  Untested here.
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        cores = int(props.get("num_vectorcore") or props.get("num_aicore") or 0)
    except Exception:
        cores = 0
    return min(MAX_GRID, cores if cores > 0 else 48)


_TABLES: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()
_TABLES_MAX = 64


def _table(
    addrs: tuple[int, ...], plan: TransferPlan, w: int, block: int
) -> tuple[torch.Tensor, int]:
    """Device table and tiles-per-row, cached by value (addresses, sizes, strides, element
    bytes, tile).

    ``w`` here is the element size in bytes; sizes, offsets and strides in the table are in
    elements.
    """
    key = (plan.device, addrs, plan.block_bytes, plan.block_strides, w, block)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    elems = [b // w for b in plan.block_bytes]
    offs = [o // w for o in plan.row_offsets]
    strides = [s // w for s in plan.block_strides]
    tile_plane: list[int] = []
    tile_start: list[int] = []
    for p, e in enumerate(elems):
        for s in range(0, e, block):
            tile_plane.append(p)
            tile_start.append(s)
    host = torch.tensor(
        [*addrs, *elems, *offs, *strides, *tile_plane, *tile_start], dtype=torch.int64
    )
    entry = (host.to(plan.device), len(tile_plane))
    _TABLES[key] = entry
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return entry


def on_device(device: torch.device) -> AbstractContextManager[object]:
    """Make ``device`` current when another accelerator is: Triton launches on the current
    device, and torch uploads there."""
    if device.type == "cpu" or device.index is None:
        return nullcontext()
    module = getattr(torch, device.type)  # pragma: no cover - accelerators only
    if module.current_device() == device.index:  # pragma: no cover
        return nullcontext()
    return module.device(device)  # pragma: no cover - needs two accelerators


def _launch(
    planes: Sequence[torch.Tensor],
    plan: TransferPlan,
    rows: torch.Tensor,
    scatter: bool,
    block: int | None = None,
    grid_cap: int | None = None,
    max_width: int = 16,
) -> None:
    if plan.num_valid == 0:
        return
    if plan.device.type == "cpu" and not interpreted():
        raise ValueError(
            "impl 'triton' got cpu tensors but the kernels are not interpreted: set "
            "TRITON_INTERPRET=1 before kvforge.ops.triton_kernels is first imported"
        )
    addrs = plan.planes.addrs
    widths = tuple(x for x in (16, 8, 4, 2, 1) if x <= max_width)
    w = elem_width(plan, (rows.data_ptr(),), widths)
    elem = min(w, 8)
    vec = w // elem
    try:
        rows_w = rows.view(ELEM_DTYPES[elem])
    except RuntimeError:  # a storage offset torch will not reinterpret: move bytes
        elem, vec, rows_w = 1, 1, rows
    if block is None:
        block = INTERPRET_BLOCK if plan.device.type == "cpu" else DEFAULT_BLOCK
    if block < vec or block & (block - 1):
        raise ValueError(f"block = {block} must be a power of two (>= {vec})")
    table, num_tiles = _table(addrs, plan, elem, block)
    if plan.device.type != "cpu":
        # the cached table outlives this call: keep the allocator from reusing it while a
        # kernel on the current (possibly side) stream may still read it
        table.record_stream(getattr(torch, plan.device.type).current_stream(plan.device))
    with on_device(plan.device):  # a launch (and its uploads) go to the planes' device
        if plan.ids_on_device is not None:
            ids = plan.ids_on_device.contiguous()
        else:
            ids = to_device(plan.ids_cpu, plan.device)
        row_ids = (
            ids if plan.row_ids is None else to_device(torch.from_numpy(plan.row_ids), plan.device)
        )
        total = plan.n * num_tiles
        cap = default_grid_cap(plan.device) if grid_cap is None else grid_cap
        grid = (max(1, min(total, cap, MAX_GRID)),)
        _move_kernel[grid](
            table,
            ids,
            row_ids,
            rows_w,
            total,
            plan.row_bytes // elem,
            len(planes),
            num_tiles,
            ELEM=elem,
            VEC=vec,
            BLOCK=block,
            SCATTER=scatter,
            ROW_IDS=plan.row_ids is not None,
        )


def gather_blocks_triton(
    planes: Sequence[torch.Tensor],
    plan: TransferPlan,
    out: torch.Tensor,
    block: int | None = None,
    grid_cap: int | None = None,
    max_width: int = 16,
) -> None:
    """One-launch gather of ``planes[p][block_ids[i]]`` into page-first rows ``out[r_i]``
    (``r_i = plan.row_ids[i]``, or ``i`` without row ids).

    Args:
        planes: ``[num_blocks_p, block_bytes_p]`` ``torch.uint8`` (strides
            ``(block_stride_p, 1)``) on one device, validated.
        plan: the validated transfer plan (block ids already on the device, or uploaded here).
        out: ``[num_rows, row_bytes]`` ``torch.uint8`` on the planes' device (a staging buffer
            on accelerators); rows not written are untouched.
        block: elements per tile (default :data:`DEFAULT_BLOCK`, :data:`INTERPRET_BLOCK` on
            CPU); a power of two; for tests and tuning.
        grid_cap: programs cap (default per device); for tests and tuning.
        max_width: widest access in bytes considered (16, 8, 4, 2 or 1); for tests and tuning.
    """
    _launch(planes, plan, out, False, block, grid_cap, max_width)


def scatter_blocks_triton(
    planes: Sequence[torch.Tensor],
    plan: TransferPlan,
    src: torch.Tensor,
    block: int | None = None,
    grid_cap: int | None = None,
    max_width: int = 16,
) -> None:
    """One-launch scatter of page-first rows ``src[r_i]`` into ``planes[p][block_ids[i]]``.

    Args: as :func:`gather_blocks_triton`, with ``src`` the ``[num_rows, row_bytes]`` source.
    """
    _launch(planes, plan, src, True, block, grid_cap, max_width)


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set in the environment now."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
