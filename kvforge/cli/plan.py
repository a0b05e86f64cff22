"""``kvforge plan``: size and name every cache of a model, without allocating anything.

:func:`plan_report` builds the model the options name, sizes its groups with the integer
planner (:func:`~kvforge.core.memory_plan.plan_memory` from ``--device-memory``, or the
explicit ``--num-blocks``), and returns everything the command prints as plain data: per
role its groups, shapes, bytes and storage-name pattern, per group its blocks and token
capacity, which groups can share one pool, and the host pages of ``--host-memory``.
:func:`print_plan` shows it as tables; ``--json`` prints it as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from kvforge.cli.args import MODEL_OPTIONS, build_backends, flag, list_models
from kvforge.cli.formatting import (
    UsageError,
    check_output_path,
    console,
    format_bytes,
    format_exact,
    make_table,
    write_text,
)

__all__ = ["cmd_plan", "plan_report", "print_plan"]


def _layer_ranges(layers: Sequence[int]) -> str:
    parts: list[str] = []
    start = prev = layers[0]
    for layer in [*layers[1:], None]:
        if layer is not None and layer == prev + 1:
            prev = layer
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if layer is not None:
            start = prev = layer
    return ",".join(parts)


def _vllm_backends(args: argparse.Namespace) -> tuple[str, Any]:
    """``--vllm-specs PATH``: the backends of a vLLM model's dumped specs
    (:mod:`kvforge.cli.specs_file`: a malformed file is one line). vLLM is imported here, on
    use only."""
    path = args.vllm_specs
    others = [d for d in ("model", "config", "backend", *MODEL_OPTIONS) if getattr(args, d)]
    if others:
        raise UsageError(
            f"{', '.join(flag(d) for d in others)} cannot be combined with --vllm-specs: the "
            "specs give every layer's cache"
        )
    from kvforge.cli.specs_file import vllm_backends

    backends = vllm_backends(path)
    return f"vLLM specs {path}", backends


def _check_sizing_flags(args: argparse.Namespace) -> None:
    """Usage errors for flags that ``--num-blocks`` makes meaningless."""
    if args.num_blocks is not None and args.max_num_seqs is not None:
        raise UsageError(
            "--max-num-seqs does not apply with --num-blocks: it sizes the pools from "
            "--device-memory, and --num-blocks gives their sizes"
        )
    if args.num_blocks is not None and args.own_pools:
        raise UsageError(
            "--own-pools does not apply with --num-blocks: --num-blocks already gives "
            "every group its own pool of that many blocks"
        )


def _plan_backends(args: argparse.Namespace) -> tuple[str, Any]:
    """The model's description and backends (from ``--vllm-specs`` or the model flags), and
    a usage error for a ``--rank`` outside ``--tp-size``."""
    if getattr(args, "vllm_specs", None) is not None:
        description, backends = _vllm_backends(args)
    else:
        description, backends = build_backends(args)
    if args.tp_size is not None and args.rank >= args.tp_size:
        raise UsageError(
            f"--rank {args.rank} is out of range for --tp-size {args.tp_size} "
            f"(ranks 0..{args.tp_size - 1})"
        )
    return description, backends


def _sizes(
    args: argparse.Namespace, layout: Any, backends: Any
) -> tuple[dict[str, int], int, Any, int | None]:
    """Blocks per group, the device budget, the memory plan (``None`` with ``--num-blocks``)
    and the max model length in effect."""
    from kvforge.core.flow import plan_with_arena
    from kvforge.core.memory_plan import plan_memory

    max_model_len = args.max_model_len
    if args.num_blocks is not None:
        blocks = dict.fromkeys((g.name for g in layout.groups), args.num_blocks)
        budget = sum(n * layout.bytes_per_block(g) for g, n in blocks.items())
        return blocks, budget, None, max_model_len
    if args.max_num_seqs is not None and max_model_len is None:
        # vLLM's rule: max_model_len defaults to the model's max_position_embeddings
        max_model_len = getattr(backends, "max_position_embeddings", None)
    if (args.max_num_seqs is None) != (max_model_len is None):
        raise UsageError(
            "--max-num-seqs and --max-model-len go together (the model's config gives no "
            "max_position_embeddings to default --max-model-len to)"
        )
    plan = plan_memory(layout, args.device_memory, args.max_num_seqs, max_model_len)
    # what CacheController(share_pools=True), the default, allocates: groups whose pages
    # differ draw on one slab arena
    if not args.own_pools:
        plan = plan_with_arena(plan, layout)
    return plan.num_blocks, args.device_memory, plan, max_model_len


def _role_rows(layout: Any, blocks: dict[str, int], rank: int) -> list[dict[str, Any]]:
    """One row per (role, group), its layers and bytes summed over them."""
    from kvforge.core.naming import StorageNamer

    namer = StorageNamer(rank=rank)
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in layout.buffers:
        key = (e.role, e.group.name)
        row = rows.setdefault(
            key,
            {
                "role": e.role.name,
                "group": e.group.name,
                "entry_shape": list(e.role.entry_shape),
                "dtype": e.role.dtype,
                "compress_ratio": e.role.compress_ratio,
                "block_shape": [
                    blocks[e.group.name],
                    e.role.entries_per_block(e.group),
                    *e.role.entry_shape,
                ],
                "bytes_per_block": e.block_bytes,
                "storage_name": namer.pattern(e.role.name),
                "layers": [],
                "total_bytes": 0,
            },
        )
        row["layers"].append(e.layer)
        row["total_bytes"] += blocks[e.group.name] * e.block_bytes
    return list(rows.values())


def _group_rows(layout: Any, blocks: dict[str, int], arena: Any) -> list[dict[str, Any]]:
    """One row per group; an arena group's bytes are the arena's, counted once elsewhere."""
    in_arena = set(arena.groups) if arena is not None else set()
    groups = []
    for g in layout.groups:
        page = layout.bytes_per_block(g.name)
        stride = arena.block_stride[arena.index(g.name)] if g.name in in_arena else page
        groups.append(
            {
                "group": g.name,
                "kind": g.kind.value,
                "block_size": g.block_size,
                "window": g.window,
                "num_blocks": blocks[g.name],
                "bytes_per_block": page,
                "device_stride": stride,
                # an arena group's blocks are the arena's bytes, counted once below
                "total_bytes": 0 if g.name in in_arena else blocks[g.name] * page,
                "token_capacity": (blocks[g.name] - 1) * g.block_size,
            }
        )
    return groups


def _arena_report(arena: Any) -> dict[str, Any] | None:
    if arena is None:
        return None
    return {
        "groups": list(arena.groups),
        "num_slabs": arena.num_slabs,
        "slab_bytes": arena.slab_bytes,
        "total_bytes": arena.total_bytes,
        "blocks_per_slab": dict(zip(arena.groups, arena.blocks_per_slab, strict=True)),
        "padding": {g: round(p, 6) for g, p in arena.padding.items()},
        # slab 0 (past the null blocks) and the tail past the last slab never move
        "home": arena.groups[arena.home],
        "home_reserved": arena.home_reserved,
        "tail_blocks": arena.tail_blocks,
        "pinned_blocks": arena.pinned_blocks(arena.groups[arena.home]),
    }


def _shared_pools(layout: Any, blocks: dict[str, int]) -> list[dict[str, Any]]:
    """Groups whose pages pair up byte for byte: CacheController(share_pools=True) gives each
    set one pool of sum(num_blocks - 1) + 1 blocks, paid once."""
    from kvforge.core.memory_plan import shared_pool_blocks

    return [
        {"groups": list(members), "num_blocks": shared_pool_blocks(layout, blocks)[members[0]]}
        for members in layout.pool_sets
        if len(members) > 1
    ]


def _host_report(layout: Any, host_memory: int) -> dict[str, Any]:
    from kvforge.core.memory_plan import plan_memory

    host = plan_memory(layout, host_memory, host=True)
    return {
        "memory": host_memory,
        "pages": host.num_blocks,
        "page_bytes": {g.group: g.bytes_per_block for g in host.groups},
        "total_bytes": host.total_bytes,
        "max_tokens": host.max_tokens,
    }


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``kvforge plan`` prints, as plain data."""
    from kvforge.core.layout import CacheLayout
    from kvforge.core.memory_plan import cache_bytes_per_sequence

    _check_sizing_flags(args)
    description, backends = _plan_backends(args)
    layout = CacheLayout(backends)
    blocks, budget, plan, max_model_len = _sizes(args, layout, backends)
    arena = plan.arena if plan is not None else None
    groups = _group_rows(layout, blocks, arena)
    report: dict[str, Any] = {
        "model": description,
        "num_layers": len(layout.layers),
        "roles": _role_rows(layout, blocks, args.rank),
        "groups": groups,
        # exact: an int when whole, else the string of a fraction ("15401/4"): no float bytes
        "kv_bytes_per_token": _exact(layout.kv_bytes_per_token()),
        "device_memory": budget,
        "total_bytes": sum(g["total_bytes"] for g in groups)
        + (arena.total_bytes if arena is not None else 0),
        "arena": _arena_report(arena),
        "max_tokens": plan.max_tokens if plan else None,
        "shared_pools": _shared_pools(layout, blocks),
    }
    if max_model_len:
        report["bytes_per_sequence"] = cache_bytes_per_sequence(layout, max_model_len)
        report["max_num_seqs"] = args.max_num_seqs
        report["max_model_len"] = max_model_len
    if args.host_memory:
        report["host"] = _host_report(layout, args.host_memory)
    return report


