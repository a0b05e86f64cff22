"""benchmarks/compare_commits.py without running a benchmark: rows from each harness's JSON,
new/old per round with its spread, the slower flag, and bad input refused before any work."""

from __future__ import annotations

import pytest
from compare_commits import _parse, compare, prefix_rows, resolve, step_rows


def test_rows_from_each_harness():
    step = [{"workload": "llama", "phase": "step", "kvforge_us": 10.0, "vllm_us": None}]
    assert step_rows(step) == {"step llama/step": 10.0}
    cost = {"cost": [{"model": "m", "kvforge_lookup_us": 5.0, "kvforge_hash_us": 2.0}]}
    assert prefix_rows(cost) == {"prefix m/kvforge_lookup_us": 5.0, "prefix m/kvforge_hash_us": 2.0}


def test_compare_gives_each_row_its_ratio_spread_and_flags_only_a_slower_row():
    old = [{"a": 10.0, "b": 10.0, "c": 10.0}] * 3
    new = [
        {"a": 12.0, "b": 9.0, "c": 9.0},
        {"a": 11.0, "b": 12.0, "c": 10.0},
        {"a": 13.0, "b": 10.0},
    ]
    rows = {r["row"]: r for r in compare(old, new, threshold=0.05)}
    assert set(rows) == {"a", "b"}  # "c" is missing from one round: never compared
    assert rows["a"]["ratio_spread"] == [1.1, 1.2, 1.3] and rows["a"]["ratio"] == 1.2
    assert rows["a"]["slower"] is True  # slower than 5% in every round
    assert rows["b"]["ratio_spread"] == [0.9, 1.0, 1.2] and rows["b"]["slower"] is False
    assert (rows["a"]["old_us"], rows["a"]["new_us"]) == (10.0, 12.0)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["HEAD", "--rounds", "2"], "--rounds must be >= 3"),
        (["HEAD", "--threshold", "-0.1"], "--threshold must be >= 0"),
    ],
)
def test_bad_arguments(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2 and fragment in capsys.readouterr().err


def test_an_unknown_commit_is_named():
    with pytest.raises(ValueError, match="commit 'no-such-commit-x' does not resolve"):
        resolve("no-such-commit-x")
