"""Torch reference gather/scatter: one ``index_select`` / ``index_copy_`` per plane.

This is the definition every other implementation is tested against, and the fallback that
runs everywhere torch runs (CPU, CUDA, NPU through torch_npu). It is simple on purpose: per
plane ``p`` it moves ``planes[p][block_ids]`` into the column slice
``rows[:, row_offsets[p] : row_offsets[p] + block_bytes[p]]`` (gather), or back (scatter).
Rows whose id is ``-1`` are left out of both directions. A plane with a block stride above its
block bytes is indexed as the strided view it is: only its ``block_bytes`` columns are read or
written, never the padding between blocks.

Bytes are moved as the widest integer type (8/4/2/1 bytes, :func:`~kvforge.ops._common.widen`)
that divides every size and address: a pure bit copy, and on CPU ~8x faster than indexing
``uint8`` elements one by one.

The functions here take an already validated :class:`~kvforge.ops._common.TransferPlan`; call
them through :func:`kvforge.ops.gather_blocks` / :func:`kvforge.ops.scatter_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._common import TransferPlan, to_device, widen

__all__ = ["gather_blocks_torch", "scatter_blocks_torch"]


def _selection(plan: TransferPlan) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(rows, ids)`` on the planes' device: block ids not -1 and the buffer rows they use;
    ``rows is None`` means rows ``0 .. n - 1`` in order."""
    rows = plan.buffer_rows()
    ids = plan.ids_cpu if plan.all_valid else plan.ids_cpu[plan.valid_rows()]
    return (None if rows is None else to_device(rows, plan.device)), to_device(ids, plan.device)


def gather_blocks_torch(
    planes: Sequence[torch.Tensor], plan: TransferPlan, out: torch.Tensor
) -> None:
    """Pack ``planes[p][block_ids[i]]`` into ``out[i]`` (page-first rows), skipping id -1.

    Args:
        planes: ``[num_blocks_p, block_bytes_p]`` ``torch.uint8`` (strides
            ``(block_stride_p, 1)``), validated.
        plan: the validated transfer plan.
        out: ``[n, row_bytes]`` ``torch.uint8`` on the planes' device; rows with id -1 are
            left untouched.
    """
    if plan.num_valid == 0:
        return
    rows, ids = _selection(plan)
    w, planes_w, out_w = widen(planes, out, plan)
    for plane, off, nbytes in zip(planes_w, plan.row_offsets, plan.block_bytes, strict=True):
        cols = out_w[:, off // w : (off + nbytes) // w]
        picked = plane.index_select(0, ids)
        if rows is None:
            cols.copy_(picked)
        else:
            cols.index_copy_(0, rows, picked)


def scatter_blocks_torch(
    planes: Sequence[torch.Tensor], plan: TransferPlan, src: torch.Tensor
) -> None:
    """Unpack page-first rows: ``planes[p][block_ids[i]] = src[i, off_p : off_p + bytes_p]``.

    Args:
        planes: ``[num_blocks_p, block_bytes_p]`` ``torch.uint8``, validated; written in place.
        plan: the validated transfer plan (ids checked unique, -1 rows skipped).
        src: ``[n, row_bytes]`` ``torch.uint8`` on the planes' device.
    """
    if plan.num_valid == 0:
        return
    rows, ids = _selection(plan)
    w, planes_w, src_w = widen(planes, src, plan)
    for plane, off, nbytes in zip(planes_w, plan.row_offsets, plan.block_bytes, strict=True):
        cols = src_w[:, off // w : (off + nbytes) // w]
        if rows is not None:
            cols = cols.index_select(0, rows)
        plane.index_copy_(0, ids, cols)
