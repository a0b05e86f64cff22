"""Triton kernel of :func:`kvforge.ops.slot_mapping` (``impl="triton"``).

Same source for CUDA (triton) and Ascend NPU (triton-ascend); on CPU tensors it runs under the
Triton interpreter (``TRITON_INTERPRET=1``, set before this module is first imported).

- Tokens are cut into tiles of ``BLOCK``; a bounded persistent grid of ``min(tiles, cap)``
  programs (``cap <= 65535``, the triton-ascend limit) walks them: program ``pid`` takes tiles
  ``pid, pid + grid, ...``.
- All index arithmetic is int64 (a table row times its stride, or a block id times entries per
  block, may exceed 2**31).
- The compress ratio and the entries per block are compile-time constants: a role's pair is
  fixed for the life of an engine, and constant powers of two become shifts and masks.
- The block-table load is masked: a token that completes no entry, whose entry lies past the
  table's last column, whose row is outside the table or whose position is negative reads
  nothing and gets ``-1``; so does a block id ``<= 0`` (the null block). Unchecked bad input
  therefore never reads out of bounds.

Importing this module imports triton; :mod:`kvforge.ops.slots` does so lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import MAX_GRID, default_grid_cap, on_device

__all__ = ["DEFAULT_BLOCK", "INTERPRET_BLOCK", "interpreted", "slot_mapping_triton"]

#: Tokens per tile on accelerators.
DEFAULT_BLOCK = 1024
#: Tokens per tile under the interpreter (small: exercises the persistent loop in tests).
INTERPRET_BLOCK = 256


@triton.jit
def _slot_kernel(
    table,  # *int32 or *int64: [num_seqs, max_blocks] block table
    rows,  # *int32 or *int64: [n] table row of each token
    positions,  # *int64: [n]
    out,  # *int64: [n]
    n,
    num_seqs,
    max_blocks,
    table_stride_row,
    table_stride_col,
    rows_stride,
    pos_stride,
    out_stride,
    RATIO: tl.constexpr,  # compress ratio r
    PER_BLOCK: tl.constexpr,  # entries per block, block_size // r
    BLOCK: tl.constexpr,  # tokens per tile
):
    pid = tl.program_id(0).to(tl.int64)
    grid = tl.num_programs(0).to(tl.int64)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    num_tiles = (n + BLOCK - 1) // BLOCK
    for tile in range(pid, num_tiles, grid):
        i = tile * BLOCK + lane
        live = i < n
        row = tl.load(rows + i * rows_stride, mask=live, other=-1).to(tl.int64)
        pos = tl.load(positions + i * pos_stride, mask=live, other=-1).to(tl.int64)
        ok = live & (pos >= 0) & (row >= 0) & (row < num_seqs)
        pos = tl.where(ok, pos, 0)  # division of non-negative values only
        entry = pos // RATIO
        col = entry // PER_BLOCK
        ok = ok & (col < max_blocks)
        if RATIO > 1:
            ok = ok & (pos - entry * RATIO == RATIO - 1)
        block_ptr = table + row * table_stride_row + col * table_stride_col
        block = tl.load(block_ptr, mask=ok, other=0).to(tl.int64)
        slot = block * PER_BLOCK + (entry - col * PER_BLOCK)
        tl.store(out + i * out_stride, tl.where(ok & (block > 0), slot, -1), mask=live)


def interpreted() -> bool:
    """Whether the kernel was built for the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return type(_slot_kernel).__name__ == "InterpretedFunction"


def slot_mapping_triton(
    table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    ratio: int,
    out: torch.Tensor,
    block: int | None = None,
    grid_cap: int | None = None,
) -> torch.Tensor:
    """Launch the slot kernel; arguments as :func:`kvforge.ops.slot_mapping` (already
    validated when the caller asked for checks), all tensors on one device.

    Args:
        block: tokens per tile (a power of two); default :data:`DEFAULT_BLOCK`, or
            :data:`INTERPRET_BLOCK` on CPU. For tests and tuning.
        grid_cap: programs cap (default per device, at most 65535). For tests and tuning.

    Returns:
        ``out``, written asynchronously on the current stream of an accelerator.
    """
    n = int(positions.shape[0])
    if n == 0:
        return out
    device = positions.device
    if device.type == "cpu" and not interpreted():
        raise ValueError(
            "impl 'triton' got cpu tensors but the kernel is not interpreted: set "
            "TRITON_INTERPRET=1 before kvforge.ops.triton_slots is first imported"
        )
    if block is None:
        block = INTERPRET_BLOCK if device.type == "cpu" else DEFAULT_BLOCK
    if block < 1 or block & (block - 1):
        raise ValueError(f"block = {block} must be a power of two")
    num_tiles = -(-n // block)
    cap = default_grid_cap(device) if grid_cap is None else grid_cap
    grid = (max(1, min(num_tiles, cap, MAX_GRID)),)
    with on_device(device):
        _slot_kernel[grid](
            table,
            rows,
            positions,
            out,
            n,
            int(table.shape[0]),
            int(table.shape[1]),
            table.stride(0),
            table.stride(1),
            rows.stride(0),
            positions.stride(0),
            out.stride(0),
            RATIO=ratio,
            PER_BLOCK=block_size // ratio,
            BLOCK=block,
        )
    return out
