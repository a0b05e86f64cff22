"""Pinned host pools, page-first per group.

One host pool per group: a ``uint8`` tensor ``[num_pages, page_bytes]``. A page holds one
block of the group for every offloaded (layer, role), packed in the controller's list order
with no padding, so one swapped block of every layer is one contiguous row and a swap of a
request is a few long contiguous runs. Page ids come from a :class:`BlockPool` (page 0 is the
reserved null page) on the scheduler side
(:class:`~kvforge.scheduler.block_manager.BlockManager`): this module holds only the
memory, on the worker side.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvforge.core.layout import CacheBuffer, CacheLayout
from kvforge.platform import Platform
from kvforge.specs import CacheRole

__all__ = ["HostGroupPool", "HostPools", "HostViews"]


class HostGroupPool:
    """The host pages of one group.

    Attributes:
        buffers: the offloaded (layer, role) buffers of the group, in page order.
        offsets: byte offset of each buffer's block inside a page (same order).
        page_bytes: bytes of one page (sum of the buffers' meaningful block bytes).
        pages: ``uint8 [num_pages, page_bytes]``, pinned on accelerators.
        num_pages: pages, the reserved null page 0 included.
    """

    def __init__(
        self, name: str, buffers: tuple[CacheBuffer, ...], num_pages: int, platform: Platform
    ) -> None:
        self.name = name
        self.buffers = buffers
        offsets, offset = [], 0
        for e in buffers:
            offsets.append(offset)
            offset += e.block_bytes
        self.offsets = tuple(offsets)
        self.page_bytes = offset
        self.num_pages = num_pages
        self.pages = platform.empty_host((num_pages, self.page_bytes), torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.pages.numel()

    def buffer_slice(self, key: tuple[str, int]) -> tuple[int, int]:
        """``(offset, bytes)`` of buffer ``key``'s block inside a page."""
        for e, off in zip(self.buffers, self.offsets, strict=True):
            if e.key == key:
                return off, e.block_bytes
        raise KeyError(f"{key} is not offloaded in group {self.name!r}")


class HostPools:
    """Every group's host pool.

    Args:
        layout: the controller's layout.
        num_pages: pages per group (null page included); groups with nothing to offload get
            no pool.
        platform: where pinned memory comes from.
    """

    def __init__(self, layout: CacheLayout, num_pages: Mapping[str, int], platform: Platform):
        self.groups: dict[str, HostGroupPool] = {}
        for group in layout.groups:
            planes = layout.offload_buffers(group.name)
            if planes:
                self.groups[group.name] = HostGroupPool(
                    group.name, planes, num_pages[group.name], platform
                )

    @property
    def nbytes(self) -> int:
        """Bytes held by the host pools (zero once freed)."""
        return sum(p.nbytes for p in self.groups.values())

    def release(self) -> None:
        """Drop the host tensors (pages must already be free)."""
        self.groups.clear()


class HostViews:
    """What ``AttentionBackend.create_host_kv_cache`` gets: typed views into host pages.

    It allocates nothing: the pages exist already; it cuts one role's view out of them. It
    satisfies :class:`kvforge.attn_backends.base.HostViewSource`.
    """

    def __init__(self, pools: HostPools) -> None:
        self.pools = pools

    def view(self, role: CacheRole, layer: int) -> torch.Tensor:
        """Role ``role`` of ``layer`` across all host pages.

        Returns:
            a strided view ``[num_pages, entries_per_block, *entry_shape]`` of the role's
            dtype when the page layout keeps its bytes aligned for that dtype, else the raw
            ``uint8 [num_pages, block_bytes]`` slice.
        """
        group = self.pools.groups[role.group]
        offset, nbytes = group.buffer_slice((role.name, layer))
        raw = group.pages[:, offset : offset + nbytes]
        try:
            typed = raw.view(role.torch_dtype)
        except RuntimeError:  # page stride or offset not a multiple of the item size
            return raw
        entries = nbytes // role.entry_bytes
        return typed.view(raw.shape[0], entries, *role.entry_shape)
