"""``kvforge plan | demo | bench``: the command-line front door.

Every command reports bad input as one line on stderr and exit code 2, never a traceback:
input is checked up front (output paths before any work, layer counts against
:data:`~kvforge.models.base.MAX_LAYERS`, options against the model they describe).
Only ``ValueError`` (``UsageError`` and pydantic's errors included) and ``FileNotFoundError``
are input errors; any other exception escaping a command is a bug and keeps its traceback.

No option is silently ignored. With ``--model`` / ``--config`` only the options that
:func:`~kvforge.models.hf_config.from_hf_config` takes apply (``--block-size``,
``--dtype``, ``--kv-cache-dtype``, ``--tp-size``, ``--num-speculative-tokens``), and it refuses
those the model's family does not use; with ``--backend NAME`` only ``--layers`` and the
parameters of the backend's builder apply.

Plugins: at start the CLI imports every entry point of the group ``kvforge.backends``
(:func:`~kvforge.models.plugins.load_plugins`) and every ``--plugin MODULE``; what
they register is then known to ``--config`` (model types) and ``--backend`` (backends). A
plugin that fails to load in any way is one line on stderr and exit code 2, and registers
nothing; with ``--help`` it is a one-line warning and the help is printed all the same.
``--backend NAME`` builds one layer's backend with the registered builder, passing the model
options the user gave as keyword arguments: the builder's parameters are the options it takes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from kvforge.attn_backends.base import AttentionBackend
from kvforge.cli.formatting import (
    UsageError,
    check_output_path,
    console,
    format_bytes,
    format_exact,
    make_table,
    one_line,
    parse_size,
)
from kvforge.models.base import MAX_LAYERS
from kvforge.models.plugins import PluginError, load_plugin_module, load_plugins
from kvforge.models.registry import registered_backends

__all__ = ["main"]

# Options of --backend, by argparse dest: each is passed to the chosen backend's builder
# under this name, and refused when the builder has no parameter of that name.
BACKEND_OPTIONS = (
    "num_kv_heads",
    "head_dim",
    "block_size",
    "dtype",
    "kv_cache_quant",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "index_head_dim",
    "kv_cache_dtype",
    "compress_ratio",
)
# What from_hf_config takes; every other model option describes a model without a config.
CONFIG_OPTIONS = ("block_size", "dtype", "kv_cache_dtype", "tp_size", "num_speculative_tokens")
MODEL_OPTIONS = (*BACKEND_OPTIONS, "layers", "tp_size", "num_speculative_tokens")
DEFAULT_LAYERS = 32


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _layer_count(text: str) -> int:
    value = _positive(text)
    if value > MAX_LAYERS:
        raise argparse.ArgumentTypeError(
            f"{value} exceeds the maximum of {MAX_LAYERS} cache layers a model may have"
        )
    return value


def _num_blocks(text: str) -> int:
    value = _positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"{value} leaves no usable block (block 0 of every group is the null block); "
            "give at least 2"
        )
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a non-negative integer")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


# ---------------------------------------------------------------------------------- models


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Options that describe a model: a bundled or given config, or a backend and its sizes."""
    src = parser.add_argument_group("model")
    src.add_argument("--model", help="a bundled model config (see --list-models)")
    src.add_argument("--config", help="path to a Hugging Face config.json")
    src.add_argument(
        "--backend",
        choices=list(registered_backends()),
        help="describe the model by a registered backend and its sizes instead of a config "
        "(default gqa)",
    )
    src.add_argument(
        "--layers",
        type=_layer_count,
        default=None,
        help=f"layer count with --backend (default {DEFAULT_LAYERS}, at most {MAX_LAYERS})",
    )
    # Backend options default to None, so that "given" is visible: the backend's builder
    # supplies the defaults of those not given (gqa: 8 kv heads of 128, mla: 512 + 64, ...).
    src.add_argument("--num-kv-heads", type=_positive, default=None)
    src.add_argument("--head-dim", type=_positive, default=None)
    src.add_argument("--block-size", type=_positive, default=None, help="tokens per block")
    src.add_argument("--dtype", default=None, help="cache dtype (default bfloat16)")
    src.add_argument("--kv-cache-quant", choices=["fp8", "block_wise_fp8"], default=None)
    src.add_argument("--kv-lora-rank", type=_positive, default=None)
    src.add_argument("--qk-rope-head-dim", type=_positive, default=None)
    src.add_argument("--index-head-dim", type=_positive, default=None)
    src.add_argument("--kv-cache-dtype", default=None, help="cache storage, e.g. fp8 or bf16")
    src.add_argument("--compress-ratio", type=int, default=None, help="deepseek-v4 ratio")
    src.add_argument(
        "--tp-size", type=_positive, default=None, help="tensor-parallel size (config models)"
    )
    src.add_argument(
        "--num-speculative-tokens",
        type=_non_negative,
        default=None,
        metavar="N",
        help="draft tokens per step; MTP layers get caches only when N > 0 (config models)",
    )
    src.add_argument("--list-models", action="store_true", help="list bundled configs and exit")


