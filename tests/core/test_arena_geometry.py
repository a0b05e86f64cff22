"""The slab arena's geometry (``kvforge.core.arena``): every block of every group lies inside
one slab, no usable block overlaps a null block, and the budget's remainder is used."""

from __future__ import annotations

import pytest

from kvforge.core.arena import plan_arena
from kvforge.core.layout import CacheLayout
from kvforge.models import from_hf_config

SHAPES = {
    "deepseek-v4-tiny": [64 << 20, 160 << 20, 1 << 30, 3 << 30],
    "deepseek-v4-flash": [2 << 30, 20 << 30, 60 << 30],
}
CASES = [(m, b) for m, budgets in SHAPES.items() for b in budgets]


@pytest.mark.parametrize(("model", "budget"), CASES)
def test_geometry_invariants(model: str, budget: int) -> None:
    layout = CacheLayout(from_hf_config(model))
    g = plan_arena(layout, budget)
    assert g is not None
    for stride, k, page in zip(g.block_stride, g.blocks_per_slab, g.page_bytes, strict=True):
        assert stride * k == g.slab_bytes and stride >= page and stride % 256 == 0
    home = g.groups[g.home]
    assert home == "compressed"  # the full-history group
    stride = g.block_stride[g.home]
    # the home group's reserved ids cover every member's null block, and no more than one
    # more of its blocks
    assert g.home_reserved * stride >= max(g.block_stride) > (g.home_reserved - 1) * stride
    # whole slabs, then the tail: at most one home block of the budget is left idle
    assert g.total_bytes <= budget < g.total_bytes + stride
    assert 0 <= g.tail_blocks < g.blocks_per_slab[g.home]
    assert g.num_blocks(home) == g.num_slabs * g.blocks_per_slab[g.home] + g.tail_blocks
    for name in g.groups:
        if name != home:
            assert g.num_blocks(name) == g.num_slabs * g.blocks_per_slab[g.index(name)]
            assert g.pinned_blocks(name) == 0
    assert g.pinned_blocks(home) == g.blocks_per_slab[g.home] - g.home_reserved + g.tail_blocks


def test_v4_tiny_on_one_gib_worked_example() -> None:
    g = plan_arena(CacheLayout(from_hf_config("deepseek-v4-tiny")), 1 << 30)
    assert g is not None
    assert (g.slab_bytes, g.num_slabs, g.home, g.home_reserved) == (14_976_000, 71, 1, 3)
    # 1 GiB - 71 slabs = 10,445,824 B: 108 blocks of compressed's 96,000 B stride
    assert (1 << 30) - 71 * 14_976_000 == 10_445_824 and g.tail_blocks == 108
    assert g.total_bytes == 71 * 14_976_000 + 108 * 96_000
    # slab 0 holds 156 compressed ids; 3 of them (288,000 B >= swa's 230,400 B null) are
    # reserved, so 153 + 108 = 261 compressed blocks never move
    assert g.pinned_blocks("compressed") == 261
