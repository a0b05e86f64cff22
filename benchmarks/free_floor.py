"""The least a free through numpy tables costs, against vLLM's ``KVCacheManager.free``.

kvforge keeps a request's blocks in numpy tables, one row per request and group, and each pool's
reference counts and free stack in numpy arrays: the batched step reads them as arrays. A free
of one request must, per group, read its row's cells, drop each block's reference, push the
freed blocks on the pool's free stack and empty the row. :func:`bare_free` does exactly those
reads and stores, on plain numpy arrays of the shapes and contents kvforge's scheduler side
holds (copied through its public ``block_table``, ``num_tokens`` and ``num_free_blocks``), and
nothing else: no check, no all-or-nothing, no delta for the worker.

Each round, on the same schedule (``step_workloads.schedule``), times per request: the bare
free, ``BlockManager.finish`` (:func:`per_request.scheduler_per_request`) and vLLM's ``free``
(:func:`per_request.vllm_per_request`), in that order, after one checked warm-up run of each.
A ratio is the median of the per-round ratios, with its spread (min, median, max).

Invariants: after the bare frees every row is empty, every reference count 0 and every pool's
free count back to what it was before the schedule ran; a run that missed a store raises
``AssertionError`` (``tests/benchmarks/test_free_floor.py``), so the floor is never cheaper than
the work.

Usage::

    python benchmarks/free_floor.py [--workloads scaling-2k] [--rounds 9] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from per_request import (
    PerRequestRecord,
    print_per_request,
    ratio_record,
    scheduler_per_request,
    vllm_per_request,
    workload_controller,
)
from step_sim import ScheduleLike, WorkloadLike
from step_workloads import all_workloads, schedule
from vllm_baseline import vllm_available

from kvforge.cli.formatting import console
from kvforge.controller import CacheController

__all__ = [
    "BareTables",
    "bare_free",
    "bare_tables",
    "floor_free_times",
    "floor_rounds",
    "main",
    "scheduled",
]


@dataclass
class BareTables:
    """One group's state as plain arrays: ``table`` ``int32 [requests, width]`` (0: no block),
    ``held_from`` ``int64 [requests]`` (first held column; ``None`` in a group without a
    window, where it is always 0), ``ref`` ``int32 [num_blocks]``, ``stack`` ``int32
    [num_blocks]`` with ``num_free`` ids on it, the group's ``block_size``, and ``shared``:
    whether a block has more than one holder (else a release stores 0, as kvforge's
    ``BlockPool.release_few`` does for an unshared pool)."""

    table: np.ndarray
    held_from: np.ndarray | None
    ref: np.ndarray
    stack: np.ndarray
    num_free: int
    block_size: int
    shared: bool


def bare_tables(ctl: CacheController, ids: Sequence[str]) -> tuple[list[BareTables], np.ndarray]:
    """The scheduler side's tables, counts and free counts of ``ids`` as plain arrays, read
    through ``ctl.scheduler``'s public calls; and ``int64 [requests]`` tokens per request."""
    manager = ctl.scheduler
    tokens = np.array([manager.num_tokens(r) for r in ids], dtype=np.int64)
    out = []
    for g in ctl.layout.groups:
        rows = [manager.block_table(r, g.name) for r in ids]
        width = max(1, *(len(row) for row in rows))
        table = np.zeros((len(ids), width), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        windowed = g.window is not None
        held_from = None
        if windowed:
            held_from = np.array([next((c for c, b in enumerate(r) if b), 0) for r in rows])
        num_blocks = manager.num_usable_blocks(g.name) + 1  # the null block is never free
        ref = np.zeros(num_blocks, dtype=np.int32)
        held = table[table != 0]
        np.add.at(ref, held, 1)
        free = manager.num_free_blocks(g.name)
        stack = np.zeros(num_blocks, dtype=np.int32)
        shared = bool(ref.max() > 1)
        out.append(BareTables(table, held_from, ref, stack, free, g.block_size, shared))
    return out, tokens


def bare_free(groups: list[BareTables], tokens: np.ndarray, i: int) -> None:
    """Free request ``i``: per group its row's cells read, each block's reference dropped, the
    blocks at none pushed on the free stack, the row emptied; its tokens zeroed."""
    n = int(tokens[i])
    for g in groups:
        first = 0 if g.held_from is None else int(g.held_from[i])
        end = -(-n // g.block_size)
        held = [b for b in g.table[i, first:end].tolist() if b]
        ref, freed = g.ref, held
        if g.shared:
            for b in held:
                ref[b] -= 1
            freed = [b for b in held if not ref[b]]
        else:  # each block's one holder lets go
            for b in held:
                ref[b] = 0
        top = g.num_free
        g.stack[top : top + len(freed)] = freed[::-1]
        g.num_free = top + len(freed)
        g.table[i, first:end] = 0
        if g.held_from is not None:
            g.held_from[i] = 0
    tokens[i] = 0


def scheduled(wl: WorkloadLike, sched: ScheduleLike) -> tuple[CacheController, list[str]]:
    """A controller whose scheduler side ran every step of ``sched`` (the worker never told,
    as :func:`per_request.scheduler_per_request`), its requests still holding their blocks."""
    ctl = workload_controller(wl)
    manager = ctl.scheduler
    ids = [f"req-{i}" for i in range(wl.num_requests)]
    for step in sched.steps:
        for i, n in step.scheduled:
            manager.end_step(manager.schedule([ids[i]], [n]))
    return ctl, ids


def floor_free_times(wl: WorkloadLike, sched: ScheduleLike) -> list[int]:
    """Nanoseconds of :func:`bare_free` per finished request of ``sched``, checked whole."""
    ctl, ids = scheduled(wl, sched)
    groups, tokens = bare_tables(ctl, ids)
    free_before = [ctl.scheduler.num_usable_blocks(g.name) for g in ctl.layout.groups]
    ctl.free()
    clock, times = time.perf_counter_ns, []
    gc.collect()
    gc.disable()
    try:
        for i in sched.finished:
            t0 = clock()
            bare_free(groups, tokens, i)
            times.append(clock() - t0)
    finally:
        gc.enable()
    left = [g.num_free for g in groups]
    if left != free_before or any(g.table.any() or g.ref.any() for g in groups) or tokens.any():
        raise AssertionError(f"{wl.name}: the bare free left blocks held: free {left}")
    return times


def floor_rounds(
    workloads: Sequence[WorkloadLike], rounds: int = 9, with_vllm: bool = True
) -> list[PerRequestRecord]:
    """Per workload, ``rounds`` interleaved rounds of the bare free, ``BlockManager.finish``
    and vLLM's ``free``: records ``free_floor`` and ``free_finish``, each with its ratio to
    vLLM's ``free`` and spread.

    Raises:
        ValueError: ``rounds`` not an int of at least 3.
    """
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 3:
        raise ValueError(
            f"rounds must be an int >= 3 (each ratio comes with its spread), got {rounds!r}"
        )
    records: list[PerRequestRecord] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for wl in workloads:
            sched = schedule(wl)
            floor_free_times(wl, sched)
            scheduler_per_request(wl, sched, check=True)
            if with_vllm:
                vllm_per_request(wl, sched, check=True)
            runs: dict[str, list[float]] = {"floor": [], "finish": [], "vllm": []}
            for _ in range(rounds):
                runs["floor"].append(statistics.mean(floor_free_times(wl, sched)) / 1000)
                runs["finish"].append(statistics.mean(scheduler_per_request(wl, sched).free) / 1000)
                if with_vllm:
                    runs["vllm"].append(statistics.mean(vllm_per_request(wl, sched).free) / 1000)
            records += [
                ratio_record(wl.name, f"free_{side}", runs[side], runs["vllm"] or None)
                for side in ("floor", "finish")
            ]
    finally:
        torch.set_num_threads(threads)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="scaling-2k", help="comma-separated names")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (>= 3)")
    parser.add_argument("--json", default=None, help="write the records to this JSON file")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3 (each ratio comes with its spread), got {args.rounds}")
    known = {w.name: w for w in all_workloads()}
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in known]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; known: {sorted(known)}")
    with_vllm = vllm_available()
    out = console()
    out.print(
        f"python {platform.python_version()}, cpus {os.cpu_count()}, load "
        f"{os.getloadavg()[0]:.2f}, vLLM {'installed' if with_vllm else 'absent'}"
    )
    records = floor_rounds([known[w] for w in wanted], args.rounds, with_vllm)
    print_per_request(records, out, "a request's free", prefix="free_")
    if args.json:
        from step_sim import write_step_json

        write_step_json(records, args.json)
        out.print(f"wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":  # pragma: no cover - the command line
    sys.exit(main())
