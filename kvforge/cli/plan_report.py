"""The values of ``kvforge plan --json``, each labelled with what it counts.

Plain data only (``docs/plans.md``, "kvforge plan --json", lists every key):

- every byte, block and token count is an ``int``; a figure that can be fractional (bytes per
  token over blocks whose entries are compressed, a padding ratio) is always the object of
  :func:`exact_json`, ``{"numerator": n, "denominator": d, "value": n / d}``, even when whole,
  so a key never changes type from one model to another (:func:`read_exact` reads it back);
- per-role and per-group bytes are the *planned share* of each group (its blocks before
  pooling); what the device holds is listed once per pool in ``pools`` (a shared pool or the
  slab arena counted once, not once per member), and the pools add up to ``total_bytes``;
- bytes per token are per group, with its kind, layers and what a token costs there (a
  window group only while the token is inside the window); ``history`` sums the full-history
  groups and says how many layers they are; per-request state is per request, never per token.

:mod:`kvforge.cli.plan` builds the report from these pieces; :mod:`kvforge.cli.plan_print`
shows it as tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

__all__ = [
    "arena_report",
    "bytes_per_token_report",
    "exact_json",
    "group_rows",
    "pool_rows",
    "read_exact",
    "request_state_report",
    "role_rows",
    "shortfall_warning",
]


def exact_json(value: int | Fraction) -> dict[str, Any]:
    """An exact figure as JSON: ``{"numerator": n, "denominator": d, "value": n / d}``.

    ``n / d`` is in lowest terms with ``d > 0``; ``value`` is the nearest float, for reading
    only (the exact figure is the fraction). ``15401/4`` -> ``{"numerator": 15401,
    "denominator": 4, "value": 3850.25}``; ``131072`` -> denominator 1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, Fraction)):
        raise TypeError(f"an exact figure is an int or a Fraction, got {value!r}")
    exact = Fraction(value)
    return {
        "numerator": exact.numerator,
        "denominator": exact.denominator,
        "value": float(exact),
    }


def read_exact(obj: Mapping[str, Any]) -> Fraction:
    """The :class:`~fractions.Fraction` an :func:`exact_json` object stands for.

    Raises:
        ValueError: ``obj`` is not such an object (naming what it lacks or holds).
    """
    if not isinstance(obj, Mapping) or set(obj) != {"numerator", "denominator", "value"}:
        raise ValueError(
            f"an exact figure is an object with keys numerator, denominator and value, got {obj!r}"
        )
    n, d = obj["numerator"], obj["denominator"]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (n, d)) or d <= 0:
        raise ValueError(f"numerator and denominator must be ints, denominator > 0, got {obj!r}")
    return Fraction(n, d)


def _kind(group: Any) -> str:
    return str(getattr(group.kind, "value", group.kind))


def _layers_of(layout: Any, group: str) -> list[int]:
    return sorted({e.layer for e in layout.buffers_of(group)})


def role_rows(
    layout: Any, blocks: Mapping[str, int], planned: Mapping[str, int], rank: int
) -> list[dict[str, Any]]:
    """One row per (role, group) with its layers. ``block_shape`` is the role's tensor per
    layer (``blocks``: the block ids of its group, pool or arena included);
    ``planned_bytes`` is the role's device bytes at its group's planned share, over its
    layers: the rows add up to the groups' ``planned_bytes``."""
    from kvforge.core.naming import StorageNamer

    namer = StorageNamer(rank=rank)
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in layout.buffers:
        row = rows.setdefault(
            (e.role, e.group.name),
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
                "planned_bytes": 0,
            },
        )
        row["layers"].append(e.layer)
        row["planned_bytes"] += planned[e.group.name] * e.device_block_bytes
    return list(rows.values())


def group_rows(
    layout: Any, blocks: Mapping[str, int], planned: Mapping[str, int], plan: Any, arena: Any
) -> list[dict[str, Any]]:
    """One row per group. ``num_blocks``: its block ids (a shared pool's or the arena's);
    ``planned_blocks``: its share of the budget before pooling, the null block included;
    ``token_capacity``: tokens that share holds; ``max_sequences``: sequences of
    ``max_model_len`` it holds (None without a plan or a length, and for an arena group:
    the arena's groups hold sequences together, the plan's ``max_concurrency``)."""
    in_arena = set(arena.groups) if arena is not None else set()
    held = {g.group: g.max_sequences for g in plan.groups} if plan is not None else {}
    rows = []
    for g in layout.groups:
        page = layout.bytes_per_block(g.name)
        stride = arena.block_stride[arena.index(g.name)] if g.name in in_arena else page
        rows.append(
            {
                "group": g.name,
                "kind": _kind(g),
                "block_size": g.block_size,
                "window": g.window,
                "layers": _layers_of(layout, g.name),
                "num_blocks": blocks[g.name],
                "planned_blocks": planned[g.name],
                "bytes_per_block": page,
                "device_stride": stride,
                "planned_bytes": planned[g.name] * page,
                "token_capacity": (planned[g.name] - 1) * g.block_size,
                "max_sequences": held.get(g.name),
            }
        )
    return rows


