"""Per-step bookkeeping benchmark, kvforge side: the schedules of ``benchmarks/step_workloads.py``.

For each workload a layout whose groups match the workload's groups is built, with a
:class:`~kvforge.cache_controller.BlockManager` (scheduler side) that is never short of blocks
and a :class:`~kvforge.worker.CacheStorage` (worker side). Both sides then run exactly the
steps of ``schedule(workload)``: per step one ``manager.schedule(ids, counts)`` and one
``storage.apply(allocation)`` (table-delta mirror and one slot mapping per (group, compress
ratio)); after the last step ``manager.finish(every id)`` and ``storage.apply_deltas`` of the
clearing deltas. The phases are timed as the vLLM side (``benchmarks/vllm_baseline.py``)
times them:

==================  ===========================================================================
``prefill_alloc``   scheduler side of a prefill step, mean over prefill steps
``decode_alloc``    scheduler side of a decode step, mean over decode steps
``kernel_inputs``   worker side of a decode step (delta mirror, positions, slot mappings)
``step``            both, per decode step, timed as one span
``free``            finishing every request and mirroring the clears, total
==================  ===========================================================================

Each figure is the median over ``repeats`` runs of the whole schedule (after one warm-up run
that also checks slot mappings against the block tables), on one torch thread with the garbage
collector off, in microseconds. Request ids and count arrays of each step are built before the
timed span: they are what an engine's scheduler hands over, not bookkeeping.

The device caches are adopted ``torch.empty`` tensors of the exact sizes: their pages are
never touched (only bookkeeping is timed), so a 256-request DeepSeek-V4 pool costs address
space, not memory.

This module imports neither vLLM nor ``benchmarks/``: a workload is any object with the
attributes of ``step_workloads.StepWorkload`` (see :class:`WorkloadLike`), and
:func:`load_step_workloads` finds that module next to the package when it is a checkout.

Invariants: the same workload always gives the same layout, block counts and steps; a run that
checks raises ``AssertionError`` on the first slot that disagrees with the block tables or on
a block that was not returned to its pool.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import torch

from kvforge.attn_backends import GQABackend
from kvforge.attn_backends.base import AttentionBackend
from kvforge.controller import CacheController
from kvforge.core.layout import CacheLayout
from kvforge.core.values import StepAllocation
from kvforge.models import from_hf_config
from kvforge.scheduler.block_manager import BlockManager
from kvforge.scheduler.block_pool import NULL_BLOCK
from kvforge.worker.storage import CacheStorage, StepInputs

__all__ = [
    "STEP_PHASES",
    "StepRecord",
    "build_backends",
    "check_step_inputs",
    "empty_caches",
    "load_step_workloads",
    "print_step_table",
    "run_facade_decode",
    "run_kvforge_step",
    "step_num_blocks",
    "step_records",
    "write_step_json",
]

STEP_PHASES: tuple[str, ...] = ("prefill_alloc", "decode_alloc", "kernel_inputs", "step", "free")


# --- what a workload looks like (duck-typed: benchmarks/step_workloads.py defines them) ----------


class GroupLike(Protocol):
    name: str
    kind: str  # "full" or "sliding_window"
    block_size: int
    window: int | None


class StepLike(Protocol):
    phase: str  # "prefill" or "decode"
    scheduled: tuple[tuple[int, int], ...]


class ScheduleLike(Protocol):
    steps: tuple[StepLike, ...]
    finished: tuple[int, ...]


class WorkloadLike(Protocol):
    name: str
    groups: tuple[GroupLike, ...]
    num_requests: int
    prompt_len: int
    max_num_batched_tokens: int
    decode_steps: int
    chunk_size: int | None
    max_model_len: int


def load_step_workloads() -> ModuleType:
    """:mod:`step_workloads`, which sits beside this module in ``benchmarks/``."""
    import step_workloads

    return step_workloads


# --- layout and sizes ---------------------------------------------------------------------------


def _signature(groups: Sequence[GroupLike]) -> tuple[tuple[str, str, int, int | None], ...]:
    return tuple(sorted((g.name, g.kind, g.block_size, g.window) for g in groups))


def build_backends(wl: WorkloadLike) -> dict[int, AttentionBackend]:
    """Layer -> backend for ``wl``, with exactly ``wl``'s groups and few layers.

    - one full group ``kv`` of block B: Llama-3-8B GQA (8 KV heads x 128) on 2 layers;
    - ``kv`` full and ``swa`` window W, block B: gpt-oss (8 KV heads x 64), 4 layers
      alternating sliding-window and full attention;
    - DeepSeek-V4's four groups: layers 2 and 3 of ``deepseek-v4-tiny`` (layer 2 carries
      ``swa``, ``compressed`` and ``c4_state``, layer 3 ``c128_state``).

    Raises:
        ValueError: no layout here has ``wl``'s groups (the message names the workload).
    """
    sig = _signature(wl.groups)
    names = {g.name: g for g in wl.groups}
    if set(names) == {"kv"} and names["kv"].kind == "full":
        bs = names["kv"].block_size
        backends: dict[int, AttentionBackend] = {i: GQABackend(8, 128, bs) for i in range(2)}
    elif set(names) == {"kv", "swa"} and names["kv"].kind == "full":
        bs, swa = names["kv"].block_size, names["swa"]
        if swa.block_size != bs or swa.kind != "sliding_window":
            raise ValueError(
                f"workload {wl.name!r}: gpt-oss layouts need 'swa' as a sliding window with "
                f"block size {bs}, got kind {swa.kind!r} block size {swa.block_size}"
            )
        window = GQABackend(8, 64, bs, sliding_window=swa.window)
        full = GQABackend(8, 64, bs)
        backends = {i: (window if i % 2 == 0 else full) for i in range(4)}
    else:
        model = from_hf_config("deepseek-v4-tiny")
        backends = {2: model[2], 3: model[3]}
    got = _signature(
        [
            _Group(
                g.name,
                "full" if g.kind.value == "full" else "sliding_window",
                g.block_size,
                g.window,
            )
            for g in CacheLayout(backends).groups
        ]
    )
    if got != sig:
        raise ValueError(
            f"workload {wl.name!r}: no kvforge layout here has groups {list(sig)}; the nearest "
            f"has {list(got)}"
        )
    return backends


@dataclass(frozen=True)
class _Group:
    name: str
    kind: str
    block_size: int
    window: int | None


def step_num_blocks(wl: WorkloadLike, layout: CacheLayout) -> dict[str, int]:
    """Blocks per group so that no step of ``wl`` is ever short, null block included.

    A full group holds at most ``cdiv(max_model_len, B)`` blocks per request. A window group
    of ``W`` tokens keeps, after a step that scheduled ``n`` tokens, the blocks from the one
    holding token ``computed + 1 - W`` to the last: at most ``cdiv(n + W - 1, B) + 1``, and a
    request keeps them until its next step. ``n`` is at most the chunk (or the whole prompt),
    so ``num_requests * (cdiv(chunk + W - 1, B) + 1)`` blocks always suffice.

    A window group also gets one batch-wide step allowance, ``cdiv(max_num_batched_tokens, B)
    + num_requests`` (a step's new blocks, one partial block per request), as memory plans
    give it: a step takes its new blocks before the blocks it releases are counted, so without
    it ``BlockManager.schedule`` would leave its batch path for the per-request one whenever
    the pool is at its bound, and time that instead.
    """
    chunk = wl.chunk_size if wl.chunk_size is not None else wl.prompt_len
    out: dict[str, int] = {}
    for g in layout.groups:
        bs = g.block_size
        if g.kind.value == "full":
            out[g.name] = 1 + wl.num_requests * -(-wl.max_model_len // bs)
        else:
            per_request = -(-(chunk + int(g.window or 0) - 1) // bs) + 1
            allowance = -(-wl.max_num_batched_tokens // bs) + wl.num_requests
            out[g.name] = 1 + wl.num_requests * per_request + allowance
    return out


def empty_caches(layout: CacheLayout, num_blocks: Mapping[str, int]) -> dict[Any, torch.Tensor]:
    """Device caches of the exact sizes to adopt, as ``torch.empty`` tensors: their pages are
    never touched, so they cost address space only."""
    caches: dict[Any, torch.Tensor] = {}
    for e in layout.buffers:
        backend = layout.backends[e.layer]
        shape = (num_blocks[e.group.name], *backend.block_shape(e.role))
        caches[e.key] = torch.empty(shape, dtype=e.role.torch_dtype)
    return caches


# --- the driver ---------------------------------------------------------------------------------


@dataclass
class StepTimes:
    """Nanoseconds of one run of a schedule (both sides of the benchmark record these)."""

    prefill_alloc: list[int] = field(default_factory=list)
    decode_alloc: list[int] = field(default_factory=list)
    kernel_inputs: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    free: int = 0

    @staticmethod
    def medians(runs: Sequence[StepTimes]) -> dict[str, float]:
        """Per phase, the median over runs (microseconds) of each run's mean per step (the
        total for ``free``), plus ``decode_alloc_first``: the first decode step alone (window
        blocks that slid out during a whole-prompt prefill are released there)."""
        return {
            "prefill_alloc": _median_us([_mean(r.prefill_alloc) for r in runs]),
            "decode_alloc": _median_us([_mean(r.decode_alloc) for r in runs]),
            "kernel_inputs": _median_us([_mean(r.kernel_inputs) for r in runs]),
            "step": _median_us([_mean(r.step) for r in runs]),
            "free": _median_us([r.free for r in runs]),
            "decode_alloc_first": _median_us(
                [r.decode_alloc[0] if r.decode_alloc else 0 for r in runs]
            ),
        }


class _Driver:
    """One scheduler side and one worker side over the same layout and block counts."""

    def __init__(self, wl: WorkloadLike, layout: CacheLayout, num_blocks: dict[str, int]):
        # per-group pools, sized per group as vLLM's baseline is: the step's bookkeeping is
        # compared, and the figures stay comparable with the runs before pools were shared
        self.manager = BlockManager(
            layout, num_blocks, wl.num_requests, wl.max_model_len, share_pools=False
        )
        self.storage = CacheStorage(layout, "cpu")
        self.storage.adopt(
            empty_caches(layout, num_blocks),
            wl.num_requests,
            wl.max_model_len,
            share_pools=False,
        )
        self.ids = [f"req-{i}" for i in range(wl.num_requests)]


def _prepared(sched: ScheduleLike, ids: list[str]) -> list[tuple[str, list[str], np.ndarray]]:
    return [
        (
            step.phase,
            [ids[i] for i, _ in step.scheduled],
            np.array([n for _, n in step.scheduled], dtype=np.int64),
        )
        for step in sched.steps
    ]


def check_step_inputs(
    manager: BlockManager, storage: CacheStorage, alloc: StepAllocation, inputs: StepInputs
) -> int:
    """Check a step's slot mappings against the scheduler side's block tables.

    For every scheduled request, group and compress ratio ``r`` (``E = B // r`` entries per
    block), the token at position ``p`` must map to ``table[p // r // E] * E + (p // r) % E``
    when ``p % r == r - 1`` and to ``-1`` otherwise; the block it maps to is never the null
    block (a step's own tokens are always held), and the worker's mirrored table equals the
    manager's. Returns the number of slots compared.

    Raises:
        AssertionError: naming the group, ratio and request that disagree.
    """
    compared = 0
    for g in manager.layout.groups:
        mirror = storage.block_table(g.name)
        if not np.array_equal(mirror, manager.table(g.name)):
            raise AssertionError(f"group {g.name!r}: the worker's table differs from the manager's")
    total = int(alloc.num_new.sum())
    for (group, ratio), slots in inputs.slot_mappings.items():
        if len(slots) != total:
            raise AssertionError(
                f"group {group!r} ratio {ratio}: {len(slots)} slots for {total} scheduled tokens"
            )
    start = 0
    for k, rid in enumerate(alloc.request_ids):
        n = int(alloc.num_new[k])
        pos = np.arange(int(alloc.num_computed[k]), int(alloc.num_computed[k]) + n)
        for (group, ratio), slots in inputs.slot_mappings.items():
            bs = manager.layout.group(group).block_size
            per_block = bs // ratio
            table = np.asarray(manager.block_table(rid, group), dtype=np.int64)
            entry = pos // ratio
            blocks = table[entry // per_block]
            if (blocks == NULL_BLOCK).any():
                raise AssertionError(
                    f"group {group!r} ratio {ratio} request {rid!r}: a scheduled token sits in "
                    "the null block"
                )
            expected = np.where(
                pos % ratio == ratio - 1, blocks * per_block + entry % per_block, -1
            )
            got = np.asarray(slots[start : start + n])
            if not np.array_equal(got, expected):
                raise AssertionError(
                    f"group {group!r} ratio {ratio} request {rid!r}: slot mapping differs from "
                    "the block table"
                )
            compared += n
        start += n
    return compared


def _run_schedule(
    wl: WorkloadLike,
    layout: CacheLayout,
    num_blocks: dict[str, int],
    sched: ScheduleLike,
    check: str,
) -> StepTimes:
    """One run; ``check``: ``"none"``, ``"some"`` (last prefill, first and last decode steps)
    or ``"all"`` steps."""
    driver = _Driver(wl, layout, num_blocks)
    manager, storage = driver.manager, driver.storage
    steps = _prepared(sched, driver.ids)
    decode_idx = [k for k, s in enumerate(steps) if s[0] == "decode"]
    prefill_idx = [k for k, s in enumerate(steps) if s[0] == "prefill"]
    wanted = set()
    if check == "some":
        wanted = {*decode_idx[:1], *decode_idx[-1:], *prefill_idx[-1:]}
    elif check == "all":
        wanted = set(range(len(steps)))
    finished = [driver.ids[i] for i in sched.finished]
    times = StepTimes()
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for k, (phase, ids, counts) in enumerate(steps):
            t0 = clock()
            alloc = manager.schedule(ids, counts)
            t1 = clock()
            inputs = storage.apply(alloc)
            t2 = clock()
            if alloc.refused:
                raise RuntimeError(f"workload {wl.name!r} step {k}: {alloc.refused[0].message}")
            if phase == "prefill":
                times.prefill_alloc.append(t1 - t0)
            else:
                times.decode_alloc.append(t1 - t0)
                times.kernel_inputs.append(t2 - t1)
                times.step.append(t2 - t0)
            if k in wanted:
                check_step_inputs(manager, storage, alloc, inputs)
        t0 = clock()
        manager.finish(finished)
        storage.apply_deltas(manager.take_table_deltas())
        times.free = clock() - t0
    finally:
        gc.enable()
    if check != "none":
        for g in layout.groups:
            if manager.num_used_blocks(g.name) != 0:
                raise AssertionError(f"{wl.name}: blocks of group {g.name!r} leaked")
            if storage.block_table(g.name).any():
                raise AssertionError(f"{wl.name}: the mirror of {g.name!r} was not cleared")
    return times


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _median_us(values: Sequence[float]) -> float:
    return statistics.median(values) / 1000.0


def _mean(ns: list[int]) -> float:
    return sum(ns) / len(ns) if ns else 0.0


def run_kvforge_step(
    wl: WorkloadLike, sched: ScheduleLike, repeats: int = 15, check: str = "some"
) -> dict[str, float]:
    """Median microseconds of kvforge's per-step bookkeeping on ``sched`` (``wl``'s schedule).

    Keys: :data:`STEP_PHASES` and ``decode_alloc_first`` (the first decode step alone), as
    the vLLM side reports them. One warm-up run checks slot mappings (``check``: ``"some"``
    checks the last prefill and the first and last decode steps, ``"all"`` every step,
    ``"none"`` nothing); then ``repeats`` timed runs, each on a fresh manager and storage.
    """
    _positive("repeats", repeats)
    if check not in ("none", "some", "all"):
        raise ValueError(f"check must be 'none', 'some' or 'all', got {check!r}")
    layout = CacheLayout(build_backends(wl))
    num_blocks = step_num_blocks(wl, layout)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run_schedule(wl, layout, num_blocks, sched, check)
        runs = [_run_schedule(wl, layout, num_blocks, sched, "none") for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
    return StepTimes.medians(runs)


def run_facade_decode(wl: WorkloadLike, sched: ScheduleLike, repeats: int = 5) -> float:
    """Median microseconds of a decode step through the one-process facade, request by request.

    ``CacheController.allocate(request, num_tokens)`` per scheduled request (one
    ``BlockManager.schedule`` of one request each, and the worker's delta mirror); the prefill
    steps run untimed the same way. Mean over decode steps, median over runs.
    """
    _positive("repeats", repeats)
    backends = build_backends(wl)
    layout = CacheLayout(backends)
    num_blocks = step_num_blocks(wl, layout)
    ids = [f"req-{i}" for i in range(wl.num_requests)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs: list[float] = []
    try:
        for _ in range(repeats + 1):  # the first run warms up
            controller = CacheController(backends, share_pools=False)  # as _Driver
            controller.adopt_kv_cache(
                empty_caches(layout, num_blocks), wl.num_requests, wl.max_model_len
            )
            held = [0] * wl.num_requests
            decode: list[int] = []
            gc.collect()
            gc.disable()
            try:
                for step in sched.steps:
                    t0 = time.perf_counter_ns()
                    for i, n in step.scheduled:
                        held[i] += n
                        controller.allocate(ids[i], held[i])
                    if step.phase == "decode":
                        decode.append(time.perf_counter_ns() - t0)
            finally:
                gc.enable()
            controller.free_requests(ids)
            controller.free()
            runs.append(_mean(decode))
    finally:
        torch.set_num_threads(threads)
    return _median_us(runs[1:])


# --- records, table, JSON -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One (workload, phase) figure of both sides; ``vllm_us`` and ``ratio`` ``None`` without
    vLLM. ``ratio = kvforge_us / vllm_us`` (below 1: kvforge is faster)."""

    workload: str
    phase: str
    kvforge_us: float
    vllm_us: float | None
    ratio: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "phase": self.phase,
            "kvforge_us": self.kvforge_us,
            "vllm_us": self.vllm_us,
            "ratio": self.ratio,
        }


def step_records(
    workload: str,
    kvforge: Mapping[str, float],
    vllm: Mapping[str, float] | None,
    phases: Sequence[str] = STEP_PHASES,
) -> list[StepRecord]:
    """One record per phase, in ``phases`` order."""
    out = []
    for phase in phases:
        ours = round(float(kvforge[phase]), 3)
        theirs = None if vllm is None else round(float(vllm[phase]), 3)
        ratio = None if theirs is None or theirs == 0 else round(ours / theirs, 4)
        out.append(StepRecord(workload, phase, ours, theirs, ratio))
    return out


def print_step_table(records: Sequence[StepRecord], title: str, out: Any = None) -> None:
    """A rich table: one row per (workload, phase) with kvforge, vLLM and their ratio."""
    from kvforge.cli.formatting import console, make_table

    table = make_table(
        title, ("workload", "phase", "kvforge", "vLLM", "ratio"), ("workload", "phase")
    )
    previous = None
    for r in records:
        table.add_row(
            r.workload if r.workload != previous else "",
            r.phase,
            f"{r.kvforge_us:,.1f}",
            "n/a" if r.vllm_us is None else f"{r.vllm_us:,.1f}",
            "n/a" if r.ratio is None else f"{r.ratio:.2f}x",
        )
        previous = r.workload
    (out or console()).print(table)


def write_step_json(records: Sequence[Any], path: str) -> None:
    """Write the records (anything with ``as_dict``) as a JSON list of ``{"workload", "phase",
    "kvforge_us", "vllm_us", "ratio"}`` objects; the per-request path's records
    (:class:`per_request.PerRequestRecord`) add ``ratio_spread``, ``kvforge_spread`` and
    ``rounds``."""
    with open(path, "w") as fh:
        json.dump([r.as_dict() for r in records], fh, indent=2)
        fh.write("\n")


def run_step_bench(
    workloads: Sequence[WorkloadLike],
    schedule: Callable[[WorkloadLike], ScheduleLike],
    repeats: int = 15,
    vllm_step: Callable[[WorkloadLike, int], Mapping[str, float]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[StepRecord], dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Both sides on every workload (vLLM only when ``vllm_step`` is given).

    Returns the records, and per workload the raw kvforge and vLLM figures (the latter empty
    without vLLM), extra keys such as ``decode_alloc_first`` included.
    """
    records: list[StepRecord] = []
    ours_all: dict[str, dict[str, float]] = {}
    theirs_all: dict[str, dict[str, float]] = {}
    for wl in workloads:
        if progress is not None:
            progress(wl.name)
        ours = run_kvforge_step(wl, schedule(wl), repeats)
        theirs = dict(vllm_step(wl, repeats)) if vllm_step is not None else None
        ours_all[wl.name] = ours
        if theirs is not None:
            theirs_all[wl.name] = theirs
        records += step_records(wl.name, ours, theirs)
    return records, ours_all, theirs_all
