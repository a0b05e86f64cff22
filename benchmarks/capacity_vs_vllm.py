#!/usr/bin/env python
"""Capacity at equal bytes: vLLM 0.33's real ``Scheduler`` against kvforge's memory plan, both
fed the same requests and driven by the same first-come, first-served policy.

vLLM side (``vllm_baseline.build_vllm_cache_setup`` / ``build_vllm_scheduler``): the engine as
``EngineCore.__init__`` starts it for the model's bundled ``config.json``, offline on CPU, with
the scenario's budget as the profiled KV cache memory; its ``Scheduler`` (v1) or, with
``async_scheduling=True``, its ``AsyncScheduler``. Nothing runs a model: after each
``schedule()`` a fake ``ModelRunnerOutput`` samples one token for every scheduled request that
is not a partial prefill (``is_prefill_chunk``), and ``update_from_output`` takes it. The
synchronous engine alternates the two (``EngineCore.step``); the asynchronous one keeps
``max_concurrent_batches`` (2) steps in flight and settles the oldest after scheduling the
next (``EngineCore.step_with_batch_queue``). Prefix caching is off on both sides (every
prompt is distinct), chunked prefill on, vLLM's defaults otherwise
(``scheduler_reserve_full_isl``: a waiting request is admitted only if its whole prompt
fits; no per-request chunk cap).

kvforge side: ``prefix_vs_vllm.kvforge_manager`` (``plan_memory`` at the budget, kvforge's
default sizing, pooled as ``CacheController.initialize_kv_cache`` pools it; a
``BlockManager``, no device memory) driven by ``prefix_vs_vllm.FcfsEngine``, a port of
``Scheduler.schedule``'s FCFS policy: running requests first (a request whose growth is short
preempts the newest running request and recomputes it later), then waiting requests in order
while rows are free and the step's allocation succeeds. kvforge has no whole-prompt admission
gate: a waiting request is admitted when its first chunk fits.

Equal bytes: vLLM's blocks are ``budget // bytes_per_block`` (its pages of every layer, one
backing allocation); kvforge's ``memory_budget`` is exactly that backing,
``num_blocks * bytes_per_block``. Equal ``max_num_seqs``, ``max_num_batched_tokens``,
``max_model_len``, bf16 KV for the GQA models (DeepSeek-V4: fp8 pages and fp32 compressor
state on both sides).

Figures per scenario and side, taken after each step's scheduling (before its tokens land):
``peak_running`` (requests running), ``peak_tokens`` (the sum of ``num_tokens``, prompt plus
output so far, over the running requests: the full-history tokens they hold), ``peak_kv_tokens``
(the sum of tokens with KV once the step's tokens are written: lower than ``peak_tokens``
while prompts are partly prefilled), preemptions, steps. ``loop check``: the same FCFS port
driving vLLM's own ``KVCacheManager`` must reproduce the real ``Scheduler``'s figures exactly
(synchronous scenarios), which shows the kvforge side runs under vLLM's policy.

Usage::

    PYTHONPATH=. ~/.venv-vllm/bin/python benchmarks/capacity_vs_vllm.py
        [--scenarios a,b] [--quick] [--json PATH] [--no-vllm] [--no-progress]
        [--kvforge-option NAME=VALUE ...]

Without vLLM the script says so and exits 2, unless ``--no-vllm`` (kvforge only, at the
scenario's nominal budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_vs_vllm import (
    FcfsEngine,
    KvforgeSide,
    SimRequest,
    VllmManagerSide,
    environment,
    kvforge_manager,
    kvforge_settings,
    parse_kvforge_options,
    short_reason,
)
from vllm_baseline import VLLM_VERSION, vllm_available

from kvforge.cli.formatting import console, make_table

__all__ = [
    "QUICK_SCENARIOS",
    "SCENARIOS",
    "CapacityRow",
    "Peaks",
    "Scenario",
    "main",
    "make_requests",
    "run_capacity_vs_vllm",
    "run_kvforge",
    "run_loop_on_vllm",
    "run_vllm_scheduler",
]

GIB = 1 << 30


@dataclass(frozen=True)
class Scenario:
    """One model, budget and request stream: ``num_requests`` requests of ``prompt_len``
    distinct random tokens and ``output_len`` output tokens, all arriving at once."""

    name: str
    model: str
    memory_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt_len: int
    output_len: int
    num_requests: int
    async_too: bool = False  # also run vLLM's AsyncScheduler
    note: str = ""
    #: stop after this many engine steps (None: when every request finished); the peaks are
    #: reached once memory is full, long before long outputs end
    max_steps: int | None = None


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "gemma-2-9b 20GiB 8k",
        "gemma-2-9b",
        20 * GIB,
        8192,
        256,
        8192,
        8000,
        192,
        16,
        note="issue 21: vLLM ran 9 requests holding 73,674 tokens",
    ),
    Scenario(
        "v4-flash 60GiB N=256",
        "deepseek-v4-flash",
        60 * GIB,
        65536,
        256,
        8192,
        57344,
        8192,
        256,
        async_too=True,
        max_steps=3000,
        note="issue 21: vLLM held 14.17M tokens, kvforge 14.32M",
    ),
    Scenario(
        "v4-flash 60GiB N=16",
        "deepseek-v4-flash",
        60 * GIB,
        65536,
        16,
        8192,
        57344,
        8192,
        32,
        async_too=True,
        max_steps=3000,
    ),
    Scenario("llama-3-8b 20GiB 8k", "llama-3-8b", 20 * GIB, 8192, 256, 8192, 7168, 1024, 32),
    Scenario("gpt-oss-20b 20GiB 32k", "gpt-oss-20b", 20 * GIB, 32768, 256, 8192, 28672, 1024, 48),
    Scenario(
        "mistral-7b 20GiB 32k", "mistral-7b-v0.1", 20 * GIB, 32768, 256, 8192, 28672, 1024, 48
    ),
    Scenario(
        "v4-tiny 1GiB N=64",
        "deepseek-v4-tiny",
        GIB,
        65536,
        64,
        8192,
        57344,
        8192,
        64,
        async_too=True,
        max_steps=2000,
    ),
)

QUICK_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("gemma-2-9b quick", "gemma-2-9b", GIB, 2048, 16, 1024, 1900, 48, 8),
    Scenario("llama-3-8b quick", "llama-3-8b", GIB // 2, 2048, 16, 1024, 1800, 48, 8),
    Scenario(
        "v4-flash quick",
        "deepseek-v4-flash",
        3 * GIB,
        8192,
        16,
        1024,
        6144,
        32,
        8,
        async_too=True,
    ),
)


def make_requests(s: Scenario, seed: int = 0) -> list[SimRequest]:
    """The scenario's requests: seeded distinct token streams (prompt, then the tokens the
    fake model samples)."""
    rng = np.random.default_rng(seed)
    total = s.prompt_len + s.output_len
    return [
        SimRequest(
            rid=f"req-{i}",
            tokens=rng.integers(0, 100_000, total, dtype=np.int64),
            prompt_len=s.prompt_len,
            max_output=s.output_len,
        )
        for i in range(s.num_requests)
    ]


@dataclass
class Peaks:
    """One side's figures (see the module docstring)."""

    side: str
    peak_running: int = 0
    peak_tokens: int = 0
    peak_kv_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    finished: int = 0
    seconds: float = 0.0

    def observe(self, running: int, tokens: int, kv_tokens: int) -> None:
        self.peak_running = max(self.peak_running, running)
        self.peak_tokens = max(self.peak_tokens, tokens)
        self.peak_kv_tokens = max(self.peak_kv_tokens, kv_tokens)

    def key(self) -> tuple[int, ...]:
        return (
            self.peak_running,
            self.peak_tokens,
            self.peak_kv_tokens,
            self.preemptions,
            self.steps,
            self.finished,
        )


