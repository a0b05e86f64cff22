"""The worker side of a slab arena: the typed views of one raw allocation that every arena
group's (role, layer) buffers are.

Group ``g`` packs its buffers page first: buffer ``j`` of block ``b`` starts
``b * block_stride[g] + buffer_offsets[g][j]`` bytes into the arena, so each view has a fixed
pointer, shape and strides whichever group a slab belongs to at the moment
(``tests/worker/test_arena_storage.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvforge.attn_backends.base import padded_block_view
from kvforge.core.arena import ArenaGeometry
from kvforge.core.layout import CacheLayout

__all__ = ["arena_views", "check_arena"]


def arena_views(
    layout: CacheLayout, arena: ArenaGeometry, raw: torch.Tensor
) -> dict[tuple[str, int], torch.Tensor]:
    """Every buffer of the arena's groups, a typed view of ``raw`` ``uint8 [total_bytes]``.

    Block ``b`` of a group with stride ``s`` is row ``b`` of the first ``num_blocks(g) * s``
    bytes of ``raw`` seen as ``[num_blocks(g), s]`` (the home group's rows run on into the
    tail); the buffer's bytes start at its offset in that row (:func:`padded_block_view`).
    """
    views: dict[tuple[str, int], torch.Tensor] = {}
    for i, g in enumerate(arena.groups):
        stride = arena.block_stride[i]
        n = arena.num_blocks(g)
        rows = raw[: n * stride].view(n, stride)
        entries = layout.buffers_of(g)
        for e, offset in zip(entries, arena.buffer_offsets[i], strict=True):
            views[e.key] = padded_block_view(rows, e.role, e.group, offset)
    return views


def check_arena(arena: object, share_pools: bool, blocks: Mapping[str, int]) -> tuple[str, ...]:
    """The groups of ``arena`` (none without one), refused unless its counts are ``blocks``'.

    Raises:
        TypeError: ``arena`` is neither an :class:`ArenaGeometry` nor None.
        ValueError: ``share_pools`` is off, or a group's count is not its arena's.
    """
    if arena is None:
        return ()
    if not isinstance(arena, ArenaGeometry):
        raise TypeError(f"arena must be an ArenaGeometry or None, got {type(arena).__name__}")
    if not share_pools:
        raise ValueError("arena needs share_pools=True: its groups share one allocation")
    for g in arena.groups:
        if blocks.get(g) != arena.num_blocks(g):
            raise ValueError(
                f"create: num_blocks gives {blocks.get(g)!r} to arena group {g!r}; its arena "
                f"gives it {arena.num_blocks(g):,}"
            )
    return arena.groups