def _exact(value: int | Fraction) -> int | str:
    if isinstance(value, Fraction) and value.denominator != 1:
        return str(value)
    return int(value)


def _print_roles(out: Any, report: dict[str, Any]) -> None:
    roles = make_table(
        f"kvforge plan: {report['model']} ({report['num_layers']} cache layers)",
        (
            "role",
            "group",
            "layers",
            "entry shape",
            "dtype",
            "ratio",
            "bytes/block",
            "storage name",
            "total",
        ),
        left=("role", "group", "layers", "entry shape", "dtype", "ratio", "storage name"),
    )
    for r in report["roles"]:
        roles.add_row(
            r["role"],
            r["group"],
            _layer_ranges(r["layers"]),
            str(tuple(r["entry_shape"])),
            r["dtype"],
            str(r["compress_ratio"]),
            f"{r['bytes_per_block']:,}",
            r["storage_name"],
            format_bytes(r["total_bytes"]),
        )
    out.print(roles)


def _print_groups(out: Any, report: dict[str, Any]) -> None:
    groups = make_table(
        "groups",
        (
            "group",
            "kind",
            "block size",
            "window",
            "blocks",
            "bytes/block",
            "total",
            "token capacity",
        ),
        left=("group", "kind"),
    )
    arena_groups = set((report.get("arena") or {}).get("groups", ()))
    for g in report["groups"]:
        groups.add_row(
            g["group"],
            g["kind"],
            str(g["block_size"]),
            str(g["window"] or "-"),
            f"{g['num_blocks']:,}",
            f"{g['bytes_per_block']:,}",
            "arena" if g["group"] in arena_groups else format_bytes(g["total_bytes"]),
            f"{g['token_capacity']:,}",
        )
    out.print(groups)


