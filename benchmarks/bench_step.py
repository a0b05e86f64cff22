#!/usr/bin/env python
"""Per-step bookkeeping: kvforge against vLLM 0.33, same schedules, same process, same run.

The kvforge side is :mod:`step_sim` (scheduler-side ``BlockManager.schedule``
and worker-side ``CacheStorage.apply`` per step); the vLLM side is :mod:`vllm_baseline`
(``KVCacheManager`` and ``MultiGroupBlockTable`` driven as vLLM's scheduler and V1 runner drive
them). Both run every workload of :mod:`step_workloads` and report the same phases, in
microseconds (medians over ``--repeats`` runs):

``prefill_alloc``, ``decode_alloc``, ``kernel_inputs``, ``step``, ``free``; ``ratio`` is
``kvforge_us / vllm_us`` (below 1: kvforge is faster), null where vLLM is not installed (the
project's ``.venv``). vLLM runs in ``~/.venv-vllm`` (see ``docs/vllm_baseline.md``).

The scaling set is also reported per request (decode ``step`` / requests) with its ratio to
2k context, and through the per-request path (:mod:`per_request`): ``CacheController.allocate``,
``block_table``, ``slot_mapping`` and ``free_request`` called one request at a time against
vLLM's ``KVCacheManager.allocate_slots``, ``get_block_ids`` and ``free`` on the same schedule,
in ``--rounds`` interleaved rounds (JSON phases ``per_request_alloc``, ``_table``, ``_slots``,
``_free`` and ``_total``, each ratio with ``ratio_spread``: min, median, max over the rounds),
and the same calls of kvforge's scheduler side alone, the scope of vLLM's ``KVCacheManager``
(``per_request_scheduler_alloc``, ``_table``, ``_free``, ``_total``).

Usage::

    ~/.venv-vllm/bin/python benchmarks/bench_step.py [--repeats 5] [--workloads a,b]
        [--json PATH] [--rounds 5] [--no-per-request]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from per_request import per_request_rounds, print_per_request
from step_sim import (
    StepRecord,
    print_step_table,
    run_step_bench,
    write_step_json,
)
from step_workloads import SCALING_WORKLOADS, all_workloads, schedule
from vllm_baseline import VLLM_VERSION, run_vllm_step, vllm_available

from kvforge.cli.formatting import console, make_table


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per workload")
    parser.add_argument("--workloads", default=None, help="comma-separated names (default all)")
    parser.add_argument("--json", default=None, help="write the records to this JSON file")
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds of the per-request path (>= 3)"
    )
    parser.add_argument(
        "--no-per-request",
        "--no-facade",
        dest="no_per_request",
        action="store_true",
        help="skip the per-request path (--no-facade: its former name)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="kvforge side only")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3 (each ratio comes with its spread), got {args.rounds}")
    args.chosen = list(all_workloads())
    if args.workloads:
        wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
        known = {w.name for w in args.chosen}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            parser.error(f"--workloads: unknown {unknown}; known: {sorted(known)}")
        args.chosen = [w for w in args.chosen if w.name in wanted]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    workloads = args.chosen
    with_vllm = not args.no_vllm and vllm_available()
    out = console()
    out.print(
        f"python {platform.python_version()}, cpus {os.cpu_count()}, load "
        f"{os.getloadavg()[0]:.2f}, vLLM "
        f"{VLLM_VERSION if with_vllm else 'absent (kvforge side only)'}, repeats {args.repeats}"
    )
    say = lambda name: out.print(f"  {name} ...", highlight=False)  # noqa: E731
    records, ours, theirs = run_step_bench(
        workloads, schedule, args.repeats, run_vllm_step if with_vllm else None, progress=say
    )
    print_step_table(records, "per-step bookkeeping, microseconds (ratio = kvforge / vLLM)", out)
    scaling = [w for w in workloads if w in SCALING_WORKLOADS]
    rows: list = list(records)
    alloc: dict[str, float] = {}
    if scaling and not args.no_per_request:
        per_request = per_request_rounds(scaling, schedule, args.rounds, with_vllm, say)
        print_per_request(per_request, out)
        rows += per_request
        alloc = {r.workload: r.kvforge_us for r in per_request if r.phase == "per_request_alloc"}
    if scaling:
        _print_scaling(scaling, ours, theirs, alloc, out)
    if args.json:
        write_step_json(rows, args.json)
        out.print(f"wrote {len(rows)} records to {args.json}")
    return 0


def _print_scaling(
    scaling: list,
    ours: dict[str, dict[str, float]],
    theirs: dict[str, dict[str, float]],
    facade: dict[str, float],
    out: object,
) -> None:
    table = make_table(
        "decode step per request against context (ratio to the first context shown)",
        ("workload", "kvforge us/req", "x first", "vLLM us/req", "x first", "allocate us/req"),
        ("workload",),
    )
    base_ours = base_theirs = None
    for wl in scaling:
        per_req = ours[wl.name]["step"] / wl.num_requests
        base_ours = base_ours or per_req
        cells = [wl.name, f"{per_req:.2f}", f"{per_req / base_ours:.2f}"]
        if wl.name in theirs:
            theirs_req = theirs[wl.name]["step"] / wl.num_requests
            base_theirs = base_theirs or theirs_req
            cells += [f"{theirs_req:.2f}", f"{theirs_req / base_theirs:.2f}"]
        else:
            cells += ["n/a", "n/a"]
        cells.append(f"{facade[wl.name]:.2f}" if wl.name in facade else "n/a")
        table.add_row(*cells)
    out.print(table)  # type: ignore[attr-defined]


__all__ = ["StepRecord", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
