"""Host page spaces of the vLLM offloading backend: one compact page space per offloaded group,
sized from one byte budget, and the load/store spec that names pages in them.

Both sides compute the same :class:`HostPagePlan` from the same inputs (the scheduler to index
pages, each worker to allocate them), so no page table crosses a process. A page of group ``g``
holds one offload chunk of that group: ``blocks_per_chunk`` blocks, each the group's layers'
unpadded pages packed back to back, no padding between groups or to the largest group (vLLM's
own CPU spec gives every key a chunk of the whole padded block of every group).

This module imports no vLLM code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvforge._checks import ArgumentError, check_int
from kvforge.integrations.vllm.checks import int_array

__all__ = ["HostPagePlan", "plan_host_pages"]


@dataclass(frozen=True)
class HostPagePlan:
    """The page spaces of every offloaded group (group positions in vLLM's offloading order).

    Attributes:
        group_ids: vLLM's KV cache group index of each position (the index an ``OffloadKey``
            carries).
        block_bytes: ``block_bytes[i]``: one block of group ``i`` as vLLM's scheduler sees it
            (its spec's unpadded page times its layers); the page count is planned from it.
        blocks_per_chunk: blocks in one offload chunk (one page).
        num_pages: usable pages per group, the same for every group: one page of every group
            holds one chunk of a full prefix.

    >>> plan = plan_host_pages([0, 1], [32_768, 4_096], blocks_per_chunk=2, host_bytes=1 << 20)
    >>> plan.page_bytes          # a chunk: 2 blocks of each group
    (65536, 8192)
    >>> plan.num_pages           # 1 MiB // (65,536 + 8,192) = 14 pages per group
    14
    >>> plan.host_bytes          # 14 * 73,728 B, within the budget
    1032192
    """

    group_ids: tuple[int, ...]
    block_bytes: tuple[int, ...]
    blocks_per_chunk: int
    num_pages: int

    @property
    def page_bytes(self) -> tuple[int, ...]:
        return tuple(b * self.blocks_per_chunk for b in self.block_bytes)

    @property
    def host_bytes(self) -> int:
        """Bytes of every group's pages together."""
        return self.num_pages * sum(self.page_bytes)

    def position(self, group_id: int) -> int:
        """The position of vLLM group ``group_id``.

        Raises:
            ArgumentError: no offloaded group has that index.
        """
        try:
            return self.group_ids.index(group_id)
        except ValueError:
            raise ArgumentError(
                f"KV cache group {group_id!r} is not offloaded; offloaded groups are "
                f"{list(self.group_ids)}"
            ) from None


_POSITIVE = "{name} must be a positive int, got {value}"


def _positive(name: str, value: object) -> int:
    return check_int(name, value, 1, type_message=_POSITIVE, range_message=_POSITIVE)


def plan_host_pages(
    group_ids: Sequence[int],
    block_bytes: Sequence[int],
    blocks_per_chunk: int,
    host_bytes: int,
) -> HostPagePlan:
    """The page spaces that ``host_bytes`` buys: as many pages per group as a chunk of every
    group together fits, ``host_bytes // (blocks_per_chunk * sum(block_bytes))``.

    Raises:
        ArgumentError: empty or mismatched groups, a value that is not a positive int, or a
            budget below one chunk of every group (the message gives the minimum).
    """
    if len(group_ids) == 0 or len(group_ids) != len(block_bytes):
        raise ArgumentError(
            f"group_ids and block_bytes must be non-empty and of one length, got "
            f"{list(group_ids)!r} and {list(block_bytes)!r}"
        )
    ids = tuple(check_int("group_ids[]", g) for g in group_ids)
    if len(set(ids)) != len(ids):
        raise ArgumentError(f"group_ids must be distinct, got {list(ids)}")
    sizes = tuple(_positive("block_bytes[]", b) for b in block_bytes)
    bpc = _positive("blocks_per_chunk", blocks_per_chunk)
    budget = _positive("host_bytes", host_bytes)
    chunk = bpc * sum(sizes)
    if budget < chunk:
        raise ArgumentError(
            f"host_bytes={budget} holds no chunk: one chunk of every offloaded group takes "
            f"{chunk} B ({bpc} block(s) of {list(sizes)} B)"
        )
    return HostPagePlan(ids, sizes, bpc, budget // chunk)


class HostPages:
    """The host side of one transfer: per group position, the pages of its chunks in chunk
    order (``pages[i]``: ``int32 [chunks of group i]``, page ids from 1; 0 is no page). Page ids
    must be ints (a float or a bool is refused with an ``ArgumentError``, never truncated).

    It is what :class:`~kvforge.integrations.vllm.manager.KVForgeOffloadingManager` hands
    vLLM's scheduler as a ``LoadStoreSpec`` and what the worker reads; the subclass that is
    one is made where vLLM is imported (:mod:`kvforge.integrations.vllm.spec`).
    """

    __slots__ = ("pages",)

    def __init__(self, pages: Sequence[np.ndarray]) -> None:
        # ints only: a float page id is refused, never truncated to a page
        self.pages = tuple(
            int_array(f"pages[{i}]", p, 0, 1 << 31).astype(np.int32) for i, p in enumerate(pages)
        )

    @property
    def num_chunks(self) -> int:
        return sum(len(p) for p in self.pages)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[p.tolist() for p in self.pages]})"
