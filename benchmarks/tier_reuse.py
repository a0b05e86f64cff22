#!/usr/bin/env python
"""Prefix reuse under device pressure, device only and with a host tier, in one run.

Issue 22's measure: the seeded multi-turn conversations of :mod:`prefix_sim`, the device at a
quarter of each model's working set (kvforge's pools split as ``bench_prefix.py`` splits
them), once with the device alone and once with a host tier of half the working set
(``kvforge.scheduler.host_tier.attach``: every evicted cached block demoted to a host page,
every lookup bringing back what only the host holds), against the aligned oracle (unbounded
pools). Both runs drive the real ``BlockManager``; the page copies a worker would run are
handed out and dropped (this measures hits, not bytes: the tests check the bytes).

Usage::

    PYTHONPATH=. python benchmarks/tier_reuse.py [--json PATH] [--models a,b]
        [--fraction 1/4] [--host 1/2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_sim import (
    MODELS,
    ManagerModel,
    PrefixWorkload,
    _memory_bytes,
    _pools,
    _unbounded_blocks,
    floor_blocks,
    make_conversations,
    simulate,
    split_pools,
    tail_cache,
    working_set,
)

from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import shared_pool_blocks
from kvforge.models import from_hf_config
from kvforge.scheduler import host_tier

#: the issue's four models (Gemma-2-9B is not one of prefix_sim's bundled runs)
TIER_MODELS: dict[str, str] = {**MODELS, "gemma-2-9b": "gemma-2-9b"}


class TieredModel(ManagerModel):
    """:class:`prefix_sim.ManagerModel` with a host tier of ``pages`` per group."""

    def __init__(
        self,
        layout: CacheLayout,
        num_blocks: Mapping[str, int],
        pages: Mapping[str, int],
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        super().__init__(layout, num_blocks, max_num_seqs, max_model_len, share_pools=True)
        self.tier = host_tier.attach(self.manager, pages)


@dataclass
class TierRecord:
    model: str
    device_fraction: str
    host_fraction: str
    device_bytes: int
    host_bytes: int
    prompt_tokens: int
    oracle_tokens: int
    device_tokens: int
    tiered_tokens: int
    host_hit_tokens: int
    device_vs_oracle: float
    tiered_vs_oracle: float
    host_demotions: int
    host_evictions: int


def run(
    wl: PrefixWorkload, models: Sequence[str], fraction: Fraction, host: Fraction
) -> list[TierRecord]:
    convs = make_conversations(wl)
    out = []
    for name in models:
        layout = CacheLayout(from_hf_config(TIER_MODELS[name]))
        print(f"{name}: aligned oracle", file=sys.stderr, flush=True)
        oracle_model = ManagerModel(
            layout, _unbounded_blocks(layout, convs), wl.max_num_seqs, wl.max_model_len
        )
        oracle = simulate(wl, convs, oracle_model)
        ws = working_set(layout, wl, oracle_model.peak)
        floor = floor_blocks(layout, wl, oracle_model.live_peak)
        tails = tail_cache(layout, wl, convs, ws, floor, oracle.hit_tokens)
        target = _memory_bytes(layout, _pools(ws, fraction, floor))
        num_blocks = shared_pool_blocks(layout, split_pools(layout, ws, floor, tails, target))
        device_bytes = _memory_bytes(layout, num_blocks, share_pools=True)
        pages = {
            g.name: math.ceil(ws[g.name] * host) + 1
            for g in layout.groups
            if layout.host_page_bytes(g.name) and not g.rule.per_request
        }
        host_bytes = sum((n - 1) * layout.host_page_bytes(g) for g, n in pages.items())
        print(f"{name}: device only at {fraction}", file=sys.stderr, flush=True)
        device = simulate(
            wl,
            convs,
            ManagerModel(layout, num_blocks, wl.max_num_seqs, wl.max_model_len, share_pools=True),
        )
        print(f"{name}: device at {fraction}, host tier at {host}", file=sys.stderr, flush=True)
        tiered_model = TieredModel(layout, num_blocks, pages, wl.max_num_seqs, wl.max_model_len)
        tiered = simulate(wl, convs, tiered_model)
        stats = tiered_model.tier.stats
        out.append(
            TierRecord(
                model=name,
                device_fraction=str(fraction),
                host_fraction=str(host),
                device_bytes=device_bytes,
                host_bytes=host_bytes,
                prompt_tokens=oracle.prompt_tokens,
                oracle_tokens=oracle.hit_tokens,
                device_tokens=device.hit_tokens,
                tiered_tokens=tiered.hit_tokens,
                host_hit_tokens=stats.hit_tokens,
                device_vs_oracle=device.hit_tokens / oracle.hit_tokens,
                tiered_vs_oracle=tiered.hit_tokens / oracle.hit_tokens,
                host_demotions=sum(stats.demotions.values()),
                host_evictions=sum(stats.evictions.values()),
            )
        )
    return out


def print_table(records: Sequence[TierRecord]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Prefix reuse under device pressure: device only vs host tier")
    for col in (
        "model",
        "device",
        "host",
        "oracle hits",
        "device only",
        "tiered",
        "device / oracle",
        "tiered / oracle",
    ):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in records:
        table.add_row(
            r.model,
            f"{r.device_fraction} ({r.device_bytes / 2**30:.2f} GiB)",
            f"{r.host_fraction} ({r.host_bytes / 2**30:.2f} GiB)",
            f"{r.oracle_tokens:,}",
            f"{r.device_tokens:,}",
            f"{r.tiered_tokens:,}",
            f"{r.device_vs_oracle:.3f}",
            f"{r.tiered_vs_oracle:.3f}",
        )
    Console(stderr=True).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--models", default=None, help=f"of {', '.join(TIER_MODELS)}")
    parser.add_argument(
        "--fraction",
        type=Fraction,
        default=Fraction(1, 4),
        help="device memory, of the working set",
    )
    parser.add_argument(
        "--host", type=Fraction, default=Fraction(1, 2), help="host tier pages, of the working set"
    )
    parser.add_argument("--quick", action="store_true", help="16 conversations (tests)")
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else list(TIER_MODELS)
    unknown = [m for m in models if m not in TIER_MODELS]
    if unknown:
        parser.error(f"--models: {unknown} are not of {list(TIER_MODELS)}")
    if not (args.fraction > 0 and args.host > 0):
        parser.error(f"--fraction and --host must be > 0, got {args.fraction}, {args.host}")
    wl = PrefixWorkload(num_conversations=16, concurrency=8) if args.quick else PrefixWorkload()
    records = run(wl, models, args.fraction, args.host)
    print_table(records)
    if args.json:
        env = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "workload": wl.model_dump(),
        }
        Path(args.json).write_text(
            json.dumps({"environment": env, "runs": [asdict(r) for r in records]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
