"""One position's slot in Python ints (``CacheStorage.slot_mapping(..., checked=True)`` of one
position, :func:`kvforge.worker.storage._one_slot`) is the slot kernel's
(:func:`kvforge.ops.slot_mapping`) on random tables, positions and compress ratios: null
blocks, entries past the table's width and tokens that complete no entry map to ``-1``."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import ops
from kvforge.worker.storage import _one_slot


@st.composite
def cases(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 6, 16, 64, 128]))
    ratio = draw(st.sampled_from([r for r in (1, 2, 3, 4, 8, 128) if block_size % r == 0]))
    rows, width = draw(st.integers(1, 4)), draw(st.integers(0, 6))
    cells = draw(st.lists(st.integers(0, 50), min_size=rows * width, max_size=rows * width))
    table = np.array(cells, dtype=np.int32).reshape(rows, width)
    row = draw(st.integers(0, rows - 1))
    position = draw(st.integers(0, (width + 1) * block_size + 2))
    return table, row, position, block_size, ratio


@settings(max_examples=300, deadline=None)
@given(cases())
def test_one_slot_is_the_kernel(case):
    table, row, position, block_size, ratio = case
    expected = ops.slot_mapping(
        table, np.array([row]), np.array([position], dtype=np.int64), block_size, ratio
    )
    assert _one_slot(table, row, position, block_size, ratio) == int(expected[0])