def _max_steps(s: Scenario) -> int:
    if s.max_steps is not None:
        return s.max_steps
    # every request recomputed a few times over is still far below this
    per_request = -(-s.prompt_len // s.max_num_batched_tokens) + s.output_len
    return 20 * s.num_requests * per_request + 1000


def _engine_args(s: Scenario) -> dict[str, int]:
    return {
        "max_model_len": s.max_model_len,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
    }


def run_vllm_scheduler(s: Scenario, setup: Any, seed: int = 0) -> Peaks:
    """vLLM's real scheduler on the scenario (``setup.vllm_config`` says sync or async)."""
    import vllm_baseline as vb
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    cfg = setup.vllm_config
    is_async = bool(cfg.scheduler_config.async_scheduling)
    sched = vb.build_vllm_scheduler(setup)
    hasher = vb.vllm_block_hasher(setup)
    streams = {}
    requests = []
    for r in make_requests(s, seed):
        streams[r.rid] = r.tokens
        req = Request(
            request_id=r.rid,
            prompt_token_ids=r.tokens[: r.prompt_len].tolist(),
            sampling_params=SamplingParams(max_tokens=r.max_output, ignore_eos=True),
            pooling_params=None,
            block_hasher=hasher,
        )
        requests.append(req)
        sched.add_request(req)
    peaks = Peaks("vLLM async" if is_async else "vLLM")
    limit = _max_steps(s)

    calls = 0

    def scheduled() -> tuple[Any, dict[str, bool]]:
        nonlocal calls
        calls += 1
        out = sched.schedule()
        running = sched.running
        peaks.observe(
            len(running),
            sum(r.num_tokens for r in running),
            sum(r.num_computed_tokens for r in running),
        )
        # the runner samples for a request that is not a partial prefill
        flags = {rid: not sched.requests[rid].is_prefill_chunk for rid in out.num_scheduled_tokens}
        peaks.steps += out.total_num_scheduled_tokens > 0  # a step that ran the model
        return out, flags

    def settle(out: Any, flags: dict[str, bool]) -> None:
        ids = list(out.num_scheduled_tokens)
        tokens = []
        for rid in ids:
            req = sched.requests.get(rid)
            if flags[rid] and req is not None:
                tokens.append([int(streams[rid][min(req.num_tokens, len(streams[rid]) - 1)])])
            else:
                tokens.append([])
        output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=tokens,
        )
        sched.update_from_output(out, output)

    t0 = time.perf_counter()
    if not is_async:  # EngineCore.step
        while sched.has_requests() and calls < limit:
            settle(*scheduled())
    else:  # EngineCore.step_with_batch_queue
        queue: deque[tuple[Any, dict[str, bool]]] = deque()
        size = cfg.max_concurrent_batches
        while (sched.has_requests() or queue) and calls < limit:
            if sched.has_requests():
                out, flags = scheduled()
                queue.appendleft((out, flags))
                executed = out.total_num_scheduled_tokens > 0
                if len(queue) < size and (executed or sched.has_requests()):
                    continue
            elif not queue:
                break
            settle(*queue.pop())
    peaks.seconds = time.perf_counter() - t0
    peaks.preemptions = sum(r.num_preemptions for r in requests)
    peaks.finished = sum(1 for r in requests if r.is_finished())
    return peaks


