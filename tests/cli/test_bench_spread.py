"""`kvforge bench` never reports a ratio from one sample: every ratio comes with its spread
(min / median / max over interleaved rounds) in the JSON and the table, and fewer than three
repeats are refused before any work. Timings are never asserted, only their shape."""

from __future__ import annotations

import json

import pytest

from kvforge.cli import bench, bench_tiers, timing
from kvforge.cli.main import main
from kvforge.cli.timing import MIN_REPEATS, Spread, ratio_spread, samples
from kvforge.platform import get_platform


def tiny_case() -> bench.BenchCase:
    return bench.BenchCase(
        "tiny", {i: bench._SynthBackend(1_168) for i in range(2)}, "kv", 32 * 2 * 1_168
    )


def test_ratio_spread_pairs_run_k_of_each_side():
    # throughput ratios baseline[k] / ours[k]: 2.0, 1.0, 0.5
    assert ratio_spread([1.0, 2.0, 4.0], [2.0, 2.0, 2.0]) == Spread(0.5, 1.0, 2.0)
    assert ratio_spread([1.0, 1.0, 1.0, 1.0], [3.0, 1.0, 2.0, 4.0]).as_list() == [1.0, 2.5, 4.0]
    assert Spread(1.0, 2.0, 3.0).text(".1f", "x") == "2.0x (1.0-3.0)"
    assert Spread.of([0.123456, 0.2, 0.3], digits=2) == Spread(0.12, 0.2, 0.3)


@pytest.mark.parametrize(
    ("call", "exc", "fragment"),
    [
        (lambda: ratio_spread([1.0, 2.0], [1.0, 2.0]), ValueError, "at least 3 runs of each side"),
        (lambda: ratio_spread([], []), ValueError, "got 0"),
        (lambda: ratio_spread([1.0, 2.0, 3.0], [1.0, 2.0]), ValueError, "got 3 and 2"),
        (lambda: Spread.of([]), ValueError, "at least one value"),
    ],
)
def test_spread_bad_input(call, exc, fragment):
    with pytest.raises(exc, match=fragment):
        call()


def test_samples_are_every_run_in_order_each_after_the_flush():
    platform = get_platform("cpu")
    events: list[str] = []
    out = samples(platform, lambda: events.append("run"), 4, lambda: events.append("flush"))
    assert len(out) == 4 and all(t >= 0 for t in out)
    assert events == ["flush", "run"] * 4
    assert timing.timed(platform, lambda: None, 3) >= 0


def test_bench_results_carry_a_spread_beside_every_ratio(tmp_path, capsys):
    results = bench.run_bench(cases=[tiny_case()], repeats=4, progress=False, device="cpu")
    for r in results:
        for ratio, spread in (
            (r.ratio_vs_memcpy, r.ratio_vs_memcpy_spread),
            (r.ratio_vs_loop, r.ratio_vs_loop_spread),
        ):
            low, median, high = spread
            assert 0 < low <= median == ratio <= high
        assert len(r.seconds_spread) == 3 and r.seconds_spread[0] == round(r.seconds, 6)
        assert r.seconds_spread[0] <= r.seconds_spread[1] <= r.seconds_spread[2]
    path = tmp_path / "bench.json"
    bench.write_json(results, str(path))
    rows = json.loads(path.read_text())
    assert {"ratio_vs_memcpy_spread", "ratio_vs_loop_spread", "seconds_spread"} <= set(rows[0])
    bench.print_results(results)
    out = capsys.readouterr().out
    first = results[0]
    assert Spread(*first.ratio_vs_loop_spread).text(".1f", "x") in out
    assert "median (min-max) over interleaved rounds" in " ".join(out.split())


@pytest.mark.parametrize(
    ("repeats", "fragment"),
    [
        (1, "got 1"),
        (2, "got 2"),
        (0, "got 0"),
        (-3, "got -3"),
        (True, "got True"),
        (3.5, "got 3.5"),
    ],
)
def test_run_bench_refuses_fewer_than_three_repeats(repeats, fragment, monkeypatch):
    measured: list[object] = []
    monkeypatch.setattr(bench, "_measure_case", lambda *a: measured.append(a) or [])
    with pytest.raises(ValueError, match=f"repeats must be an int >= {MIN_REPEATS}.*{fragment}"):
        bench.run_bench(cases=[tiny_case()], repeats=repeats, progress=False, device="cpu")
    assert measured == []  # refused before any case was set up


@pytest.mark.parametrize("repeats", [1, 2, True])
def test_run_tiers_refuses_fewer_than_three_repeats(repeats, monkeypatch):
    started: list[object] = []
    monkeypatch.setattr(bench_tiers, "servers", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match=f"repeats must be an int >= {MIN_REPEATS}"):
        bench_tiers.run_tiers([], remotes=(), repeats=repeats, progress=False, device="cpu")
    assert started == []  # no server started


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--repeats", "1"], "--repeats must be at least 3"),
        (["--repeats", "2", "--quick"], "got 2"),
        (["--tiers", "--remote", "none", "--repeats", "2"], "--repeats must be at least 3"),
    ],
)
def test_bench_command_refuses_fewer_than_three_repeats(
    argv, fragment, tmp_path, capsys, monkeypatch
):
    measured: list[object] = []
    monkeypatch.setattr(bench, "_measure_case", lambda *a: measured.append(a) or [])
    path = tmp_path / "out.json"
    code = main(["bench", "--no-progress", "--json", str(path), *argv])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not path.exists() and measured == []  # nothing measured, nothing written