def _given(args: argparse.Namespace, dests: Sequence[str]) -> list[str]:
    return [d for d in dests if getattr(args, d, None) is not None]


def _refuse(extra: Sequence[str], where: str, takes: Sequence[str]) -> None:
    if extra:
        verb = "does" if len(extra) == 1 else "do"
        raise UsageError(
            f"{', '.join(_flag(d) for d in extra)} {verb} not apply to {where}; it takes "
            f"{', '.join(_flag(d) for d in takes)}"
        )


def build_backends(args: argparse.Namespace) -> tuple[str, dict[int, AttentionBackend]]:
    """The model named by the options: ``(description, layer id -> backend)``."""
    chosen = [opt for opt in ("model", "config", "backend") if getattr(args, opt)]
    if len(chosen) > 1:
        raise UsageError(f"give one of --model, --config or --backend, not {chosen}")
    if args.model or args.config:
        from kvforge.models.hf_config import from_hf_config, load_model_config

        source = args.model or args.config
        option = "--model" if args.model else "--config"
        extra = [d for d in _given(args, MODEL_OPTIONS) if d not in CONFIG_OPTIONS]
        _refuse(extra, f"a model from a config ({option} {source})", CONFIG_OPTIONS)
        try:
            config = load_model_config(source)
        except FileNotFoundError:
            raise
        except OSError as exc:  # unreadable (permissions, a device): input, not a bug
            raise UsageError(f"cannot read {option} {source!r}: {exc.strerror or exc}") from None
        backends = from_hf_config(
            config,
            block_size=args.block_size,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            tp_size=args.tp_size if args.tp_size is not None else 1,
            num_speculative_tokens=args.num_speculative_tokens or 0,
        )
        return str(source), backends
    kind = args.backend or "gqa"
    layers = args.layers if args.layers is not None else DEFAULT_LAYERS
    backend = _backend_from_options(kind, args)
    return f"{backend!r} x {layers} layers", dict.fromkeys(range(layers), backend)


def _backend_from_options(kind: str, args: argparse.Namespace) -> AttentionBackend:
    """One layer's backend of the registered backend ``kind``, from the options given."""
    entry = registered_backends()[kind]
    params = entry.parameters()
    takes = [*(p for p in params if p in BACKEND_OPTIONS), "layers"]
    _refuse([d for d in _given(args, MODEL_OPTIONS) if d not in takes], f"--backend {kind}", takes)
    given = {d: getattr(args, d) for d in _given(args, BACKEND_OPTIONS)}
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in given]
    unsettable = [name for name in missing if name not in BACKEND_OPTIONS]
    if unsettable:
        raise UsageError(
            f"--backend {kind} cannot be built from command-line options: its builder needs "
            f"{unsettable}, which no option sets (register it with a cli_builder)"
        )
    if missing:
        raise UsageError(f"--backend {kind} needs {', '.join(_flag(m) for m in missing)}")
    return entry.builder(**given)


def _list_models(args: argparse.Namespace) -> int:
    from kvforge.models.hf_config import bundled_models

    others = _given(args, ("model", "config", "backend", *MODEL_OPTIONS))
    if others:
        raise UsageError(
            f"--list-models lists the bundled configs and takes no model options, got "
            f"{', '.join(_flag(d) for d in others)}"
        )
    for name in bundled_models():
        print(name)
    return 0