def pool_rows(
    layout: Any, planned: Mapping[str, int], arena: Any, share: bool
) -> list[dict[str, Any]]:
    """What the device holds, each pool counted once: ``sharing`` is ``"arena"`` (the slab
    arena of groups whose pages differ), ``"shared"`` (groups whose pages pair up byte for
    byte: one pool of all their blocks, one null block) or ``"own"``; ``num_blocks`` gives
    each member's block ids; the rows' ``total_bytes`` add up to the plan's."""
    rows = []
    arena_groups = set(arena.groups) if arena is not None else set()
    if arena is not None:
        rows.append(
            {
                "groups": list(arena.groups),
                "sharing": "arena",
                "num_blocks": {g: arena.num_blocks(g) for g in arena.groups},
                "total_bytes": arena.total_bytes,
            }
        )
    sets = layout.pool_sets if share else tuple((g.name,) for g in layout.groups)
    for members in sets:
        if members[0] in arena_groups:
            continue
        count = sum(planned[m] for m in members)  # one null block for the pool
        rows.append(
            {
                "groups": list(members),
                "sharing": "shared" if len(members) > 1 else "own",
                "num_blocks": dict.fromkeys(members, count),
                "total_bytes": count * layout.bytes_per_block(members[0]),
            }
        )
    return rows


def bytes_per_token_report(layout: Any) -> dict[str, Any]:
    """Device bytes a token costs, per token-indexed group (block-amortised, padding
    included), and ``history``: the sum over the full-history groups, with their layer
    count beside the model's (gpt-oss-120b: 18 of 36 layers)."""
    rows = []
    history = Fraction(0)
    history_layers: set[int] = set()
    for g in layout.groups:
        if g.rule.per_request:
            continue
        cost = Fraction(layout.bytes_per_block(g.name), g.block_size)
        layers = _layers_of(layout, g.name)
        if g.rule.history:
            history += cost
            history_layers.update(layers)
            counts = "every token of the sequence, for as long as it runs"
        else:
            counts = f"a token only while it is inside the window of {g.window:,} tokens"
        rows.append(
            {
                "group": g.name,
                "kind": _kind(g),
                "window": g.window,
                "num_layers": len(layers),
                "bytes_per_token": exact_json(cost),
                "counts": counts,
            }
        )
    return {
        "history": exact_json(history),
        "history_layers": len(history_layers),
        "num_layers": len(layout.layers),
        "groups": rows,
    }


def request_state_report(layout: Any) -> dict[str, Any]:
    """Bytes every running request holds in per-request groups, whatever its length."""
    groups = [
        {
            "group": g.name,
            "kind": _kind(g),
            "num_layers": len(_layers_of(layout, g.name)),
            "slots_per_request": g.slots_per_request,
            "bytes": g.slots_per_request * layout.bytes_per_block(g.name),
        }
        for g in layout.groups
        if g.rule.per_request
    ]
    return {"total": sum(g["bytes"] for g in groups), "groups": groups}


def arena_report(arena: Any) -> dict[str, Any] | None:
    """The slab arena's geometry; ``padding`` per group is exact (stride - page) / page."""
    if arena is None:
        return None
    padding = zip(arena.groups, arena.block_stride, arena.page_bytes, strict=True)
    return {
        "groups": list(arena.groups),
        "num_slabs": arena.num_slabs,
        "slab_bytes": arena.slab_bytes,
        "total_bytes": arena.total_bytes,
        "blocks_per_slab": dict(zip(arena.groups, arena.blocks_per_slab, strict=True)),
        "padding": {g: exact_json(Fraction(s - p, p)) for g, s, p in padding},
        # slab 0 (past the null blocks) and the tail past the last slab never move
        "home": arena.groups[arena.home],
        "home_reserved": arena.home_reserved,
        "tail_blocks": arena.tail_blocks,
        "pinned_blocks": arena.pinned_blocks(arena.groups[arena.home]),
    }


def shortfall_warning(
    held: int, seqs: int, model_len: int, per_sequence: int, defaulted: tuple[str, ...]
) -> str:
    """The warning when the plan holds fewer sequences of ``model_len`` than ``seqs``."""
    asked = f"{seqs:,}" + (" (the engine default)" if "max_num_seqs" in defaulted else "")
    length = f"{model_len:,}" + (" (the model's)" if "max_model_len" in defaulted else "")
    return (
        f"only {held:,} of {asked} sequences of {length} tokens fit at once (one such "
        f"sequence keeps {per_sequence:,} bytes of cache live): raise --device-memory, or "
        "lower --max-num-seqs or --max-model-len"
    )
