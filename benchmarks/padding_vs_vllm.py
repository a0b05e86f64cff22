#!/usr/bin/env python
"""Device padding per group: kvforge's slab arena beside vLLM 0.33's one pool, same model and
budget.

vLLM (``benchmarks/vllm_baseline.py``, ``build_vllm_cache_setup``: ``get_global_kv_cache_groups``
and ``get_kv_cache_configs`` in ``vllm/v1/core/kv_cache_planning.py``) stores each layer's page
(``real_page_size_bytes`` of the group's spec, ``vllm/v1/kv_cache_interface.py``) in a padded
page (``page_size_bytes``) and backs every block id with one ``bytes_per_block`` across its
packed layers; the rows give the per-page padding. kvforge
(``kvforge.core.arena.plan_arena``) pads each group's page to its stride. Run with vLLM
installed as ``docs/vllm_baseline.md`` says::

    PYTHONPATH=. ~/.venv-vllm/bin/python benchmarks/padding_vs_vllm.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = (("deepseek-v4-tiny", 1 << 30, 65536, 64), ("deepseek-v4-flash", 60 << 30, 65536, 256))


def vllm_padding(model: str, budget: int, max_model_len: int, seqs: int) -> list[dict[str, Any]]:
    """Per vLLM group: one layer's real page (``real_page_size_bytes``) and the page vLLM
    stores it in (``page_size_bytes``, padded), from the group's own spec. Every block id then
    costs ``bytes_per_block`` of the one backing allocation across the packed layers."""
    import vllm_baseline as vb

    setup = vb.build_vllm_cache_setup(
        model,
        budget,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
    )
    rows = []
    for group, text in zip(setup.kv_cache_config.kv_cache_groups, setup.groups, strict=True):
        spec = group.kv_cache_spec
        real = int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
        rows.append(
            {
                "group": text,
                "real_bytes": real,
                "block_bytes": int(spec.page_size_bytes),
                "padding": spec.page_size_bytes / real - 1,
                "bytes_per_block_id": int(setup.bytes_per_block),
            }
        )
    return rows


def kvforge_padding(model: str, budget: int) -> list[dict[str, Any]]:
    from kvforge.core.arena import plan_arena
    from kvforge.core.layout import CacheLayout
    from kvforge.models import from_hf_config

    arena = plan_arena(CacheLayout(from_hf_config(model)), budget)
    assert arena is not None
    return [
        {"group": g, "real_bytes": p, "block_bytes": s, "padding": s / p - 1}
        for g, p, s in zip(arena.groups, arena.page_bytes, arena.block_stride, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    report = {}
    for model, budget, model_len, seqs in CASES:
        report[model] = {
            "budget": budget,
            "vllm": vllm_padding(model, budget, model_len, seqs),
            "kvforge": kvforge_padding(model, budget),
        }
        table = Table(title=f"{model}: device bytes per block and padding, {budget:,} B")
        for col in ("side", "group", "real B", "block B", "padding"):
            table.add_column(col, justify="left" if col in ("side", "group") else "right")
        for side in ("vllm", "kvforge"):
            for r in report[model][side]:
                table.add_row(
                    side,
                    r["group"],
                    f"{r['real_bytes']:,}",
                    f"{r['block_bytes']:,}",
                    f"{r['padding']:.2%}",
                )
        Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
