"""Tests for kvforge.ops.slot_mapping and kvforge.ops.token_positions.

The definition, one token at a time (``E = block_size // r`` entries per block):

    p % r != r - 1                      -> -1   (the token completes no entry)
    e = p // r; c = e // E; c >= M      -> -1   (past the table's last column)
    b = block_table[row, c]; b == 0     -> -1   (null block)
    otherwise                           -> b * E + e % E

Every implementation (numpy, torch, Triton under ``TRITON_INTERPRET=1``) is compared with that
loop, on numpy arrays and on CPU tensors.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kvforge.ops as ops


def _has_triton() -> bool:
    try:
        ops.resolve_slot_impl("triton", "cpu")
    except (ValueError, RuntimeError):
        return False
    return True


needs_triton = pytest.mark.skipif(not _has_triton(), reason="triton interpreter off")
IMPLS = ["numpy", "torch", pytest.param("triton", marks=needs_triton)]


def reference(table, rows, positions, block_size: int, ratio: int) -> list[int]:
    """The definition, per token, in plain Python."""
    table = np.asarray(table).tolist()
    per_block = block_size // ratio
    out = []
    for row, p in zip(np.asarray(rows).tolist(), np.asarray(positions).tolist(), strict=True):
        if p % ratio != ratio - 1:
            out.append(-1)
            continue
        e = p // ratio
        if e // per_block >= len(table[row]):
            out.append(-1)
            continue
        b = table[row][e // per_block]
        out.append(-1 if b == 0 else b * per_block + e % per_block)
    return out


def i32(values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def i64(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# Two requests in rows 0 and 2 of a 3-row table with 4 columns; block_size 8.
TABLE = i32([[3, 4, 0, 7], [9, 9, 9, 9], [1, 0, 2, 5]])
ROWS = i32([0, 0, 0, 0, 2, 2, 2, 2])
POSITIONS = i64([0, 7, 8, 23, 3, 15, 31, 40])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("as_torch", [False, True])
def test_hand_checked_example(impl, as_torch):
    # ratio 1, E = 8: p -> block table[row][p // 8], slot block * 8 + p % 8
    #   row 0: p 0 -> 3 * 8 + 0 = 24; p 7 -> 3 * 8 + 7 = 31; p 8 -> 4 * 8 + 0 = 32;
    #          p 23 -> column 2, the null block -> -1
    #   row 2: p 3 -> 1 * 8 + 3 = 11; p 15 -> column 1, null -> -1; p 31 -> 5 * 8 + 7 = 47;
    #          p 40 -> column 5 >= 4 columns -> -1
    # ratio 4, E = 2: only p % 4 == 3 writes, entry e = p // 4 in column e // 2
    #   p 7 -> e 1, column 0, 3 * 2 + 1 = 7; p 23 -> e 5, column 2, null -> -1;
    #   p 3 -> e 0, 1 * 2 + 0 = 2; p 15 -> e 3, column 1, null -> -1; p 31 -> e 7, column 3,
    #   5 * 2 + 1 = 11; p 0, 8 and 40 complete no entry -> -1
    conv = torch.from_numpy if as_torch else (lambda a: a)
    args = conv(TABLE), conv(ROWS), conv(POSITIONS)
    for ratio, want in [
        (1, [24, 31, 32, -1, 11, -1, 47, -1]),
        (4, [-1, 7, -1, -1, 2, -1, 11, -1]),
    ]:
        got = ops.slot_mapping(*args, 8, ratio, impl=impl)
        assert type(got) is (torch.Tensor if as_torch else np.ndarray)
        assert got.dtype == (torch.int64 if as_torch else np.int64)
        assert got.tolist() == want == reference(TABLE, ROWS, POSITIONS, 8, ratio)


@st.composite
def slot_cases(draw, max_n: int = 48):
    ratio = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 128]))
    per_block = draw(st.sampled_from([1, 2, 3, 4, 6, 16, 64]))
    block_size = ratio * per_block
    num_seqs = draw(st.integers(1, 5))
    max_blocks = draw(st.integers(0, 6))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    block = st.one_of(st.just(0), st.integers(1, 2**31 - 1))  # 0: the null block
    table = draw(hnp.arrays(dtype, (num_seqs, max_blocks), elements=block))
    n = draw(st.integers(0, max_n))
    rows = draw(
        hnp.arrays(
            draw(st.sampled_from([np.int32, np.int64])), n, elements=st.integers(0, num_seqs - 1)
        )
    )
    # positions inside the table, just past it, and far past it (2**40 tokens)
    near = st.integers(0, block_size * (max_blocks + 1) + ratio)
    positions = draw(hnp.arrays(np.int64, n, elements=st.one_of(near, st.just(2**40 - 1))))
    return table, rows, positions, block_size, ratio


@settings(max_examples=300, deadline=None)
@given(case=slot_cases())
def test_numpy_and_torch_match_the_definition(case):
    table, rows, positions, block_size, ratio = case
    want = reference(table, rows, positions, block_size, ratio)
    assert ops.slot_mapping(table, rows, positions, block_size, ratio).tolist() == want
    tensors = [torch.from_numpy(a) for a in (table, rows, positions)]
    got = ops.slot_mapping(*tensors, block_size, ratio)  # CPU tensors -> the numpy path
    assert isinstance(got, torch.Tensor) and got.tolist() == want
    assert ops.slot_mapping(*tensors, block_size, ratio, impl="torch").tolist() == want
    unchecked = ops.slot_mapping(table, rows, positions, block_size, ratio, check=False)
    assert unchecked.tolist() == want


@needs_triton
@settings(max_examples=40, deadline=None)
@given(case=slot_cases(max_n=80))
def test_triton_matches_numpy(case):
    from kvforge.ops import triton_slots

    table, rows, positions, block_size, ratio = case
    want = ops.slot_mapping(table, rows, positions, block_size, ratio, impl="numpy")
    assert ops.slot_mapping(table, rows, positions, block_size, ratio, impl="triton").tolist() == (
        want.tolist()
    )
    # tiles of 16 tokens, 2 programs: up to 5 tiles, several per program
    tensors = [torch.from_numpy(a) for a in (table, rows, positions)]
    out = torch.full((positions.shape[0],), 123, dtype=torch.int64)
    triton_slots.slot_mapping_triton(*tensors, block_size, ratio, out, block=16, grid_cap=2)
    assert out.tolist() == want.tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_64_bit_slots_and_strided_table(impl):
    # block id 2**31 - 1 (the largest int32) with E = 256 entries: slot (2**31 - 1) * 256 + 255
    # = 549,755,813,887 > 2**31; position 2**33 + 255 lands in column 2**33 // 256 = 2**25,
    # past the table -> -1. The table is a column slice (row stride 8, not 4).
    big = 2**31 - 1
    wide = i32([[big, 5, 6, 7, 0, 0, 0, 0], [2, big, 0, 1, 0, 0, 0, 0]])
    table = wide[:, :4]
    rows, positions = i64([0, 1, 1, 0]), i64([255, 511, 2**33 + 255, 1024 + 3])
    want = [big * 256 + 255, big * 256 + 255, -1, -1]  # 1027 -> column 4 of 4: past the table
    assert want[0] == 549_755_813_887
    assert reference(table, rows, positions, 256, 1) == want
    assert ops.slot_mapping(table, rows, positions, 256, impl=impl).tolist() == want
    as_t = [torch.from_numpy(a) for a in (table, rows, positions)]
    assert as_t[0].stride() == (8, 1)
    assert ops.slot_mapping(*as_t, 256, impl=impl).tolist() == want


@pytest.mark.parametrize("impl", IMPLS)
def test_edges_empty_no_columns_negative_entries_and_out(impl):
    empty = ops.slot_mapping(TABLE, i32([]), i64([]), 8, impl=impl)
    assert empty.shape == (0,) and empty.dtype == np.int64
    # a table with no columns: every slot -1
    got = ops.slot_mapping(np.zeros((2, 0), np.int32), i32([0, 1]), i64([0, 9]), 8, impl=impl)
    assert got.tolist() == [-1, -1]
    # a negative entry (never in a valid table) gives -1 too: no negative slot but -1, ever
    got = ops.slot_mapping(i32([[-3, 2]]), i32([0, 0]), i64([1, 9]), 8, impl=impl)
    assert got.tolist() == [-1, 2 * 8 + 1]
    # out: written and returned; it may alias positions
    out = np.full(8, 99, dtype=np.int64)
    assert ops.slot_mapping(TABLE, ROWS, POSITIONS, 8, out=out, impl=impl) is out
    assert out.tolist() == reference(TABLE, ROWS, POSITIONS, 8, 1)
    pos = POSITIONS.copy()
    ops.slot_mapping(TABLE, ROWS, pos, 8, 4, out=pos, impl=impl)
    assert pos.tolist() == reference(TABLE, ROWS, POSITIONS, 8, 4)
    out_t = torch.full((8,), 99, dtype=torch.int64)
    tensors = [torch.from_numpy(a) for a in (TABLE, ROWS, POSITIONS)]
    assert ops.slot_mapping(*tensors, 8, out=out_t, impl=impl) is out_t
    assert out_t.tolist() == reference(TABLE, ROWS, POSITIONS, 8, 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_inputs_and_out(impl):
    # every second element of larger buffers: rows, positions and out with stride 2; the
    # elements in between are never written
    want = reference(TABLE, ROWS, POSITIONS, 8, 1)
    rows = np.repeat(ROWS, 2)[::2]
    positions = np.repeat(POSITIONS, 2)[::2]
    buf = np.full(16, 55, dtype=np.int64)
    ops.slot_mapping(TABLE, rows, positions, 8, out=buf[::2], impl=impl)
    assert buf[::2].tolist() == want and buf[1::2].tolist() == [55] * 8
    tbuf = torch.full((16,), 55, dtype=torch.int64)
    tensors = [torch.from_numpy(a) for a in (TABLE, rows, positions)]
    assert tensors[1].stride() == (2,)
    ops.slot_mapping(*tensors, 8, out=tbuf[::2], impl=impl)
    assert tbuf[::2].tolist() == want and tbuf[1::2].tolist() == [55] * 8


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_unchecked_bad_rows_never_read_out_of_bounds(impl):
    # check=False trusts the caller; on tensors (the accelerator paths) a row outside the table
    # or a negative position still reads nothing and gives -1
    tensors = [torch.from_numpy(a) for a in (TABLE, i32([0, 3, -1, 2]), i64([0, 1, 2, -5]))]
    got = ops.slot_mapping(*tensors, 8, impl=impl, check=False)
    assert got.tolist() == [24, -1, -1, -1]


# --------------------------------------------------------------------------------------------
# implementation choice


def test_resolve_slot_impl(monkeypatch):
    assert ops.resolve_slot_impl("auto", "cpu") == "numpy"
    assert ops.resolve_slot_impl("torch", "cuda:0") == "torch"
    with pytest.raises(ValueError) as info:
        ops.resolve_slot_impl("numpy", "cuda:0")
    assert str(info.value) == (
        "impl 'numpy' runs on numpy arrays and cpu tensors; the arrays are on cuda:0"
    )
    monkeypatch.setattr(ops, "triton_error", lambda: None)
    assert ops.resolve_slot_impl("auto", "cuda:0") == "triton"
    monkeypatch.setattr(ops, "triton_error", lambda: "ModuleNotFoundError: No module 'triton'")
    assert ops.resolve_slot_impl("auto", "cuda:0") == "torch"  # no triton: the torch fallback
    with pytest.raises(RuntimeError) as info:
        ops.resolve_slot_impl("triton", "cuda:0")
    assert str(info.value) == (
        "impl 'triton' needs triton, which does not import (ModuleNotFoundError: No module "
        "'triton')"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError) as info:
        ops.resolve_slot_impl("triton", "cpu")
    assert str(info.value).startswith(
        "impl 'triton' on cpu arrays needs the Triton interpreter: set TRITON_INTERPRET=1"
    )


# --------------------------------------------------------------------------------------------
# bad input: exact messages, nothing written

GOOD = {
    "block_table": i32([[3, 4, 0], [1, 2, 5], [6, 0, 0], [7, 8, 9]]),
    "rows": i32([0, 1, 3]),
    "positions": i64([0, 5, 9]),
    "block_size": 4,
    "compress_ratio": 1,
}
BOTH_KINDS = "pass numpy arrays only, or torch tensors on one device only"
READ_ONLY = np.zeros(3, dtype=np.int64)
READ_ONLY.flags.writeable = False

BAD_SLOT_ARGS = [
    (
        {"block_table": [[3, 4, 0]]},
        TypeError,
        "block_table is list; expected a 2-D int32 [max_num_seqs, max_blocks] (numpy array or "
        "torch tensor)",
    ),
    (
        {"block_table": np.zeros((4, 3), np.float32)},
        TypeError,
        "block_table has dtype numpy.float32; expected int32 or int64",
    ),
    (
        {"block_table": torch.zeros(4, 3, dtype=torch.int16)},
        TypeError,
        "block_table has dtype torch.int16; expected int32 or int64",
    ),
    (
        {"block_table": np.zeros(12, np.int32)},
        ValueError,
        "block_table has shape (12,); expected 2-D [max_num_seqs, max_blocks_per_req]",
    ),
    (
        {"rows": (0, 1, 3)},
        TypeError,
        "rows is tuple; expected a 1-D int32 or int64 [N] (numpy array or torch tensor)",
    ),
    (
        {"rows": np.array([0.0, 1.0, 3.0])},
        TypeError,
        "rows has dtype numpy.float64; expected int32 or int64",
    ),
    ({"rows": i32([[0], [1], [3]])}, ValueError, "rows has shape (3, 1); expected 1-D [N]"),
    (
        {"positions": np.array([0, 5, 9], np.int32)},
        TypeError,
        "positions has dtype numpy.int32; expected int64",
    ),
    (
        {"positions": i64([0, 5])},
        ValueError,
        "positions has shape (2,); expected (3,) (one position per entry of rows)",
    ),
    (
        {"positions": torch.tensor([0, 5, 9])},
        ValueError,
        f"positions is a torch tensor on cpu but block_table is a numpy array; {BOTH_KINDS}",
    ),
    (
        {
            "block_table": torch.zeros(4, 3, dtype=torch.int32),
            "rows": torch.zeros(3, dtype=torch.int32, device="meta"),
            "positions": torch.zeros(3, dtype=torch.int64),
        },
        ValueError,
        f"rows is a torch tensor on meta but block_table is a torch tensor on cpu; {BOTH_KINDS}",
    ),
    (
        {"rows": i32([0, 4, 1])},
        ValueError,
        "rows[1] = 4 is out of range for block_table with 4 rows (max_num_seqs)",
    ),
    (
        {"rows": i64([0, 1, -1])},
        ValueError,
        "rows[2] = -1 is out of range for block_table with 4 rows (max_num_seqs)",
    ),
    (
        {"positions": i64([-5, 5, -1])},
        ValueError,
        "positions[0] = -5 is negative; positions start at 0",
    ),
    ({"block_size": 0}, ValueError, "block_size = 0; expected an int >= 1"),
    ({"block_size": 4.0}, TypeError, "block_size is float; expected an int >= 1"),
    ({"block_size": True}, TypeError, "block_size is bool; expected an int >= 1"),
    ({"compress_ratio": 0}, ValueError, "compress_ratio = 0; expected an int >= 1"),
    (
        {"compress_ratio": 3},
        ValueError,
        "compress_ratio = 3 does not divide block_size = 4; a block must hold a whole number "
        "of entries",
    ),
    ({"out": np.zeros(3, np.int32)}, TypeError, "out has dtype numpy.int32; expected int64"),
    (
        {"out": np.zeros(4, np.int64)},
        ValueError,
        "out has shape (4,); expected (3,) (one slot per position)",
    ),
    ({"out": READ_ONLY}, ValueError, "out is a read-only numpy array; expected a writeable one"),
    (
        {"out": torch.zeros(3, dtype=torch.int64)},
        ValueError,
        f"out is a torch tensor on cpu but block_table is a numpy array; {BOTH_KINDS}",
    ),
    (
        {"impl": "fast"},
        ValueError,
        "impl 'fast' is not one of 'auto', 'numpy', 'torch', 'triton'",
    ),
    ({"impl": 3}, TypeError, "impl is int; expected one of 'auto', 'numpy', 'torch', 'triton'"),
    ({"check": "yes"}, TypeError, "check is str; expected a bool"),
]


@pytest.mark.parametrize(("override", "exc", "message"), BAD_SLOT_ARGS)
def test_slot_mapping_bad_input(override, exc, message):
    args = {**GOOD, **override}
    out = args.pop("out", None)
    sentinel = np.full(3, 77, dtype=np.int64)
    if out is None:
        out = sentinel
    inputs = {
        k: v.copy() if isinstance(v, np.ndarray) else v.clone()
        for k, v in args.items()
        if isinstance(v, np.ndarray) or (isinstance(v, torch.Tensor) and v.device.type == "cpu")
    }
    extra = {k: args.pop(k) for k in ("impl", "check") if k in args}
    with pytest.raises(exc) as info:
        ops.slot_mapping(**args, out=out, **extra)
    assert str(info.value) == message
    assert sentinel.tolist() == [77, 77, 77]  # nothing written
    for k, before in inputs.items():  # inputs untouched
        now = args[k]
        assert (np.array_equal if isinstance(now, np.ndarray) else torch.equal)(now, before)


# --------------------------------------------------------------------------------------------
# token_positions


def positions_loop(num_computed, num_new) -> tuple[list[int], list[int]]:
    request, positions = [], []
    for i, (c, k) in enumerate(zip(num_computed, num_new, strict=True)):
        request += [i] * k
        positions += list(range(c, c + k))
    return request, positions


def test_token_positions_example():
    # [5, 7) of request 0, [0, 3) of request 1, nothing of request 2, [9, 10) of request 3
    got = ops.token_positions(i64([5, 0, 4, 9]), i64([2, 3, 0, 1]))
    assert isinstance(got, ops.TokenPositions)
    assert got.request_index.dtype == np.int64 and got.positions.dtype == np.int64
    assert got.request_index.tolist() == [0, 0, 1, 1, 1, 3]
    assert got.positions.tolist() == [5, 6, 0, 1, 2, 9]
    t = ops.token_positions(
        torch.tensor([5, 0, 4, 9]), torch.tensor([2, 3, 0, 1], dtype=torch.int32)
    )
    assert isinstance(t.positions, torch.Tensor) and t.positions.dtype == torch.int64
    assert (t.request_index.tolist(), t.positions.tolist()) == (
        [0, 0, 1, 1, 1, 3],
        [5, 6, 0, 1, 2, 9],
    )
    none = ops.token_positions(i64([]), i64([]))
    assert none.request_index.shape == (0,) and none.positions.shape == (0,)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 9)), max_size=12),
    as_torch=st.booleans(),
)
def test_token_positions_match_loop(counts, as_torch):
    computed = i64([c for c, _ in counts])
    new = i64([k for _, k in counts])
    conv = torch.from_numpy if as_torch else (lambda a: a)
    got = ops.token_positions(conv(computed), conv(new))
    assert (got.request_index.tolist(), got.positions.tolist()) == positions_loop(
        computed.tolist(), new.tolist()
    )
    # feeding slot_mapping: request i uses table row i (blocks 2i + 1 and 2i + 2)
    if counts:
        table = np.arange(1, 1 + 2 * len(counts), dtype=np.int32).reshape(-1, 2)
        rows, positions = np.asarray(got.request_index), np.asarray(got.positions)
        slots = ops.slot_mapping(table, rows, positions, 16)
        assert slots.tolist() == reference(table, rows, positions, 16, 1)


BAD_TOKEN_ARGS = [
    (
        ([0, 1], i64([1, 1])),
        TypeError,
        "num_computed is list; expected a 1-D int64 [B] (numpy array or torch tensor)",
    ),
    (
        (i64([0, 1]), np.array([1.0, 2.0])),
        TypeError,
        "num_new has dtype numpy.float64; expected int64 (or int32)",
    ),
    ((i64([[0], [1]]), i64([1, 1])), ValueError, "num_computed has shape (2, 1); expected 1-D [B]"),
    (
        (i64([0, 1, 2]), i64([1, 1])),
        ValueError,
        "num_new has shape (2,); expected (3,) (one count per entry of num_computed)",
    ),
    (
        (i64([0, 1]), torch.tensor([1, 1])),
        ValueError,
        "num_new is a torch tensor on cpu but num_computed is a numpy array; pass numpy arrays "
        "only, or torch tensors on one device only",
    ),
    ((i64([-1, 1]), i64([1, 1])), ValueError, "num_computed[0] = -1 is negative"),
    ((i64([0, 1, 2]), i64([1, -2, 0])), ValueError, "num_new[1] = -2 is negative"),
]


@pytest.mark.parametrize(("args", "exc", "message"), BAD_TOKEN_ARGS)
def test_token_positions_bad_input(args, exc, message):
    with pytest.raises(exc) as info:
        ops.token_positions(*args)
    assert str(info.value) == message
