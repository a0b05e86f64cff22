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
from _helpers import arena_manager, sweep_lines
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import DeepseekV4Backend, GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.errors import RequestStateError
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


def _held_manager(
    extra_holders: bool = False, share_pools: bool = False
) -> tuple[BlockManager, tuple]:
    """Per-group pools (four of them) or shared ones, three requests grown, one of them past
    its windows;
    ``extra_holders``: some of ``b``'s blocks also held by a second holder or retained (as
    a prefix hit and the prefix cache make them), so its release shares and caches."""
    if share_pools:  # a window group and a full one drawing on one pool
        swa = GQABackend(2, 8, block_size=16, sliding_window=32)
        kv = GQABackend(2, 8, block_size=16)
        layout = CacheLayout({0: swa, 1: kv, 2: swa, 3: kv})
        m = BlockManager(layout, {"swa": 90, "kv": 90}, 3, 2048, share_pools=True)
        assert [members for _, members in m._t.pools] == [[0, 1]]
    else:
        m = _manager(kv=60, swa=60, rows=3, share_pools=False)
    for rid, n in (("a", 40), ("b", 300), ("c", 17)):
        m.end_step(m.schedule([rid], [n]))
    m.take_effects()
    if extra_holders:
        t = m._t
        for g in t.groups:
            held = [b for b in g.table[t.row_of["b"]].tolist() if b]
            g.pool.share(held[:1])
            for b in held[1:3]:
                g.pool.retain(b)
    return m, state(m)


def _evictable(m: BlockManager) -> list[list[int]]:
    return [list(g.pool._evictable) for g in m._t.groups]  # in eviction order


@pytest.mark.parametrize("share_pools", [False, True])
@pytest.mark.parametrize("extra_holders", [False, True])
def test_a_row_released_at_once_rolls_back_under_an_interrupt_at_every_line(
    extra_holders, share_pools
):
    """``RequestTables.release_row_at_once`` changes several pools in turn, with no undo of
    the book's: an interrupt at any line of kvforge that ``finish`` runs (between two
    reference stores, between the second pool's release and the row's clearing, after the
    clearing and before the request is forgotten) leaves the manager exactly as before, the
    evictable blocks in their order included, or the finish done; a finish rolled back then
    runs whole. Either way the manager ends as the batch path leaves it."""
    m, _ = _held_manager(extra_holders, share_pools)
    with pytest.MonkeyPatch.context() as mp:  # what the batch path makes of it
        mp.setattr(SwapBook, "_finish_one", _off)
        m.finish(["b"])
    seen: list[tuple[str, int]] = []
    outcomes = sweep_lines(
        lambda: _held_manager(extra_holders, share_pools)[0],
        lambda m: m.finish(["b"]),
        lambda m: (state(m), _evictable(m)),
        same,
        done=(state(m), _evictable(m)),
        lines=seen,
    )
    assert any(name == "BlockPool.release_few" for name, _ in seen), seen
    assert outcomes["rolled back"] > 30 and outcomes["completed"] > 0, outcomes
    if extra_holders:  # the shared blocks kept a holder, the retained ones are evictable
        pools = {id(g.pool): g.pool for g in m._t.groups}
        assert sum(len(p._evictable) for p in pools.values()) == 2 * len(m._t.groups)


def test_many_blocks_keep_a_finish_under_the_undo():
    """A row with more blocks in a pool than scalar stores serve (64): ``release_row_at_once``
    answers ``False`` with nothing changed, and the finish takes the undo path, releasing
    exactly the row's blocks."""
    m = _manager(kv=80, swa=60, rows=2, share_pools=False)
    m.end_step(m.schedule(["a"], [70 * 16]))  # 70 blocks of the full group
    m.take_effects()
    t = m._t
    row = t.row_of["a"]
    before = state(m)
    assert not t.release_row_at_once("a", row, t.row_cells(row))
    assert same(state(m), before)
    m.finish(["a"])
    assert m.requests == [] and all(g.pool.num_used == 0 for g in t.groups)


def test_a_copied_manager_frees_its_own_rows():
    """A finish reads and clears a row through scalar views of the tables and counts: a copy
    of the manager (as ``tests/scheduler/test_swap_faults.py`` makes them) frees its own rows
    and leaves the original's exactly as they were."""
    import copy
    import threading

    m = _manager(kv=40, swa=30, rows=3)
    m.end_step(m.schedule(["a", "b"], [300, 40]))
    m.take_effects()
    before = state(m)
    twin = copy.deepcopy(m, {id(m._lock): threading.RLock()})
    row = twin.row_of("a")
    twin.finish(["a"])
    assert same(state(m), before) and m.requests == ["a", "b"]
    assert twin.requests == ["b"] and row in twin._t.free_rows
    assert all(not g.table[row].any() and g.held_from[row] == 0 for g in twin._t.groups)
    m.finish(["a"])
    assert same(state(m), state(twin))
    for clear in (twin._t.one_row[row], m._t.one_row[row]):  # frozen in the copy too
        assert not clear.flags.writeable and clear.tolist() == [row]
        with pytest.raises(ValueError):
            clear.base.flags.writeable = True  # immutable bytes: never thawed