def _print_arena(out: Any, arena: dict[str, Any]) -> None:
    out.print(
        f"groups {', '.join(arena['groups'])} draw on one arena of {arena['num_slabs']:,} "
        f"slabs x {arena['slab_bytes']:,} B: a slab moves to the group that needs it once "
        "none of its blocks is in use, so their bytes flow with the load; under slab "
        "pressure a step moves cached blocks out of busy slabs (blocks: each group's ids "
        "across the whole arena)"
    )
    out.print(
        f"{arena['home']} keeps slab 0 past the null blocks and {arena['tail_blocks']:,} "
        f"blocks past the last slab for good ({arena['pinned_blocks']:,} blocks)"
    )
    out.print(
        "device padding per block: "
        + ", ".join(f"{g} {p:.2%}" for g, p in arena["padding"].items())
    )


def _print_totals(out: Any, report: dict[str, Any]) -> None:
    per_token = Fraction(report["kv_bytes_per_token"])
    out.print(f"KV bytes per token: {format_exact(per_token)}")
    out.print(
        f"device memory: {format_bytes(report['total_bytes'])} of "
        f"{format_bytes(report['device_memory'])}"
    )
    if report.get("max_tokens") is not None:
        out.print(f"token capacity (full groups): {report['max_tokens']:,}")


def print_plan(report: dict[str, Any]) -> None:
    """The tables and lines of ``kvforge plan`` for ``report`` (:func:`plan_report`)."""
    out = console()
    _print_roles(out, report)
    _print_groups(out, report)
    _print_totals(out, report)
    if report.get("arena"):
        _print_arena(out, report["arena"])
    for pool in report.get("shared_pools", ()):
        out.print(
            f"groups {', '.join(pool['groups'])} pair up byte for byte: with share_pools=True "
            f"they draw on one pool of {pool['num_blocks']:,} blocks"
        )
    if "bytes_per_sequence" in report:
        out.print(
            f"one sequence of {report['max_model_len']:,} tokens keeps "
            f"{format_bytes(report['bytes_per_sequence'])} live"
        )
    if "host" in report:
        host = report["host"]
        out.print(
            f"host pages: {host['pages']} ({format_bytes(host['total_bytes'])} of "
            f"{format_bytes(host['memory'])})"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    """``kvforge plan``: tables on stdout; ``--json`` prints JSON instead, ``--json PATH``
    writes it there as well."""
    if args.list_models:
        if getattr(args, "vllm_specs", None) is not None:
            raise UsageError("--list-models lists the bundled configs; drop --vllm-specs")
        return list_models(args)
    to_file = args.json not in (None, "-")
    if to_file:
        check_output_path(args.json, "--json")
    report = plan_report(args)
    text = json.dumps(report, indent=2)
    if to_file:
        write_text(args.json, text + "\n")
    if args.json == "-":
        print(text)
    else:
        print_plan(report)
    return 0
