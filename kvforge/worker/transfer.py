"""Moving a request's blocks between device planes and host pages.

Data path (see docs/architecture.md): on CPU the gather kernel packs the selected device
blocks of every plane of a group straight into their page-first host pages, wherever those
pages are, in one call (``row_ids``). On an accelerator it packs them into a device staging
buffer on a side stream, then one DMA per contiguous run of host pages moves the rows to
pinned host memory; swap in is the mirror image. The current stream is made to wait for the
side stream before any later kernel can touch the moved device blocks, so freeing or reusing
them right away is safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kvforge import ops
from kvforge.platform import Platform
from kvforge.specs import SwapPurpose

__all__ = ["SwapHandle", "SwapStreams", "contiguous_runs", "move_pages", "plane_bytes"]


def plane_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A block-major cache ``[num_blocks, ...]`` seen as raw bytes ``uint8 [num_blocks,
    block_bytes]`` with strides ``(block_stride_bytes, 1)``, sharing the cache's memory.

    Dim 0 is the block dimension; ``block_bytes`` is the bytes of one block
    (``prod(shape[1:]) * element_size``) and ``block_stride_bytes`` is ``stride(0) *
    element_size``, which may exceed ``block_bytes``: alignment padding, an engine's padded
    allocation, or several roles carved out of one buffer (an indexer key ``[blocks, 64, 128]``
    and its scale ``[blocks, 64, 4]`` inside one ``[blocks, 8704]`` allocation). One block must
    be a single contiguous run of bytes: its dims of size > 1, ordered by stride, nest exactly
    (a permuted but dense block qualifies; only memory order matters to a byte copy).

    Raises:
        ValueError: naming the shape and strides, for a 0-d tensor, a block that is not one
            contiguous run of bytes, or blocks that overlap (block stride below block bytes).
    """
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cache must be a torch.Tensor, got {type(cache).__name__}")
    shape, strides = tuple(cache.shape), tuple(cache.stride())
    if cache.dim() == 0:
        raise ValueError("cache is a 0-d tensor; dim 0 must be the block dimension")
    itemsize = cache.element_size()
    inner = sorted((st, sz) for sz, st in zip(shape[1:], strides[1:], strict=True) if sz != 1)
    empty = 0 in shape[1:]  # a zero-size block is one (empty) run whatever its strides
    elems = 1
    for stride, size in [] if empty else inner:
        if stride != elems:
            raise ValueError(
                f"cache of shape {shape} with element strides {strides} is not block-major: one "
                "block is not a single contiguous run of bytes"
            )
        elems *= size
    num_blocks, block_bytes = shape[0], 0 if empty else elems * itemsize
    # a single block's stride is meaningless (torch reports anything): use the block itself
    block_stride = strides[0] * itemsize if num_blocks > 1 else block_bytes
    if block_stride < block_bytes:
        raise ValueError(
            f"cache of shape {shape} with element strides {strides} has blocks that overlap: "
            f"block stride {block_stride} bytes < {block_bytes} bytes per block"
        )
    raw = torch.empty(0, dtype=torch.uint8, device=cache.device)
    # the lowest address of the view is element [0, ...]: every stride is non-negative
    raw.set_(
        cache.untyped_storage(),
        cache.storage_offset() * itemsize,
        (num_blocks, block_bytes),
        (block_stride, 1),
    )
    return raw


def contiguous_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``ids`` into runs of consecutive values: ``(start index, end index, first id)``."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, i, ids[start]))
            start = i
    return runs


@dataclass
class SwapHandle:
    """A swap in flight.

    On CPU every copy has finished when the handle is returned; on accelerators the copies run
    on a side stream and :meth:`wait` blocks the host until they have.

    Attributes:
        request_id: the request moved.
        direction: ``"out"`` (device to host) or ``"in"``.
        purpose: why it moved.
        num_tokens: tokens the request holds.
        bytes_moved: bytes copied between device and host.
        blocks_moved: blocks copied, per group.
    """

    request_id: str
    direction: Literal["out", "in"]
    purpose: SwapPurpose
    num_tokens: int
    bytes_moved: int = 0
    blocks_moved: dict[str, int] = field(default_factory=dict)
    event: Any = None
    keep_alive: list[torch.Tensor] = field(default_factory=list, repr=False)

    def done(self) -> bool:
        """True once every copy of this swap has completed."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block until every copy of this swap has completed."""
        if self.event is not None:
            self.event.synchronize()  # pragma: no cover - accelerators only
        self.keep_alive.clear()


# Accelerator swaps move in chunks of about this many bytes, so the gather (or scatter) of one
# chunk on the compute stream overlaps the DMA of the previous one on the copy stream.
PIPELINE_CHUNK_BYTES = 32 << 20  # measured on H100: 8 MiB chunks lose to per-call overhead


@dataclass(frozen=True)
class SwapStreams:
    """The two side streams of accelerator swaps: kernels on ``compute``, DMAs on ``copy``."""

    compute: Any
    copy: Any

    @classmethod
    def create(cls, platform: Platform) -> SwapStreams | None:
        """Two new streams on an accelerator, ``None`` on CPU."""
        if not platform.is_accelerator:
            return None
        return cls(platform.new_stream(), platform.new_stream())  # pragma: no cover


