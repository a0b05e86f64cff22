"""The free floor benchmark (``benchmarks/free_floor.py``) on tiny workloads: its snapshot is
the scheduler side's state, the bare free does every store a free needs (breaking any one of
them fails the run's check), the deltas are the ones a finish hands the worker, each ratio
comes with its spread, and bad input is refused before any run. No timing is asserted."""

from __future__ import annotations

import free_floor
import numpy as np
import pytest
from _step_workloads import tiny
from free_floor import (
    KVFORGE_FREES,
    bare_free,
    bare_tables,
    floor_free_times,
    floor_rounds,
    free_times,
    main,
    scheduled,
)
from step_sim import load_step_workloads
from vllm_baseline import vllm_available

from kvforge.core.values import NO_CELLS, cleared_row_deltas, frozen_rows

SW = load_step_workloads()
HAVE_VLLM = vllm_available()
GROUP_SETS = [SW.LLAMA_GROUPS, SW.GPT_OSS_GROUPS, SW.DEEPSEEK_V4_TINY_GROUPS]


@pytest.mark.parametrize("groups", GROUP_SETS)
def test_the_snapshot_is_the_scheduler_sides_state(groups) -> None:
    wl = tiny(groups)
    ctl, ids = scheduled(wl, SW.schedule(wl))
    manager = ctl.scheduler
    tables, requests = bare_tables(ctl, ids)
    assert requests.tokens.tolist() == [manager.num_tokens(r) for r in ids]
    assert requests.tokens.tolist() == [wl.prompt_len + wl.decode_steps] * 3  # nothing refused
    assert requests.row_of == {r: i for i, r in enumerate(ids)} and requests.free_rows == []
    for spec, g in zip(ctl.layout.groups, tables, strict=True):
        for i, rid in enumerate(ids):
            row = manager.block_table(rid, spec.name)
            assert g.table[i, : len(row)].tolist() == row and not g.table[i, len(row) :].any()
        assert g.ref.tolist() == manager.pool(spec.name).ref_counts.tolist()
        assert g.num_free == manager.num_free_blocks(spec.name)
        free = sorted(g.stack[: g.num_free].tolist())
        assert free == np.flatnonzero(g.ref == 0)[1:].tolist()  # the null block never free
        assert (g.held_from is None) == (spec.window is None)
    ctl.free()


@pytest.mark.parametrize("groups", GROUP_SETS)
def test_the_bare_free_empties_one_row_and_gives_exactly_its_blocks_back(groups) -> None:
    wl = tiny(groups)
    ctl, ids = scheduled(wl, SW.schedule(wl))
    tables, requests = bare_tables(ctl, ids)
    ctl.free()
    held = [sorted(g.table[0][g.table[0] != 0].tolist()) for g in tables]
    before = [g.num_free for g in tables]
    bare_free(tables, requests, ids[0])
    for g, blocks, top in zip(tables, held, before, strict=True):
        assert not g.table[0].any() and not g.ref[blocks].any()
        assert sorted(g.stack[top : g.num_free].tolist()) == blocks
        assert g.table[1:].any()  # the other requests keep theirs
    assert ids[0] not in requests.row_of and requests.free_rows == [0]
    assert requests.tokens[0] == 0 and requests.tokens[1:].all()


def test_the_floor_clears_each_row_through_its_own_frozen_array() -> None:
    rows = frozen_rows(3)
    deltas = cleared_row_deltas(["kv", "swa"], rows[2])
    assert [d.group for d in deltas] == ["kv", "swa"]
    assert all(d.clear_rows.tolist() == [2] and d.rows is NO_CELLS for d in deltas)
    assert deltas[0].clear_rows is deltas[1].clear_rows is rows[2]  # as a finish
    assert [r.tolist() for r in rows] == [[0], [1], [2]]
    with pytest.raises(ValueError, match="read-only"):
        rows[1][0] = 1


