"""The per-request path benchmark (``benchmarks/per_request.py``) on tiny workloads: every call
is timed on both sides, the kvforge side's slots agree with its block tables, every ratio comes
with its spread over at least three interleaved rounds, and bad rounds are refused. No timing is
asserted: figures are only checked to be positive and ordered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _step_workloads import tiny
from per_request import (
    CALLS,
    FACADE_ONLY_CALLS,
    SCHEDULER_CALLS,
    facade_only,
    kvforge_per_request,
    per_request_rounds,
    print_per_request,
    vllm_per_request,
)
from step_sim import load_step_workloads, write_step_json
from vllm_baseline import vllm_available

from kvforge.cli.formatting import console

SW = load_step_workloads()
HAVE_VLLM = vllm_available()


@pytest.mark.parametrize("groups", [SW.LLAMA_GROUPS, SW.GPT_OSS_GROUPS, SW.DEEPSEEK_V4_TINY_GROUPS])
def test_kvforge_side_times_every_call_and_checks_slots(groups) -> None:
    wl = tiny(groups)
    times = kvforge_per_request(wl, SW.schedule(wl), check=True)
    # 5 decode steps of 3 requests; one free per request
    assert len(times.alloc) == len(times.table) == len(times.slots) == 15
    assert len(times.free) == 3
    means = times.means_us()
    assert set(means) == set(CALLS)
    assert means["total"] == pytest.approx(means["alloc"] + means["table"] + means["slots"])


@pytest.mark.parametrize("groups", [SW.LLAMA_GROUPS, SW.GPT_OSS_GROUPS, SW.DEEPSEEK_V4_TINY_GROUPS])
def test_scheduler_side_times_alloc_table_and_free_and_leaves_every_pool_whole(
    groups, monkeypatch
) -> None:
    from kvforge.controller import CacheController
    from kvforge.scheduler import BlockManager
    from kvforge.worker import CacheStorage

    calls: list[str] = []
    for cls, name in [
        (BlockManager, "schedule"),
        (BlockManager, "end_step"),
        (BlockManager, "finish"),
        (CacheStorage, "run"),
        (CacheStorage, "apply"),
        (CacheController, "allocate"),
        (CacheController, "free_request"),
    ]:
        real = getattr(cls, name)
        monkeypatch.setattr(
            cls, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1]
        )
    wl = tiny(groups)
    times = kvforge_per_request(wl, SW.schedule(wl), check=True, side="scheduler")
    # the scheduler side alone: every step ended, the worker never told, no facade call
    assert calls.count("schedule") == calls.count("end_step") > 15
    assert calls.count("finish") == 3
    assert not {"run", "apply", "allocate", "free_request"} & set(calls)
    # the scheduler side has no slot mapping (the worker's, as in vLLM)
    assert len(times.alloc) == len(times.table) == 15 and times.slots == []
    assert len(times.free) == 3
    means = times.means_us()
    assert means["total"] == pytest.approx(means["alloc"] + means["table"])


def test_an_unknown_side_is_refused() -> None:
    wl = tiny(SW.LLAMA_GROUPS)
    with pytest.raises(
        ValueError, match=r"side must be one of \('facade', 'scheduler'\), got 'worker'"
    ):
        kvforge_per_request(wl, SW.schedule(wl), side="worker")


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_vllm_side_times_alloc_table_and_free() -> None:
    wl = tiny(SW.DEEPSEEK_V4_TINY_GROUPS)
    times = vllm_per_request(wl, SW.schedule(wl), check=True)
    assert len(times.alloc) == len(times.table) == 15 and times.slots == []
    assert len(times.free) == 3


def test_rounds_report_each_ratio_with_its_spread(tmp_path: Path, capsys) -> None:
    wl = tiny(SW.LLAMA_GROUPS)
    records = per_request_rounds([wl], SW.schedule, rounds=3, with_vllm=HAVE_VLLM)
    assert [r.phase for r in records] == [
        *(f"per_request_{c}" for c in CALLS),
        *(f"per_request_scheduler_{c}" for c in SCHEDULER_CALLS),
        *(f"per_request_facade_only_{c}" for c in FACADE_ONLY_CALLS),
    ]
    by_phase = {r.phase: r for r in records}
    for r in records:
        if "facade_only" in r.phase:  # a difference of two sides: noise may take it below 0
            call = r.phase.rsplit("_", 1)[1]
            assert r.vllm_us == by_phase[f"per_request_{call}"].vllm_us and r.rounds == 3
            low, median, high = r.kvforge_spread
            assert low <= median == pytest.approx(r.kvforge_us, abs=1e-3) and median <= high
            continue
        assert r.rounds == 3 and r.kvforge_us > 0
        low, median, high = r.kvforge_spread
        assert low <= median <= high and median == pytest.approx(r.kvforge_us, abs=1e-3)
        if HAVE_VLLM and r.phase != "per_request_slots":
            low, median, high = r.ratio_spread
            assert 0 < low <= median == r.ratio <= high and r.vllm_us > 0
        else:  # vLLM has no per-request slot mapping: no ratio, never a made-up one
            assert r.ratio is None and r.ratio_spread is None and r.vllm_us is None
    path = tmp_path / "per_request.json"
    write_step_json(records, str(path))
    data = json.loads(path.read_text())
    assert {"ratio_spread", "kvforge_spread", "rounds"} <= set(data[0])
    print_per_request(records, console())
    assert "median (min-max) over the rounds" in " ".join(capsys.readouterr().out.split())


def test_facade_only_is_the_facade_less_its_scheduler_side_round_by_round() -> None:
    facade = [{"alloc": 51.0, "free": 72.0}, {"alloc": 40.0, "free": 60.0}]
    scheduler = [{"alloc": 26.0, "free": 34.0}, {"alloc": 41.0, "free": 30.0}]
    assert facade_only(facade, scheduler, "alloc") == [25.0, -1.0]  # noise kept as measured
    assert facade_only(facade, scheduler, "free") == [38.0, 30.0]
    with pytest.raises(ValueError):  # rounds of both sides pair up one to one
        facade_only(facade, scheduler[:1], "free")


@pytest.mark.parametrize(
    ("rounds", "fragment"),
    [(2, "rounds must be >= 3"), (0, "rounds must be a positive int, got 0"), (True, "got True")],
)
def test_bad_rounds(rounds, fragment) -> None:
    calls: list[str] = []
    with pytest.raises(ValueError, match=fragment):
        per_request_rounds(
            [tiny(SW.LLAMA_GROUPS)], SW.schedule, rounds=rounds, progress=calls.append
        )
    assert calls == []  # refused before any run
