"""Exact check that no two cache planes share a byte.

A plane is a buffer addressed per block: block ``i`` of plane ``p`` is the byte range
``[base + i * block_stride, base + i * block_stride + block_bytes)`` for ``i`` in
``range(num_blocks)``. The stride may exceed the block's bytes (alignment padding, interleaved
strided views of one allocation, several roles packed in one allocation), so two planes whose
address ranges interleave may still be disjoint byte for byte. :func:`find_overlap` decides it
exactly, with integer arithmetic only, and fast enough for real caches (thousands of planes of
100k blocks each):

1. whole extents ``[base, base + (n - 1) * stride + block_bytes)`` are swept in address order,
   so planes whose extents do not intersect are never compared;
2. planes with equal strides are compared by residue modulo the stride: for them, sharing a byte
   is the same as extents intersecting and residue arcs intersecting (proof in the comment
   before :class:`_StrideArcs`), so the active planes of one stride have pairwise disjoint
   arcs and a sorted list answers each query;
3. any other pair (different strides, single-block planes) is decided in O(log) by a
   Euclid-like search for the first block of one plane that lands on a block of the other.

Shared pools: groups that draw on one block pool (one id space, each block id held by at most
one group at a time) may place their buffers in the same bytes. ``find_overlap`` accepts that
one exception when told each plane's pool and member (``members``): planes of *different*
members of *one* pool that coincide (same base, block stride and block count; their
meaningful bytes may differ, as when one member pads a role to the stride its partner fills)
are one plane, the widest of them, since block ``b`` of one is block ``b`` of the other and the
pool never hands ``b`` to two members. Coinciding planes of one member, or of different pools,
are an overlap (reported at blocks ``0`` and ``0``); planes of one pool that meet only in part
(another base or stride) are decided by the sweep like any others.

Invariants: every quantity is a Python ``int`` (no float, no fixed-width overflow); a plane
whose blocks overlap each other (``block_stride < block_bytes`` with two or more blocks) is
itself an overlap; an empty plane (no blocks or no bytes) never overlaps anything.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvforge._checks import check_int

__all__ = ["PlaneExtent", "PoolMember", "find_overlap", "plane_extent"]


@dataclass(frozen=True)
class PoolMember:
    """Which shared block pool a plane's blocks are drawn from, and for which member.

    Attributes:
        pool: identifies the pool (e.g. the tuple of its groups' names).
        member: the member drawing on it (e.g. the plane's group name).
    """

    pool: Hashable
    member: Hashable


def _check_int(owner: str, field: str, value: object, minimum: int) -> None:
    check_int(
        f"{owner}: {field}",
        value,
        minimum,
        type_message="{name} must be an int, got {value}",
        range_message="{name} must be >= {minimum}, got {value}",
    )


@dataclass(frozen=True)
class PlaneExtent:
    """The bytes a plane addresses.

    Attributes:
        name: what to call the plane in messages (e.g. a storage name).
        base: address of block 0.
        block_stride: bytes from the start of one block to the start of the next.
        block_bytes: bytes of one block that the plane addresses (its meaningful bytes).
        num_blocks: blocks in the plane.
    """

    name: str
    base: int
    block_stride: int
    block_bytes: int
    num_blocks: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"PlaneExtent: name must be a non-empty str, got {self.name!r}")
        owner = f"PlaneExtent {self.name!r}"
        _check_int(owner, "base", self.base, 0)
        _check_int(owner, "block_stride", self.block_stride, 0)
        _check_int(owner, "block_bytes", self.block_bytes, 0)
        _check_int(owner, "num_blocks", self.num_blocks, 0)

    @property
    def empty(self) -> bool:
        """True when the plane addresses no byte."""
        return self.num_blocks == 0 or self.block_bytes == 0

    @property
    def end(self) -> int:
        """One past the last byte of the last block (``base`` for an empty plane)."""
        if self.empty:
            return self.base
        return self.base + (self.num_blocks - 1) * self.block_stride + self.block_bytes

    def block_range(self, index: int) -> tuple[int, int]:
        """``(start, end)`` byte addresses of block ``index``."""
        if not 0 <= index < self.num_blocks:
            raise IndexError(
                f"plane {self.name!r} has blocks 0..{self.num_blocks - 1}, not {index}"
            )
        start = self.base + index * self.block_stride
        return start, start + self.block_bytes

    @property
    def self_overlapping(self) -> bool:
        """True when consecutive blocks share bytes (stride smaller than the block)."""
        return self.num_blocks > 1 and self.block_bytes > 0 and self.block_stride < self.block_bytes


# ---------------------------------------------------------------------- number theory


def _min_multiple_in(a: int, m: int, lo: int, hi: int) -> int | None:
    """Smallest ``x >= 0`` with ``lo <= (a * x) % m <= hi``, for ``0 <= lo <= hi < m``.

    Euclid-like: if no multiple of ``a`` lands in ``[lo, hi]`` before the first wrap, the
    first wrap ``y`` (``a * x - m * y`` in ``[lo, hi]``) is found by the same problem with
    ``(m, a)`` in place of ``(a, m)``, so the depth is that of ``gcd(a, m)``.
    """
    if lo == 0:
        return 0
    a %= m
    if a == 0:
        return None
    x = -(-lo // a)
    if a * x <= hi:
        return x
    # [lo, hi] holds no multiple of a, so lo % a <= hi % a and both are non-zero: a multiple of
    # a lies in [lo + m*y, hi + m*y] exactly when (m*y) % a is in [(-hi) % a, (-lo) % a].
    y = _min_multiple_in(m, a, (-hi) % a, (-lo) % a)
    if y is None:
        return None
    return -(-(lo + m * y) // a)


def _first_in_window(c: int, a: int, m: int, lo: int, hi: int, count: int) -> int | None:
    """Smallest ``x`` in ``range(count)`` with ``lo <= (c + a * x) % m <= hi``, else None."""
    shifted_lo, shifted_hi = (lo - c) % m, (hi - c) % m
    if hi - lo + 1 >= m or shifted_lo > shifted_hi:
        x: int | None = 0  # the window covers c itself (it wraps past 0 once shifted)
    else:
        x = _min_multiple_in(a, m, shifted_lo, shifted_hi)
    return x if x is not None and x < count else None


def _pair_hit(a: PlaneExtent, b: PlaneExtent) -> tuple[int, int] | None:
    """Lowest block ``i`` of ``a`` that shares a byte with ``b``, and the lowest such block ``j``.

    Both planes must be non-empty and not self-overlapping. Block ``i`` of ``a`` meets block
    ``j`` of ``b`` exactly when ``j*sb - na < x_i < j*sb + nb`` with ``x_i = a.base - b.base +
    i*sa``. The blocks of ``a`` that meet ``b``'s extent form a range; within it, the smallest
    candidate ``j`` for ``i`` is ``floor((x_i - nb) / sb) + 1`` and it fits exactly when
    ``(x_i - nb) % sb > sb - na - nb``, a modular window that :func:`_first_in_window` solves.
    """
    na, nb = a.block_bytes, b.block_bytes
    # A single-block plane's stride is never used; any positive value keeps the algebra exact.
    sa = a.block_stride if a.num_blocks > 1 else na
    sb = b.block_stride if b.num_blocks > 1 else nb
    d = a.base - b.base
    i_lo = max(0, (-d - na) // sa + 1)
    i_hi = min(a.num_blocks - 1, -(-((b.num_blocks - 1) * sb + nb - d) // sa) - 1)
    if i_lo > i_hi:
        return None
    y_lo = d - nb + i_lo * sa
    if y_lo < 0:  # block i_lo reaches below b's block 1: it meets block 0 (extents intersect)
        return i_lo, 0
    window_lo = sb - na - nb + 1
    if window_lo <= 0:
        x: int | None = 0
    else:
        x = _first_in_window(y_lo % sb, sa % sb, sb, window_lo, sb - 1, i_hi - i_lo + 1)
    if x is None:
        return None
    i = i_lo + x
    return i, (d - nb + i * sa) // sb + 1


# ---------------------------------------------------------------------- sweep


# Why planes of one stride need only a residue test. Take planes A, B with stride s, bytes na, nb,
# blocks NA, NB and d = A.base - B.base. Block i of A meets block j of B iff -na < d + k*s < nb
# with k = i - j, which ranges over [-(NB-1), NA-1]. The integers k with -na < d + k*s < nb form
# a run [t, u], non-empty iff the residue arcs [A.base % s, +na) and [B.base % s, +nb) meet. The
# extents intersect iff -(NA-1)*s - na < d < (NB-1)*s + nb: the left inequality says k = NA-1
# meets the lower bound, so t <= NA-1; the right one says k = -(NB-1) meets the upper bound, so
# u >= -(NB-1). With t <= u, the runs [t, u] and [-(NB-1), NA-1] intersect. Hence planes of one
# stride share a byte iff their extents and residue arcs intersect, and planes of one stride
# whose extents all contain one address and that share no byte have pairwise disjoint arcs.


class _StrideArcs:
    """Residue arcs ``[start, start + length)`` modulo ``stride`` of active planes, disjoint."""

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self.arcs: list[tuple[int, int, int]] = []  # (start, position, length), sorted

    def add(self, start: int, position: int, length: int) -> None:
        bisect.insort(self.arcs, (start, position, length))

    def remove(self, start: int, position: int, length: int) -> None:
        at = bisect.bisect_left(self.arcs, (start, position, length))
        del self.arcs[at]

    def _starting_in(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        first, stop = bisect.bisect_left(self.arcs, (lo,)), bisect.bisect_left(self.arcs, (hi,))
        return self.arcs[first:stop]

    def meeting(self, start: int, length: int) -> list[int]:
        """Positions of the stored arcs that intersect ``[start, start + length)``."""
        if not self.arcs:
            return []
        s = self.stride
        end = start + length
        found = self._starting_in(start, min(end, s))
        if end > s:
            found += self._starting_in(0, end - s)
        # The one arc that may contain ``start`` without starting inside the query: the
        # circular predecessor (arcs are disjoint, so no other can).
        at = bisect.bisect_left(self.arcs, (start,)) - 1
        pred = self.arcs[at]  # at == -1 wraps to the arc with the largest start
        if pred[0] != start and (start - pred[0]) % s < pred[2]:
            found.append(pred)
        return sorted({position for _, position, _ in found})


def find_overlap(
    planes: Sequence[PlaneExtent],
    members: Sequence[PoolMember | None] | None = None,
) -> tuple[PlaneExtent, PlaneExtent, int, int] | None:
    """The first pair of planes that share a byte, with a block index of each; else None.

    ``members[i]`` (optional) is the shared pool ``planes[i]`` draws its blocks from, or None
    when it shares none: non-empty planes with the same base, block stride and block count
    may coincide only when every one of them names the same pool and a different member (see
    the module docstring); the first pair (in input order) that breaks this is reported as
    ``(first, second, 0, 0)``, after self-overlapping planes. The planes of a legal
    coincidence count as one (the widest) in what follows.

    A plane that overlaps itself (two or more blocks, ``block_stride < block_bytes``) is
    reported first, in input order, as ``(plane, plane, 0, 1)``. Otherwise planes are scanned
    by ascending ``base`` (ties in input order) and the pair reported is the one whose later
    plane comes first in that scan, with its earliest partner: ``(earlier, later, i, j)``,
    where ``i`` is the lowest block of ``earlier`` that shares a byte with ``later`` and ``j``
    the lowest block of ``later`` that shares a byte with block ``i``.

    Cost: sorting plus, per plane, a query among the planes whose extents contain its base:
    O(log n) against those of its own stride, O(log) each against the others.

    Raises:
        TypeError: an item is not a :class:`PlaneExtent`, or ``members`` holds an item that
            is neither a :class:`PoolMember` nor None.
        ValueError: ``members`` is not as long as ``planes``.
    """
    items = list(planes)
    for n, plane in enumerate(items):
        if not isinstance(plane, PlaneExtent):
            raise TypeError(f"planes[{n}] must be a PlaneExtent, got {type(plane).__name__}")
    for plane in items:
        if plane.self_overlapping:
            return plane, plane, 0, 1
    if members is not None:
        kept, clash = _merge_coincident(items, _check_members(members, len(items)))
        if clash is not None:
            return clash
        items = kept
    return _first_shared(items)


def _check_members(members: Sequence[PoolMember | None], n: int) -> list[PoolMember | None]:
    """``members`` as a list, one :class:`PoolMember` or None per plane."""
    tags = list(members)
    if len(tags) != n:
        raise ValueError(
            f"members must name one pool member (or None) per plane: {len(tags)} for {n} planes"
        )
    for i, tag in enumerate(tags):
        if tag is not None and not isinstance(tag, PoolMember):
            raise TypeError(f"members[{i}] must be a PoolMember or None, got {type(tag).__name__}")
    return tags


def _first_shared(
    items: list[PlaneExtent],
) -> tuple[PlaneExtent, PlaneExtent, int, int] | None:
    """The scan of :func:`find_overlap` over planes none of which overlaps itself: by
    ascending base, each plane against the active planes whose extents contain its base."""
    order = sorted(
        (n for n, p in enumerate(items) if not p.empty), key=lambda n: (items[n].base, n)
    )
    live = [items[n] for n in order]
    heap: list[tuple[int, int]] = []  # (end, position) of active planes
    arcs: dict[int, _StrideArcs] = {}  # stride -> active multi-block planes of that stride
    singles: set[int] = set()  # positions of active single-block planes
    for pos, plane in enumerate(live):
        while heap and heap[0][0] <= plane.base:
            _, gone = heapq.heappop(heap)
            _forget(live[gone], gone, arcs, singles)
        candidates: list[int] = []
        own = plane.block_stride if plane.num_blocks > 1 else None
        if own is not None and own in arcs:
            candidates += arcs[own].meeting(plane.base % own, plane.block_bytes)
        for stride, group in arcs.items():
            if stride != own:
                candidates += [position for _, position, _ in group.arcs]
        candidates += singles
        for partner in sorted(candidates):
            hit = _pair_hit(live[partner], plane)
            if hit is not None:
                return live[partner], plane, hit[0], hit[1]
        heapq.heappush(heap, (plane.end, pos))
        if own is None:
            singles.add(pos)
        else:
            arcs.setdefault(own, _StrideArcs(own)).add(plane.base % own, pos, plane.block_bytes)
    return None


def _merge_coincident(
    items: list[PlaneExtent], tags: list[PoolMember | None]
) -> tuple[list[PlaneExtent], tuple[PlaneExtent, PlaneExtent, int, int] | None]:
    """The planes with each legal coincidence kept once, or the first pair of coinciding
    planes that may not coincide.

    Planes coincide when they start at the same address with the same block stride and block
    count; their meaningful bytes may differ (one member's role padded to the stride that its
    partner fills). The coincidence is represented by its widest plane, so the sweep that
    follows sees every byte any of them addresses."""
    at: dict[tuple[int, int, int], int] = {}  # (base, stride, blocks) -> position in kept
    seen: dict[int, list[int]] = {}  # position in kept -> every plane coinciding there
    kept: list[PlaneExtent] = []
    for n, plane in enumerate(items):
        if plane.empty:  # an empty plane shares no byte, whatever it coincides with
            kept.append(plane)
            continue
        where = (plane.base, plane.block_stride, plane.num_blocks)
        pos = at.get(where)
        if pos is None:
            at[where] = len(kept)
            seen[len(kept)] = [n]
            kept.append(plane)
            continue
        tag = tags[n]
        for other in seen[pos]:
            mate = tags[other]
            if tag is None or mate is None or tag.pool != mate.pool or tag.member == mate.member:
                return kept, (items[other], plane, 0, 0)
        seen[pos].append(n)
        if plane.block_bytes > kept[pos].block_bytes:
            kept[pos] = plane
    return kept, None


def _forget(
    plane: PlaneExtent, position: int, arcs: dict[int, _StrideArcs], singles: set[int]
) -> None:
    if plane.num_blocks > 1:
        group = arcs[plane.block_stride]
        group.remove(plane.base % plane.block_stride, position, plane.block_bytes)
        if not group.arcs:
            del arcs[plane.block_stride]
    else:
        singles.discard(position)


# ---------------------------------------------------------------------- tensors


def plane_extent(name: str, tensor: torch.Tensor) -> PlaneExtent:
    """The plane of a block-major tensor: dim 0 is the block dimension.

    ``base`` is ``data_ptr()`` (the storage offset included), ``block_stride`` is
    ``stride(0) * element_size()`` and ``block_bytes`` the bytes one block addresses. A block
    must be one contiguous run of bytes: its dims (size > 1), ordered by stride, must nest
    exactly (the innermost has stride 1, each next one the product of the previous sizes). A
    permuted but dense block qualifies; a block with gaps or aliased elements does not.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.
        ValueError: naming the plane, for a 0-d tensor or a block that is not one run of bytes.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"plane {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError(f"plane {name!r} is a 0-d tensor; dim 0 must be the block dimension")
    itemsize = tensor.element_size()
    sizes, strides = tuple(tensor.shape[1:]), tuple(tensor.stride()[1:])
    if 0 in sizes:
        block_elems = 0
    else:
        expected = 1
        for size, stride in sorted(
            ((sz, st) for sz, st in zip(sizes, strides, strict=True) if sz > 1),
            key=lambda pair: (pair[1], pair[0]),
        ):
            if stride != expected:
                raise ValueError(
                    f"plane {name!r}: a block of shape {sizes} with element strides {strides} "
                    "is not one contiguous run of bytes (planes must be block-major)"
                )
            expected = stride * size
        block_elems = expected
    return PlaneExtent(
        name=name,
        base=tensor.data_ptr(),
        block_stride=tensor.stride(0) * itemsize,
        block_bytes=block_elems * itemsize,
        num_blocks=tensor.shape[0],
    )
