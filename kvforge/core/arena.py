"""The geometry of a slab arena: one device allocation whose bytes flow between groups whose
pages differ (DeepSeek-V4's window, compressed and state groups).

The arena is ``num_slabs`` slabs of ``slab_bytes``. Group ``g`` packs its buffers page first
(block ``b`` of every role and layer of ``g`` is one run of ``block_stride[g]`` bytes) and
addresses the *whole* arena linearly: block ``b`` starts ``b * block_stride[g]`` bytes in.
Because ``block_stride[g] * blocks_per_slab[g] == slab_bytes``, block ``b`` lies inside slab
``b // blocks_per_slab[g]``; a slab belongs to one group at a time, so blocks of different
groups never overlap, and an empty slab can move to another group without touching a tensor.

Two regions never move, both the *home* group's (a full-history group where there is one: it
always has blocks to keep there):

- slab 0, whose first ``max(block_stride)`` bytes hold every member's null block (block 0):
  the home group's ids that overlap them are reserved, its other ids of slab 0 are usable, so
  the nulls cost one largest page, as one null block does in vLLM's pool, not a whole slab;
- the tail past the last whole slab, ``tail_blocks`` more home blocks, so the budget's
  remainder after whole slabs is not left idle.

Invariants (``tests/core/test_arena_geometry.py``):

- ``block_stride[g] * blocks_per_slab[g] == slab_bytes`` and ``block_stride[g] >=
  page_bytes[g]`` (padding per block, stated as :attr:`ArenaGeometry.padding`);
- ``home_reserved * block_stride[home] >= max(block_stride)``: no usable home block overlaps
  a member's null block;
- ``total_bytes <= `` the budget; every figure is an exact int; nothing here allocates.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from kvforge.attn_backends.base import AttentionBackend
from kvforge.core.layout import CacheLayout

__all__ = ["BLOCK_ALIGN", "MIN_SLABS", "ArenaGeometry", "arena_groups", "plan_arena"]

BLOCK_ALIGN = 256
"""Every block and every buffer inside it starts on a 256-byte boundary (what vector loads and
DMA engines want; more than any role's dtype needs)."""

BUFFER_ALIGN = 16
"""Buffers of one block start 16 bytes apart at least (the widest dtype plus room)."""

MIN_SLABS = 8
"""Fewer slabs than this and groups could not trade memory: such a budget keeps own pools."""

MIN_BLOCKS_PER_SLAB = 8
"""A slab holds at least this many blocks of its largest-page group."""

PADDING_TARGET = 0.01
"""The smallest slab whose worst padding is at most 1% wins; else the least padded one."""

PADDING_LIMIT = 0.03
"""More slabs are worth up to 3% padding per block; past that, fewer and larger slabs."""


class ArenaGeometry(BaseModel):
    """Where every member group's blocks lie in one arena (frozen: both sides get it).

    Worked example, DeepSeek-V4-tiny on 1 GiB (pages 224,640 / 95,616 / 82,944 / 65,664 B):
    a slab of ``256 * L`` bytes whose ``L`` has divisors just above each page's 256-byte
    count, so ``blocks_per_slab[g] = L // ceil(page / 256)`` and the stride is the slab
    divided by it.
    """

    model_config = ConfigDict(frozen=True)

    groups: tuple[str, ...]
    slab_bytes: int
    num_slabs: int
    """Whole slabs in the arena, slab 0 (the null blocks) included."""
    blocks_per_slab: tuple[int, ...]
    block_stride: tuple[int, ...]
    """Device bytes from one block of the group to the next (its page, padded)."""
    page_bytes: tuple[int, ...]
    """The group's buffers' device strides, summed, each rounded up to 16 bytes."""
    buffer_offsets: tuple[tuple[int, ...], ...]
    """Per group, where each of its buffers (layout order) starts inside the block."""
    home: int = 0
    """The group (index) that owns slab 0 and the tail for good."""
    tail_blocks: int = 0
    """Home blocks past the last whole slab (fewer than a slab's worth)."""

    @property
    def home_reserved(self) -> int:
        """Home ids at the arena's start that overlap some member's null block (never
        handed out): ``ceil(max(block_stride) / block_stride[home])``."""
        return -(-max(self.block_stride) // self.block_stride[self.home])

    def index(self, group: str) -> int:
        try:
            return self.groups.index(group)
        except ValueError:
            raise ValueError(
                f"group {group!r} is not in the arena; its groups are {list(self.groups)}"
            ) from None

    def num_blocks(self, group: str) -> int:
        """Block ids of ``group`` (the null block included): every slab's worth, and the
        tail's for the home group."""
        i = self.index(group)
        tail = self.tail_blocks if i == self.home else 0
        return self.num_slabs * self.blocks_per_slab[i] + tail

    @property
    def total_bytes(self) -> int:
        return self.num_slabs * self.slab_bytes + self.tail_blocks * self.block_stride[self.home]

    def pinned_blocks(self, group: str) -> int:
        """Usable blocks ``group`` holds for good (slab 0 and the tail; 0 but for home)."""
        i = self.index(group)
        if i != self.home:
            return 0
        return self.blocks_per_slab[i] - self.home_reserved + self.tail_blocks

    @property
    def padding(self) -> dict[str, float]:
        """Device padding per block, as a fraction of the unpadded page."""
        return {
            g: (s - p) / p
            for g, s, p in zip(self.groups, self.block_stride, self.page_bytes, strict=True)
        }


def arena_groups(layout: CacheLayout) -> tuple[str, ...]:
    """The groups one arena can serve: those that would keep a pool of their own (a set of
    one in :attr:`CacheLayout.pool_sets`) and are paged (not per-request slots) and laid out
    by the default ``create_kv_cache``. Empty unless at least two qualify."""
    own_memory = set()
    for backend, layers in layout.backend_layers():
        if type(backend).create_kv_cache is not AttentionBackend.create_kv_cache:
            own_memory.update(e.group.name for e in layout.buffers_of_layers(layers))
    names = tuple(
        s[0]
        for s in layout.pool_sets
        if len(s) == 1
        and not layout.group(s[0]).rule.per_request
        and s[0] not in own_memory
        and layout.bytes_per_block(s[0]) > 0
    )
    return names if len(names) >= 2 else ()


def _page(layout: CacheLayout, group: str) -> tuple[int, tuple[int, ...]]:
    """The packed page of ``group``: its size and each buffer's offset in it."""
    offsets = []
    at = 0
    for e in layout.buffers_of(group):
        offsets.append(at)
        at += -(-e.device_block_bytes // BUFFER_ALIGN) * BUFFER_ALIGN
    return at, tuple(offsets)


def plan_arena(
    layout: CacheLayout, memory_budget: int, groups: Sequence[str] | None = None
) -> ArenaGeometry | None:
    """The arena of ``groups`` (default :func:`arena_groups`) in ``memory_budget`` bytes, or
    None when fewer than two groups qualify or the budget holds fewer than
    :data:`MIN_SLABS` slabs of the smallest fitting size.

    DeepSeek-V4-tiny on 1 GiB: pages of 878, 374, 324 and 257 units of 256 B; the slab of
    ``L = 58,500`` units (``2^2 3^2 5^3 13``) has divisors 900, 375, 325 and 260, so each
    group's stride is ``256 * q`` and ``L // q`` blocks fill a slab exactly:

    >>> from kvforge.models import from_hf_config
    >>> g = plan_arena(CacheLayout(from_hf_config("deepseek-v4-tiny")), 1 << 30)
    >>> g.slab_bytes, g.num_slabs, g.blocks_per_slab
    (14976000, 71, (65, 156, 180, 225))
    >>> g.block_stride, g.page_bytes
    ((230400, 96000, 83200, 66560), (224640, 95616, 82944, 65664))
    >>> [s * k == g.slab_bytes for s, k in zip(g.block_stride, g.blocks_per_slab)]
    [True, True, True, True]
    """
    names = tuple(groups) if groups is not None else arena_groups(layout)
    if len(names) < 2:
        return None
    pages = [_page(layout, n) for n in names]
    units = tuple(-(-p // BLOCK_ALIGN) for p, _ in pages)
    lo = MIN_BLOCKS_PER_SLAB * max(units)
    best = None
    # many slabs drain often (a slab moves only once none of its blocks is in use), so the
    # most slabs whose padding stays within PADDING_LIMIT win; a small budget falls back to
    # fewer, larger slabs
    for slabs in (256, 64, MIN_SLABS):
        hi = memory_budget // (BLOCK_ALIGN * slabs)
        if hi < lo:
            continue
        best = _slab_units(units, lo, hi)
        if best is not None and (best[2] <= PADDING_LIMIT or slabs == MIN_SLABS):
            break
    if best is None:
        return None
    slab_units, per_slab, _ = best
    slab_bytes = slab_units * BLOCK_ALIGN
    strides = tuple(slab_bytes // k for k in per_slab)
    # home: a full-history group (it keeps blocks wherever there is room), the smallest
    # stride among them (the fewest bytes lost to the nulls and the tail)
    history = [i for i, n in enumerate(names) if layout.group(n).rule.history]
    home = min(history or range(len(names)), key=lambda i: strides[i])
    num_slabs = memory_budget // slab_bytes
    return ArenaGeometry(
        groups=names,
        slab_bytes=slab_bytes,
        num_slabs=num_slabs,
        blocks_per_slab=per_slab,
        block_stride=strides,
        page_bytes=tuple(p for p, _ in pages),
        buffer_offsets=tuple(o for _, o in pages),
        home=home,
        tail_blocks=(memory_budget - num_slabs * slab_bytes) // strides[home],
    )


_PRIMES = (2, 3, 5, 7, 11, 13)


@functools.lru_cache(maxsize=64)
def _slab_units(
    units: tuple[int, ...], lo: int, hi: int
) -> tuple[int, tuple[int, ...], float] | None:
    """The slab size ``L`` (in :data:`BLOCK_ALIGN` units) in ``[lo, hi]`` and the blocks per
    slab of each page, and the worst padding: ``L`` is 13-smooth, so it has many divisors,
    and page ``u`` gets the smallest divisor ``q >= u`` (``L // q`` blocks of ``q`` units).
    The smallest ``L`` whose worst padding ``q / u - 1`` is at most :data:`PADDING_TARGET`
    wins, else the least padded.
    """
    hi = min(hi, lo * 64, 1 << 28)  # past 64x the least, slabs only fragment more
    best: tuple[float, int, tuple[int, ...]] | None = None
    for L, factors in _smooth_between(lo, hi):
        divisors = _divisors(factors)
        worst = 0.0
        per_slab = []
        for u in units:
            q = divisors[bisect.bisect_left(divisors, u)]
            worst = max(worst, q / u - 1)
            per_slab.append(L // q)
        if best is None or worst < best[0]:
            best = (worst, L, tuple(per_slab))
        if worst <= PADDING_TARGET:
            break
    return None if best is None else (best[1], best[2], best[0])


def _smooth_between(lo: int, hi: int) -> list[tuple[int, tuple[int, ...]]]:
    """13-smooth numbers in ``[lo, hi]`` ascending, each with its exponents."""
    found: list[tuple[int, tuple[int, ...]]] = []

    def walk(i: int, value: int, exps: tuple[int, ...]) -> None:
        if i == len(_PRIMES):
            if value >= lo:
                found.append((value, exps))
            return
        e = 0
        while value <= hi:
            walk(i + 1, value, (*exps, e))
            value *= _PRIMES[i]
            e += 1

    walk(0, 1, ())
    found.sort()
    return found


def _divisors(exps: tuple[int, ...]) -> list[int]:
    divs = [1]
    for p, e in zip(_PRIMES, exps, strict=True):
        divs = [d * p**i for d in divs for i in range(e + 1)]
    return sorted(divs)
