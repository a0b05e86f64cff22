"""The free floor benchmark (``benchmarks/free_floor.py``) on tiny workloads: the bare free
does every store a free needs (rows empty, counts 0, every block back on its free stack, for
unshared and window groups alike), its snapshot matches the scheduler side's public tables,
each ratio comes with its spread, and bad rounds are refused before any run. No timing is
asserted."""

from __future__ import annotations

import pytest
from _step_workloads import tiny
from free_floor import bare_free, bare_tables, floor_free_times, floor_rounds, main, scheduled
from step_sim import load_step_workloads
from vllm_baseline import vllm_available

SW = load_step_workloads()
HAVE_VLLM = vllm_available()


@pytest.mark.parametrize("groups", [SW.LLAMA_GROUPS, SW.GPT_OSS_GROUPS, SW.DEEPSEEK_V4_TINY_GROUPS])
def test_the_snapshot_is_the_scheduler_sides_tables(groups) -> None:
    wl = tiny(groups)
    ctl, ids = scheduled(wl, SW.schedule(wl))
    manager = ctl.scheduler
    tables, tokens = bare_tables(ctl, ids)
    assert tokens.tolist() == [manager.num_tokens(r) for r in ids]
    for spec, g in zip(ctl.layout.groups, tables, strict=True):
        for i, rid in enumerate(ids):
            row = manager.block_table(rid, spec.name)
            assert g.table[i, : len(row)].tolist() == row and not g.table[i, len(row) :].any()
        assert g.num_free == manager.num_free_blocks(spec.name)
        assert int((g.ref > 0).sum()) == manager.num_used_blocks(spec.name)
        assert (g.held_from is None) == (spec.window is None)
    ctl.free()


@pytest.mark.parametrize("groups", [SW.LLAMA_GROUPS, SW.GPT_OSS_GROUPS, SW.DEEPSEEK_V4_TINY_GROUPS])
def test_the_bare_free_empties_each_row_and_gives_every_block_back(groups) -> None:
    wl = tiny(groups)
    ctl, ids = scheduled(wl, SW.schedule(wl))
    tables, tokens = bare_tables(ctl, ids)
    usable = [ctl.scheduler.num_usable_blocks(g.name) for g in ctl.layout.groups]
    ctl.free()
    held = [sorted(g.table[0][g.table[0] != 0].tolist()) for g in tables]
    before = [g.num_free for g in tables]
    bare_free(tables, tokens, 0)
    for g, blocks, top in zip(tables, held, before, strict=True):
        assert not g.table[0].any() and not g.ref[blocks].any()
        assert sorted(g.stack[top : g.num_free].tolist()) == blocks  # exactly its blocks
        assert g.table[1:].any()  # the other requests keep theirs
    assert tokens[0] == 0 and tokens[1:].all()
    for i in (1, 2):
        bare_free(tables, tokens, i)
    assert [g.num_free for g in tables] == usable
    assert not any(g.ref.any() or g.table.any() for g in tables)


def test_a_free_that_misses_a_store_is_caught(monkeypatch) -> None:
    import free_floor

    wl = tiny(SW.GPT_OSS_GROUPS)
    real = free_floor.bare_free

    def skips_the_last_group(groups, tokens, i):
        real(groups[:-1], tokens, i)

    monkeypatch.setattr(free_floor, "bare_free", skips_the_last_group)
    with pytest.raises(AssertionError, match="the bare free left blocks held"):
        floor_free_times(wl, SW.schedule(wl))


def test_rounds_give_each_ratio_with_its_spread() -> None:
    wl = tiny(SW.DEEPSEEK_V4_TINY_GROUPS)
    records = floor_rounds([wl], rounds=3, with_vllm=HAVE_VLLM)
    assert [r.phase for r in records] == ["free_floor", "free_finish"]
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
    ("rounds", "fragment"),
    [(2, "got 2"), (0, "got 0"), (True, "got True"), ("9", "got '9'")],
)
def test_bad_rounds_are_refused(rounds, fragment) -> None:
    with pytest.raises(ValueError, match=rf"rounds must be an int >= 3 .*{fragment}"):
        floor_rounds([tiny(SW.LLAMA_GROUPS)], rounds=rounds)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--rounds", "2"], "--rounds must be >= 3"),
        (["--workloads", "nope"], "--workloads: unknown ['nope']"),
    ],
)
def test_bad_command_lines_exit_2(argv, fragment, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err
