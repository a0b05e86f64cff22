#!/usr/bin/env python
"""Two commits' step and prefix benchmarks, same machine, same run: each row's ratio new/old.

Each commit's tree is exported (``git archive``, into a temporary directory: the checkout, its
index and its worktree list are never touched) and each benchmark runs there as a fresh process
with ``PYTHONPATH`` set to that tree, so the kvforge it imports is that commit's. ``--rounds``
rounds run interleaved (old step, new step, old prefix, new prefix, then the next round), so a
change of machine load hits both commits alike. Per row (a step record ``workload/phase`` or a
prefix cost figure ``model/kvforge_lookup_us`` and ``model/kvforge_hash_us``; kvforge side only)
the figure of each round is compared: ``ratio = new / old`` (above 1: the new commit is slower)
as the median of the per-round ratios with its spread (min, median, max over the rounds), and
``slower`` flags a row whose least per-round ratio is above ``1 + --threshold`` (slower in every
round by more than the threshold).

Usage::

    python benchmarks/compare_commits.py OLD [NEW] [--rounds 3] [--json PATH]
        [--step-args "--repeats 5"] [--prefix-args "--cost-only --repeats 100"] [--only step]

``NEW`` defaults to ``HEAD``. The defaults measure every workload of ``bench_step.py`` (without
its per-request section) and the prefix cost of every model; a smoke run on a tiny size::

    python benchmarks/compare_commits.py HEAD~1 --rounds 3 \\
        --step-args "--repeats 1 --workloads chunked-prefill --no-facade" \\
        --prefix-args "--cost-only --repeats 5 --models llama-3-8b"

Invariants: a commit that does not resolve, or a benchmark that exits non-zero, stops the run
with the command and its output's tail (nothing is compared from a partial run); the temporary
trees are removed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: ``--no-facade``: the name both old and new ``bench_step.py`` know for skipping the
#: per-request section (``--no-per-request`` today)
STEP_DEFAULT = "--repeats 5 --no-facade"
PREFIX_DEFAULT = "--cost-only --repeats 100"


def resolve(commit: str) -> str:
    """The full sha of ``commit`` (``ValueError`` naming it when git does not know it)."""
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ValueError(f"commit {commit!r} does not resolve in {ROOT}")
    return done.stdout.strip()


def export(sha: str, into: Path) -> Path:
    """``sha``'s tree, extracted under ``into/<sha[:12]>``."""
    tree = into / sha[:12]
    tree.mkdir()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {sha} failed")
    return tree


def run_bench(tree: Path, script: str, args: str, out: Path) -> Any:
    """Run ``benchmarks/<script>`` of ``tree`` with ``args`` and ``--json out``; its JSON."""
    cmd = [sys.executable, f"benchmarks/{script}", *shlex.split(args), "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} in {tree} exited {done.returncode}:\n{tail}")
    return json.loads(out.read_text())


def step_rows(data: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``workload/phase`` -> kvforge microseconds, from ``bench_step.py --json``."""
    return {f"step {d['workload']}/{d['phase']}": float(d["kvforge_us"]) for d in data}


def prefix_rows(data: dict[str, Any]) -> dict[str, float]:
    """``model/figure`` -> microseconds of kvforge's prefix cost, from ``bench_prefix.py``."""
    rows = {}
    for c in data["cost"]:
        for key in ("kvforge_lookup_us", "kvforge_hash_us"):
            rows[f"prefix {c['model']}/{key}"] = float(c[key])
    return rows


def compare(
    old: list[dict[str, float]], new: list[dict[str, float]], threshold: float
) -> list[dict[str, Any]]:
    """Per row present in every round of both: the figures, ``new / old`` per round, and the
    ratio's median and spread; ``slower`` when every round's ratio exceeds ``1 + threshold``."""
    rows = []
    keys = [k for k in old[0] if all(k in r for r in (*old, *new))]
    for key in keys:
        ratios = [n[key] / o[key] for o, n in zip(old, new, strict=True) if o[key] > 0]
        if not ratios:
            continue
        low, median, high = min(ratios), statistics.median(ratios), max(ratios)
        spread = [round(low, 4), round(median, 4), round(high, 4)]
        rows.append(
            {
                "row": key,
                "old_us": round(statistics.median(o[key] for o in old), 3),
                "new_us": round(statistics.median(n[key] for n in new), 3),
                "ratio": spread[1],
                "ratio_spread": spread,
                "slower": spread[0] > 1 + threshold,
            }
        )
    return rows


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the commit compared against")
    parser.add_argument("new", nargs="?", default="HEAD", help="the commit measured (HEAD)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--step-args", default=STEP_DEFAULT, help="bench_step.py's arguments")
    parser.add_argument("--prefix-args", default=PREFIX_DEFAULT, help="bench_prefix.py's")
    parser.add_argument("--only", choices=["step", "prefix"], default=None)
    parser.add_argument("--threshold", type=float, default=0.05, help="slower beyond (0.05)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3 (each ratio has a spread), got {args.rounds}")
    if args.threshold < 0:
        parser.error(f"--threshold must be >= 0, got {args.threshold}")
    return args


def _rounds(args: argparse.Namespace, trees: dict[str, Path], tmp: Path) -> dict[str, list]:
    """Each commit's rows per round, the benchmarks of the two commits interleaved."""
    benches = [("step", "bench_step.py", args.step_args, step_rows)]
    benches += [("prefix", "bench_prefix.py", args.prefix_args, prefix_rows)]
    benches = [b for b in benches if args.only in (None, b[0])]
    figures: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for k in range(args.rounds):
        for side in ("old", "new"):
            figures[side].append({})
        for name, script, bench_args, rows in benches:
            for side in ("old", "new"):
                print(f"round {k + 1}/{args.rounds}: {name} of {side} ...", flush=True)
                out = tmp / f"{side}-{name}-{k}.json"
                figures[side][k] |= rows(run_bench(trees[side], script, bench_args, out))
    return figures


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    shas = {"old": resolve(args.old), "new": resolve(args.new)}
    with tempfile.TemporaryDirectory(prefix="kvforge-compare-") as tmp_dir:
        tmp = Path(tmp_dir)
        old_tree = export(shas["old"], tmp)
        same = shas["new"] == shas["old"]
        trees = {"old": old_tree, "new": old_tree if same else export(shas["new"], tmp)}
        figures = _rounds(args, trees, tmp)
    rows = compare(figures["old"], figures["new"], args.threshold)
    print(
        f"new {shas['new'][:12]} / old {shas['old'][:12]}, {args.rounds} interleaved rounds, "
        f"load {os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}"
    )
    print(f"{'row':<52} {'old us':>10} {'new us':>10}  ratio (min-max)")
    for r in rows:
        low, median, high = r["ratio_spread"]
        flag = "  SLOWER" if r["slower"] else ""
        print(
            f"{r['row']:<52} {r['old_us']:>10.2f} {r['new_us']:>10.2f}  "
            f"{median:.3f} ({low:.3f}-{high:.3f}){flag}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"commits": shas, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
