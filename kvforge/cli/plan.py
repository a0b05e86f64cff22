"""``kvforge plan``: size and name every cache of a model, without allocating anything.

:func:`plan_report` builds the model the options name, sizes its groups with the integer
planner (:func:`~kvforge.core.memory_plan.plan_memory` from ``--device-memory``, or the
explicit ``--num-blocks``), and returns everything the command prints as plain data
(:mod:`kvforge.cli.plan_report`: every figure labelled with what it counts): the
concurrency values the plan used and its warnings, per role its groups, shapes, bytes and
storage-name pattern, per group its blocks and token capacity, the pools each counted once,
bytes per token per group and per-request state, and the host pages of ``--host-memory``.
:func:`kvforge.cli.plan_print.print_plan` shows it as tables; ``--json`` prints it as JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvforge.cli.args import MODEL_OPTIONS, build_backends, check_list_models, flag, list_models
from kvforge.cli.formatting import UsageError, check_output_path, write_text

__all__ = ["DEFAULT_DEVICE_MEMORY", "cmd_plan", "plan_report"]

DEFAULT_DEVICE_MEMORY = 8 * 1024**3
"""``--device-memory`` when not given (and not ``--num-blocks``): 8 GiB."""
#: plan options that size a plan, which --list-models does not take
_SIZING = ("num_blocks", "device_memory", "host_memory", "max_model_len", "max_num_seqs")


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


def _sizes(args: argparse.Namespace, layout: Any) -> tuple[dict[str, int], int, Any]:
    """Planned blocks per group (each group's share, before pooling), the device budget and
    the plan as allocated (with its arena when groups draw on one; ``None`` with
    ``--num-blocks``).

    ``--max-num-seqs`` and ``--max-model-len`` are each optional: the planner takes the
    engine default of one not given (``max_num_seqs`` 256) or the model's
    ``max_position_embeddings`` (``max_model_len``), and the report says which it assumed.
    """
    from kvforge.core.flow import plan_with_arena
    from kvforge.core.memory_plan import plan_memory

    if args.num_blocks is not None:
        blocks = dict.fromkeys((g.name for g in layout.groups), args.num_blocks)
        budget = sum(n * layout.bytes_per_block(g) for g, n in blocks.items())
        return blocks, budget, None
    if (
        args.max_num_seqs is not None
        and args.max_model_len is None
        and layout.max_model_len is None
    ):
        raise UsageError(
            f"--max-num-seqs {args.max_num_seqs} needs a sequence length: give --max-model-len "
            "(the model gives no max_position_embeddings to default it to)"
        )
    budget = args.device_memory if args.device_memory is not None else DEFAULT_DEVICE_MEMORY
    plan = plan_memory(layout, budget, args.max_num_seqs, args.max_model_len)
    # what CacheController(share_pools=True), the default, allocates: groups whose pages
    # differ draw on one slab arena
    pooled = plan if args.own_pools else plan_with_arena(plan, layout)
    return plan.num_blocks, budget, pooled


def _block_ids(layout: Any, planned: dict[str, int], pooled: Any, share: bool) -> dict[str, int]:
    """Each group's block ids as allocated: its arena's, its shared pool's, or its own."""
    from kvforge.core.memory_plan import shared_pool_blocks

    blocks = shared_pool_blocks(layout, planned) if share else dict(planned)
    arena = pooled.arena if pooled is not None else None
    if arena is not None:
        blocks.update({g: arena.num_blocks(g) for g in arena.groups})
    return blocks


def _settings(args: argparse.Namespace, pooled: Any) -> dict[str, Any]:
    """The concurrency values the plan used, and which of them it assumed."""
    if pooled is None:
        return {
            "max_num_seqs": None,
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": None,
            "defaulted": [],
        }
    return {
        "max_num_seqs": pooled.max_num_seqs,
        "max_model_len": pooled.max_model_len,
        "max_num_batched_tokens": pooled.max_num_batched_tokens,
        "defaulted": list(pooled.defaulted),
    }


def _warnings(pooled: Any, per_sequence: int | None) -> list[str]:
    """The plan's warnings, the shortfall of sequences first (in the CLI's words: the
    planner's own sentence about it is replaced, not repeated)."""
    from kvforge.cli.plan_report import shortfall_warning

    if pooled is None:
        return []
    held, seqs, length = pooled.max_concurrency, pooled.max_num_seqs, pooled.max_model_len
    if held is None or seqs is None or length is None or held >= seqs:
        return list(pooled.warnings)
    assert per_sequence is not None
    first = shortfall_warning(held, seqs, length, per_sequence, pooled.defaulted)
    return [first, *(w for w in pooled.warnings if not w.startswith("the plan holds "))]


def _host_report(
    layout: Any, host_memory: int, max_num_seqs: int | None, max_model_len: int | None
) -> dict[str, Any]:
    """Host pages of ``--host-memory`` (offloaded roles only, packed, no padding) for
    requests at rest: ``--max-num-seqs`` of them (the planner's default when not given) of
    the device plan's ``max_model_len``."""
    from kvforge.core.memory_plan import plan_memory

    host = plan_memory(layout, host_memory, max_num_seqs, max_model_len, host=True)
    return {
        "memory": host_memory,
        "pages": host.num_blocks,
        "page_bytes": {g.group: g.bytes_per_block for g in host.groups},
        "total_bytes": host.total_bytes,
        "max_tokens": host.max_tokens,
    }


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``kvforge plan`` prints, as plain data (``docs/plans.md``: its keys)."""
    from kvforge.cli import plan_report as values
    from kvforge.core.layout import CacheLayout
    from kvforge.core.memory_plan import cache_bytes_per_sequence

    _check_sizing_flags(args)
    description, backends = _plan_backends(args)
    layout = CacheLayout(backends)
    planned, budget, pooled = _sizes(args, layout)
    share = args.num_blocks is None and not args.own_pools
    blocks = _block_ids(layout, planned, pooled, share)
    arena = pooled.arena if pooled is not None else None
    settings = _settings(args, pooled)
    length = settings["max_model_len"]
    per_sequence = cache_bytes_per_sequence(layout, length) if length else None
    pools = values.pool_rows(layout, planned, arena, share)
    return {
        "model": description,
        "num_layers": len(layout.layers),
        **settings,
        "max_concurrency": pooled.max_concurrency if pooled is not None else None,
        "warnings": _warnings(pooled, per_sequence),
        "device_memory": budget,
        "total_bytes": sum(p["total_bytes"] for p in pools),
        "max_tokens": pooled.max_tokens if pooled is not None else None,
        "bytes_per_token": values.bytes_per_token_report(layout),
        "bytes_per_request": values.request_state_report(layout),
        "bytes_per_sequence": per_sequence,
        "roles": values.role_rows(layout, blocks, planned, args.rank),
        "groups": values.group_rows(layout, blocks, planned, pooled, arena),
        "pools": pools,
        "arena": values.arena_report(arena),
        "host": (
            _host_report(layout, args.host_memory, args.max_num_seqs, length)
            if args.host_memory
            else None
        ),
    }


def cmd_plan(args: argparse.Namespace) -> int:
    """``kvforge plan``: tables on stdout; ``--json`` prints JSON instead, ``--json PATH``
    writes it there as well."""
    if args.list_models:
        return _list_models(args)
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
        from kvforge.cli.plan_print import print_plan

        print_plan(report)
    return 0


def _list_models(args: argparse.Namespace) -> int:
    """``--list-models``: the tables, or with ``--json`` the same rows as JSON
    (``{"bundled": [...], "model_types": [...]}``); sizing options are refused by flag."""
    if getattr(args, "vllm_specs", None) is not None:
        raise UsageError("--list-models lists the bundled configs; drop --vllm-specs")
    sizing = [d for d in _SIZING if getattr(args, d) is not None]
    sizing += [d for d in ("own_pools",) if args.own_pools] + (["rank"] if args.rank else [])
    if sizing:
        raise UsageError(
            f"--list-models lists the bundled configs and takes no sizing options, got "
            f"{', '.join(flag(d) for d in sizing)}"
        )
    if args.json is None:
        return list_models(args)
    from kvforge.cli.plan_models import bundled_rows, model_type_rows

    check_list_models(args)
    if args.json != "-":
        check_output_path(args.json, "--json")
    bundled = bundled_rows()
    text = json.dumps({"bundled": bundled, "model_types": model_type_rows(bundled)}, indent=2)
    if args.json == "-":
        print(text)
        return 0
    write_text(args.json, text + "\n")
    from kvforge.cli.plan_models import print_models

    print_models()
    return 0
