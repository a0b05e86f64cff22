"""The stages of a scheduler step (:mod:`kvforge.scheduler.step_stages`), each on its own: what
it reads, what it changes, and that a refused request ends the step as it started it.

The stages run on a :class:`BlockManager`'s parts (its tables, prefix cache and swap book),
reached here through its private attributes, as only a test may.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import kvforge
from kvforge import DeepseekV4Backend, GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.core.swap_receipt import plan_receipt
from kvforge.core.values import PrefixQuery, SwapResult
from kvforge.errors import RequestStateError
from kvforge.scheduler import BlockManager, step_stages
from kvforge.scheduler.block_pool import NULL_BLOCK


def manager(kv: int = 40, swa: int = 40, rows: int = 4, max_len: int = 1024) -> BlockManager:
    """A full group ``kv`` (block 16) and a sliding window ``swa`` (block 64, window 128)."""
    layout = CacheLayout({0: GQABackend(2, 8, 16), 1: DeepseekV4Backend(0)})
    groups = {g.name for g in layout.groups}
    counts = {name: (kv if name == "kv" else swa) for name in groups}
    return BlockManager(layout, counts, rows, max_len)


def state(m: BlockManager) -> tuple:
    """Everything a stage may change: tables, extents, counts, rows, pools, queues."""
    t = m._t
    return (
        [g.table.copy() for g in t.groups],
        [g.held_from.copy() for g in t.groups],
        t.num_tokens.copy(),
        t.committed.copy(),
        dict(t.row_of),
        list(t.free_rows),
        [(g.pool.num_free, g.pool.ref_counts.copy()) for g in t.groups],
        len(t.pending),
        len(t.copies),
    )


def same(a: tuple, b: tuple) -> bool:
    def eq(x, y) -> bool:
        if isinstance(x, np.ndarray):
            return np.array_equal(x, y)
        if isinstance(x, list | tuple):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y, strict=True))
        return x == y

    return eq(a, b)


# ---------------------------------------------------------------- stage 1: check_batch

BAD_BATCHES = [
    # (request ids, counts, token ids, exception, message fragment)
    (["a", "a"], [1, 1], None, ValueError, "'a'"),
    (["a"], [1, 2], None, ValueError, "num_new_tokens"),
    (["a"], [-1], None, ValueError, "num_new_tokens"),
    (["a"], [1.5], None, ValueError, "num_new_tokens must hold ints, got 1.5"),
    (["a"], [2], [[1]], ValueError, "new_token_ids"),
    (["run", "s"], [1, 1], None, RequestStateError, "'s' is swapped out"),
    (["out"], [1], None, RequestStateError, "'out' has a swap in flight"),
]


def _with_swaps() -> BlockManager:
    m = manager()
    m.init_host({g: 20 for g in m.groups})
    m.schedule(["run", "s", "out"], [20, 20, 20])
    m.end_step(m.open_steps[-1])
    plan = m.plan_swap_out(["s"])
    m.complete_swap(SwapResult(plan.plan_id, receipt=plan_receipt(plan)))
    m.plan_swap_out(["out"])  # in flight: busy
    return m


@pytest.mark.parametrize(("ids", "counts", "tokens", "exc", "fragment"), BAD_BATCHES)
def test_check_batch_refuses_a_malformed_batch_and_changes_nothing(
    ids, counts, tokens, exc, fragment
):
    m = _with_swaps()
    before = state(m)
    with pytest.raises(exc, match=fragment):
        step_stages.check_batch(m._t, m._book, ids, counts, tokens, None)
    with pytest.raises(exc, match=fragment):
        m.schedule(ids, counts, tokens)
    assert same(state(m), before)


def test_check_batch_refuses_a_match_for_a_running_request():
    m = manager()
    m.end_step(m.schedule(["a"], [10]))
    [match] = m.lookup([PrefixQuery(np.arange(10))])  # no prefix caching: an empty match
    before = state(m)
    with pytest.raises(ValueError, match=r"prefix_matches\[0\] is given for request 'a'"):
        step_stages.check_batch(m._t, m._book, ["a"], [1], None, [match])
    assert same(state(m), before)


def test_check_batch_finds_rows_and_marks_new_requests():
    m = manager()
    m.end_step(m.schedule(["a"], [10]))
    b = step_stages.check_batch(m._t, m._book, ["x", "a"], [3, 1], None, None)
    assert b.ids == ["x", "a"] and b.n_fresh == 1
    assert b.rows.tolist() == [-1, m.row_of("a")] and b.fresh.tolist() == [True, False]
    assert b.accept.all() and b.refused == [] and b.new.tolist() == [3, 1]


# ---------------------------------------------------------------- stages 2 and 6: admit, give back


def test_admit_pops_rows_in_order_and_refuses_past_the_last_free_row():
    m = manager(rows=2)
    free = list(m._t.free_rows)
    b = step_stages.check_batch(m._t, m._book, ["a", "b", "c"], [1, 1, 1], None, None)
    step_stages.admit(b, m._t, m.max_num_seqs)
    assert b.rows.tolist() == [free[-1], free[-2], -1]
    assert b.accept.tolist() == [True, True, False]
    assert [(r.request_id, r.reason, r.available) for r in b.refused] == [("c", "max_num_seqs", 2)]
    assert b.safe_rows.tolist() == [free[-1], free[-2], 0] and m._t.free_rows == []
    # a refusal after admission hands its row back (stage 6)
    b.accept[1] = False
    step_stages.give_back_refused(b, m._t, m._prefix)
    assert m._t.free_rows == [free[-2]]


# ---------------------------------------------------------------- stage 4: bound


def test_bound_refuses_past_max_model_len_and_cuts_at_a_snapshot_boundary():
    m = manager(max_len=100)
    m.end_step(m.schedule(["a"], [90]))
    b = step_stages.check_batch(m._t, m._book, ["a", "n"], [20, 30], None, None)
    step_stages.admit(b, m._t, m.max_num_seqs)
    step_stages.bound(b, m._t, None, m.max_model_len)
    assert b.before.tolist() == [90, 0] and b.after.tolist() == [110, 30]
    assert b.accept.tolist() == [False, True]
    assert [(r.reason, r.needed, r.available) for r in b.refused] == [("max_model_len", 110, 100)]
    # with a snapshot interval of 64 a step ends on the next multiple: 90 -> 128, 0 -> 64
    b = step_stages.check_batch(m._t, m._book, ["a"], [50], None, None)
    step_stages.admit(b, m._t, m.max_num_seqs)
    step_stages.bound(b, m._t, 64, 10_000)
    assert b.new.tolist() == [38] and b.after.tolist() == [128]


# ---------------------------------------------------------------- stages 5 and 7: grow, commit


def test_a_request_refused_for_blocks_ends_the_step_as_it_started_it():
    m = manager(kv=9)  # 8 usable blocks of 16 tokens
    m.end_step(m.schedule(["a"], [16]))  # a holds 1
    t = m._t
    row_a = m.row_of("a")
    kv = t.by_name["kv"]
    held = kv.table[row_a].copy()
    b = step_stages.check_batch(t, m._book, ["x", "a", "y"], [16, 200, 16], None, None)
    step_stages.admit(b, t, m.max_num_seqs)
    step_stages.bound(b, t, None, m.max_model_len)
    step_stages.grow(b, t, None, False)
    # a would need 12 more blocks: refused, its row untouched; x and y take one each
    assert b.accept.tolist() == [True, False, True]
    assert np.array_equal(kv.table[row_a], held) and kv.pool.num_used == 3
    step_stages.give_back_refused(b, t, m._prefix)
    before, after = step_stages.commit(b, t, m._prefix, None)
    assert before == [] and after == []
    assert b.kept_ids == ("x", "y") and [r.request_id for r in b.refused] == ["a"]
    assert t.num_tokens[row_a] == 16 and t.num_tokens[t.row_of["x"]] == 16
    assert sorted(t.row_of) == ["a", "x", "y"]
    # one delta per group, naming only the accepted rows
    deltas = t.take_pending()
    kv_rows = {int(r) for d in deltas if d.group == "kv" for r in d.rows}
    assert kv_rows == {t.row_of["x"], t.row_of["y"]}


def test_refusals_come_back_in_request_order_whichever_stage_refused_them():
    m = manager(kv=3, rows=3, max_len=64)  # 2 usable kv blocks, 3 rows
    step = m.schedule(["big", "long", "ok", "norow"], [48, 80, 16, 1])
    assert [r.request_id for r in step.refused] == ["big", "long", "norow"]
    assert [r.reason for r in step.refused] == ["out_of_blocks", "max_model_len", "max_num_seqs"]
    assert step.request_ids == ("ok",) and m.requests == ["ok"]
    assert m.num_used_blocks("kv") == 1 and m.num_free_rows == 2


def test_grow_releases_a_window_behind_the_first_token_read():
    m = manager()
    m.end_step(m.schedule(["a"], [256]))  # swa: 4 blocks of 64
    swa = next(g for g in m._t.groups if g.windowed)
    row = m.row_of("a")
    b = step_stages.check_batch(m._t, m._book, ["a"], [1], None, None)
    step_stages.admit(b, m._t, m.max_num_seqs)
    step_stages.bound(b, m._t, None, m.max_model_len)
    step_stages.grow(b, m._t, None, False)
    # token 256 reads 129..256 (window 128): blocks 0 and 1 go, 2..4 stay or are new
    assert swa.table[row, :2].tolist() == [NULL_BLOCK, NULL_BLOCK]
    assert NULL_BLOCK not in swa.table[row, 2:5].tolist() and swa.held_from[row] == 2


# ---------------------------------------------------------------- one way to build a delta


def test_only_the_tables_module_builds_table_deltas():
    """Every table delta of the scheduler side goes through ``RequestTables.record`` /
    ``record_cleared`` (one place to number, type and check them)."""
    scheduler = Path(kvforge.__file__).parent / "scheduler"
    builders = []
    for path in sorted(scheduler.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "TableDelta"
            ):
                builders.append(f"{path.relative_to(scheduler)}:{node.lineno}")
    assert builders and all(b.startswith("tables.py:") for b in builders), builders


def test_record_queues_int32_copies_of_the_cells():
    m = manager()
    t = m._t
    g = t.groups[0]
    rows, cols, ids = np.array([1, 1]), np.array([0, 1]), np.array([5, 6], dtype=np.int64)
    t.record(g, rows, cols, ids)
    t.record_cleared(g, np.array([2]))
    ids[0] = 99  # the queued delta holds its own copy
    first, second = t.take_pending()
    assert first.group == g.spec.name and first.block_ids.tolist() == [5, 6]
    assert first.rows.dtype == first.cols.dtype == first.block_ids.dtype == np.int32
    assert second.clear_rows.tolist() == [2] and len(second.rows) == 0
    assert (first.seq, second.seq) == (0, 1)
