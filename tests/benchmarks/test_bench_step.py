"""The kvforge side of the per-step benchmark (``step_sim``) on tiny workloads:
record structure, block counts, and slot mappings that agree with the block tables at every step.
No timing is asserted: figures are only checked to be non-negative numbers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from _step_workloads import tiny
from step_sim import (
    STEP_PHASES,
    StepRecord,
    build_backends,
    check_step_inputs,
    load_step_workloads,
    run_facade_decode,
    run_kvforge_step,
    step_num_blocks,
    step_records,
    write_step_json,
)

from kvforge.core.layout import CacheLayout
from kvforge.scheduler import BlockManager
from kvforge.worker import CacheStorage

SW = load_step_workloads()
ROOT = Path(__file__).resolve().parents[2]


GROUP_SETS = {
    "llama": SW.LLAMA_GROUPS,
    "gpt-oss": SW.GPT_OSS_GROUPS,
    "deepseek-v4-tiny": SW.DEEPSEEK_V4_TINY_GROUPS,
}


def _layout_groups(layout: CacheLayout) -> list[tuple[str, str, int, int | None]]:
    return sorted(
        (g.name, "full" if g.kind.value == "full" else "sliding_window", g.block_size, g.window)
        for g in layout.groups
    )


@pytest.mark.parametrize("model", sorted(GROUP_SETS))
def test_layout_has_the_workload_groups(model: str) -> None:
    wl = tiny(GROUP_SETS[model])
    layout = CacheLayout(build_backends(wl))
    expected = sorted((g.name, g.kind, g.block_size, g.window) for g in wl.groups)
    assert _layout_groups(layout) == expected


def test_layout_for_unknown_groups_is_refused() -> None:
    groups = (SW.GroupDef("attn", "full", 16, None, 16 * 4096),)
    wl = tiny(groups, name="odd")
    with pytest.raises(ValueError, match="workload 'odd': no kvforge layout here has groups"):
        build_backends(wl)
    gpt = (
        SW.GroupDef("kv", "full", 16, None, 16 * 2048),
        SW.GroupDef("swa", "sliding_window", 32, 128, 32 * 2048),
    )
    with pytest.raises(ValueError, match="'swa' as a sliding window with block size 16"):
        build_backends(tiny(gpt, name="gpt-odd"))


def test_block_counts_by_hand() -> None:
    wl = tiny(SW.DEEPSEEK_V4_TINY_GROUPS)
    layout = CacheLayout(build_backends(wl))
    # 3 requests, chunk 128, 512 tokens per step; a window group adds the step allowance
    # cdiv(512, B) + 3:
    # swa (block 64, window 128): cdiv(128 + 127, 64) + 1 = 4 + 1 = 5 per request,
    #   allowance 8 + 3 -> 1 + 15 + 11 = 27
    # compressed (full, block 256): cdiv(512, 256) = 2 per request -> 1 + 6 = 7
    # c4_state (block 4, window 8): cdiv(128 + 7, 4) + 1 = 34 + 1 = 35 per request,
    #   allowance 128 + 3 -> 1 + 105 + 131 = 237
    # c128_state (block 8, window 128): cdiv(128 + 127, 8) + 1 = 32 + 1 = 33 per request,
    #   allowance 64 + 3 -> 1 + 99 + 67 = 167
    assert step_num_blocks(wl, layout) == {
        "swa": 27,
        "compressed": 7,
        "c4_state": 237,
        "c128_state": 167,
    }
    whole = tiny(SW.LLAMA_GROUPS, chunk_size=None)
    # llama, full block 16: cdiv(512, 16) = 32 per request -> 1 + 96
    assert step_num_blocks(whole, CacheLayout(build_backends(whole))) == {"kv": 97}


@pytest.mark.parametrize("model", sorted(GROUP_SETS))
@pytest.mark.parametrize("chunk_size", [128, None])
def test_every_step_checks_and_figures_are_complete(model: str, chunk_size: int | None) -> None:
    wl = tiny(GROUP_SETS[model], chunk_size=chunk_size)
    figures = run_kvforge_step(wl, SW.schedule(wl), repeats=1, check="all")
    assert list(figures) == [*STEP_PHASES, "decode_alloc_first"]
    for key, value in figures.items():
        assert isinstance(value, float) and value >= 0.0, key
    assert figures["step"] > 0.0 and figures["free"] > 0.0


def _first_steps(wl, steps: int):
    layout = CacheLayout(build_backends(wl))
    blocks = step_num_blocks(wl, layout)
    manager = BlockManager(layout, blocks, wl.num_requests, wl.max_model_len, share_pools=False)
    storage = CacheStorage(layout)
    storage.create(blocks, wl.num_requests, wl.max_model_len, share_pools=False)
    ids = [f"req-{i}" for i in range(wl.num_requests)]
    out = []
    for step in SW.schedule(wl).steps[:steps]:
        alloc = manager.schedule(
            [ids[i] for i, _ in step.scheduled], [n for _, n in step.scheduled]
        )
        out.append((alloc, storage.apply(alloc)))
    return manager, storage, out


def test_check_counts_every_slot() -> None:
    wl = tiny(SW.DEEPSEEK_V4_TINY_GROUPS)
    manager, storage, steps = _first_steps(wl, 4)
    # (group, ratio) pairs of layers 2 and 3 of deepseek-v4-tiny: swa 1, compressed 4 and
    # 128, c4_state 1, c128_state 1 -> 5 slot mappings per token.
    alloc, inputs = steps[-1]
    assert sorted(inputs.slot_mappings) == [
        ("c128_state", 1),
        ("c4_state", 1),
        ("compressed", 4),
        ("compressed", 128),
        ("swa", 1),
    ]
    # the 4th step is the first decode step: 3 tokens x 5 mappings
    assert check_step_inputs(manager, storage, alloc, inputs) == 15


def test_check_catches_a_wrong_slot_and_a_stale_mirror() -> None:
    wl = tiny(SW.GPT_OSS_GROUPS)
    manager, storage, steps = _first_steps(wl, 1)
    alloc, inputs = steps[0]
    assert check_step_inputs(manager, storage, alloc, inputs) == 3 * 128 * 2
    bad = dict(inputs.slot_mappings)
    wrong = np.array(bad[("kv", 1)])
    wrong[130] += 1  # request req-1, position 2
    bad[("kv", 1)] = wrong
    broken = type(inputs)(inputs.request_index, inputs.positions, bad, inputs.block_tables)
    with pytest.raises(AssertionError, match="group 'kv' ratio 1 request 'req-1': slot mapping"):
        check_step_inputs(manager, storage, alloc, broken)
    short = dict(inputs.slot_mappings)
    short[("swa", 1)] = short[("swa", 1)][:-1]
    broken = type(inputs)(inputs.request_index, inputs.positions, short, inputs.block_tables)
    with pytest.raises(AssertionError, match="group 'swa' ratio 1: 383 slots for 384 scheduled"):
        check_step_inputs(manager, storage, alloc, broken)
    storage.block_table("swa")[0, 0] += 1
    with pytest.raises(AssertionError, match="group 'swa': the worker's table differs"):
        check_step_inputs(manager, storage, alloc, inputs)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"repeats": 0}, ValueError, "repeats must be a positive int, got 0"),
        ({"repeats": True}, ValueError, "repeats must be a positive int, got True"),
        ({"repeats": 1, "check": "every"}, ValueError, "check must be 'none', 'some' or 'all'"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, fragment: str) -> None:
    wl = tiny(SW.LLAMA_GROUPS)
    with pytest.raises(error, match=fragment):
        run_kvforge_step(wl, SW.schedule(wl), **kwargs)
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        run_facade_decode(wl, SW.schedule(wl), repeats=0)


def test_facade_decode_runs() -> None:
    wl = tiny(SW.DEEPSEEK_V4_TINY_GROUPS)
    assert run_facade_decode(wl, SW.schedule(wl), repeats=1) > 0.0


def test_records_and_json(tmp_path: Path) -> None:
    ours = {
        "prefill_alloc": 10.0,
        "decode_alloc": 4.0,
        "kernel_inputs": 1.0,
        "step": 5.0,
        "free": 8.0,
        "decode_alloc_first": 6.0,
    }
    theirs = dict.fromkeys(STEP_PHASES, 20.0)
    records = step_records("w", ours, theirs)
    assert [r.phase for r in records] == list(STEP_PHASES)
    assert records[3] == StepRecord("w", "step", 5.0, 20.0, 0.25)
    alone = step_records("w", ours, None)
    assert alone[0] == StepRecord("w", "prefill_alloc", 10.0, None, None)
    path = tmp_path / "out.json"
    write_step_json(records + alone, str(path))
    data = json.loads(path.read_text())
    assert len(data) == 10
    assert data[0] == {
        "workload": "w",
        "phase": "prefill_alloc",
        "kvforge_us": 10.0,
        "vllm_us": 20.0,
        "ratio": 0.5,
    }
    assert data[5]["vllm_us"] is None and data[5]["ratio"] is None


def test_benchmark_script_kvforge_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    spec = importlib.util.spec_from_file_location(
        "bench_step_script", ROOT / "benchmarks/bench_step.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_step_script"] = module
    spec.loader.exec_module(module)
    path = tmp_path / "step.json"
    rc = module.main(
        ["--repeats", "1", "--workloads", "chunked-prefill", "--no-vllm", "--json", str(path)]
    )
    assert rc == 0
    data = json.loads(path.read_text())
    assert [(d["workload"], d["phase"]) for d in data] == [
        ("chunked-prefill", p) for p in STEP_PHASES
    ]
    for d in data:
        assert set(d) == {"workload", "phase", "kvforge_us", "vllm_us", "ratio"}
        assert d["vllm_us"] is None and d["ratio"] is None and d["kvforge_us"] >= 0
    assert "per-step bookkeeping" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["bench", "--step"], "python benchmarks/bench_step.py --no-vllm"),
        (["bench", "--prefix"], "python benchmarks/bench_prefix.py --no-vllm"),
        (["bench", "--step", "--quick"], "kvforge bench --step is a research harness"),
        (["bench", "--step", "--prefix"], "give one of --step or --prefix, not both"),
    ],
)
def test_cli_names_the_harness_script(
    argv: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # The harnesses compare with vLLM's own code and are not in the wheel: the CLI exits 2
    # with one line naming the script to run from a checkout, and writes nothing.
    from kvforge.cli.main import main

    path = tmp_path / "never.json"
    assert main([*argv, "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
    assert not path.exists()
