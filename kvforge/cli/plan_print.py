"""The tables of ``kvforge plan``: :func:`print_plan` shows a report of
:func:`kvforge.cli.plan.plan_report` and recomputes nothing.

Every figure carries its label: role and group bytes are each group's planned share, the
pools table counts each pool once (its total is the plan's), bytes per token are per group
with what they count, per-request state is per request, and the plan's concurrency and
warnings are printed beside the tables, as ``--json`` carries them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.text import Text

from kvforge.cli.formatting import console, format_bytes, format_exact, make_table
from kvforge.cli.plan_report import read_exact

__all__ = ["layer_ranges", "print_plan"]


def layer_ranges(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    if not layers:
        return "-"
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


def _print_roles(out: Any, report: dict[str, Any]) -> None:
    columns = ("role", "group", "layers", "entry shape", "dtype", "ratio", "bytes/block")
    roles = make_table(
        f"kvforge plan: {report['model']} ({report['num_layers']} cache layers)",
        (*columns, "storage name", "planned (group's share)"),
        left=("role", "group", "layers", "entry shape", "dtype", "ratio", "storage name"),
    )
    for r in report["roles"]:
        roles.add_row(
            r["role"],
            r["group"],
            layer_ranges(r["layers"]),
            str(tuple(r["entry_shape"])),
            r["dtype"],
            str(r["compress_ratio"]),
            f"{r['bytes_per_block']:,}",
            r["storage_name"],
            format_bytes(r["planned_bytes"]),
        )
    out.print(roles)


def _print_groups(out: Any, report: dict[str, Any]) -> None:
    groups = make_table(
        "groups (planned: each group's share of the budget before pooling)",
        (
            "group",
            "kind",
            "window",
            "layers",
            "block size",
            "block ids",
            "planned blocks",
            "bytes/block",
            "planned",
            "token capacity",
            "sequences",
        ),
        left=("group", "kind"),
    )
    arena = set((report["arena"] or {}).get("groups", ()))
    for g in report["groups"]:
        held = g["max_sequences"]
        sequences = f"{held:,}" if held is not None else "arena" if g["group"] in arena else "-"
        groups.add_row(
            g["group"],
            g["kind"],
            f"{g['window']:,}" if g["window"] is not None else "-",
            str(len(g["layers"])),
            str(g["block_size"]),
            f"{g['num_blocks']:,}",
            f"{g['planned_blocks']:,}",
            f"{g['bytes_per_block']:,}",
            format_bytes(g["planned_bytes"]),
            f"{g['token_capacity']:,}",
            sequences,
        )
    out.print(groups)


def _print_pools(out: Any, report: dict[str, Any]) -> None:
    pools = make_table(
        "device memory by pool (each pool counted once)",
        ("pool", "sharing", "block ids", "bytes"),
        left=("pool", "sharing", "block ids"),
    )
    for p in report["pools"]:
        ids = ", ".join(f"{g} {n:,}" for g, n in p["num_blocks"].items())
        pools.add_row(", ".join(p["groups"]), p["sharing"], ids, format_bytes(p["total_bytes"]))
    pools.add_row(
        "total",
        "",
        f"of {format_bytes(report['device_memory'])}",
        format_bytes(report["total_bytes"]),
    )
    out.print(pools)


def _print_bytes_per_token(out: Any, report: dict[str, Any]) -> None:
    per_token = report["bytes_per_token"]
    table = make_table(
        "cache bytes per token, by group (block-amortised, device padding included)",
        ("group", "kind", "layers", "bytes / token", "counts"),
        left=("group", "kind", "counts"),
    )
    for row in per_token["groups"]:
        table.add_row(
            row["group"],
            row["kind"],
            str(row["num_layers"]),
            format_exact(read_exact(row["bytes_per_token"])),
            row["counts"],
        )
    for row in report["bytes_per_request"]["groups"]:
        table.add_row(
            row["group"],
            row["kind"],
            str(row["num_layers"]),
            "-",
            f"{row['bytes']:,} B per request, whatever its length",
        )
    out.print(table)
    layers = f"full-history layers: {per_token['history_layers']} of {per_token['num_layers']}"
    layers += " cache layers"
    if not per_token["history_layers"]:
        layers += "; no layer keeps the whole history"
    out.print(
        f"KV bytes per token of history: {format_exact(read_exact(per_token['history']))} "
        f"({layers})"
    )


def _print_concurrency(out: Any, report: dict[str, Any]) -> None:
    defaulted = report["defaulted"]
    notes = {"max_model_len": " (the model's)", "max_num_seqs": " (engine default)"}
    settings = [
        f"{name} {report[name]:,}"
        + (notes.get(name, " (engine default)") if name in defaulted else "")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens")
        if report[name] is not None
    ]
    if settings:
        out.print("planned for " + ", ".join(settings))
    if report["max_concurrency"] is not None:
        out.print(
            f"holds {report['max_concurrency']:,} sequences of {report['max_model_len']:,} "
            "tokens at once"
        )
    if report["bytes_per_sequence"] is not None:
        out.print(
            f"one sequence of {report['max_model_len']:,} tokens keeps "
            f"{format_bytes(report['bytes_per_sequence'])} live"
        )
    if report["max_tokens"] is not None:
        out.print(f"token capacity (full-history groups): {report['max_tokens']:,}")


def _print_arena(out: Any, arena: dict[str, Any]) -> None:
    out.print(
        f"groups {', '.join(arena['groups'])} draw on one arena of {arena['num_slabs']:,} "
        f"slabs x {arena['slab_bytes']:,} B: a slab moves to the group that needs it once "
        "none of its blocks is in use, so their bytes flow with the load; under slab "
        "pressure a step moves cached blocks out of busy slabs (block ids: each group's "
        "across the whole arena)"
    )
    out.print(
        f"{arena['home']} keeps slab 0 past the null blocks and {arena['tail_blocks']:,} "
        f"blocks past the last slab for good ({arena['pinned_blocks']:,} blocks)"
    )
    padding = (f"{g} {float(read_exact(p)):.2%}" for g, p in arena["padding"].items())
    out.print("device padding per block: " + ", ".join(padding))


def print_plan(report: dict[str, Any]) -> None:
    """The tables and lines of ``kvforge plan`` for ``report``."""
    out = console()
    _print_roles(out, report)
    _print_groups(out, report)
    _print_pools(out, report)
    _print_bytes_per_token(out, report)
    _print_concurrency(out, report)
    if report["arena"] is not None:
        _print_arena(out, report["arena"])
    host = report["host"]
    if host is not None:
        pages = ", ".join(f"{g} {n:,}" for g, n in host["pages"].items())
        out.print(
            f"host pages: {pages} ({format_bytes(host['total_bytes'])} of "
            f"{format_bytes(host['memory'])})"
        )
    for warning in report["warnings"]:
        out.print(Text.assemble(("warning: ", "bold yellow"), warning))
