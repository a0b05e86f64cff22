#!/usr/bin/env python
"""Prefix reuse: kvforge's prefix cache on seeded multi-turn conversations, and its cost vs vLLM.

The kvforge side is :mod:`prefix_sim`: conversations through
``BlockManager`` (lookup, chunked prefill with prefix matches, one decode token per step,
finish) for DeepSeek-V4-Flash, Llama-3-8B and gpt-oss-20b, at memory sizes from "nothing is
ever evicted" down to a quarter of the working set (kvforge's pools split as its planner
sizes them: window/state groups their floor plus a measured tail cache, full groups the rest),
against the aligned oracle, the token oracle, a plain LRU over all groups at exactly the same
bytes and a history-only cache.

Cost (:func:`measure_costs`, one :class:`CostRecord` per model): a 2,048-token prompt that a
first request served and finished, looked up again (a full hit), medians over ``--repeats``
rounds, both sides in this process and run, their rounds interleaved (a kvforge round, then a
vLLM round) so both see the same machine load:

- kvforge: ``BlockManager.lookup`` (it hashes the prompt, looks the keys up and runs the exact
  check: ``kvforge_lookup_us``, the figure compared) and, separately, the hashing alone
  (``kvforge_hash_us``), by ``prefix_sim.measure_cost``;
- vLLM 0.33 (``vllm_baseline.VllmPrefixRounds``, where the model has a vLLM config there:
  Llama-3-8B at block 16, DeepSeek-V4-Flash at block 256): its default sha256 request block
  hasher (``vllm_hash_us``) and ``KVCacheManager.get_computed_blocks`` (``vllm_lookup_us``);
- ``ratio = kvforge_lookup_us / (vllm_hash_us + vllm_lookup_us)`` (issue 19's goal: <= 0.5).

vLLM figures are null where vLLM is not installed (the project's ``.venv``) or with
``--no-vllm``. vLLM runs in ``~/.venv-vllm`` (see ``docs/vllm_baseline.md``), kvforge from
the checkout (``PYTHONPATH=.``).

``--json`` writes ``{"environment": ..., "cost": [CostRecord, ...], "runs": [PrefixRecord,
...]}``; the runs' ``hash_us`` / ``lookup_us`` / ``vllm_*`` / ``hash_lookup_ratio`` are their
model's cost record's figures. ``--cost-only`` skips the hit-rate runs (``runs`` is empty).

Usage::

    PYTHONPATH=. ~/.venv-vllm/bin/python benchmarks/bench_prefix.py [--json PATH]
        [--seed 0] [--conversations 64] [--concurrency 32] [--max-num-seqs 16] [--models a,b]
        [--repeats 200] [--quick] [--cost-only] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_sim import (
    MODELS,
    PrefixRecord,
    PrefixWorkload,
    build_layout,
    measure_cost,
    print_prefix_table,
    run_prefix_bench,
)
from vllm_baseline import PREFIX_MODELS, VLLM_VERSION, VllmPrefixRounds, vllm_available

from kvforge.cli.formatting import console, make_table
from kvforge.scheduler.block_manager import BlockManager

PROMPT_LEN = 2048

#: ``(model, prompt_len) -> VllmPrefixRounds`` (a context; each call one timed round; its
#: ``figures()`` the medians), or None where vLLM has no config of the model
VllmRounds = Callable[[str, int], Any]


@dataclass
class CostRecord:
    """Hashing and full-hit lookup of one 2,048-token prompt, kvforge and vLLM, in us."""

    model: str
    prompt_tokens: int
    repeats: int
    kvforge_hash_us: float  # the prompt's key chain alone (PrefixHasher.extend)
    kvforge_lookup_us: float  # BlockManager.lookup: hashing, lookup and exact check
    kvforge_unit: int  # tokens per hashed unit (BlockManager.prefix_unit)
    kvforge_hit_tokens: int
    vllm_hash_us: float | None  # the request block hasher over the prompt
    vllm_lookup_us: float | None  # KVCacheManager.get_computed_blocks
    vllm_hash_block_size: int | None  # tokens per vLLM block hash
    vllm_block_size: int | None  # vLLM's scheduler block size
    vllm_hit_tokens: int | None
    vllm_groups: list[str] | None  # vLLM's KV cache groups
    ratio: float | None  # kvforge_lookup_us / (vllm_hash_us + vllm_lookup_us)


def _kvforge_unit_and_hit(model: str, prompt_len: int) -> tuple[int, int]:
    layout = build_layout(model)
    manager = BlockManager(
        layout,
        {g.name: 2 for g in layout.groups},
        1,
        prompt_len + 64,
        enable_prefix_caching=True,
    )
    boundary = manager.boundary
    return manager.prefix_unit, (prompt_len - 1) // boundary * boundary


def vllm_rounds(model: str, prompt_len: int) -> VllmPrefixRounds | None:
    """vLLM's side for ``model`` (None where ``vllm_baseline`` has no config of it)."""
    if model not in PREFIX_MODELS:
        return None
    return VllmPrefixRounds(model, prompt_len)


