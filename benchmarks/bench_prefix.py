#!/usr/bin/env python
"""Prefix reuse: kvforge's prefix cache on seeded multi-turn conversations, and its cost vs vLLM.

The kvforge side is :mod:`prefix_sim`: conversations through
``BlockManager`` (lookup, chunked prefill with prefix matches, one decode token per step,
finish) for DeepSeek-V4-Flash, Llama-3-8B and gpt-oss-20b, at memory sizes from "nothing is
ever evicted" down to a quarter of the working set (kvforge's pools split as its planner
sizes them: window/state groups their floor plus a measured tail cache, full groups the rest),
against the aligned oracle, the token oracle, a plain LRU over all groups at exactly the same
bytes and a history-only cache. The vLLM side
is ``vllm_baseline.run_vllm_prefix_cost``: vLLM's default block hasher and
``KVCacheManager.get_computed_blocks`` on a 2,048-token prompt, block 16, measured in the same
run; vLLM figures are null where vLLM is not installed (the project's ``.venv``). vLLM runs in
``/work/.venv-vllm`` (see ``docs/vllm_baseline.md``).

Usage::

    /work/.venv-vllm/bin/python benchmarks/bench_prefix.py [--json PATH] [--seed 0]
        [--conversations 64] [--concurrency 32]
        [--max-num-seqs 16] [--models a,b] [--repeats 200] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_sim import (
    MODELS,
    PrefixWorkload,
    print_prefix_table,
    run_prefix_bench,
    write_prefix_json,
)
from vllm_baseline import VLLM_VERSION, run_vllm_prefix_cost, vllm_available

from kvforge.cli.formatting import console


def _vllm_cost(repeats: int):
    def cost(prompt_len: int, block_size: int) -> tuple[float, float]:
        figures = run_vllm_prefix_cost(prompt_len, block_size, repeats)
        return figures["hash_us"], figures["lookup_us"]

    return cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the records to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32, help="open conversations")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="running requests")
    parser.add_argument("--models", default=None, help="comma-separated (default all)")
    parser.add_argument("--repeats", type=int, default=200, help="rounds of the cost figures")
    parser.add_argument(
        "--quick", action="store_true", help="16 conversations, 8 open, 4 running"
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
    conversations, concurrency, seqs = (16, 8, 4) if args.quick else (
        args.conversations, args.concurrency, args.max_num_seqs
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
    out.print(
        f"python {platform.python_version()}, cpus {os.cpu_count()}, load "
        f"{os.getloadavg()[0]:.2f}, vLLM "
        f"{VLLM_VERSION if with_vllm else 'absent (kvforge side only)'}, seed {wl.seed}, "
        f"{wl.num_conversations} conversations, {wl.concurrency} open, {wl.max_num_seqs} running"
    )
    records = run_prefix_bench(
        wl,
        models,
        cost_repeats=args.repeats,
        vllm_cost=_vllm_cost(args.repeats) if with_vllm else None,
        progress=None if args.no_progress else (lambda s: out.print(f"  {s} ...")),
    )
    print_prefix_table(records, "prefix reuse: token hit rates; hashing + lookup of 2,048 tokens")
    if args.json:
        write_prefix_json(records, args.json)
        out.print(f"wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
