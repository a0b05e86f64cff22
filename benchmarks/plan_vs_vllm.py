#!/usr/bin/env python
"""kvforge's memory plans against vLLM 0.33's own KV cache sizing, at the same concurrency.

kvforge (:func:`kvforge.core.memory_plan.plan_memory`) gives every group its own
pool: window and state groups get ``n * max_live_blocks(L) + cdiv(T, B) + N`` blocks (plus a
null block), full groups the rest. vLLM 0.33 has one shared pool for all groups (hybrid
allocator) and admits a request into a sliding-window group with a reservation of
``SlidingWindowSpec.max_admission_blocks_per_request(max_in_flight_tokens, L)`` =
``cdiv(min(W - 1 + T, L), B) + 1`` blocks, the figure its startup sizing
(``max_memory_usage_bytes``) and its admission gate share. At concurrency ``N`` the vLLM
full-history capacity is what the shared pool has left once ``N`` requests hold that many blocks
in every window and state group.

How each vLLM figure is obtained:

- Gemma-2-9B shape: vLLM's own functions on vLLM spec objects built by hand (no GPU, no model):
  ``get_kv_cache_groups`` then ``get_kv_cache_config_from_groups`` (``NHD`` layout, hybrid
  manager on) give the pool's ``num_blocks``; block 0 is the null block. The per-request
  window reservation is ``max_admission_blocks_per_request`` of the group's own spec.
- DeepSeek-V4-Flash: vLLM 0.33 declares V4's caches per layer (``SlidingWindowMLASpec`` swa,
  ``MLAAttentionSpec`` compressed and indexer caches with ``tokens_per_state`` = compress
  ratio, ``SlidingWindowMLASpec`` compressor states with window ``coff * ratio``) and packs
  them block-outermost (``_get_packed_kv_cache_groups``), which only adds padding. The
  comparison models an *ideal* shared pool instead: each group's block costs exactly kvforge's
  device bytes per block (same entries, same 576-byte alignment), no null block and no packing
  padding. That overstates vLLM's capacity, so kvforge at least matching it is a conservative
  result. The window reservations still come from vLLM's own method, on ``SlidingWindowSpec``
  objects with kvforge's block sizes and windows (swa: 64 / 128, c4 states: 4 / 8, c128
  states: 8 / 128, the same figures vLLM's V4 code uses).

``max_in_flight_tokens`` is ``max_num_batched_tokens`` (one batch in flight: no async
scheduling, no pipeline parallelism); with async scheduling vLLM reserves twice as much. A second
vLLM figure, "decode", charges each request only the blocks its window spans between steps
(``max_in_flight_tokens = 1``): the least N resident requests can hold, for context.

Usage (needs vLLM 0.33, e.g. ``/work/.venv-vllm``)::

    /work/.venv-vllm/bin/python benchmarks/plan_vs_vllm.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import MemoryPlan, plan_memory
from kvforge.models.hf_config import from_hf_config
from kvforge.specs import GroupKind

GIB = 1 << 30
MAX_NUM_BATCHED_TOKENS = 8192
CONCURRENCIES = (16, 256)


@dataclass(frozen=True)
class Case:
    """One model and budget of the comparison."""

    name: str
    hf_name: str
    dtype: str | None
    budget: int
    max_model_len: int
    vllm_method: str


CASES = (
    Case("DeepSeek-V4-Flash", "deepseek-v4-flash", None, 60 * GIB, 65_536, "ideal shared pool"),
    Case("Gemma-2-9B", "gemma-2-9b", "bfloat16", 20 * GIB, 8_192, "vLLM functions"),
)


@dataclass
class Row:
    """The figures of one model at one concurrency."""

    model: str
    concurrency: int
    kvforge_tokens: int
    vllm_tokens: int
    vllm_decode_tokens: int
    kvforge_bytes: dict[str, int]
    vllm_bytes: dict[str, int]
    vllm_blocks_per_request: dict[str, int]
    max_concurrency: int | None
    warnings: list[str]
    vllm_note: str = ""
    host_page_bytes: dict[str, int] = field(default_factory=dict)
    device_block_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> Fraction | None:
        return None if self.vllm_tokens == 0 else Fraction(self.kvforge_tokens, self.vllm_tokens)


def _ratio_text(r: Fraction | None) -> str:
    if r is None:
        return "inf (vLLM: 0)"
    thousandths = r.numerator * 1000 // r.denominator  # integer display, no float
    return f"{thousandths // 1000}.{thousandths % 1000:03d}"


def _layout(case: Case) -> CacheLayout:
    kwargs = {} if case.dtype is None else {"dtype": case.dtype}
    return CacheLayout(from_hf_config(case.hf_name, **kwargs))


def _kvforge_plan(layout: CacheLayout, case: Case, n: int) -> MemoryPlan:
    return plan_memory(layout, case.budget, n, case.max_model_len, MAX_NUM_BATCHED_TOKENS)


def _vllm_window_spec(block_size: int, window: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    # head shape is irrelevant to the admission cap, which reads only window and block size
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.uint8,
        sliding_window=window,
    )


def _vllm_config_namespace() -> Any:
    """The fields of ``VllmConfig`` that vLLM's grouping and sizing functions read (a real
    ``VllmConfig`` cannot be built here: it needs a device)."""
    from vllm.config.cache import _layout_from_name

    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=False,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            kv_cache_layout="NHD",
            get_resolved_kv_cache_layout=lambda: _layout_from_name("NHD"),
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
        ),
    )


def _gemma_vllm_pool(case: Case) -> tuple[int, int, dict[str, Any]]:
    """(usable blocks, bytes per block, vLLM spec per kvforge group) from vLLM's functions."""
    import torch
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs: dict[str, Any] = {}
    for i in range(42):  # Gemma-2-9B: even layers sliding window 4096, odd layers full
        common = {"block_size": 16, "num_kv_heads": 8, "head_size": 256, "dtype": torch.bfloat16}
        if i % 2 == 0:
            specs[f"layers.{i}"] = SlidingWindowSpec(sliding_window=4096, **common)
        else:
            specs[f"layers.{i}"] = FullAttentionSpec(**common)
    config = _vllm_config_namespace()
    groups = planning.get_kv_cache_groups(config, specs)
    kv_config = planning.get_kv_cache_config_from_groups(config, groups, case.budget)
    by_kind: dict[str, Any] = {}
    page = 0
    for g in groups:
        spec = g.kv_cache_spec
        by_kind["swa" if isinstance(spec, SlidingWindowSpec) else "kv"] = spec
        page = max(page, spec.page_size_bytes * len(g.layer_names))
    return kv_config.num_blocks - 1, page, by_kind  # block 0: vLLM's null block