def test_a_row_read_stops_at_the_tables_width():
    """``row_cells`` reads a row through a flat view of the table: like numpy's slice it
    stops at the row's end, so a token count past the width never reaches the next row."""
    m = _manager(kv=40, swa=30, rows=3)
    m.end_step(m.schedule(["a", "b"], [300, 300]))
    t = m._t
    row = t.row_of["a"]
    t.num_tokens[row] = 10**6  # past every table's width (a broken invariant)
    for g, (first, end, cells, _) in zip(t.groups, t.row_cells(row), strict=True):
        assert end <= g.width and cells == g.table[row, first:end].tolist()


def test_a_finish_hands_each_group_the_rows_own_frozen_clear():
    """The cleared-row deltas of a finish share one frozen ``int32 [1]`` per row, the same
    for every finish of that row, equal to ``TableDelta(group, [row])``."""
    from kvforge.core.values import TableDelta

    m = _manager(kv=40, swa=30, rows=2)
    clears = []
    for rid in ("a", "b"):
        m.end_step(m.schedule([rid], [100]))
        m.take_effects()
        row = m.row_of(rid)
        m.finish([rid])
        deltas = m.take_table_deltas()
        assert [d.group for d in deltas] == [g.name for g in m.layout.groups]
        assert all(d == TableDelta(d.group, d.clear_rows, seq=d.seq) for d in deltas)
        assert all(d.clear_rows is deltas[0].clear_rows for d in deltas)
        assert deltas[0].clear_rows.tolist() == [row] and deltas[0].clear_rows.dtype == np.int32
        assert not deltas[0].clear_rows.flags.writeable
        clears.append(deltas[0].clear_rows)
    assert clears[0] is clears[1]  # the one row, freed twice: its one array


@pytest.mark.parametrize(
    ("request_ids", "error", "message"),
    [
        ([""], RequestStateError, "request_id must be a non-empty str, got ''"),
        ([5], RequestStateError, "request_id must be a non-empty str, got 5"),
        ("a", TypeError, "request_ids must be a sequence of request ids, got str"),
        (["x"], RequestStateError, "request 'x' has no blocks on the device"),
        (["a", "a"], ValueError, "request_ids lists 'a' twice"),
    ],
)
def test_a_finish_of_one_bad_id_is_refused_with_nothing_changed(request_ids, error, message):
    """One request id, the engine's call, is checked as a batch's are."""
    m = _manager(kv=40, swa=30, rows=2)
    m.end_step(m.schedule(["a"], [100]))
    m.take_effects()
    before = state(m)
    with pytest.raises(error, match=message):
        m.finish(request_ids)
    assert same(state(m), before) and m.requests == ["a"]


class _Id(str):
    """A str subclass: a request id all the same."""


def test_a_finish_of_one_str_subclass_or_tuple_id_frees_it():
    m = _manager(kv=40, swa=30, rows=2)
    for ids in ([_Id("a")], ("a",)):
        m.end_step(m.schedule(["a"], [100]))
        m.finish(ids)
        assert m.requests == [] and all(g.pool.num_used == 0 for g in m._t.groups)
        m.take_effects()


@pytest.mark.slow
@pytest.mark.parametrize("share_pools", [False, True])
@pytest.mark.parametrize("extra_holders", [False, True])
def test_a_batch_finish_rolls_back_under_an_interrupt_at_every_line(extra_holders, share_pools):
    """A finish of two requests releases their rows under the book's undo, whose step for a
    pool restores the saved reference counts and rebuilds the free stack
    (``BlockPool.restore_counts``): an interrupt at any line, one between a count store and
    its push or after the pushes and before the free count moves included, leaves every
    pool, stack, evictable block and row as before (a retry then frees both) or the finish
    done. Before, the undo popped the top of the stack, which such an interrupt left short,
    and lost blocks."""

    def view(m: BlockManager) -> tuple:
        return state(m), _evictable(m)

    def build() -> BlockManager:
        return _held_manager(extra_holders, share_pools)[0]

    outcomes = sweep_lines(build, lambda m: m.finish(["a", "b"]), view, same)
    assert outcomes["rolled back"] > 150 and outcomes["completed"] >= 1, outcomes


@pytest.mark.slow
def test_a_batch_finish_in_a_slab_arena_rolls_back_under_an_interrupt_at_every_line():
    """As above for an arena's pools, which also count the blocks in use and cached per slab
    (``ArenaBlockPool.restore_counts`` reads them again), with prefix caching on: the
    released blocks become evictable, and leave the evictable set again on an undo."""

    def build() -> BlockManager:
        return arena_manager(finished=False)

    def view(m: BlockManager) -> tuple:
        assert m.arena is not None
        m.arena.check()
        pools = [
            (p.ref_counts, p.num_free, p.free_stack, p.live, p.cached, list(p._evictable))
            for p in m.arena.pools
        ]
        return pools, [m.table(g) for g in m.groups], m.requests

    outcomes = sweep_lines(build, lambda m: m.finish(["a", "b"]), view, same)
    assert outcomes["rolled back"] > 500 and outcomes["completed"] >= 1, outcomes
    m = build()
    m.finish(["a", "b"])  # the released blocks were cached: the undo had evictable ones
    assert m.arena is not None and sum(p.num_evictable for p in m.arena.pools) > 20
