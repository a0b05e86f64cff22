"""The per-request path, kvforge against vLLM 0.33, same schedules, same process, interleaved.

An engine that drives its cache manager one request at a time calls, per scheduled request:

=================  ==========================================  ================================
call               kvforge (``CacheController``)               vLLM (``KVCacheManager``)
=================  ==========================================  ================================
``alloc``          ``allocate(request, num_tokens)``           ``allocate_slots(request, n)``
                                                               (``get_computed_blocks`` first
                                                               for a new request)
``table``          ``block_table(request, group)``, every      ``get_block_ids(request_id)``
                   group                                       (every group at once)
``slots``          ``slot_mapping(request, group, positions)`` none: vLLM's worker computes
                   of the step's new tokens, every group       slot mappings for the batch
``free``           ``free_request(request)``                   ``free(request)``
=================  ==========================================  ================================

Each call is timed on its own (``perf_counter_ns`` around it; the positions tensor and the
request objects are built before the timed span, as an engine hands them over) on the
workloads' decode steps; ``free`` once per request after the last step. A run is one pass of the
whole schedule on a fresh controller (or manager); :func:`per_request_rounds` runs
``rounds`` rounds, each one run of kvforge then one of vLLM, after one warm-up run of each,
and reports per call the median over rounds of the mean microseconds per request, with each
ratio (``kvforge / vLLM``, below 1: kvforge is cheaper) as the median of the per-round ratios
and its spread (min, median, max over the rounds). ``total`` is ``alloc + table + slots``
against ``alloc + table``: what one request's step costs each side.

``CacheController`` is both sides of kvforge: each call also runs the worker's checked mirror of
the step (``CacheStorage.run``), which vLLM's ``KVCacheManager`` never does (vLLM's worker
learns of a step from the next ``SchedulerOutput``, in its own process). So each run of kvforge
is followed, in the same round, by one of its scheduler side alone (``side="scheduler"``:
``BlockManager.schedule`` and ``end_step`` / ``block_table`` / ``finish``, the worker never
told), reported as the calls ``scheduler_alloc``, ``scheduler_table``, ``scheduler_free`` and
``scheduler_total``: the same scope as ``KVCacheManager``. Their difference in each round,
``facade_only_alloc`` and ``facade_only_free`` (:func:`facade_only`), is what only the facade
does; its ratio to vLLM's whole call is the least the facade's ratio could be if its scheduler
side cost nothing.

Invariants: both sides run exactly the steps of ``schedule(workload)`` on the blocks
:func:`step_sim.step_num_blocks` sizes (kvforge) and :func:`vllm_baseline.build_kv_cache_config`
sizes (vLLM); the warm-up run of kvforge checks each step's slot mapping against the block
table it returned and that every block went back to its pool (``tests/benchmarks/
test_per_request.py``).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from step_sim import ScheduleLike, WorkloadLike, build_backends, empty_caches, step_num_blocks

from kvforge.controller import CacheController
from kvforge.core.layout import CacheLayout

__all__ = [
    "CALLS",
    "FACADE_ONLY_CALLS",
    "SCHEDULER_CALLS",
    "SIDES",
    "PerRequestRecord",
    "PerRequestTimes",
    "facade_only",
    "kvforge_per_request",
    "per_request_rounds",
    "print_per_request",
    "ratio_record",
    "scheduler_per_request",
    "vllm_per_request",
    "workload_controller",
]

#: the calls timed, in reporting order; ``total`` is the step's calls together
CALLS: tuple[str, ...] = ("alloc", "table", "slots", "free", "total")

#: the scheduler side's calls (``side="scheduler"``): no slot mapping, as vLLM's manager
SCHEDULER_CALLS: tuple[str, ...] = ("alloc", "table", "free", "total")

#: which of kvforge is timed: the facade (both sides), or its scheduler side alone
SIDES: tuple[str, ...] = ("facade", "scheduler")

#: the calls whose facade-only share is reported (``facade_only``): what the facade adds to
#: its scheduler side, against vLLM's whole call
FACADE_ONLY_CALLS: tuple[str, ...] = ("alloc", "free")


@dataclass
class PerRequestTimes:
    """Nanoseconds of one run, one entry per call made (per request per decode step; ``free``
    per request)."""

    alloc: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)

    def means_us(self) -> dict[str, float]:
        """Mean microseconds per call, and ``total``: a request's step (alloc, table, slots)."""
        runs = {"alloc": self.alloc, "table": self.table, "slots": self.slots, "free": self.free}
        out = {c: (sum(ns) / len(ns) / 1000.0 if ns else 0.0) for c, ns in runs.items()}
        out["total"] = out["alloc"] + out["table"] + out["slots"]
        return out


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