def compare(case: Case, n: int) -> Row:
    layout = _layout(case)
    plan = _kvforge_plan(layout, case, n)
    full = [g for g in layout.groups if g.kind is GroupKind.FULL]
    windows = [g for g in layout.groups if g.kind is not GroupKind.FULL]
    assert len(full) == 1, "the comparison models one full-history group"
    (hist,) = full
    block_bytes = {g.name: layout.bytes_per_block(g.name) for g in layout.groups}
    if case.vllm_method == "vLLM functions":
        usable, page, vspecs = _gemma_vllm_pool(case)
        assert all(block_bytes[g.name] == page for g in layout.groups), "uniform page expected"
        pool_bytes = usable * page
        spec_of = {g.name: vspecs[g.name] for g in windows}
        note = f"vLLM pool: {usable + 1:,} blocks x {page:,} B (block 0 null)"
    else:
        pool_bytes = case.budget
        spec_of = {g.name: _vllm_window_spec(g.block_size, g.window) for g in windows}
        note = "ideal shared pool: kvforge's device bytes per block, no null block, no packing"

    def held(in_flight: int) -> dict[str, int]:
        return {
            name: spec.max_admission_blocks_per_request(in_flight, case.max_model_len)
            for name, spec in spec_of.items()
        }

    def history_tokens(per_request: dict[str, int]) -> tuple[int, dict[str, int]]:
        spent = {name: n * blocks * block_bytes[name] for name, blocks in per_request.items()}
        left = pool_bytes - sum(spent.values())
        blocks = max(0, left // block_bytes[hist.name])
        spent[hist.name] = blocks * block_bytes[hist.name]
        return blocks * hist.block_size, spent

    per_request = held(MAX_NUM_BATCHED_TOKENS)
    vllm_tokens, vllm_bytes = history_tokens(per_request)
    decode_tokens, _ = history_tokens(held(1))
    if vllm_tokens == 0:
        need = sum(n * b * block_bytes[name] for name, b in per_request.items())
        note += f"; window groups alone need {need:,} B of {pool_bytes:,} B"
    return Row(
        model=case.name,
        concurrency=n,
        kvforge_tokens=plan.max_tokens or 0,
        vllm_tokens=vllm_tokens,
        vllm_decode_tokens=decode_tokens,
        kvforge_bytes={g.group: g.total_bytes for g in plan.groups},
        vllm_bytes=vllm_bytes,
        vllm_blocks_per_request=per_request,
        max_concurrency=plan.max_concurrency,
        warnings=list(plan.warnings),
        vllm_note=note,
        host_page_bytes={g.name: layout.host_page_bytes(g.name) for g in layout.groups},
        device_block_bytes=block_bytes,
    )


def _print(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Full-history capacity at the same concurrency: kvforge vs vLLM 0.33")
    for col in ("model", "N", "kvforge tokens", "vLLM tokens", "ratio", "vLLM decode tokens",
                "kvforge max_concurrency"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for r in rows:
        table.add_row(
            r.model, f"{r.concurrency:,}", f"{r.kvforge_tokens:,}", f"{r.vllm_tokens:,}",
            _ratio_text(r.ratio), f"{r.vllm_decode_tokens:,}", f"{r.max_concurrency:,}",
        )
    console = Console(width=150)
    console.print(table)
    groups = Table(title="Bytes per group (kvforge plan | vLLM at N requests)")
    for col in ("model", "N", "group", "kvforge B", "vLLM B", "vLLM blocks/request"):
        groups.add_column(col, justify="left" if col in ("model", "group") else "right")
    for r in rows:
        for name, kb in r.kvforge_bytes.items():
            per = r.vllm_blocks_per_request.get(name)
            groups.add_row(
                r.model, f"{r.concurrency:,}", name, f"{kb:,}", f"{r.vllm_bytes[name]:,}",
                "-" if per is None else f"{per:,}",
            )
    console.print(groups)
    for r in rows:
        console.print(f"{r.model}, N={r.concurrency}: {r.vllm_note}")
        for w in r.warnings:
            console.print(f"  kvforge warning: {w}")


def _as_json(r: Row) -> dict[str, Any]:
    ratio = r.ratio
    return {
        "model": r.model,
        "concurrency": r.concurrency,
        "kvforge_full_history_tokens": r.kvforge_tokens,
        "vllm_full_history_tokens": r.vllm_tokens,
        "ratio": None if ratio is None else f"{ratio.numerator}/{ratio.denominator}",
        "ratio_display": _ratio_text(ratio),
        "vllm_decode_full_history_tokens": r.vllm_decode_tokens,
        "kvforge_bytes": r.kvforge_bytes,
        "vllm_bytes": r.vllm_bytes,
        "vllm_blocks_per_request": r.vllm_blocks_per_request,
        "kvforge_max_concurrency": r.max_concurrency,
        "kvforge_warnings": r.warnings,
        "vllm_note": r.vllm_note,
        "device_block_bytes": r.device_block_bytes,
        "host_page_bytes": r.host_page_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM 0.33 is needed: run with /work/.venv-vllm/bin/python", file=sys.stderr)
        return 2
    rows = [compare(case, n) for case in CASES for n in CONCURRENCIES]
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([_as_json(r) for r in rows], f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