def _chunk_out(
    platform: Platform,
    streams: SwapStreams,
    planes: Sequence[torch.Tensor],
    ids: np.ndarray,
    pages: torch.Tensor,
    page_ids: Sequence[int],
    slot: torch.Tensor,
    reuse: Any,
    k: int,
) -> Any:
    """Chunk ``k`` of a move out: gather into ``slot`` on the compute stream (once ``reuse``,
    chunk k-2's DMA, drained it), then DMA it to the pages on the copy stream; the event
    after which ``slot`` may be refilled."""
    compute, copy = streams.compute, streams.copy
    if reuse is not None:  # chunk k-2's DMA has drained this slot
        compute.wait_event(reuse)
    with platform.stream_context(compute):
        ops.gather_blocks(planes, ids, slot)
    copy.wait_event(platform.record_event(compute))
    with platform.stream_context(copy):
        _dma(pages, page_ids, slot, out=True)
    return platform.record_event(copy)


def _chunk_in(
    platform: Platform,
    streams: SwapStreams,
    planes: Sequence[torch.Tensor],
    ids: np.ndarray,
    pages: torch.Tensor,
    page_ids: Sequence[int],
    slot: torch.Tensor,
    reuse: Any,
    k: int,
) -> Any:
    """Chunk ``k`` of a move in: DMA the pages into ``slot`` on the copy stream (once
    ``reuse``, chunk k-2's scatter, read it; the first after the compute stream's earlier
    work), then scatter it on the compute stream; the event after which ``slot`` may be
    refilled."""
    compute, copy = streams.compute, streams.copy
    if reuse is not None:  # chunk k-2's scatter has read this slot
        copy.wait_event(reuse)
    elif k == 0:  # the copy stream starts after the compute stream's earlier work
        copy.wait_stream(compute)
    with platform.stream_context(copy):
        _dma(pages, page_ids, slot, out=False)
    compute.wait_event(platform.record_event(copy))
    with platform.stream_context(compute):
        ops.scatter_blocks(planes, ids, slot)
    return platform.record_event(compute)


def _dma(pages: torch.Tensor, page_ids: Sequence[int], staging: torch.Tensor, out: bool) -> None:
    """One copy per contiguous run of host pages, between ``staging`` rows and those pages."""
    for start, end, first in contiguous_runs(page_ids):
        host = pages[first : first + end - start]
        if out:
            host.copy_(staging[start:end], non_blocking=True)
        else:
            staging[start:end].copy_(host, non_blocking=True)


def move_pages(
    direction: Literal["out", "in"],
    platform: Platform,
    streams: SwapStreams | None,
    planes: Sequence[torch.Tensor],
    device_ids: Sequence[int],
    pages: torch.Tensor,
    page_ids: Sequence[int],
    keep_alive: list[torch.Tensor],
) -> None:
    """Move device blocks ``device_ids`` of ``planes`` to (``"out"``) or from (``"in"``) host
    pages ``page_ids`` of ``pages`` (``uint8 [num_pages, page_bytes]``, page-first).

    Without ``streams`` (CPU) the kernels read and write the host rows directly. With them
    (accelerators) the work is queued on ``streams`` after everything already queued on the
    current stream, in chunks of about :data:`PIPELINE_CHUNK_BYTES`; the compute stream ends
    after every copy, so an event recorded on it covers the whole move. Tensors the queued
    work still uses are appended to ``keep_alive``.
    """
    if not len(device_ids):
        return
    ids = np.array(device_ids, dtype=np.int64)  # ops validates on the host, uploads async
    if streams is None:  # one call, straight between device blocks and scattered host pages
        page_rows = np.array(page_ids, dtype=np.int64)
        if direction == "out":
            ops.gather_blocks(planes, ids, pages, row_ids=page_rows)
        else:
            ops.scatter_blocks(planes, ids, pages, row_ids=page_rows)
        return
    compute, copy = streams.compute, streams.copy
    n, row_bytes = len(device_ids), pages.shape[1]
    step = max(1, PIPELINE_CHUNK_BYTES // row_bytes)
    # Two chunk slots, used in turns: chunk k's kernel fills one while chunk k-1's DMA drains
    # the other, and staging stays at two chunks however many requests a batch moves (a
    # swap runs when device memory is short).
    with platform.side_stream(compute):
        staging = platform.empty((min(n, 2 * step), row_bytes), torch.uint8)
    free_again: list[Any] = [None, None]  # per slot: event after which it may be refilled
    chunk = _chunk_out if direction == "out" else _chunk_in
    for k, a in enumerate(range(0, n, step)):
        b = min(n, a + step)
        slot = staging[(k % 2) * step : (k % 2) * step + (b - a)]
        free_again[k % 2] = chunk(
            platform, streams, planes, ids[a:b], pages, page_ids[a:b], slot, free_again[k % 2], k
        )
    compute.wait_stream(copy)
    keep_alive.append(staging)