def _run_loop(s: Scenario, side: Any, name: str, seed: int) -> Peaks:
    engine = FcfsEngine(
        side,
        s.max_num_seqs,
        s.max_num_batched_tokens,
        s.max_model_len,
        long_prefill_token_threshold=0,
    )
    requests = make_requests(s, seed)
    for r in requests:
        engine.add(r)
    peaks = Peaks(name)

    def observe(running: list[SimRequest], sched: list[tuple[SimRequest, int]]) -> None:
        new = {id(r): n for r, n in sched}
        peaks.observe(
            len(running),
            sum(r.num_tokens for r in running),
            sum(r.computed + new.get(id(r), 0) for r in running),
        )

    engine.on_scheduled = observe
    limit = _max_steps(s)
    t0 = time.perf_counter()
    finished = 0
    while engine.has_requests() and engine.steps < limit:
        finished += len(engine.step().finished)
    peaks.seconds = time.perf_counter() - t0
    peaks.steps = engine.steps
    peaks.preemptions = engine.preemptions
    peaks.finished = finished
    return peaks


def run_loop_on_vllm(s: Scenario, setup: Any, seed: int = 0) -> Peaks:
    """The FCFS port over vLLM's own ``KVCacheManager`` (must equal the real scheduler)."""
    return _run_loop(s, VllmManagerSide(setup), "loop over vLLM's manager", seed)


def run_kvforge(
    s: Scenario,
    memory_bytes: int,
    options: Mapping[str, Any] | None = None,
    seed: int = 0,
    gate: bool = False,
) -> tuple[Peaks, dict[str, Any]]:
    """kvforge's plan at ``memory_bytes`` through the FCFS port; ``gate``: with vLLM's
    whole-prompt admission rule, probed on kvforge's pools (``KvforgeSide.gate_chunk``)."""
    manager, info = kvforge_manager(
        s.model, memory_bytes, enable_prefix_caching=False, options=options, **_engine_args(s)
    )
    side = KvforgeSide(manager, gate_chunk=s.max_num_batched_tokens if gate else None)
    name = "kvforge, whole-prompt gate" if gate else "kvforge"
    return _run_loop(s, side, name, seed), info