def measure_costs(
    models: Sequence[str],
    repeats: int,
    vllm: VllmRounds | None = None,
    prompt_len: int = PROMPT_LEN,
    progress: Callable[[str], None] | None = None,
) -> list[CostRecord]:
    """One :class:`CostRecord` per model: kvforge's side by ``prefix_sim.measure_cost`` and,
    with ``vllm`` (None: kvforge only), vLLM's rounds run between kvforge's, round by round, on
    the same seeded prompt; medians of ``repeats`` rounds after a warm-up round each."""
    say = progress or (lambda _label: None)
    records = []
    for model in models:
        layout = build_layout(model)
        rounds = None if vllm is None else vllm(model, prompt_len)
        say(f"{model}: kvforge" + (" and vLLM, interleaved" if rounds is not None else ""))
        # measure_cost's prompt is vllm_baseline.prefix_prompt's: seed 1, ids in [0, 128000)
        if rounds is None:
            kv_hash, kv_lookup = measure_cost(layout, prompt_len, repeats)
            figures = None
        else:
            with rounds:
                kv_hash, kv_lookup = measure_cost(layout, prompt_len, repeats, interleave=rounds)
            figures = rounds.figures()
        unit, hit = _kvforge_unit_and_hit(model, prompt_len)
        v_hash = v_lookup = ratio = None
        if figures is not None:
            v_hash, v_lookup = float(figures["hash_us"]), float(figures["lookup_us"])
            ratio = kv_lookup / (v_hash + v_lookup)
        records.append(
            CostRecord(
                model=model,
                prompt_tokens=prompt_len,
                repeats=repeats,
                kvforge_hash_us=kv_hash,
                kvforge_lookup_us=kv_lookup,
                kvforge_unit=unit,
                kvforge_hit_tokens=hit,
                vllm_hash_us=v_hash,
                vllm_lookup_us=v_lookup,
                vllm_hash_block_size=None if figures is None else figures["hash_block_size"],
                vllm_block_size=None if figures is None else figures["scheduler_block_size"],
                vllm_hit_tokens=None if figures is None else figures["hit_tokens"],
                vllm_groups=None if figures is None else list(figures["groups"]),
                ratio=ratio,
            )
        )
    return records


def apply_costs(runs: Sequence[PrefixRecord], costs: Sequence[CostRecord]) -> None:
    """Give each hit-rate run its model's cost figures (the runs measure none themselves)."""
    by_model = {c.model: c for c in costs}
    for r in runs:
        c = by_model.get(r.model)
        if c is None:
            continue
        r.hash_us, r.lookup_us = c.kvforge_hash_us, c.kvforge_lookup_us
        r.vllm_hash_us, r.vllm_lookup_us = c.vllm_hash_us, c.vllm_lookup_us
        r.hash_lookup_ratio = c.ratio


