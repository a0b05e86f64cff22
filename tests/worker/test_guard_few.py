"""The worker accepts a step's few small table deltas in Python ints
(``guard._few_cells_fit``); whatever it accepts, the full checks by array reductions
(``guard._check_every_delta``) accept too, and whatever the full checks refuse, the Python
ints decline (so the refusal keeps its words). Random deltas, in and out of range, of every
integer dtype, in and out of sequence, with cells of their own or the shared frozen empty
cells of a delta that only clears rows (``NO_CELLS``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.core.values import NO_CELLS, TableDelta
from kvforge.errors import WorkerRefusedError
from kvforge.worker import guard

TABLES = {
    "a": np.zeros((4, 6), np.int32),
    "b": np.zeros((4, 3), np.int32),
    "c": np.zeros((2, 6), np.int32),  # fewer rows: a row another group's table holds is out
}
NUM_BLOCKS = {"a": 10, "b": 5, "c": 10}

CELL = st.integers(-2, 11)
DTYPE = st.sampled_from([np.int32, np.int32, np.int32, np.int64, np.int16, np.uint32])


def _array(values: list[int], dtype: type) -> np.ndarray:
    """``values`` in ``dtype``; negatives wrap in an unsigned one (huge values, refused)."""
    return np.array(values, np.int64).astype(dtype)


@st.composite
def deltas(draw: st.DrawFn) -> tuple[list[TableDelta], int]:
    """A few deltas, mostly valid, numbered from a random start (sometimes out of order)."""
    start = draw(st.integers(0, 3))
    out = []
    for i in range(draw(st.integers(1, 4))):
        group = draw(st.sampled_from(["a", "b", "a", "c", "zz"] if draw(st.booleans()) else ["a"]))
        n = draw(st.integers(0, 10))
        dtype = draw(DTYPE)
        rows = _array(draw(st.lists(st.integers(-1, 4), min_size=n, max_size=n)), dtype)
        cols = _array(draw(st.lists(CELL, min_size=n, max_size=n)), dtype)
        m = draw(st.sampled_from([n, n, n, max(n - 1, 0)]))  # sometimes a short array
        ids = _array(draw(st.lists(CELL, min_size=m, max_size=m)), dtype)
        clear = _array(draw(st.lists(st.integers(-1, 4), max_size=2)), draw(DTYPE))
        if out and draw(st.booleans()):  # a finish's groups share one clear_rows array
            clear = out[-1].clear_rows
        if n == 0 and draw(st.booleans()):  # the scheduler side's clear: one frozen array
            rows = cols = ids = NO_CELLS
        seq = start + i + draw(st.sampled_from([0, 0, 0, 1]))
        out.append(TableDelta(group, clear, rows, cols, ids, seq))
    return out, start


def full_accepts(batch: list[TableDelta], start: int) -> bool:
    try:
        guard._check_every_delta(batch, start, TABLES, NUM_BLOCKS)
    except WorkerRefusedError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(case=deltas())
def test_python_ints_accept_only_what_the_full_checks_accept(case):
    batch, start = case
    few = guard._few_cells_fit(batch, start, TABLES, NUM_BLOCKS)
    full = full_accepts(batch, start)
    assert not few or full  # never accepts what the full checks refuse
    small = all(
        d.rows.dtype == np.int32 and len(d.rows) <= guard._FEW_CELLS
        and d.cols.dtype == np.int32 and d.block_ids.dtype == np.int32
        and d.clear_rows.dtype == np.int32
        for d in batch
    )  # fmt: skip
    if small and full:
        assert few  # and takes every small int32 batch the full checks accept


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        (TableDelta("a", rows=np.array([4], np.int32), cols=np.array([0], np.int32),
                    block_ids=np.array([1], np.int32), seq=0),
         "row 4 .* outside"),
        (TableDelta("a", rows=np.array([0], np.int32), cols=np.array([6], np.int32),
                    block_ids=np.array([1], np.int32), seq=0),
         "column 6 .* outside"),
        (TableDelta("a", rows=np.array([0], np.int32), cols=np.array([0], np.int32),
                    block_ids=np.array([10], np.int32), seq=0),
         "block id 10 .* outside"),
        (TableDelta("a", clear_rows=np.array([-1], np.int32), seq=0), "row -1 .* outside"),
        (TableDelta("zz", seq=0), "unknown group 'zz'"),
        (TableDelta(["a"], seq=0), r"unknown group \['a'\]"),  # a forged, unhashable name
        (TableDelta("a", seq=1), "seq"),
    ],
)  # fmt: skip
def test_a_bad_small_delta_is_refused_in_the_full_checks_words(delta, message):
    tables = {k: v.copy() for k, v in TABLES.items()}
    with pytest.raises(WorkerRefusedError, match=message):
        guard.check_deltas([delta], 0, tables, NUM_BLOCKS)
    assert all(np.array_equal(tables[k], TABLES[k]) for k in TABLES)  # nothing mirrored


@settings(max_examples=200, deadline=None)
@given(
    cells=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 9)), max_size=12),
    clear=st.lists(st.integers(0, 3), max_size=3),
)
def test_a_delta_of_a_few_cells_mirrors_as_a_scatter(cells, clear):
    """``TableDelta.apply`` of a few cells (scalar stores) or one cleared row (basic
    indexing) leaves the table numpy's scatter leaves (the last write to a cell wins)."""
    rows, cols, ids = (np.array([c[k] for c in cells], np.int32) for k in range(3))
    delta = TableDelta("a", np.array(clear, np.int32), rows, cols, ids)
    start = np.arange(24, dtype=np.int32).reshape(4, 6)
    mirrored, scattered = start.copy(), start.copy()
    delta.apply(mirrored)
    scattered[np.array(clear, np.int64)] = 0
    scattered[rows, cols] = ids
    assert np.array_equal(mirrored, scattered)


def test_a_delta_of_lists_mirrors_as_before():
    """A delta whose cells are lists (the full checks accept any 1-d integer sequence) is
    mirrored by the scatter, as before the scalar stores: no ``tolist`` of a list."""
    delta = TableDelta("a", rows=[3, 0], cols=(1, 5), block_ids=[8, 9])  # type: ignore[arg-type]
    table = np.zeros((4, 6), np.int32)
    delta.apply(table)
    assert table[3, 1] == 8 and table[0, 5] == 9 and int(table.sum()) == 17


def test_a_shared_clear_is_checked_against_every_table_it_clears():
    """A finish's deltas share one ``clear_rows`` array: looked at once, but again for a
    table of fewer rows, where row 3 lies outside."""
    clear = np.array([3], np.int32)
    clear.flags.writeable = False
    batch = [TableDelta(g, clear, seq=i) for i, g in enumerate(["a", "b", "c"])]
    assert guard._few_cells_fit(batch[:2], 0, TABLES, NUM_BLOCKS)
    assert not guard._few_cells_fit(batch, 0, TABLES, NUM_BLOCKS)
    with pytest.raises(WorkerRefusedError, match=r"row 3 .* outside"):
        guard.check_deltas(batch, 0, TABLES, NUM_BLOCKS)
