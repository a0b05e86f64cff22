"""The least a free through numpy tables costs, against vLLM's ``KVCacheManager.free``.

kvforge keeps a request's blocks in numpy tables, one row per request and group, and each pool's
reference counts and free stack in numpy arrays: the batched step reads them as arrays. A free
of one request must forget the request and, per group, read its row's cells, drop each block's
reference, push the freed blocks on the pool's free stack and empty the row, then zero the
row's counts and put the row back. :func:`bare_free` does those reads and stores, on plain
arrays holding what kvforge's scheduler side holds (read through its public ``block_table``,
``num_tokens``, ``pool(...).ref_counts`` and ``num_free_blocks``), and nothing else: no check,
no all-or-nothing. With ``deltas``, it also builds the one thing a free must hand the worker:
a cleared-row ``TableDelta`` per group, as kvforge builds them
(``kvforge.core.values.cleared_row_deltas`` of the row's ``frozen_rows``, built once).

Each round, on the same schedule (``step_workloads.schedule``), times per request: the bare
free, the bare free with its deltas, ``BlockManager.finish``
(:func:`per_request.scheduler_per_request`) and vLLM's ``free``
(:func:`per_request.vllm_per_request`), in that order, after one checked warm-up run of each.
Each run collects garbage once, before its schedule, and not again until its frees were
timed. A ratio is the median of the per-round ratios, with its spread (min, median, max).

Invariants: after the bare frees every row is empty and back on the free rows, every
``held_from`` and count 0, every block exactly once on its free stack and every request
forgotten; a run that skipped a store raises ``AssertionError``
(``tests/benchmarks/test_free_floor.py`` breaks each store in turn). The floor covers unshared
pools (prefix caching off), the setting of the per-request benchmark; a shared block is
refused.

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
from kvforge.core.values import cleared_row_deltas, frozen_rows

__all__ = [
    "KVFORGE_FREES",
    "BareRequests",
    "BareTables",
    "bare_free",
    "bare_tables",
    "floor_free_times",
    "floor_rounds",
    "free_times",
    "main",
    "run_schedule",
    "scheduled",
]


@dataclass
class BareTables:
    """One group's state as plain arrays: ``table`` ``int32 [rows, width]`` (0: no block),
    ``held_from`` ``int64 [rows]`` (first held column; ``None`` in a group without a window,
    where it is always 0), ``ref`` ``int32 [num_blocks]`` (every block one holder at most),
    ``stack`` ``int32 [num_blocks]`` with ``num_free`` free ids on it, and the group's
    ``block_size``."""

    table: np.ndarray
    held_from: np.ndarray | None
    ref: np.ndarray
    stack: np.ndarray
    num_free: int
    block_size: int


@dataclass
class BareRequests:
    """What a free reads and stores beside the groups' arrays: ``row_of`` (request id ->
    row), ``tokens`` ``int64 [rows]``, ``committed`` ``int64 [groups, rows]`` (blocks a row
    registered, 0 here: prefix caching is off) and ``free_rows``."""

    row_of: dict[str, int]
    tokens: np.ndarray
    committed: np.ndarray
    free_rows: list[int]


def bare_tables(ctl: CacheController, ids: Sequence[str]) -> tuple[list[BareTables], BareRequests]:
    """The scheduler side's tables, counts and free counts of ``ids`` (row ``i`` for
    ``ids[i]``) as plain arrays, read through ``ctl.scheduler``'s public calls.

    Raises:
        ValueError: no ids, or a block held twice (a shared pool: the bare free drops one
            holder per block, as ``BlockPool.release_few`` does for an unshared pool).
    """
    if not ids:
        raise ValueError("ids must name at least one request holding blocks, got none")
    manager = ctl.scheduler
    out = []
    for g in ctl.layout.groups:
        rows = [manager.block_table(r, g.name) for r in ids]
        table = np.zeros((len(ids), max(len(row) for row in rows) or 1), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        held_from = None
        if g.window is not None:  # released cells are null: the first held one
            held_from = np.array([next((c for c, b in enumerate(r) if b), 0) for r in rows])
        ref = np.array(manager.pool(g.name).ref_counts)
        if ref.max() > 1:
            raise ValueError(f"group {g.name!r} shares a block: the bare free has no shared pool")
        free_ids = np.flatnonzero(ref == 0)[1:].astype(np.int32)  # the null block is never free
        stack = np.zeros(len(ref), dtype=np.int32)
        stack[: len(free_ids)] = free_ids
        if len(free_ids) != manager.num_free_blocks(g.name):
            raise AssertionError(f"group {g.name!r}: the free ids are not its free count")
        out.append(BareTables(table, held_from, ref, stack, len(free_ids), g.block_size))
    tokens = np.array([manager.num_tokens(r) for r in ids], dtype=np.int64)
    committed = np.zeros((len(out), len(ids)), dtype=np.int64)
    return out, BareRequests({r: i for i, r in enumerate(ids)}, tokens, committed, [])


def bare_free(groups: list[BareTables], requests: BareRequests, request_id: str) -> None:
    """Free ``request_id``: its row forgotten; per group the row's cells read, each block's
    one reference dropped, the blocks pushed on the free stack, the row emptied; its tokens
    and registered blocks zeroed; the row put back."""
    row = requests.row_of.pop(request_id)
    n = int(requests.tokens[row])
    for g in groups:
        first = 0 if g.held_from is None else int(g.held_from[row])
        end = -(-n // g.block_size)
        held = [b for b in g.table[row, first:end].tolist() if b]
        ref = g.ref
        for b in held:
            ref[b] = 0
        top = g.num_free
        g.stack[top : top + len(held)] = held[::-1]
        g.num_free = top + len(held)
        g.table[row, first:end] = 0
        if g.held_from is not None:
            g.held_from[row] = 0
    requests.tokens[row] = 0
    requests.committed[:, row] = 0
    requests.free_rows.append(row)


def scheduled(wl: WorkloadLike, sched: ScheduleLike) -> tuple[CacheController, list[str]]:
    """A controller of ``wl`` (:func:`per_request.workload_controller`) that ran ``sched``
    (:func:`run_schedule`)."""
    ctl = workload_controller(wl)
    return ctl, run_schedule(ctl, wl, sched)


def run_schedule(ctl: CacheController, wl: WorkloadLike, sched: ScheduleLike) -> list[str]:
    """Run every step of ``sched`` through ``ctl``'s scheduler side alone (the worker never
    told, as :func:`per_request.scheduler_per_request`); the request ids, each still holding
    its blocks.

    Raises:
        RuntimeError: a step was refused (the snapshot would miss blocks).
    """
    manager = ctl.scheduler
    ids = [f"req-{i}" for i in range(wl.num_requests)]
    for step in sched.steps:
        for i, n in step.scheduled:
            allocation = manager.schedule([ids[i]], [n])
            manager.end_step(allocation)
            if allocation.refused:
                raise RuntimeError(f"kvforge refused {n} tokens for {ids[i]}: {allocation.refused}")
    return ids


def floor_free_times(wl: WorkloadLike, sched: ScheduleLike, deltas: bool = False) -> list[int]:
    """Nanoseconds of :func:`bare_free` per finished request of ``sched`` (``deltas``: and
    its cleared-row deltas), checked whole. As on the other sides, the collector runs
    once, after the controller is built and before the schedule, and not again until the
    frees were timed."""
    ctl = workload_controller(wl)
    gc.collect()
    gc.disable()
    try:
        ids = run_schedule(ctl, wl, sched)
        groups, requests = bare_tables(ctl, ids)
        usable = [ctl.scheduler.num_usable_blocks(g.name) for g in ctl.layout.groups]
        names = [g.name for g in ctl.layout.groups]
        one_row = frozen_rows(len(requests.tokens))
        clock, times, pending = time.perf_counter_ns, [], []
        for i in sched.finished:
            t0 = clock()
            bare_free(groups, requests, ids[i])
            if deltas:
                pending += cleared_row_deltas(names, one_row[requests.free_rows[-1]])
            times.append(clock() - t0)
    finally:
        gc.enable()
    ctl.free()
    _check_whole(wl.name, groups, requests, usable)
    if deltas and len(pending) != len(names) * len(sched.finished):
        raise AssertionError(f"{wl.name}: {len(pending)} deltas for {len(sched.finished)} frees")
    return times


def _check_whole(
    name: str, groups: list[BareTables], requests: BareRequests, usable: list[int]
) -> None:
    """Every row empty, every count 0, every block once on its free stack, every request
    forgotten and its row back: a bare free that skipped a store fails here."""
    for g, n in zip(groups, usable, strict=True):
        ids = sorted(g.stack[: g.num_free].tolist())
        held_from = g.held_from is not None and g.held_from.any()
        if ids != list(range(1, n + 1)) or g.table.any() or g.ref.any() or held_from:
            raise AssertionError(f"{name}: the bare free left blocks held: free {g.num_free}/{n}")
    r = requests
    if r.row_of or r.tokens.any() or sorted(r.free_rows) != list(range(len(r.tokens))):
        raise AssertionError(f"{name}: the bare free left requests: {sorted(r.row_of)}")


#: the frees timed on kvforge's side, in order: the bare stores, with the worker's deltas, and
#: ``BlockManager.finish``
KVFORGE_FREES: tuple[str, ...] = ("floor", "floor_deltas", "finish")


def free_times(side: str, wl: WorkloadLike, sched: ScheduleLike) -> list[int]:
    """Nanoseconds per free of one checked run of ``side`` (one of :data:`KVFORGE_FREES`, or
    ``"vllm"``) on ``sched``."""
    if side == "floor":
        return floor_free_times(wl, sched)
    if side == "floor_deltas":
        return floor_free_times(wl, sched, deltas=True)
    if side == "finish":
        return scheduler_per_request(wl, sched, check=True).free
    if side == "vllm":
        return vllm_per_request(wl, sched, check=True).free
    raise ValueError(f"side must be one of {(*KVFORGE_FREES, 'vllm')}, got {side!r}")


def floor_rounds(
    workloads: Sequence[WorkloadLike], rounds: int = 9, with_vllm: bool = True
) -> list[PerRequestRecord]:
    """Per workload, ``rounds`` interleaved rounds of the bare free, the bare free with the
    worker's deltas, ``BlockManager.finish`` and vLLM's ``free``: records ``free_floor``,
    ``free_floor_deltas`` and ``free_finish``, each with its ratio to vLLM's ``free`` and
    spread.

    Raises:
        ValueError: no workload, or ``rounds`` not an int of at least 3.
    """
    if not workloads:
        raise ValueError("workloads must name at least one workload, got none")
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
            sides = [*KVFORGE_FREES, "vllm"] if with_vllm else list(KVFORGE_FREES)
            for side in sides:  # one warm-up run each
                free_times(side, wl, sched)
            runs: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(rounds):
                for side in sides:
                    runs[side].append(statistics.mean(free_times(side, wl, sched)) / 1000)
            theirs = runs.get("vllm")
            records += [
                ratio_record(wl.name, f"free_{side}", runs[side], theirs) for side in KVFORGE_FREES
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
    if not wanted:
        parser.error(f"--workloads names no workload: {args.workloads!r}")
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