# --- kvforge ------------------------------------------------------------------------------------


def workload_controller(wl: WorkloadLike) -> CacheController:
    """A controller with exactly ``wl``'s groups, per-group pools (as ``step_sim``'s driver)
    of :func:`step_sim.step_num_blocks` blocks, and ``wl``'s requests and length."""
    backends = build_backends(wl)
    layout = CacheLayout(backends)
    ctl = CacheController(backends, share_pools=False)
    caches = empty_caches(layout, step_num_blocks(wl, layout))
    ctl.adopt_kv_cache(caches, wl.num_requests, wl.max_model_len)
    return ctl


def _check_slots(ctl: CacheController, rid: str, group: str, pos: torch.Tensor, slots: Any) -> None:
    table = np.asarray(ctl.block_table(rid, group), dtype=np.int64)
    bs = ctl.layout.group(group).block_size
    p = pos.numpy()
    expected = table[p // bs] * bs + p % bs
    if not np.array_equal(np.asarray(slots), expected):
        raise AssertionError(f"request {rid!r} group {group!r}: slots differ from its block table")


def kvforge_per_request(
    wl: WorkloadLike, sched: ScheduleLike, check: bool = False, side: str = "facade"
) -> PerRequestTimes:
    """One run of ``sched`` through the facade, one request at a time (see the module
    docstring); ``check``: compare every decode step's slots with the block table, and the
    pools with empty after the frees (``AssertionError`` on the first difference).
    ``side="scheduler"``: :func:`scheduler_per_request` instead.

    Raises:
        ValueError: ``side`` not one of :data:`SIDES`.
    """
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if side == "scheduler":
        return scheduler_per_request(wl, sched, check)
    ctl = workload_controller(wl)
    groups = [g.name for g in ctl.layout.groups]
    ids = [f"req-{i}" for i in range(wl.num_requests)]
    held = [0] * wl.num_requests
    times = PerRequestTimes()
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for step in sched.steps:
            decode = step.phase == "decode"
            for i, n in step.scheduled:
                rid, start = ids[i], held[i]
                held[i] += n
                pos = torch.arange(start, held[i], dtype=torch.int64)
                t0 = clock()
                ctl.allocate(rid, held[i])
                t1 = clock()
                tables = [ctl.block_table(rid, g) for g in groups]
                t2 = clock()
                slots = [ctl.slot_mapping(rid, g, pos) for g in groups]
                t3 = clock()
                if decode:
                    times.alloc.append(t1 - t0)
                    times.table.append(t2 - t1)
                    times.slots.append(t3 - t2)
                    if check:
                        for g, s in zip(groups, slots, strict=True):
                            _check_slots(ctl, rid, g, pos, s)
                del tables
        for i in sched.finished:
            t0 = clock()
            ctl.free_request(ids[i])
            times.free.append(clock() - t0)
    finally:
        gc.enable()
    if check and ctl.requests:
        raise AssertionError(f"{wl.name}: requests still hold blocks after free: {ctl.requests}")
    ctl.free()
    return times


def scheduler_per_request(
    wl: WorkloadLike, sched: ScheduleLike, check: bool = False
) -> PerRequestTimes:
    """One run of ``sched`` through kvforge's scheduler side alone, the scope of vLLM's
    ``KVCacheManager``: per request ``BlockManager.schedule`` of its new tokens and
    ``end_step`` (``alloc``, as ``CacheController.allocate`` calls them), ``block_table`` of
    every group (``table``), ``finish`` (``free``). The worker is never told (its mirror is
    what the facade adds); ``check``: no refusal, and every pool whole after the frees."""
    ctl = workload_controller(wl)
    manager = ctl.scheduler
    groups = [g.name for g in ctl.layout.groups]
    free_before = {g: manager.num_free_blocks(g) for g in groups}
    ids = [f"req-{i}" for i in range(wl.num_requests)]
    times = PerRequestTimes()
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for step in sched.steps:
            decode = step.phase == "decode"
            for i, n in step.scheduled:
                rid = ids[i]
                t0 = clock()
                allocation = manager.schedule([rid], [n])
                manager.end_step(allocation)
                t1 = clock()
                tables = [manager.block_table(rid, g) for g in groups]
                t2 = clock()
                if allocation.refused:
                    raise RuntimeError(f"kvforge refused {n} tokens for {rid}: {allocation}")
                if decode:
                    times.alloc.append(t1 - t0)
                    times.table.append(t2 - t1)
                del tables
        for i in sched.finished:
            t0 = clock()
            manager.finish([ids[i]])
            times.free.append(clock() - t0)
    finally:
        gc.enable()
    if check:
        left = {g: manager.num_free_blocks(g) for g in groups}
        if manager.requests or left != free_before:
            raise AssertionError(f"{wl.name}: blocks still held after free: {left}")
    ctl.free()
    return times


# --- vLLM ---------------------------------------------------------------------------------------


def _vllm_allocate(driver: Any, request: Any, n: int, new: bool) -> tuple[Any, int]:
    """``allocate_slots`` as vLLM's scheduler calls it: a new request after
    ``get_computed_blocks`` (prefix caching is off: nothing is found), a running one alone."""
    manager = driver.manager
    if not new:
        return manager.allocate_slots(request, n, num_lookahead_tokens=0), 0
    computed, num_local, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(
        request,
        n,
        num_new_computed_tokens=num_local,
        new_computed_blocks=computed,
        num_lookahead_tokens=0,
        num_external_computed_tokens=0,
        delay_cache_blocks=False,
        num_encoder_tokens=0,
        full_sequence_must_fit=True,  # SchedulerConfig.scheduler_reserve_full_isl
        reserved_blocks=0,
        has_scheduled_reqs=driver.num_running > 0,
    )
    return blocks, num_local


def vllm_per_request(wl: WorkloadLike, sched: ScheduleLike, check: bool = False) -> PerRequestTimes:
    """One run of ``sched`` through vLLM's ``KVCacheManager``, one request at a time, as its
    scheduler calls it (see the module docstring); ``check``: every block back in the pool at
    the end."""
    import vllm_baseline as vb

    v = vb._vllm()
    driver = vb._VllmStepDriver(v, wl)  # its manager and requests, exactly as the step bench
    manager, waiting, running = driver.manager, v.RequestStatus.WAITING, v.RequestStatus.RUNNING
    times = PerRequestTimes()
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for step in sched.steps:
            decode = step.phase == "decode"
            manager.new_step_starts()
            for i, n in step.scheduled:
                request = driver.requests[i]
                new = request.status == waiting
                t0 = clock()
                new_blocks, num_local = _vllm_allocate(driver, request, n, new)
                t1 = clock()
                manager.get_block_ids(request.request_id)
                t2 = clock()
                if new_blocks is None:
                    raise RuntimeError(f"vLLM could not allocate {n} tokens for request {i}")
                if new:
                    driver.num_running += 1
                    request.status = running
                    request.num_computed_tokens = num_local
                if decode:
                    times.alloc.append(t1 - t0)
                    times.table.append(t2 - t1)
            manager.take_new_block_ids()
            for i, n in step.scheduled:  # Scheduler._update_after_schedule, then the output
                request = driver.requests[i]
                request.num_computed_tokens += n
                request.num_in_flight_tokens += n
                request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
            driver.settle(step)
        for i in sched.finished:
            t0 = clock()
            manager.free(driver.requests[i])
            times.free.append(clock() - t0)
    finally:
        gc.enable()
    pool = manager.block_pool
    if check and pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
        raise AssertionError(f"{wl.name}: vLLM blocks leaked after freeing every request")
    return times


# --- rounds, records, table ---------------------------------------------------------------------


@dataclass(frozen=True)
class PerRequestRecord:
    """One (workload, call): medians over rounds of the mean microseconds per request, the
    ratio ``kvforge / vLLM`` as the median of the per-round ratios and its spread ``[min,
    median, max]``; vLLM's figures ``None`` where it was not run (and for ``slots``, which
    vLLM does not do per request)."""

    workload: str
    phase: str
    kvforge_us: float
    vllm_us: float | None
    ratio: float | None
    ratio_spread: list[float] | None
    kvforge_spread: list[float]
    rounds: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _spread(values: Sequence[float], digits: int = 3) -> list[float]:
    low, median, high = min(values), statistics.median(values), max(values)
    return [round(low, digits), round(median, digits), round(high, digits)]


def _records(
    name: str,
    ours: list[dict[str, float]],
    theirs: list[dict[str, float]] | None,
    side: str = "facade",
) -> list[PerRequestRecord]:
    """One record per call of ``side`` (phases ``per_request_{call}`` for the facade,
    ``per_request_scheduler_{call}`` for the scheduler side)."""
    calls, prefix = (CALLS, "") if side == "facade" else (SCHEDULER_CALLS, f"{side}_")
    return [
        ratio_record(
            name,
            f"per_request_{prefix}{call}",
            [r[call] for r in ours],
            None if theirs is None or call == "slots" else [r[call] for r in theirs],
        )
        for call in calls
    ]


def ratio_record(
    workload: str, phase: str, ours: list[float], theirs: list[float] | None
) -> PerRequestRecord:
    """The record of one (workload, phase) from its per-round microseconds on each side
    (``theirs`` ``None``: vLLM not run, or no counterpart): medians, and the ratio as the
    median of the per-round ratios with its spread."""
    ratios = None if theirs is None else [a / b for a, b in zip(ours, theirs, strict=True) if b]
    spread = _spread(ratios, 4) if ratios else None
    return PerRequestRecord(
        workload=workload,
        phase=phase,
        kvforge_us=round(statistics.median(ours), 3),
        vllm_us=None if theirs is None else round(statistics.median(theirs), 3),
        ratio=None if spread is None else spread[1],
        ratio_spread=spread,
        kvforge_spread=_spread(ours),
        rounds=len(ours),
    )


def facade_only(
    facade: Sequence[dict[str, float]], scheduler: Sequence[dict[str, float]], call: str
) -> list[float]:
    """Per round, what the facade's ``call`` costs beyond its scheduler side's in the same
    round (microseconds per request): the worker's checked mirror of the step and the
    facade's own checks, which vLLM's ``KVCacheManager`` call never does. Against vLLM's
    whole call it is a lower bound of the facade's ratio with a scheduler side that cost
    nothing. A round's difference below 0 is the machine's noise and is kept as measured.

    >>> facade_only([{"free": 70.0}, {"free": 66.5}], [{"free": 34.0}, {"free": 40.0}], "free")
    [36.0, 26.5]
    """
    return [f[call] - s[call] for f, s in zip(facade, scheduler, strict=True)]


def per_request_rounds(
    workloads: Sequence[WorkloadLike],
    schedule: Callable[[WorkloadLike], ScheduleLike],
    rounds: int = 5,
    with_vllm: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[PerRequestRecord]:
    """Per workload: one checked warm-up run of each side, then ``rounds`` interleaved rounds
    (kvforge's facade, its scheduler side, then vLLM), one record per call of :data:`CALLS`
    (the facade), of :data:`SCHEDULER_CALLS` (the scheduler side), and of
    :data:`FACADE_ONLY_CALLS` (:func:`facade_only`, phases ``per_request_facade_only_{call}``).

    Raises:
        ValueError: ``rounds`` below 3 (a ratio is never reported from fewer rounds).
    """
    _positive("rounds", rounds)
    if rounds < 3:
        raise ValueError(
            f"rounds must be >= 3 (each ratio is reported with its spread), got {rounds}"
        )
    records: list[PerRequestRecord] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for wl in workloads:
            if progress is not None:
                progress(f"{wl.name} (per request)")
            sched = schedule(wl)
            for side in SIDES:
                kvforge_per_request(wl, sched, check=True, side=side)
            if with_vllm:
                vllm_per_request(wl, sched, check=True)
            ours: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
            theirs: list[dict[str, float]] = []
            for _ in range(rounds):
                for side in SIDES:
                    ours[side].append(kvforge_per_request(wl, sched, side=side).means_us())
                if with_vllm:
                    theirs.append(vllm_per_request(wl, sched).means_us())
            for side in SIDES:
                records += _records(wl.name, ours[side], theirs if with_vllm else None, side)
            for call in FACADE_ONLY_CALLS:
                records.append(
                    ratio_record(
                        wl.name,
                        f"per_request_facade_only_{call}",
                        facade_only(ours["facade"], ours["scheduler"], call),
                        [r[call] for r in theirs] if with_vllm else None,
                    )
                )
    finally:
        torch.set_num_threads(threads)
    return records


def print_per_request(
    records: Sequence[PerRequestRecord],
    out: Any,
    what: str = "per-request path",
    prefix: str = "per_request_",
) -> None:
    """A rich table of ``what``: per (workload, call) kvforge and vLLM microseconds per
    request and the ratio with its spread; a call is its phase less ``prefix``."""
    from kvforge.cli.formatting import make_table

    rounds = records[0].rounds if records else 0
    table = make_table(
        f"{what}, microseconds per request (medians of {rounds} interleaved rounds; "
        "ratio = kvforge / vLLM, median (min-max) over the rounds)",
        ("workload", "call", "kvforge", "vLLM", "ratio"),
        ("workload", "call"),
    )
    previous = None
    for r in records:
        ratio = "n/a"
        if r.ratio_spread is not None:
            low, median, high = r.ratio_spread
            ratio = f"{median:.2f}x ({low:.2f}-{high:.2f})"
        table.add_row(
            r.workload if r.workload != previous else "",
            r.phase.removeprefix(prefix).replace("_", " "),
            f"{r.kvforge_us:,.2f}",
            "n/a" if r.vllm_us is None else f"{r.vllm_us:,.2f}",
            ratio,
        )
        previous = r.workload
    out.print(table)