@dataclass
class CapacityRow:
    scenario: str
    model: str
    nominal_bytes: int
    memory_bytes: int  # both sides: vLLM's backing allocation, kvforge's memory_budget
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt_len: int
    output_len: int
    num_requests: int
    note: str = ""
    vllm_num_blocks: int | None = None
    vllm_bytes_per_block: int | None = None
    vllm_groups: list[str] | None = None
    #: side -> Peaks as a dict; sides: "vllm" (Scheduler), "vllm_async" (AsyncScheduler),
    #: "loop_check" (the FCFS port over vLLM's manager), "kvforge" (first chunk admits),
    #: "kvforge_gated" (whole-prompt gate)
    sides: dict[str, dict[str, Any]] = field(default_factory=dict)
    loop_matches_scheduler: bool | None = None
    kvforge_plan: list[str] | None = None
    kvforge_plan_bytes: int | None = None
    kvforge_pools: dict[str, int] | None = None
    #: "<kvforge side>/<vLLM side>" -> {"running": ratio, "tokens": ratio, "kv_tokens": ratio}
    ratios: dict[str, dict[str, float | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return a[key] / b[key] if b[key] else None


def run_capacity_vs_vllm(
    scenarios: Sequence[Scenario],
    with_vllm: bool = True,
    kvforge_options: Mapping[str, Any] | None = None,
    progress: Any = None,
    seed: int = 0,
) -> list[CapacityRow]:
    """Every scenario: vLLM's scheduler (and async one), the loop check, kvforge with and
    without the whole-prompt gate, at vLLM's backing bytes (the nominal budget without vLLM)."""
    rows = []
    for s in scenarios:
        row = CapacityRow(
            scenario=s.name,
            model=s.model,
            nominal_bytes=s.memory_bytes,
            memory_bytes=s.memory_bytes,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            prompt_len=s.prompt_len,
            output_len=s.output_len,
            num_requests=s.num_requests,
            note=s.note,
        )
        if progress is not None:
            progress.start(s.name, 2 + (2 + int(s.async_too) if with_vllm else 0))
        if with_vllm:
            import vllm_baseline as vb

            args = dict(_engine_args(s), enable_prefix_caching=False)
            try:
                setup = vb.build_vllm_cache_setup(s.model, s.memory_bytes, **args)
            except ValueError as exc:
                row.errors["vllm"] = str(exc)
                setup = None
            if setup is not None:
                row.memory_bytes = setup.memory_bytes
                row.vllm_num_blocks = setup.num_blocks
                row.vllm_bytes_per_block = setup.bytes_per_block
                row.vllm_groups = list(setup.groups)
                real = run_vllm_scheduler(s, setup, seed)
                row.sides["vllm"] = asdict(real)
                if progress is not None:
                    progress.advance()
                loop = run_loop_on_vllm(
                    s, vb.build_vllm_cache_setup(s.model, s.memory_bytes, **args), seed
                )
                row.sides["loop_check"] = asdict(loop)
                row.loop_matches_scheduler = loop.key() == real.key()
                if progress is not None:
                    progress.advance()
                if s.async_too:
                    async_setup = vb.build_vllm_cache_setup(
                        s.model, s.memory_bytes, async_scheduling=True, **args
                    )
                    row.sides["vllm_async"] = asdict(run_vllm_scheduler(s, async_setup, seed))
                    if progress is not None:
                        progress.advance()
        for key, gate in (("kvforge", False), ("kvforge_gated", True)):
            try:
                peaks, info = run_kvforge(s, row.memory_bytes, kvforge_options, seed, gate)
            except ValueError as exc:
                row.errors[key] = str(exc)
            else:
                row.sides[key] = asdict(peaks)
                row.kvforge_plan = info["plan"]
                row.kvforge_plan_bytes = info["plan_bytes"]
                row.kvforge_pools = info["pools"]
            if progress is not None:
                progress.advance()
        for k in ("kvforge", "kvforge_gated"):
            for v in ("vllm", "vllm_async"):
                if k in row.sides and v in row.sides:
                    a, b = row.sides[k], row.sides[v]
                    row.ratios[f"{k}/{v}"] = {
                        "running": _ratio(a, b, "peak_running"),
                        "tokens": _ratio(a, b, "peak_tokens"),
                        "kv_tokens": _ratio(a, b, "peak_kv_tokens"),
                    }
        rows.append(row)
    return rows


_SIDE_NAMES = {
    "vllm": "vLLM Scheduler",
    "vllm_async": "vLLM AsyncScheduler",
    "loop_check": "port on vLLM's manager",
    "kvforge": "kvforge, chunk admits",
    "kvforge_gated": "kvforge, gated",
}


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_rows(rows: Sequence[CapacityRow], out: Any) -> None:
    table = make_table(
        "capacity at equal bytes, after each step's scheduling: peak running requests, peak "
        "full-history tokens (sum of num_tokens), peak tokens with KV",
        (
            "scenario",
            "GiB",
            "N",
            "side",
            "peak reqs",
            "peak tokens",
            "peak KV tokens",
            "preempt",
            "steps",
            "tokens / vLLM",
            "KV tokens / vLLM",
        ),
        ("scenario", "side"),
    )
    for r in rows:
        first = True
        for key, d in r.sides.items():
            base = r.sides.get("vllm_async" if key == "vllm_async" else "vllm")
            vs = None if base is None or key.startswith("vllm") or key == "loop_check" else base
            table.add_row(
                r.scenario if first else "",
                f"{r.memory_bytes / GIB:.2f}" if first else "",
                str(r.max_num_seqs) if first else "",
                _SIDE_NAMES[key],
                f"{d['peak_running']:,}",
                f"{d['peak_tokens']:,}",
                f"{d['peak_kv_tokens']:,}",
                f"{d['preemptions']:,}",
                f"{d['steps']:,}",
                "-" if vs is None else _r(_ratio(d, vs, "peak_tokens")),
                "-" if vs is None else _r(_ratio(d, vs, "peak_kv_tokens")),
            )
            first = False
    out.print(table)
    for r in rows:
        if r.loop_matches_scheduler is not None:
            out.print(
                f"  {r.scenario}: the FCFS port on vLLM's manager "
                + ("reproduces" if r.loop_matches_scheduler else "DOES NOT reproduce")
                + " vLLM's Scheduler (peaks, preemptions, steps)"
            )
        for side, why in r.errors.items():
            out.print(f"  {r.scenario}: {side} did not run: {short_reason(why)}")
        stopped = [k for k, d in r.sides.items() if d["finished"] < r.num_requests]
        if stopped:
            out.print(
                f"  {r.scenario}: stopped at the step cap with requests unfinished ("
                + ", ".join(
                    f"{_SIDE_NAMES[k]} {r.sides[k]['finished']} of {r.num_requests}"
                    for k in stopped
                )
                + ")"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=None, help="comma-separated scenario names")
    parser.add_argument("--quick", action="store_true", help="small scenarios (tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--no-vllm", action="store_true", help="kvforge only")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--kvforge-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an option for kvforge's plan_memory / BlockManager (repeatable)",
    )
    args = parser.parse_args(argv)
    known = QUICK_SCENARIOS if args.quick else SCENARIOS
    scenarios = list(known)
    if args.scenarios:
        by_name = {s.name: s for s in known}
        wanted = [n.strip() for n in args.scenarios.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in by_name]
        if unknown:
            parser.error(f"--scenarios: unknown {unknown}; known: {', '.join(by_name)}")
        scenarios = [by_name[n] for n in wanted]
    try:
        options = parse_kvforge_options(args.kvforge_option)
    except ValueError as exc:
        parser.error(str(exc))
    out = console()
    with_vllm = not args.no_vllm
    if with_vllm and not vllm_available():
        out.print(
            f"vLLM {VLLM_VERSION} is not importable here: run with ~/.venv-vllm/bin/python "
            "(PYTHONPATH=.; see docs/vllm_baseline.md), or pass --no-vllm for the "
            "kvforge side alone"
        )
        return 2
    env = environment(with_vllm)
    settings = kvforge_settings(options)
    out.print(
        f"python {env['python']}, {env['cpu_count']} cpus, load {env['load_before'][0]}, "
        f"vLLM {env['vllm'] or 'absent (kvforge only)'}; kvforge share_pools="
        f"{settings['controller'].get('share_pools')}, options {settings['options'] or 'none'}"
    )
    from prefix_vs_vllm import _progress_bar

    t0 = time.perf_counter()
    gen = _progress_bar(not args.no_progress, out)
    progress = next(gen)
    try:
        rows = run_capacity_vs_vllm(scenarios, with_vllm, options, progress, args.seed)
    finally:
        gen.close()
    env["seconds"] = round(time.perf_counter() - t0, 1)
    env["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print_rows(rows, out)
    if args.json:
        data = {
            "environment": env,
            "kvforge": settings,
            "scenarios": [asdict(s) for s in scenarios],
            "rows": [asdict(r) for r in rows],
        }
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
        out.print(f"wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