# ---------------------------------------------------------------------------------- plan


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``kvforge plan`` prints, as plain data."""
    from kvforge.core.layout import CacheLayout
    from kvforge.core.memory_plan import (
        cache_bytes_per_sequence,
        plan_memory,
        shared_pool_blocks,
    )
    from kvforge.core.naming import StorageNamer

    if args.num_blocks is not None and args.max_num_seqs is not None:
        raise UsageError(
            "--max-num-seqs does not apply with --num-blocks: it sizes the pools from "
            "--device-memory, and --num-blocks gives their sizes"
        )
    description, backends = build_backends(args)
    if args.tp_size is not None and args.rank >= args.tp_size:
        raise UsageError(
            f"--rank {args.rank} is out of range for --tp-size {args.tp_size} "
            f"(ranks 0..{args.tp_size - 1})"
        )
    layout = CacheLayout(backends)
    max_model_len = args.max_model_len
    if args.num_blocks is not None:
        blocks = dict.fromkeys((g.name for g in layout.groups), args.num_blocks)
        budget = sum(n * layout.bytes_per_block(g) for g, n in blocks.items())
        plan = None
    else:
        if args.max_num_seqs is not None and max_model_len is None:
            # vLLM's rule: max_model_len defaults to the model's max_position_embeddings
            max_model_len = getattr(backends, "max_position_embeddings", None)
        if (args.max_num_seqs is None) != (max_model_len is None):
            raise UsageError(
                "--max-num-seqs and --max-model-len go together (the model's config gives no "
                "max_position_embeddings to default --max-model-len to)"
            )
        plan = plan_memory(layout, args.device_memory, args.max_num_seqs, max_model_len)
        blocks = plan.num_blocks
        budget = args.device_memory
    namer = StorageNamer(rank=args.rank)
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
    groups = []
    for g in layout.groups:
        groups.append(
            {
                "group": g.name,
                "kind": g.kind.value,
                "block_size": g.block_size,
                "window": g.window,
                "num_blocks": blocks[g.name],
                "bytes_per_block": layout.bytes_per_block(g.name),
                "total_bytes": blocks[g.name] * layout.bytes_per_block(g.name),
                "token_capacity": (blocks[g.name] - 1) * g.block_size,
            }
        )
    report: dict[str, Any] = {
        "model": description,
        "num_layers": len(layout.layers),
        "roles": list(rows.values()),
        "groups": groups,
        # exact: an int when whole, else the string of a fraction ("15401/4"): no float bytes
        "kv_bytes_per_token": _exact(layout.kv_bytes_per_token()),
        "device_memory": budget,
        "total_bytes": sum(g["total_bytes"] for g in groups),
        "max_tokens": plan.max_tokens if plan else None,
        # groups whose pages pair up byte for byte: CacheController(share_pools=True) gives
        # each set one pool of sum(num_blocks - 1) + 1 blocks, paid once
        "shared_pools": [
            {
                "groups": list(members),
                "num_blocks": shared_pool_blocks(layout, blocks)[members[0]],
            }
            for members in layout.pool_sets
            if len(members) > 1
        ],
    }
    if max_model_len:
        report["bytes_per_sequence"] = cache_bytes_per_sequence(layout, max_model_len)
        report["max_num_seqs"] = args.max_num_seqs
        report["max_model_len"] = max_model_len
    if args.host_memory:
        host = plan_memory(layout, args.host_memory, host=True)
        report["host"] = {
            "memory": args.host_memory,
            "pages": host.num_blocks,
            "page_bytes": {g.group: g.bytes_per_block for g in host.groups},
            "total_bytes": host.total_bytes,
            "max_tokens": host.max_tokens,
        }
    return report


def _exact(value: int | Fraction) -> int | str:
    if isinstance(value, Fraction) and value.denominator != 1:
        return str(value)
    return int(value)


def print_plan(report: dict[str, Any]) -> None:
    out = console()
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
    for g in report["groups"]:
        groups.add_row(
            g["group"],
            g["kind"],
            str(g["block_size"]),
            str(g["window"] or "-"),
            f"{g['num_blocks']:,}",
            f"{g['bytes_per_block']:,}",
            format_bytes(g["total_bytes"]),
            f"{g['token_capacity']:,}",
        )
    out.print(groups)
    per_token = Fraction(report["kv_bytes_per_token"])
    out.print(f"KV bytes per token: {format_exact(per_token)}")
    out.print(
        f"device memory: {format_bytes(report['total_bytes'])} of "
        f"{format_bytes(report['device_memory'])}"
    )
    if report.get("max_tokens") is not None:
        out.print(f"token capacity (full groups): {report['max_tokens']:,}")
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
        return _list_models(args)
    to_file = args.json not in (None, "-")
    if to_file:
        check_output_path(args.json, "--json")
    report = plan_report(args)
    text = json.dumps(report, indent=2)
    if to_file:
        _write_text(args.json, text + "\n")
    if args.json == "-":
        print(text)
    else:
        print_plan(report)
    return 0


def _write_text(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:  # checked before the work; this is a race with the filesystem
        raise UsageError(f"cannot write --json {path!r}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    """``kvforge demo``: the serving loop of :mod:`~kvforge.cli.demo`; exit 1 on a mismatch."""
    if args.list_models:
        return _list_models(args)
    if args.json is not None:
        check_output_path(args.json, "--json")
    from kvforge.cli.demo import DEFAULT_MODEL, DemoConfig, print_summary, run_demo

    if not (args.model or args.config or args.backend):
        args.model = DEFAULT_MODEL
    description, backends = build_backends(args)
    config = DemoConfig(
        model=description,
        device=args.device,
        seed=args.seed,
        requests=args.requests,
        device_memory=args.device_memory,
        host_memory=args.host_memory,
        corrupt_after_step=args.self_test_corrupt,
        prefix_conversations=args.prefix_conversations,
    )
    progress = not args.no_progress and sys.stderr.isatty()
    result = run_demo(config, progress=progress, backends=backends)
    if args.json is not None:
        _write_text(args.json, result.model_dump_json(indent=2) + "\n")
    print_summary(result)
    return 0 if result.ok else 1


# ---------------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> int:
    from kvforge.cli.bench import print_results, run_bench, write_json

    if args.json is not None:
        check_output_path(args.json, "--json")
    if args.step and args.prefix:
        raise UsageError("give one of --step or --prefix, not both")
    if args.step:
        raise _moved_to_checkout("--step")
    if args.prefix:
        raise _moved_to_checkout("--prefix")
    results = run_bench(
        quick=args.quick,
        device=args.device,
        repeats=args.repeats,
        progress=not args.no_progress,
        warm_cache=args.warm_cache,
    )
    print_results(results)
    if args.json:
        write_json(results, args.json)
    return 0


#: ``kvforge bench`` flag -> the research harness that replaced it. The harnesses compare
#: kvforge with vLLM's own code and live in the checkout's ``benchmarks/``, not in the wheel.
HARNESSES = {"--step": "benchmarks/bench_step.py", "--prefix": "benchmarks/bench_prefix.py"}


def _moved_to_checkout(flag: str) -> UsageError:
    return UsageError(
        f"kvforge bench {flag} is a research harness that is not installed with kvforge; "
        f"from a checkout run: python {HARNESSES[flag]} --no-vllm (with vLLM installed, "
        "without --no-vllm)"
    )


# ---------------------------------------------------------------------------------- main


def _add_plugin_option(parser: argparse.ArgumentParser, default: object) -> None:
    # on a subcommand the default is SUPPRESS, so `kvforge --plugin M plan` keeps the
    # top-level value instead of the subparser overwriting it with None
    parser.add_argument(
        "--plugin",
        action="append",
        metavar="MODULE",
        default=default,
        help="import MODULE first, which registers backends and model types (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvforge", description="KV cache allocation, paging and offload for LLM inference"
    )
    _add_plugin_option(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="size and name every cache of a model")
    add_model_args(plan)
    size = plan.add_mutually_exclusive_group()
    size.add_argument(
        "--num-blocks",
        type=_num_blocks,
        help="blocks per group, the null block included (at least 2)",
    )
    size.add_argument(
        "--device-memory",
        type=_size,
        default=parse_size("8GiB"),
        help="device memory budget, e.g. 60GiB (default 8GiB)",
    )
    plan.add_argument("--host-memory", type=_size, default=None, help="host budget, e.g. 32GiB")
    plan.add_argument("--max-model-len", type=_positive, default=None)
    plan.add_argument("--max-num-seqs", type=_positive, default=None)
    plan.add_argument(
        "--rank", type=_non_negative, default=0, help="tensor-parallel rank for names"
    )
    plan.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="print JSON instead of tables; with PATH, write it there and print the tables",
    )
    _add_plugin_option(plan, argparse.SUPPRESS)
    plan.set_defaults(func=cmd_plan)

    demo = sub.add_parser(
        "demo", help="a serving loop that allocates, preempts, swaps and verifies every byte"
    )
    add_model_args(demo)
    demo.add_argument(
        "--device",
        choices=["cpu", "cuda", "npu", "auto"],
        default="auto",
        help="where the caches live (default: auto, the best device found)",
    )
    demo.add_argument("--seed", type=int, default=0, help="same seed, same run (default 0)")
    demo.add_argument("--requests", type=_positive, default=14, help="requests (default 14)")
    demo.add_argument(
        "--device-memory",
        type=_size,
        default=None,
        help="device cache budget, e.g. 64MiB (default: a third of what the requests need)",
    )
    demo.add_argument(
        "--host-memory",
        type=_size,
        default=None,
        help="host cache budget (default: room for every request swapped out at once)",
    )
    demo.add_argument(
        "--prefix-conversations",
        type=_non_negative,
        default=4,
        metavar="N",
        help="multi-turn conversations run with the prefix cache after the loop (0: none)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--json", default=None, metavar="PATH", help="also write the result here")
    demo.add_argument(
        "--self-test-corrupt",
        type=_positive,
        default=None,
        metavar="STEP",
        help="self-test: flip one cached byte after STEP steps; the run must fail (exit 1)",
    )
    _add_plugin_option(demo, argparse.SUPPRESS)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser(
        "bench", help="swap throughput vs a contiguous copy and a per-block loop"
    )
    bench.add_argument("--quick", action="store_true", help="a reduced set, well under a minute")
    bench.add_argument("--device", default=None, help="cpu, cuda or npu (default: best found)")
    bench.add_argument("--repeats", type=_positive, default=None, help="timed runs per case")
    bench.add_argument("--json", default=None, help="write the cases to this JSON file")
    bench.add_argument(
        "--warm-cache",
        action="store_true",
        help="do not flush CPU caches before each timed run (small transfers then run from cache)",
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--step",
        action="store_true",
        help="moved: run benchmarks/bench_step.py from a checkout (exits 2 and says so)",
    )
    bench.add_argument(
        "--prefix",
        action="store_true",
        help="moved: run benchmarks/bench_prefix.py from a checkout (exits 2 and says so)",
    )
    _add_plugin_option(bench, argparse.SUPPRESS)
    bench.set_defaults(func=cmd_bench)

    return parser


def _wants_help(argv: Sequence[str]) -> bool:
    options = argv[: argv.index("--")] if "--" in argv else argv
    return any(a in ("-h", "--help") for a in options)


def _load_plugins(argv: list[str]) -> int | None:
    """Import the installed plugins and those of ``--plugin``; an exit code on failure.

    With ``--help`` a failure is a warning: the help of what did load is still useful.
    """
    pre = _Parser(prog="kvforge", add_help=False)
    pre.add_argument("--plugin", action="append", default=[])
    try:
        known, _ = pre.parse_known_args(argv)
    except SystemExit as exc:  # e.g. --plugin without a value: argparse printed one line
        return int(exc.code or 0)
    help_only = _wants_help(argv)
    loads = [("", load_plugins)] + [(m, lambda m=m: load_plugin_module(m)) for m in known.plugin]
    for module, load in loads:
        try:
            load()
        except (PluginError, ValueError, TypeError) as exc:
            # PluginError carries any failure of the plugin itself; ValueError / TypeError
            # are a bad --plugin name (empty), refused before importing anything.
            where = "" if isinstance(exc, PluginError) else f"--plugin {module!r}: "
            if help_only:
                print(f"kvforge: warning: {where}{one_line(exc)}", file=sys.stderr)
                continue
            print(f"kvforge: error: {where}{one_line(exc)}", file=sys.stderr)
            return 2
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    failed = _load_plugins(argv)
    if failed is not None:
        return failed
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (exit 2) and --help (exit 0) as return codes
        return int(exc.code or 0)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        # Input errors only (UsageError and pydantic's ValidationError are ValueErrors). A
        # TypeError, KeyError, ... escaping a command is a bug: it keeps its traceback.
        print(f"kvforge {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