def _skip_group(real):
    return lambda groups, requests, rid: real(groups[:-1], requests, rid)


def _no_stack_push(groups, requests, rid):
    tops = [g.num_free for g in groups]
    free_floor.BARE_FREE(groups, requests, rid)
    for g, top in zip(groups, tops, strict=True):
        g.stack[top : g.num_free] = 0  # the count moved, the ids never landed


def _no_held_from(groups, requests, rid):
    saved = [None if g.held_from is None else g.held_from.copy() for g in groups]
    free_floor.BARE_FREE(groups, requests, rid)
    for g, old in zip(groups, saved, strict=True):
        if old is not None:
            g.held_from[:] = np.where(g.table.any(axis=1), g.held_from, old)


def _keeps_request(groups, requests, rid):
    row = requests.row_of[rid]
    free_floor.BARE_FREE(groups, requests, rid)
    requests.row_of[rid] = row


def _no_free_row(groups, requests, rid):
    free_floor.BARE_FREE(groups, requests, rid)
    requests.free_rows.pop()


@pytest.mark.parametrize(
    ("broken", "fragment"),
    [
        (_skip_group(bare_free), "left blocks held"),
        (_no_stack_push, "left blocks held"),
        (_no_held_from, "left blocks held"),
        (_keeps_request, "left requests"),
        (_no_free_row, "left requests"),
    ],
    ids=["a group", "the free stack", "held_from", "the request", "the free row"],
)
def test_a_free_that_skips_a_store_is_caught(monkeypatch, broken, fragment) -> None:
    wl = tiny(SW.GPT_OSS_GROUPS)
    monkeypatch.setattr(free_floor, "BARE_FREE", bare_free, raising=False)
    monkeypatch.setattr(free_floor, "bare_free", broken)
    with pytest.raises(AssertionError, match=fragment):
        floor_free_times(wl, SW.schedule(wl))


def test_the_deltas_run_builds_one_per_group_per_free() -> None:
    wl = tiny(SW.DEEPSEEK_V4_TINY_GROUPS)
    assert len(floor_free_times(wl, SW.schedule(wl), deltas=True)) == 3


def test_rounds_give_each_ratio_with_its_spread() -> None:
    wl = tiny(SW.DEEPSEEK_V4_TINY_GROUPS)
    records = floor_rounds([wl], rounds=3, with_vllm=HAVE_VLLM)
    assert [r.phase for r in records] == [f"free_{side}" for side in KVFORGE_FREES]
    for r in records:
        assert r.rounds == 3 and r.kvforge_us > 0
        low, median, high = r.kvforge_spread
        assert low <= median <= high
        if HAVE_VLLM:
            low, median, high = r.ratio_spread
            assert 0 < low <= median == r.ratio <= high and r.vllm_us > 0
        else:
            assert r.ratio is None and r.vllm_us is None


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda wl: floor_rounds([wl], rounds=2), ValueError, "rounds must be an int >= 3 .*got 2"),
        (lambda wl: floor_rounds([wl], rounds=True), ValueError, "got True"),
        (lambda wl: floor_rounds([wl], rounds="9"), ValueError, "got '9'"),
        (lambda wl: floor_rounds([]), ValueError, "workloads must name at least one"),
        (lambda wl: free_times("worker", wl, None), ValueError, "side must be one of .*'worker'"),
        (lambda wl: bare_tables(None, []), ValueError, "ids must name at least one request"),
    ],
)
def test_bad_input_is_refused(call, error, fragment) -> None:
    with pytest.raises(error, match=fragment):
        call(tiny(SW.LLAMA_GROUPS))


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--rounds", "2"], "--rounds must be >= 3"),
        (["--workloads", "nope"], "--workloads: unknown ['nope']"),
        (["--workloads", ","], "--workloads names no workload: ','"),
    ],
)
def test_bad_command_lines_exit_2(argv, fragment, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err