def print_cost_table(costs: Sequence[CostRecord], out: Any) -> None:
    def us(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    repeats = costs[0].repeats if costs else 0
    table = make_table(
        f"prefix cost: {PROMPT_LEN}-token prompt, full hit, us (medians of {repeats})",
        (
            "model",
            "kvforge hash",
            "kvforge lookup",
            "unit",
            "vLLM hash",
            "vLLM lookup",
            "vLLM total",
            "vLLM hash unit / block",
            "hit",
            "ratio",
        ),
        ("model",),
    )
    for c in costs:
        vllm_total = (
            None
            if c.vllm_hash_us is None or c.vllm_lookup_us is None
            else c.vllm_hash_us + c.vllm_lookup_us
        )
        table.add_row(
            c.model,
            us(c.kvforge_hash_us),
            us(c.kvforge_lookup_us),
            str(c.kvforge_unit),
            us(c.vllm_hash_us),
            us(c.vllm_lookup_us),
            us(vllm_total),
            "-"
            if c.vllm_hash_block_size is None
            else f"{c.vllm_hash_block_size} / {c.vllm_block_size}",
            str(c.kvforge_hit_tokens)
            if c.vllm_hit_tokens in (None, c.kvforge_hit_tokens)
            else f"{c.kvforge_hit_tokens} (vLLM {c.vllm_hit_tokens})",
            "-" if c.ratio is None else f"{c.ratio:.3f}",
        )
    out.print(table)


def write_json(
    path: str | Path,
    environment: dict[str, Any],
    costs: Sequence[CostRecord],
    runs: Sequence[PrefixRecord],
) -> None:
    data = {
        "environment": environment,
        "cost": [asdict(c) for c in costs],
        "runs": [asdict(r) for r in runs],
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the records to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32, help="open conversations")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="running requests")
    parser.add_argument("--models", default=None, help="comma-separated (default all)")
    parser.add_argument("--repeats", type=int, default=200, help="rounds of the cost figures")
    parser.add_argument("--quick", action="store_true", help="16 conversations, 8 open, 4 running")
    parser.add_argument(
        "--cost-only", action="store_true", help="the cost figures only, no hit-rate runs"
    )
    parser.add_argument("--no-vllm", action="store_true", help="kvforge side only")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    models = list(MODELS)
    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            parser.error(f"--models: unknown {unknown}; known: {sorted(MODELS)}")
    conversations, concurrency, seqs = (
        (16, 8, 4) if args.quick else (args.conversations, args.concurrency, args.max_num_seqs)
    )
    try:
        wl = PrefixWorkload(
            seed=args.seed,
            num_conversations=conversations,
            concurrency=concurrency,
            max_num_seqs=seqs,
        )
    except ValueError as exc:
        parser.error(str(exc))
    with_vllm = not args.no_vllm and vllm_available()
    out = console()
    progress = None if args.no_progress else (lambda s: out.print(f"  {s} ..."))
    load_before = os.getloadavg()
    environment: dict[str, Any] = {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "vllm": VLLM_VERSION if with_vllm else None,
        "load_before": [round(x, 2) for x in load_before],
    }
    out.print(
        f"python {platform.python_version()}, cpus {os.cpu_count()}, load "
        f"{load_before[0]:.2f}, vLLM "
        f"{VLLM_VERSION if with_vllm else 'absent (kvforge side only)'}, "
        f"{args.repeats} cost rounds"
        + (
            ""
            if args.cost_only
            else (
                f", seed {wl.seed}, {wl.num_conversations} conversations, {wl.concurrency} open, "
                f"{wl.max_num_seqs} running"
            )
        )
    )
    costs = measure_costs(
        models, args.repeats, vllm_rounds if with_vllm else None, progress=progress
    )
    environment["load_after_cost"] = [round(x, 2) for x in os.getloadavg()]
    print_cost_table(costs, out)
    out.print(
        f"load average (1, 5, 15 min) before {environment['load_before']}, after the cost "
        f"figures {environment['load_after_cost']}"
    )
    runs: list[PrefixRecord] = []
    if not args.cost_only:
        runs = run_prefix_bench(wl, models, cost_repeats=0, vllm_cost=None, progress=progress)
        apply_costs(runs, costs)
        print_prefix_table(runs, "prefix reuse: token hit rates; hashing + lookup of 2,048 tokens")
    if args.json:
        write_json(args.json, environment, costs, runs)
        out.print(f"wrote {len(costs)} cost records and {len(runs)} runs to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
