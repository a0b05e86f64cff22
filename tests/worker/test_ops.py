"""Tests for kvforge.ops: gather/scatter between block-major planes and page-first rows.

Every implementation is compared byte for byte with the torch reference, and the torch reference
with a per-block Python loop that spells out the definition:

    gather:  out[i, off_p : off_p + bytes_p] = planes[p][ids[i]]      (rows with id -1 untouched)
    scatter: planes[p][ids[i]] = src[i, off_p : off_p + bytes_p]      (rows with id -1 skipped)

with ``off_p = bytes_0 + ... + bytes_{p-1}``; e.g. planes of 1168, 8448 and 37376 bytes give
rows of 1168 + 8448 + 37376 = 46992 bytes, plane 2 at byte offset 1168 + 8448 = 9616.

The Triton kernels run under the interpreter (``TRITON_INTERPRET=1``, set in ``conftest.py``
and again below before any kernel module is imported), so sizes stay small.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import kvforge.ops as ops

ODD_SIZES = [1168, 8448, 37376, 1, 3]


def _has(impl: str) -> bool:
    return impl in ops.available_impls("cpu")


IMPLS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(not _has("cpu"), reason="numba missing")),
    pytest.param(
        "triton", marks=pytest.mark.skipif(not _has("triton"), reason="triton interpreter off")
    ),
]


def rand_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def make_planes(sizes: Sequence[int], num_blocks: int | Sequence[int], seed: int = 0):
    counts = [num_blocks] * len(sizes) if isinstance(num_blocks, int) else list(num_blocks)
    return [
        rand_bytes((nb, s), seed * 1000 + p)
        for p, (s, nb) in enumerate(zip(sizes, counts, strict=True))
    ]


def ids_of(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def loop_gather(planes, ids, out: torch.Tensor) -> torch.Tensor:
    """The definition, one block at a time."""
    out = out.clone()
    for i, b in enumerate(ids.tolist()):
        if b == -1:
            continue
        off = 0
        for plane in planes:
            nb = plane.shape[1]
            out[i, off : off + nb] = plane[b]
            off += nb
    return out


def loop_scatter(planes, ids, src: torch.Tensor) -> list[torch.Tensor]:
    planes = [p.clone() for p in planes]
    for i, b in enumerate(ids.tolist()):
        if b == -1:
            continue
        off = 0
        for plane in planes:
            nb = plane.shape[1]
            plane[b] = src[i, off : off + nb]
            off += nb
    return planes


def check_gather(planes, ids, impl: str, seed: int = 7) -> None:
    row_bytes = sum(p.shape[1] for p in planes)
    init = rand_bytes((ids.shape[0], row_bytes), seed)
    expected = loop_gather(planes, ids, init)
    before = [p.clone() for p in planes]
    out = init.clone()
    ret = ops.gather_blocks(planes, ids, out, impl=impl)
    assert ret is out
    assert torch.equal(out, expected)
    assert all(
        torch.equal(a, b) for a, b in zip(planes, before, strict=True)
    )  # planes are read only


def check_scatter(planes, ids, impl: str, seed: int = 11) -> None:
    row_bytes = sum(p.shape[1] for p in planes)
    src = rand_bytes((ids.shape[0], row_bytes), seed)
    src_before = src.clone()
    expected = loop_scatter(planes, ids, src)
    got = [p.clone() for p in planes]
    assert ops.scatter_blocks(got, ids, src, impl=impl) is None
    for p, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"plane {p} differs"  # whole planes: non-targets untouched
    assert torch.equal(src, src_before)


# --------------------------------------------------------------------------------------------
# equality with the reference


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_mixed_odd_sizes_skip_and_repeat(impl):
    # rows of 1168 + 8448 + 37376 + 1 + 3 = 46996 bytes; id 3 twice, row 1 skipped
    planes = make_planes(ODD_SIZES, [9, 10, 11, 12, 13])
    check_gather(planes, ids_of([3, -1, 0, 3, 8, 5]), impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_scatter_mixed_odd_sizes_skip(impl):
    planes = make_planes(ODD_SIZES, [9, 10, 11, 12, 13], seed=1)
    check_scatter(planes, ids_of([3, -1, 0, 7, 8, -1]), impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", ODD_SIZES)
def test_single_plane_each_size(impl, size):
    planes = make_planes([size], 6, seed=size)
    check_gather(planes, ids_of([5, 0, -1, 5]), impl)
    check_scatter(planes, ids_of([4, -1, 0, 2]), impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_many_planes(impl):
    # 40 planes cycling through 1, 3, 16, 64, 1168 bytes: 8 * (1 + 3 + 16 + 64 + 1168) = 10016
    sizes = [1, 3, 16, 64, 1168] * 8
    planes = make_planes(sizes, 7, seed=3)
    assert sum(sizes) == 10016
    check_gather(planes, ids_of([6, 0, -1, 2, 6]), impl)
    check_scatter(planes, ids_of([6, 0, -1, 2, 5]), impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_all_skipped(impl):
    planes = make_planes([1168, 3], 4)
    before = [p.clone() for p in planes]
    out = torch.empty(0, 1171, dtype=torch.uint8)
    assert ops.gather_blocks(planes, ids_of([]), out, impl=impl) is out
    ops.scatter_blocks(planes, ids_of([]), out, impl=impl)
    check_gather(planes, ids_of([-1, -1]), impl)
    check_scatter(planes, ids_of([-1, -1, -1]), impl)
    assert all(torch.equal(a, b) for a, b in zip(planes, before, strict=True))


@pytest.mark.parametrize("impl", ["torch", pytest.param("cpu", marks=IMPLS[1].marks)])
def test_large_transfer_parallel_path(impl):
    # 128 rows of 8448 + 37376 = 45824 bytes = 5.6 MiB, one skipped: 127 * 45824 = 5,819,648
    # bytes, above cpu_fast.PARALLEL_MIN_BYTES (4 MiB = 4,194,304): the multi-threaded path
    if impl == "cpu":
        from kvforge.ops import cpu_fast

        assert cpu_fast.PARALLEL_MIN_BYTES < 127 * 45824
    planes = make_planes([8448, 37376], 160, seed=5)
    ids = torch.randperm(160, generator=torch.Generator().manual_seed(0))[:128]
    ids[7] = -1
    check_gather(planes, ids, impl)
    check_scatter(planes, ids, impl)


@pytest.mark.skipif(not _has("cpu"), reason="numba missing")
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_cpu_split_across_threads(monkeypatch, threads):
    # force the multi-threaded split on a small call: 5 rows x 3 planes = 15 (row, plane) items
    # cut into min(15, 8 * threads) chunks shared by `threads` threads, chunks ending mid-row
    from kvforge.ops import cpu_fast

    monkeypatch.setattr(cpu_fast, "_num_threads", lambda nbytes: threads)
    monkeypatch.setattr(cpu_fast, "MIN_CHUNK_BYTES", 1)  # up to 8 chunks per thread
    planes = make_planes([1168, 1, 37376], 8, seed=4)
    check_gather(planes, ids_of([7, -1, 0, 7, 3]), "cpu")
    check_scatter(planes, ids_of([7, -1, 0, 2, 3]), "cpu")


@pytest.mark.skipif(not _has("cpu"), reason="numba missing")
@pytest.mark.parametrize("row_shift", [0, 1, 40])
def test_cpu_streaming_stores(monkeypatch, row_shift):
    # STREAM_MIN_BYTES = 0 puts every call on the non-temporal path: a memcpy head up to the
    # next 32-byte boundary, 64-byte streamed lines, a memcpy tail. Pieces of 1, 3, 63, 64, 65,
    # 1168 and 8448 bytes in rows shifted by 0, 1 and 40 bytes hit every head/body/tail mix.
    from kvforge.ops import cpu_fast

    monkeypatch.setattr(cpu_fast, "STREAM_MIN_BYTES", 0)
    sizes = [1, 3, 63, 64, 65, 1168, 8448]
    row_bytes = sum(sizes)
    planes = make_planes(sizes, 6, seed=row_shift)
    ids = ids_of([5, -1, 0, 5, 2])
    buf = rand_bytes((5 * row_bytes + row_shift,), 3)
    out = buf[row_shift:].view(5, row_bytes)
    expected = loop_gather(planes, ids, out)
    ops.gather_blocks(planes, ids, out, impl="cpu")
    assert torch.equal(out, expected)
    assert torch.equal(buf[:row_shift], rand_bytes((5 * row_bytes + row_shift,), 3)[:row_shift])

    sids = ids_of([5, -1, 0, 2])
    src = rand_bytes((4 * row_bytes + row_shift,), 4)[row_shift:].view(4, row_bytes)
    expected_planes = loop_scatter(planes, sids, src)
    ops.scatter_blocks(planes, sids, src, impl="cpu")
    assert all(torch.equal(a, b) for a, b in zip(planes, expected_planes, strict=True))

    # Through row ids (the swap path): each streamed piece prefetches the start of the next
    # one, which here lives in another row, after a skipped (-1) entry or in another plane.
    rows = np.array([3, 0, 4, 1], dtype=np.int64)
    gids = np.array([2, -1, 5, 0], dtype=np.int64)
    packed = loop_gather(
        planes, ids_of(gids.tolist()), torch.zeros(4, row_bytes, dtype=torch.uint8)
    )
    out = rand_bytes((5, row_bytes), 5)
    expected = out.clone()
    expected[rows[[0, 2, 3]]] = packed[[0, 2, 3]]
    ops.gather_blocks(planes, gids, out, impl="cpu", row_ids=rows)
    assert torch.equal(out, expected)
    src = rand_bytes((5, row_bytes), 6)
    expected_planes = loop_scatter(planes, ids_of(gids.tolist()), src[rows])
    ops.scatter_blocks(planes, gids, src, impl="cpu", row_ids=rows)
    assert all(torch.equal(a, b) for a, b in zip(planes, expected_planes, strict=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_row_ids_pick_buffer_rows(impl):
    # 4 block ids moved to / from rows 5, 0, 3 and 1 of a 6-row buffer; the -1 entry moves
    # nothing, and rows 2 and 4 are never touched. numpy ids and torch ids give the same bytes.
    planes = make_planes([1168, 8448, 1], [8, 9, 10], seed=12)
    ids, rows = [7, -1, 0, 3], [5, 0, 3, 1]
    init = rand_bytes((6, 9617), 2)
    expected = init.clone()
    staged = loop_gather(planes, ids_of(ids), torch.zeros(4, 9617, dtype=torch.uint8))
    for i, (b, r) in enumerate(zip(ids, rows, strict=True)):
        if b >= 0:
            expected[r] = staged[i]
    for as_ids in (ids_of, lambda v: np.array(v, dtype=np.int64)):
        out = init.clone()
        ops.gather_blocks(planes, as_ids(ids), out, impl=impl, row_ids=as_ids(rows))
        assert torch.equal(out, expected)

    src = rand_bytes((6, 9617), 3)
    got = [p.clone() for p in planes]
    ops.scatter_blocks(got, ids_of([7, -1, 0, 2]), src, impl=impl, row_ids=ids_of([5, 5, 0, 5]))
    want = loop_scatter(planes, ids_of([7, -1, 0, 2]), src[torch.tensor([5, 5, 0, 5])])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_gather_returns_and_equals_torch_on_every_impl():
    planes = make_planes([1168, 8448, 1], [8, 9, 10], seed=9)
    ids = ids_of([7, 1, 1, -1, 0])
    ref = ops.gather_blocks(planes, ids, torch.zeros(5, 9617, dtype=torch.uint8), impl="torch")
    for impl in ops.available_impls("cpu"):
        out = ops.gather_blocks(planes, ids, torch.zeros(5, 9617, dtype=torch.uint8), impl=impl)
        assert torch.equal(out, ref), impl


# --------------------------------------------------------------------------------------------
# triton kernel specifics (interpreter)

needs_triton = pytest.mark.skipif(not _has("triton"), reason="triton interpreter off")


@needs_triton
@pytest.mark.parametrize(
    ("sizes", "width"),
    [
        ([16, 1168, 8448], 16),  # 1168 = 16 * 73, 8448 = 16 * 528: int64 pairs (VEC = 2)
        ([8, 1168, 8448], 8),  # 8 is not a multiple of 16
        ([12, 1164], 4),  # 12 = 4 * 3, 1164 = 4 * 291
        ([6, 1166], 2),
        ([1168, 3], 1),
        ([1], 1),
    ],
)
@pytest.mark.parametrize("max_width", [16, 1])
def test_triton_element_width_small_tiles(sizes, width, max_width):
    from kvforge.ops import _common, triton_kernels

    planes = make_planes(sizes, 5, seed=len(sizes))
    ids = ids_of([4, -1, 1, 4, 0, 2, 3])
    row_bytes = sum(sizes)
    out = rand_bytes((7, row_bytes), 1)
    plan = _common.validate(planes, ids, out, "out", "gather_blocks")
    addrs = [p.data_ptr() for p in planes] + [out.data_ptr()]
    assert _common.elem_width(plan, addrs, (16, 8, 4, 2, 1)) == width
    expected = loop_gather(planes, ids, out)
    # small tiles and 2 programs: many tiles per plane, many items per program (byte elements
    # get larger tiles to keep the interpreter quick)
    kw = {"block": 64 if max_width > 1 else 512, "grid_cap": 2, "max_width": max_width}
    triton_kernels.gather_blocks_triton(planes, plan, out, **kw)
    assert torch.equal(out, expected)

    sids = ids_of([4, -1, 1, 0])
    src = rand_bytes((4, row_bytes), 2)
    splan = _common.validate(planes, sids, src, "src", "scatter_blocks")
    expected_planes = loop_scatter(planes, sids, src)
    triton_kernels.scatter_blocks_triton(planes, splan, src, **kw)
    assert all(torch.equal(a, b) for a, b in zip(planes, expected_planes, strict=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_misaligned_addresses_use_byte_width(impl):
    # rows or a plane starting at an odd address rule out every element width but 1; the bytes
    # must still match (8448 and 1168 alone would allow 8-byte elements)
    from kvforge.ops import _common

    planes = make_planes([1168, 8448], 4, seed=2)
    buf = torch.zeros(3 * 9616 + 1, dtype=torch.uint8)
    out = buf[1:].view(3, 9616)
    assert out.data_ptr() % 2 == 1
    ids = ids_of([3, 0, 3])
    plan = _common.validate(planes, ids, out, "out", "gather_blocks")
    assert _common.elem_width(plan, [p.data_ptr() for p in planes]) == 8
    assert _common.elem_width(plan, [out.data_ptr()]) == 1
    ops.gather_blocks(planes, ids, out, impl=impl)
    assert torch.equal(out, loop_gather(planes, ids, torch.zeros(3, 9616, dtype=torch.uint8)))
    assert buf[0] == 0

    odd = rand_bytes((4 * 8448 + 1,), 5)[1:].view(4, 8448)
    check_gather([planes[0], odd], ids_of([1, -1, 3]), impl)
    check_scatter([planes[0], odd], ids_of([1, -1, 3]), impl)


@needs_triton
def test_triton_grid_is_bounded():
    from kvforge.ops import triton_kernels

    assert triton_kernels.MAX_GRID == 65535
    assert triton_kernels.default_grid_cap(torch.device("cpu")) <= triton_kernels.MAX_GRID
    assert triton_kernels.interpreted()


# --------------------------------------------------------------------------------------------
# impl resolution


def test_resolve_impl_auto_and_names(monkeypatch):
    assert ops.resolve_impl("torch", "cpu") == "torch"
    assert ops.resolve_impl("auto", torch.device("cpu")) in ("cpu", "torch")
    if _has("cpu"):
        assert ops.resolve_impl("auto", "cpu") == "cpu"
    with pytest.raises(
        ValueError,
        match=r"^impl 'cpu' runs on cpu tensors only; the planes are "
        r"on cuda:0$",
    ):
        ops.resolve_impl("cpu", "cuda:0")
    with pytest.raises(ValueError) as e:
        ops.resolve_impl("fast", "cpu")
    assert str(e.value) == "impl 'fast' is not one of 'auto', 'torch', 'cpu', 'triton'"
    with pytest.raises(TypeError, match="impl is int"):
        ops.resolve_impl(3, "cpu")  # type: ignore[arg-type]
    if _has("triton"):
        assert ops.resolve_impl("auto", "cuda:0") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs the Triton interpreter: set TRITON_INTERPRET=1"):
        ops.resolve_impl("triton", "cpu")


def test_fallback_without_numba_or_triton(monkeypatch):
    # pretend neither optional dependency imports
    monkeypatch.setattr(ops, "_cpu_error", lambda: "ModuleNotFoundError: No module named 'numba'")
    monkeypatch.setattr(
        ops, "triton_error", lambda: "ModuleNotFoundError: No module named 'triton'"
    )
    assert ops.resolve_impl("auto", "cpu") == "torch"
    assert ops.resolve_impl("auto", "cuda") == "torch"
    assert ops.available_impls("cpu") == ["torch"]
    with pytest.raises(RuntimeError, match=r"impl 'cpu' needs numba, which does not import"):
        ops.resolve_impl("cpu", "cpu")
    with pytest.raises(RuntimeError, match=r"impl 'triton' needs triton, which does not import"):
        ops.resolve_impl("triton", "cuda")
    planes = make_planes([1168, 3], 4)
    check_gather(planes, ids_of([1, -1, 3]), "auto")
    check_scatter(planes, ids_of([1, -1, 3]), "auto")


def test_import_does_not_load_triton_or_numba():
    code = (
        "import sys, kvforge.ops\n"
        "bad = [m for m in ('triton', 'numba') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# --------------------------------------------------------------------------------------------
# validation: exact messages, nothing changed


def snapshot(*tensors) -> list[torch.Tensor]:
    return [t.clone() for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu"]


def assert_rejected(fn, planes, ids, rows, exc, message: str, impl: str = "torch"):
    planes_before = snapshot(*[p for p in planes if isinstance(p, torch.Tensor)])
    rows_before = snapshot(rows)
    with pytest.raises(exc) as info:
        fn(planes, ids, rows, impl=impl)
    assert str(info.value) == message
    cpu_planes = [p for p in planes if isinstance(p, torch.Tensor) and p.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(cpu_planes, planes_before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(snapshot(rows), rows_before, strict=True))


BOTH = [ops.gather_blocks, ops.scatter_blocks]


def rows_name(fn) -> str:
    return "out" if fn is ops.gather_blocks else "src"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", BOTH)
def test_id_out_of_range(fn, impl):
    planes = make_planes([40, 80], [16, 20])  # rows of 40 + 80 = 120 bytes
    rows = rand_bytes((4, 120), 3)
    assert_rejected(
        fn,
        planes,
        ids_of([0, 1, 2, 17]),
        rows,
        ValueError,
        "block_ids[3] = 17 is out of range for planes[0] with 16 blocks",
        impl,
    )
    planes = make_planes([40, 80], [20, 16])
    assert_rejected(
        fn,
        planes,
        ids_of([16, 1]),
        rand_bytes((2, 120), 3),
        ValueError,
        "block_ids[0] = 16 is out of range for planes[1] with 16 blocks",
        impl,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", BOTH)
def test_negative_id_other_than_skip(fn, impl):
    planes = make_planes([40, 80], 16)
    assert_rejected(
        fn,
        planes,
        ids_of([-1, 2, -2]),
        rand_bytes((3, 120), 3),
        ValueError,
        "block_ids[2] = -2 is negative; only -1 (skip this row) is allowed",
        impl,
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_scatter_duplicate_destination(impl):
    planes = make_planes([40, 80], 16)
    assert_rejected(
        ops.scatter_blocks,
        planes,
        ids_of([0, 5, -1, 5, -1]),
        rand_bytes((5, 120), 3),
        ValueError,
        "block_ids has duplicate destination id 5 (rows 1 and 3) in scatter_blocks",
        impl,
    )
    # -1 may repeat, and a gather may read one block twice
    check_scatter(planes, ids_of([0, -1, 5, -1]), impl)
    check_gather(planes, ids_of([5, 5, -1, 5]), impl)


@pytest.mark.parametrize("num_blocks", [1000, 100_000])
def test_scatter_duplicate_destination_many_ids(num_blocks):
    # 300 ids (> the 256 checked with Python lists): 1000 blocks use the bitmap check,
    # 100000 blocks (> 64 * 300 + 65536 = 84736) the sorted check
    planes = make_planes([1, 3], num_blocks)
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))[:300]
    ids[::7] = -1
    check_scatter(planes, ids, "torch")
    ids[250] = ids[20]
    assert_rejected(
        ops.scatter_blocks,
        planes,
        ids,
        rand_bytes((300, 4), 3),
        ValueError,
        f"block_ids has duplicate destination id {int(ids[20])} (rows 20 and 250) in "
        "scatter_blocks",
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", BOTH)
def test_rows_shape_dtype_stride_device(fn, impl):
    name = rows_name(fn)
    planes = make_planes([40, 80], 16)
    ids = ids_of([0, 1, 2, 3])
    assert_rejected(
        fn,
        planes,
        ids,
        rand_bytes((4, 100), 1),
        ValueError,
        f"{name} has shape (4, 100); expected (4, 120): 4 rows of 120 bytes "
        "(sum of plane block bytes)",
        impl,
    )
    assert_rejected(
        fn,
        planes,
        ids,
        rand_bytes((3, 120), 1),
        ValueError,
        f"{name} has shape (3, 120); expected (4, 120): 4 rows of 120 bytes "
        "(sum of plane block bytes)",
        impl,
    )
    assert_rejected(
        fn,
        planes,
        ids,
        rand_bytes((480,), 1),
        ValueError,
        f"{name} has shape (480,); expected (4, 120): 4 rows of 120 bytes "
        "(sum of plane block bytes)",
        impl,
    )
    assert_rejected(
        fn,
        planes,
        ids,
        torch.zeros(4, 60, dtype=torch.float16),
        TypeError,
        f"{name} has dtype torch.float16; expected torch.uint8 (use .view(torch.uint8))",
        impl,
    )
    wide = rand_bytes((4, 128), 1)
    assert_rejected(
        fn,
        planes,
        ids,
        wide[:, :120],
        ValueError,
        f"{name} has strides (128, 1); expected row-contiguous (120, 1)",
        impl,
    )
    assert_rejected(
        fn,
        planes,
        ids,
        torch.empty(4, 120, dtype=torch.uint8, device="meta"),
        ValueError,
        f"{name} is on meta; expected cpu (the planes' device)",
        impl,
    )
    assert_rejected(
        fn,
        planes,
        ids,
        [[0] * 120] * 4,
        TypeError,
        f"{name} is list; expected a [4, 120] torch.uint8 tensor",
        impl,
    )


@pytest.mark.parametrize("fn", BOTH)
def test_planes_errors(fn):
    rows = rand_bytes((2, 120), 1)
    ids = ids_of([0, 1])
    good = make_planes([40, 80], 16)
    assert_rejected(
        fn,
        [],
        ids,
        rows,
        ValueError,
        "planes is empty; expected at least one [num_blocks, block_bytes] torch.uint8 tensor",
    )
    assert_rejected(
        fn,
        good[0],
        ids,
        rows,
        TypeError,
        "planes is Tensor; expected a sequence (list or tuple) of [num_blocks, block_bytes] "
        "torch.uint8 tensors",
    )
    assert_rejected(
        fn, [good[0], "x"], ids, rows, TypeError, "planes[1] is str; expected a torch.Tensor"
    )
    half = torch.zeros(16, 40, dtype=torch.float16)
    assert_rejected(
        fn,
        [*good, half],
        ids,
        rand_bytes((2, 200), 1),
        TypeError,
        "planes[2] has dtype torch.float16; expected torch.uint8 (use .view(torch.uint8))",
    )
    assert_rejected(
        fn,
        [rand_bytes((16, 4, 10), 0), good[1]],
        ids,
        rows,
        ValueError,
        "planes[0] has shape (16, 4, 10); expected 2-D [num_blocks, block_bytes]",
    )
    assert_rejected(
        fn,
        [good[0], torch.zeros(16, 0, dtype=torch.uint8)],
        ids,
        rand_bytes((2, 40), 1),
        ValueError,
        "planes[1] has shape (16, 0): block_bytes is 0; every plane must hold at least one "
        "byte per block",
    )
    meta = torch.empty(16, 80, dtype=torch.uint8, device="meta")
    assert_rejected(
        fn,
        [good[0], meta],
        ids,
        rows,
        ValueError,
        "planes[1] is on meta but planes[0] is on cpu; all planes must be on one device",
    )


BAD_BLOCK_IDS = [
    (
        torch.tensor([0, 1], dtype=torch.int32),
        TypeError,
        "block_ids has dtype torch.int32; expected torch.int64",
    ),
    (
        torch.zeros(2, 1, dtype=torch.int64),
        ValueError,
        "block_ids has shape (2, 1); expected 1-D [n]",
    ),
    (
        [0, 1],
        TypeError,
        "block_ids is list; expected a 1-D torch.int64 tensor (or numpy int64 array)",
    ),
    (
        np.array([0, 1], dtype=np.int32),
        TypeError,
        "block_ids has dtype numpy.int32; expected int64",
    ),
    (np.zeros((2, 1), dtype=np.int64), ValueError, "block_ids has shape (2, 1); expected 1-D [n]"),
    (
        torch.zeros(2, dtype=torch.int64, device="meta"),
        ValueError,
        "block_ids is on meta; expected cpu or the planes' device cpu",
    ),
]


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize(("ids", "exc", "message"), BAD_BLOCK_IDS)
def test_block_ids_errors(fn, ids, exc, message):
    planes = make_planes([40, 80], 16)
    assert_rejected(fn, planes, ids, rand_bytes((2, 120), 1), exc, message)


@pytest.mark.parametrize("fn", BOTH)
def test_unknown_impl(fn):
    planes = make_planes([40, 80], 16)
    assert_rejected(
        fn,
        planes,
        ids_of([0, 1]),
        rand_bytes((2, 120), 1),
        ValueError,
        "impl 'cuda' is not one of 'auto', 'torch', 'cpu', 'triton'",
        impl="cuda",
    )


@pytest.mark.parametrize("fn", BOTH)
def test_row_ids_errors(fn):
    name = rows_name(fn)
    planes = make_planes([40, 80], 16)
    rows = rand_bytes((3, 120), 1)
    ids = ids_of([0, 1])
    for row_ids, exc, message in [
        (ids_of([0, 1, 2]), ValueError, "row_ids has 3 entries; expected 2 (one per block id)"),
        (ids_of([0, 3]), ValueError, f"row_ids[1] = 3 is out of range for {name} with 3 rows"),
        (ids_of([-1, 0]), ValueError, f"row_ids[0] = -1 is out of range for {name} with 3 rows"),
        (
            [0, 1],
            TypeError,
            "row_ids is list; expected a 1-D torch.int64 tensor (or numpy int64 array)",
        ),
    ]:
        with pytest.raises(exc) as info:
            fn(planes, ids, rows, row_ids=row_ids)
        assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        fn(planes, ids, rand_bytes((3, 121), 1), row_ids=ids_of([0, 1]))
    assert str(info.value) == (
        f"{name} has shape (3, 121); expected (num_rows, 120): rows of 120 bytes (sum of plane "
        "block bytes)"
    )
    if fn is ops.gather_blocks:
        before = rows.clone()
        with pytest.raises(ValueError) as info:
            fn(planes, ids_of([0, 1, 2]), rows, row_ids=ids_of([2, 0, 2]))
        assert str(info.value) == (
            "row_ids has duplicate destination row 2 (entries 0 and 2) in gather_blocks"
        )
        assert torch.equal(rows, before)


# --------------------------------------------------------------------------------------------
# strided planes: a block stride above the block bytes (padding, or roles packed in one buffer)

PAD = 0xA5  # padding sentinel: must survive every scatter


def alloc(num_blocks: int, stride: int, seed: int) -> torch.Tensor:
    """One allocation ``[num_blocks, stride]`` of random bytes (planes are column ranges)."""
    return rand_bytes((num_blocks, stride), seed)


def padded(sizes: Sequence[int], strides: Sequence[int], num_blocks: int, seed: int = 0):
    """One allocation per plane: plane ``p`` is bytes ``[0, sizes[p])`` of each ``strides[p]``
    byte block; the rest of the block is ``PAD``. Returns ``(allocations, spans)`` where
    ``spans[p] = (allocation, first byte, bytes)``."""
    allocs = []
    for p, (size, stride) in enumerate(zip(sizes, strides, strict=True)):
        a = alloc(num_blocks, stride, seed * 1000 + p)
        a[:, size:] = PAD
        allocs.append(a)
    return allocs, [(p, 0, size) for p, size in enumerate(sizes)]


def views(allocs: Sequence[torch.Tensor], spans) -> list[torch.Tensor]:
    return [allocs[a][:, start : start + nb] for a, start, nb in spans]


def ref_scatter_allocs(allocs, spans, ids: Sequence[int], src: torch.Tensor):
    """The definition of a scatter, on whole allocations: only the span bytes of each target
    block change; padding and every other byte stay."""
    allocs = [a.clone() for a in allocs]
    for i, b in enumerate(ids):
        if b == -1:
            continue
        off = 0
        for a, start, nb in spans:
            allocs[a][b, start : start + nb] = src[i, off : off + nb]
            off += nb
    return allocs


def check_strided(allocs, spans, gather_ids, scatter_ids, impl: str, **kernel_kw) -> None:
    """Gather and scatter through strided views of ``allocs``, byte-exact against the loop
    reference over whole allocations (padding bytes included). ``kernel_kw`` calls the Triton
    kernels directly (tile size, grid cap)."""
    from kvforge.ops import _common, triton_kernels

    planes = views(allocs, spans)
    row_bytes = sum(nb for _, _, nb in spans)
    before = [a.clone() for a in allocs]
    # gather: rows equal the loop over views; allocations untouched
    ids = ids_of(gather_ids)
    out = rand_bytes((len(gather_ids), row_bytes), 21)
    expected = loop_gather(planes, ids, out)
    if kernel_kw:
        plan = _common.validate(planes, ids, out, "out", "gather_blocks")
        triton_kernels.gather_blocks_triton(planes, plan, out, **kernel_kw)
    else:
        ops.gather_blocks(planes, ids, out, impl=impl)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(allocs, before, strict=True))
    # scatter: whole allocations equal the reference (padding and untargeted blocks kept)
    ids = ids_of(scatter_ids)
    src = rand_bytes((len(scatter_ids), row_bytes), 22)
    want = ref_scatter_allocs(allocs, spans, scatter_ids, src)
    if kernel_kw:
        plan = _common.validate(planes, ids, src, "src", "scatter_blocks")
        triton_kernels.scatter_blocks_triton(planes, plan, src, **kernel_kw)
    else:
        ops.scatter_blocks(planes, ids, src, impl=impl)
    for p, (a, b) in enumerate(zip(allocs, want, strict=True)):
        assert torch.equal(a, b), f"allocation {p} differs"


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_planes(impl):
    # FlashMLA-style padding to multiples of 576 B: 1168 -> 3 * 576 = 1728, 8448 -> 15 * 576 =
    # 8640, 37376 -> 65 * 576 = 37440; and 3 bytes in 8-byte blocks. Rows stay packed:
    # 1168 + 8448 + 37376 + 3 = 49995 bytes.
    sizes, strides = [1168, 8448, 37376, 3], [1728, 8640, 37440, 8]
    assert [s // 576 for s in strides[:3]] == [3, 15, 65]
    allocs, spans = padded(sizes, strides, 7, seed=1)
    check_strided(allocs, spans, [3, -1, 0, 3, 6], [3, -1, 0, 6, 5], impl)
    for a, size in zip(allocs, sizes, strict=True):
        assert bool((a[:, size:] == PAD).all())  # the padding survived the scatter


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stride", [8640, 8704])
@pytest.mark.parametrize("scale_first", [False, True])
def test_interleaved_views_of_one_allocation(impl, stride, scale_first):
    # An indexer key in bytes [0, 8448) of each block and its scale in [8448, 8640), one
    # allocation with blocks `stride` bytes apart (8704: 64 more bytes of padding after the
    # scale). Two strided views of one buffer, plus a plane of another allocation. Row order is
    # plane order, whatever the memory order: rows of 192 + 8448 + 1168 = 9808 bytes.
    shared = alloc(6, stride, 5)
    shared[:, 8640:] = PAD
    other = alloc(6, 1168, 6)
    key, scale = (0, 0, 8448), (0, 8448, 192)
    spans = [scale, key, (1, 0, 1168)] if scale_first else [key, scale, (1, 0, 1168)]
    planes = views([shared, other], spans)
    assert [p.stride() for p in planes[:2]] == [(stride, 1), (stride, 1)]
    assert ops.PlaneSet(planes).block_strides == (stride, stride, 1168)
    check_strided([shared, other], spans, [5, 0, -1, 5], [5, -1, 0, 2], impl)
    assert bool((shared[:, 8640:] == PAD).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_two_mib_block_stride(impl):
    # an engine that aligns every block to 2 MiB: 37376 meaningful bytes per 2,097,152
    allocs, spans = padded([37376], [2 << 20], 3, seed=2)
    check_strided(allocs, spans, [2, -1, 0], [2, 0], impl)
    assert bool((allocs[0][:, 37376:] == PAD).all())


def test_plane_set_records_strides_and_alignment():
    # Fresh CPU allocations start 64-byte aligned, so strides and sizes decide the alignment:
    # 1168 = 16 * 73 with stride 1728 = 16 * 108 -> 16; stride 1176 = 8 * 147 -> 8;
    # stride 1170 = 2 * 585 -> 2. A one-block plane has no meaningful stride: its own bytes.
    bufs = {s: alloc(4, s, s) for s in (1168, 1728, 1176, 1170)}
    assert all(b.data_ptr() % 64 == 0 for b in bufs.values())
    for stride, align in [(1168, 16), (1728, 16), (1176, 8), (1170, 2)]:
        ps = ops.PlaneSet([bufs[stride][:, :1168]])
        assert (ps.block_bytes, ps.block_strides, ps.alignment) == ((1168,), (stride,), align)
    ps = ops.PlaneSet([bufs[1728][:, :1168], bufs[1176][:, :8], bufs[1170][:1, :80]])
    assert ps.block_strides == (1728, 1176, 80)
    assert ps.row_offsets == (0, 1168, 1176) and ps.row_bytes == 1256
    assert ps.alignment == 8  # 1256 = 8 * 157; the one-block plane's stride (1170) is ignored
    assert ps.layout_table.tolist() == [
        *(p.data_ptr() for p in ps),
        *(1168, 8, 80),
        *(0, 1168, 1176),
        *(1728, 1176, 80),
    ]


@needs_triton
@pytest.mark.parametrize(
    ("sizes", "strides", "width"),
    [
        ([1168, 8448], [1728, 8640], 16),  # 1728 = 16 * 108, 8640 = 16 * 540
        ([1168, 8448], [1176, 8448], 8),  # the 1176 = 8 * 147 stride limits it
        ([12, 1164], [20, 1168], 4),  # 20 = 4 * 5
        ([1168], [1170], 2),
        ([3, 1168], [5, 1728], 1),
    ],
)
def test_triton_strided_element_width_small_tiles(sizes, strides, width):
    from kvforge.ops import _common

    allocs, spans = padded(sizes, strides, 5, seed=len(sizes))
    planes = views(allocs, spans)
    rows = torch.empty(2, sum(sizes), dtype=torch.uint8)
    plan = _common.validate(planes, ids_of([0, 1]), rows, "out", "gather_blocks")
    assert _common.elem_width(plan, [rows.data_ptr()], (16, 8, 4, 2, 1)) == width
    # tiles of 64 elements (128 bytes for 1-byte elements) and 2 programs: several tiles per
    # block, tails masked at the block bytes, never at the stride
    block = 64 if width > 1 else 128
    check_strided(allocs, spans, [4, -1, 1, 4, 0], [4, -1, 1, 0], "triton", block=block, grid_cap=2)
    for a, size in zip(allocs, sizes, strict=True):
        assert bool((a[:, size:] == PAD).all())


BAD_PLANE_STRIDES = [
    (
        torch.zeros(16 * 40 + 40, dtype=torch.uint8).as_strided((16, 80), (40, 1)),
        ValueError,
        "planes[1] has strides (40, 1): block stride 40 is below block_bytes 80 (blocks would "
        "overlap); expected (block_stride, 1) with block_stride >= 80",
    ),
    (
        torch.zeros(1, 80, dtype=torch.uint8).expand(16, 80),
        ValueError,
        "planes[1] has strides (0, 1): block stride 0 is not positive (blocks would alias); "
        "expected (block_stride, 1) with block_stride >= 80",
    ),
    (
        torch.zeros(16, 160, dtype=torch.uint8)[:, ::2],
        ValueError,
        "planes[1] has strides (160, 2): inner stride 2; expected (block_stride, 1): the 80 "
        "bytes of a block must be contiguous",
    ),
    (
        torch.zeros(80, 16, dtype=torch.uint8).t(),
        ValueError,
        "planes[1] has strides (1, 16): inner stride 16; expected (block_stride, 1): the 80 "
        "bytes of a block must be contiguous",
    ),
    (
        torch.zeros(16, 48, dtype=torch.float16)[:, :40],
        TypeError,
        "planes[1] has dtype torch.float16; expected torch.uint8 (use .view(torch.uint8))",
    ),
    (
        torch.zeros(16, 96, dtype=torch.float16)[:, :80].view(torch.uint8),
        None,  # a uint8 view of a padded fp16 buffer is fine: 160 bytes per block, stride 192
        "",
    ),
]


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize(("bad", "exc", "message"), BAD_PLANE_STRIDES)
def test_plane_stride_errors(fn, bad, exc, message):
    good = make_planes([40], 16)[0]
    row_bytes = 40 + bad.shape[1] * (bad.element_size() if bad.dtype != torch.uint8 else 1)
    rows = rand_bytes((2, row_bytes), 1)
    if exc is None:
        assert ops.PlaneSet([good, bad]).block_strides == (40, 192)
        fn([good, bad], ids_of([0, 15]), rows)
        return
    assert_rejected(fn, [good, bad], ids_of([0, 1]), rows, exc, message)
    with pytest.raises(exc) as info:
        ops.PlaneSet([good, bad])
    assert str(info.value) == message


def test_negative_block_stride_is_refused():
    # torch cannot build a tensor with a negative stride (as_strided refuses); the check that
    # every implementation relies on still names it
    from kvforge.ops import _common

    with pytest.raises(ValueError) as info:
        _common.block_stride_of(2, (16, 80), (-80, 1))
    assert str(info.value) == (
        "planes[2] has strides (-80, 1): block stride -80 is not positive (blocks would alias); "
        "expected (block_stride, 1) with block_stride >= 80"
    )
    assert _common.block_stride_of(2, (16, 80), (80, 1)) == 80
    assert _common.block_stride_of(2, (16, 80), (8640, 1)) == 8640
    assert _common.block_stride_of(2, (1, 80), (3, 1)) == 80  # one block: stride meaningless
    assert _common.block_stride_of(2, (16, 1), (5, 7)) == 5  # one byte: inner stride meaningless
