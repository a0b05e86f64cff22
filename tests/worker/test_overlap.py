"""find_overlap / plane_extent: exact byte-overlap decisions between cache planes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.worker.overlap import PlaneExtent, find_overlap, plane_extent


def P(name, base, stride, nbytes, blocks):
    return PlaneExtent(
        name=name, base=base, block_stride=stride, block_bytes=nbytes, num_blocks=blocks
    )


def named(result):
    if result is None:
        return None
    a, b, i, j = result
    return a.name, b.name, i, j


# (case, planes, expected (first, second, block of first, block of second) or None)
CASES = [
    # kv = [4 blocks, 2 roles, 8 bytes]: key at offset 0, value at offset 8, both stride 16
    ("interleaved views of one allocation", [P("key", 0, 16, 8, 4), P("value", 8, 16, 8, 4)], None),
    # the same with 3 roles and padding: rows of 32 bytes, roles at 0, 8, 20 (12 bytes padding)
    (
        "three interleaved roles with padding",
        [P("a", 1000, 32, 8, 50), P("b", 1008, 32, 12, 50), P("c", 1020, 32, 4, 50)],
        None,
    ),
    (
        "key and value share one buffer",
        [P("key", 0, 16, 16, 4), P("value", 0, 16, 16, 4)],
        ("key", "value", 0, 0),
    ),
    # a ends at 0 + 3*10 + 10 = 40: a plane starting at 40 touches it, one at 39 overlaps block 3
    ("touching ranges", [P("a", 0, 10, 10, 4), P("b", 40, 10, 10, 4)], None),
    (
        "one byte into the last block",
        [P("a", 0, 10, 10, 4), P("b", 39, 10, 10, 4)],
        ("a", "b", 3, 0),
    ),
    # a's last block is [400, 460); b starts at 459 (overlap) or 460 (touching)
    (
        "partial overlap at the last block",
        [P("a", 0, 100, 60, 5), P("b", 459, 100, 10, 3)],
        ("a", "b", 4, 0),
    ),
    ("touching the last block", [P("a", 0, 100, 60, 5), P("b", 460, 100, 10, 3)], None),
    # b's first block [60, 70) sits in a's padding [60, 100): extents intersect, bytes do not
    ("inside the padding", [P("a", 0, 100, 60, 5), P("b", 60, 100, 40, 4)], None),
    (
        "one byte past the padding",
        [P("a", 0, 100, 60, 5), P("b", 60, 100, 41, 4)],
        ("a", "b", 1, 0),
    ),
    # a: [3000i, 3000i + 1000); b: [1000 + 5000j, 1500 + 5000j); first meeting: a[2] = [6000, 7000)
    # and b[1] = [6000, 6500) (a[0], a[1] miss b[0] = [1000, 1500))
    (
        "different strides that meet",
        [P("a", 0, 3000, 1000, 100_000), P("b", 1000, 5000, 500, 100_000)],
        ("a", "b", 2, 1),
    ),
    # a: [4i, 4i + 2); b: [2 + 8j, 4 + 8j) always starts at 2 mod 4, in a's gaps
    ("different strides that never meet", [P("a", 0, 4, 2, 50_000), P("b", 2, 8, 2, 25_000)], None),
    # b's one block [95, 97) vs a: [0, 2), [7, 9), ... [91, 93), [98, 100): between blocks 13, 14
    ("single block between strided blocks", [P("a", 0, 7, 2, 15), P("b", 95, 0, 2, 1)], None),
    (
        "single block on a strided block",
        [P("a", 0, 7, 2, 15), P("b", 92, 0, 2, 1)],
        ("a", "b", 13, 0),
    ),
    (
        "self overlap: stride below the block",
        [P("ok", 0, 8, 8, 2), P("bad", 100, 8, 16, 3)],
        ("bad", "bad", 0, 1),
    ),
    ("self overlap: stride 0", [P("bad", 0, 0, 4, 2)], ("bad", "bad", 0, 1)),
    ("one block needs no stride", [P("one", 0, 0, 4, 1), P("next", 4, 4, 4, 3)], None),
    (
        "empty planes hold no byte",
        [P("a", 0, 8, 8, 4), P("none", 0, 8, 8, 0), P("zero", 8, 8, 0, 4)],
        None,
    ),
    # scan by base: 'late' (base 20) meets 'wide' (base 0); 'later' (base 30) meets both, but the
    # pair whose second plane starts first is reported
    (
        "first pair in address order",
        [P("later", 30, 1, 1, 1), P("late", 20, 1, 1, 2), P("wide", 0, 100, 40, 1)],
        ("wide", "late", 0, 0),
    ),
    (
        "equal bases keep input order",
        [P("second", 0, 4, 4, 1), P("first", 0, 4, 4, 1)],
        ("second", "first", 0, 0),
    ),
]


@pytest.mark.parametrize(("case", "planes", "expected"), CASES, ids=[c[0] for c in CASES])
def test_find_overlap_table(case, planes, expected):
    assert named(find_overlap(planes)) == expected
    if expected is not None and expected[0] != expected[1]:
        a, b, i, j = find_overlap(planes)
        (a0, a1), (b0, b1) = a.block_range(i), b.block_range(j)
        assert max(a0, b0) < min(a1, b1)  # the reported blocks really share a byte


def test_find_overlap_at_cache_scale():
    # 4,000 planes of 100,000 blocks interleaved in one allocation: rows of 4,000 * 1,024 bytes
    row = 4_000 * 1_024
    base = 1 << 40
    planes = [P(f"p{k}", base + k * 1_024, row, 1_024, 100_000) for k in range(4_000)]
    assert find_overlap(planes) is None
    # a 100-byte plane that starts 1,000 bytes into p3999's block 50 spills 76 bytes into row 51,
    # i.e. into p0's block 51; p0 comes first in address order, so it is the reported partner
    stray = P("stray", base + 50 * row + 3_999 * 1_024 + 1_000, row, 100, 3)
    assert named(find_overlap([*planes, stray])) == ("p0", "stray", 51, 0)
    # 4,000 separate allocations of 100,000 blocks of 4 KiB each
    separate = [P(f"s{k}", base + k * 100_000 * 4_096, 4_096, 4_096, 100_000) for k in range(4_000)]
    assert find_overlap(separate) is None


# ---------------------------------------------------------------------- property test


def _blocks(plane):
    return [
        set(
            range(
                plane.base + i * plane.block_stride,
                plane.base + i * plane.block_stride + plane.block_bytes,
            )
        )
        for i in range(plane.num_blocks)
    ]


def brute_force(planes):
    """The documented answer, computed from byte sets."""
    for p in planes:
        if p.num_blocks > 1 and p.block_bytes and p.block_stride < p.block_bytes:
            return p, p, 0, 1
    order = sorted(
        (n for n, p in enumerate(planes) if p.num_blocks and p.block_bytes),
        key=lambda n: (planes[n].base, n),
    )
    live = [planes[n] for n in order]
    for later in range(len(live)):
        for earlier in range(later):
            a, b = live[earlier], live[later]
            blocks_b = _blocks(b)
            for i, x in enumerate(_blocks(a)):
                for j, y in enumerate(blocks_b):
                    if x & y:
                        return a, b, i, j
    return None


planes_st = st.lists(
    st.builds(
        P,
        name=st.sampled_from(["a", "b", "c", "d", "e"]),
        base=st.integers(0, 48),
        stride=st.integers(0, 13),
        nbytes=st.integers(0, 7),
        blocks=st.integers(0, 7),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=1500, deadline=None)
@given(planes_st)
def test_find_overlap_matches_byte_sets(planes):
    assert find_overlap(planes) == brute_force(planes)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 5_000),
    st.integers(1, 400),
    st.integers(1, 400),
    st.integers(1, 400),
    st.integers(1, 400),
    st.integers(1, 40),
    st.integers(1, 40),
)
def test_two_strided_planes_match_interval_reference(db, sa, sb, na, nb, ca, cb):
    a, b = P("a", 0, max(sa, na), na, ca), P("b", db, max(sb, nb), nb, cb)
    want = None
    for i in range(ca):
        a0, a1 = a.block_range(i)
        hits = [j for j in range(cb) if max(a0, b.block_range(j)[0]) < min(a1, b.block_range(j)[1])]
        if hits:
            want = (a, b, i, hits[0])
            break
    assert find_overlap([a, b]) == want


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": ""}, TypeError, "PlaneExtent: name must be a non-empty str, got ''"),
        ({"base": -1}, ValueError, "PlaneExtent 'p': base must be >= 0, got -1"),
        ({"block_stride": 2.0}, TypeError, "PlaneExtent 'p': block_stride must be an int, got 2.0"),
        ({"block_bytes": True}, TypeError, "PlaneExtent 'p': block_bytes must be an int, got True"),
        ({"num_blocks": -3}, ValueError, "PlaneExtent 'p': num_blocks must be >= 0, got -3"),
    ],
)
def test_plane_extent_bad_fields(kwargs, error, message):
    fields = {"name": "p", "base": 0, "block_stride": 8, "block_bytes": 8, "num_blocks": 2} | kwargs
    with pytest.raises(error) as info:
        PlaneExtent(**fields)
    assert str(info.value) == message


def test_find_overlap_refuses_other_items():
    with pytest.raises(TypeError, match=r"^planes\[1\] must be a PlaneExtent, got tuple$"):
        find_overlap([P("a", 0, 8, 8, 2), ("b", 0, 8, 8, 2)])


def test_block_range():
    p = P("p", 100, 64, 48, 3)
    assert [p.block_range(i) for i in range(3)] == [(100, 148), (164, 212), (228, 276)]
    assert p.end == 276
    with pytest.raises(IndexError, match=r"plane 'p' has blocks 0..2, not 3"):
        p.block_range(3)


# ---------------------------------------------------------------------- tensors


def test_plane_extent_of_a_contiguous_cache():
    cache = torch.zeros(6, 16, 2, 8, dtype=torch.bfloat16)  # 16 tokens * 2 heads * 8 dims * 2 B
    assert plane_extent("key", cache) == P("key", cache.data_ptr(), 512, 512, 6)
    tail = cache[2:]  # the storage offset is part of the base
    assert plane_extent("tail", tail) == P("tail", cache.data_ptr() + 2 * 512, 512, 512, 4)


def test_interleaved_views_are_legal_and_shared_views_are_not():
    kv = torch.zeros(5, 2, 16, 8, dtype=torch.float16)  # [blocks, role, tokens, dims]: 256 B a role
    key, value = plane_extent("key", kv[:, 0]), plane_extent("value", kv[:, 1])
    assert key == P("key", kv.data_ptr(), 512, 256, 5)
    assert value == P("value", kv.data_ptr() + 256, 512, 256, 5)
    assert find_overlap([key, value]) is None
    same = plane_extent("value", kv[:, 0])
    assert named(find_overlap([key, same])) == ("key", "value", 0, 0)
    # one role carved as [2, blocks, ...]: the halves are separate, touching extents
    fused = torch.zeros(2, 5, 16, 8, dtype=torch.float16)
    halves = [plane_extent("key", fused[0]), plane_extent("value", fused[1])]
    assert halves[0].end == halves[1].base and find_overlap(halves) is None


def test_plane_extent_of_permuted_and_degenerate_blocks():
    permuted = torch.zeros(3, 8, 16, dtype=torch.float32).transpose(1, 2)  # dense, permuted block
    assert plane_extent("p", permuted) == P("p", permuted.data_ptr(), 512, 8 * 16 * 4, 3)
    flat = torch.zeros(7, dtype=torch.int64)  # one element per block
    assert plane_extent("f", flat) == P("f", flat.data_ptr(), 8, 8, 7)
    empty_block = torch.zeros(3, 0, 4)
    assert plane_extent("e", empty_block).block_bytes == 0
    singleton = torch.zeros(4, 1, 6, dtype=torch.uint8)[:, :, :]  # size-1 dims carry any stride
    assert plane_extent("s", singleton) == P("s", singleton.data_ptr(), 6, 6, 4)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: torch.zeros(4, 16, 8)[:, :, :4],
            ValueError,
            "plane 'bad': a block of shape (16, 4) with element strides (8, 1) is not one "
            "contiguous run of bytes (planes must be block-major)",
        ),
        (
            lambda: torch.zeros(4, 1, 8).expand(4, 3, 8),
            ValueError,
            "plane 'bad': a block of shape (3, 8) with element strides (0, 1) is not one "
            "contiguous run of bytes (planes must be block-major)",
        ),
        (
            lambda: torch.tensor(1.0),
            ValueError,
            "plane 'bad' is a 0-d tensor; dim 0 must be the block dimension",
        ),
        (lambda: [1, 2], TypeError, "plane 'bad' must be a torch.Tensor, got list"),
    ],
    ids=["gap in the block", "aliased elements", "0-d", "not a tensor"],
)
def test_plane_extent_refuses(make, error, message):
    with pytest.raises(error) as info:
        plane_extent("bad", make())
    assert str(info.value) == message
