"""A batch of one request takes the one-request path: a running request's step through
:func:`kvforge.scheduler.step_stages.one_running` and
:func:`kvforge.scheduler.growth.grow_one` (Python ints), a finish through
``SwapBook._finish_one`` (its row read once); it must be exactly the batch path
(``check_batch`` .. ``commit``, ``plan_growth`` / ``fits_in_order`` / ``apply_growth``,
``schedule_one_by_one`` for refusals, ``_release_rows`` for a finish) for a batch of one.

Two managers run the same random history of one-request steps and finishes, one with the fast
paths and one with them turned off (``step_stages.grow_one`` and ``SwapBook._finish_one``
answering ``False``, so the batch paths decide): after every call both hold the same tables,
extents, token counts, rows, pools and free stacks, and hand out the same steps (rows,
counts, refusals, table deltas) and the same effects of a finish.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import DeepseekV4Backend, GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.scheduler import BlockManager, growth, step_stages
from kvforge.scheduler.swap_book import SwapBook


def state(m: BlockManager) -> tuple:
    """Everything a step may change: tables, extents, counts, rows, pools, queues."""
    t = m._t  # a test reads the manager's parts
    return (
        [g.table.copy() for g in t.groups],
        [g.held_from.copy() for g in t.groups],
        t.num_tokens.copy(),
        dict(t.row_of),
        list(t.free_rows),
        [(g.pool.num_free, g.pool.ref_counts.copy()) for g in t.groups],
        [g.pool._stack[: g.pool._num_free].copy() for g in t.groups],  # the order of takes
        len(t.pending),
    )


def same(a: object, b: object) -> bool:
    """Equal values, arrays of equal dtype and contents, element by element."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def _manager(kv: int, swa: int, rows: int, share_pools: bool = True) -> BlockManager:
    """A full group ``kv`` and the DeepSeek-V4 window and state groups, small pools."""
    layout = CacheLayout({0: GQABackend(2, 8, 16), 1: DeepseekV4Backend(0)})
    counts = {g.name: (kv if g.name == "kv" else swa) for g in layout.groups}
    return BlockManager(layout, counts, rows, 2048, share_pools=share_pools)


def _step_view(step) -> tuple:
    deltas = [
        (d.group, d.seq, d.rows, d.cols, d.block_ids, d.clear_rows) for d in step.table_deltas
    ]
    return (
        step.request_ids,
        step.rows,
        step.num_computed,
        step.num_new,
        step.refused,
        deltas,
        step.copies_before,
        step.copies_after,
    )


def _off(*args: object) -> bool:
    return False  # the batch path decides


OPS = st.lists(
    # (request, new tokens; -1: finish, one op in five)
    st.tuples(st.integers(0, 4), st.one_of(st.integers(0, 300), st.just(-1))),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=OPS,
    kv=st.integers(2, 60),
    swa=st.integers(2, 30),
    rows=st.integers(1, 4),
    share_pools=st.booleans(),
)
def test_grow_one_is_the_batch_path_for_one_request(ops, kv, swa, rows, share_pools):
    fast, slow = _manager(kv, swa, rows, share_pools), _manager(kv, swa, rows, share_pools)
    for request, n in ops:
        rid = f"r{request}"
        results = []
        for m, patched in ((fast, False), (slow, True)):
            with pytest.MonkeyPatch.context() as mp:
                if patched:  # the batch paths: growth, then the stages, then the free
                    mp.setattr(step_stages, "grow_one", _off)
                    mp.setattr(SwapBook, "_finish_one", _off)
                if n < 0:
                    if rid not in m.requests:
                        results.append(None)
                        continue
                    m.finish([rid])
                    effects = m.take_effects()
                    results.append(None if effects is None else _step_view(effects))
                else:
                    step = m.schedule([rid], [n])
                    m.end_step(step)
                    results.append(_step_view(step))
        assert same(results[0], results[1])
        assert same(state(fast), state(slow))


def test_grow_one_declines_what_the_batch_path_must_decide():
    """A request its pools cannot serve: ``grow_one`` changes nothing and answers ``False``;
    the step then refuses it (``out_of_blocks``) through the batch path."""
    m = _manager(kv=3, swa=30, rows=2)
    t = m._t
    before = state(m)
    assert not growth.grow_one(t, 0, True, 0, 200)  # 13 blocks of 16 tokens, 2 usable
    assert same(state(m), before)
    step = m.schedule(["a"], [200])
    assert [(r.reason, r.group) for r in step.refused] == [("out_of_blocks", "kv")]
    assert step.request_ids == () and same(state(m), before)


def _held_manager() -> tuple[BlockManager, tuple]:
    """Per-group pools (four of them), three requests grown, one of them past its windows."""
    m = _manager(kv=60, swa=60, rows=3, share_pools=False)
    for rid, n in (("a", 40), ("b", 300), ("c", 17)):
        m.end_step(m.schedule([rid], [n]))
    m.take_effects()
    return m, state(m)


def test_a_row_released_at_once_rolls_back_under_an_interrupt_at_every_phase():
    """``RequestTables.release_row_at_once`` changes several pools in turn, with no undo of
    the book's: an interrupt as any kvforge function of ``finish`` is entered (the second
    pool's release, the row's clearing) leaves the manager exactly as before, or the finish
    done; the finish then runs whole."""
    import sys

    import kvforge

    root = kvforge.__file__.rsplit("/", 1)[0]
    m, _ = _held_manager()
    m.finish(["b"])
    done = state(m)
    k, outcomes = 0, set()
    while True:
        k += 1
        m, before = _held_manager()
        entered = []

        def calls(frame, event, arg, k=k, entered=entered):
            if frame.f_code.co_filename.startswith(root) and "<" not in frame.f_code.co_name:
                entered.append(frame.f_code.co_qualname)
                if len(entered) == k:
                    raise KeyboardInterrupt(frame.f_code.co_qualname)

        sys.settrace(calls)
        try:
            m.finish(["b"])
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if len(entered) < k:
            break  # every phase was swept
        now = state(m)
        if same(now, before):
            outcomes.add("rolled back")
            m.finish(["b"])
        assert same(state(m), done), entered
    assert "BlockPool.release_few" in entered and outcomes == {"rolled back"}, entered
    assert k > 8


def test_a_shared_block_keeps_a_finish_under_the_undo():
    """A pool where a block has two holders cannot drop a row in scalar stores:
    ``release_row_at_once`` answers ``False`` with nothing changed, and the finish takes the
    undo path, releasing exactly the row's references."""
    m, _ = _held_manager()
    t = m._t
    g = t.by_name["kv"]
    row = t.row_of["a"]
    block = int(g.table[row, 0])
    g.pool.share([block])  # a second holder, as a prefix hit makes
    before = state(m)
    cells = t.row_cells(row)
    assert not t.release_row_at_once(row, cells)
    assert same(state(m), before)
    m.finish(["a"])
    assert "a" not in m.requests and g.pool.ref_count(block) == 1
    g.pool.release([block])
