"""The command line of ``kvforge``: the parser, option types, and the model the options name.

:func:`build_parser` declares every subcommand and option. Option types check their value
where argparse can report it (``argument --dtype: 'int64' is not a cache dtype ...``), so
that bad input is one line and exit code 2 before any work. :func:`build_backends` turns the
model options into ``{layer id: backend}``: a bundled or given config through
:func:`~kvforge.models.hf_config.from_hf_config` (only the options it takes apply), or a
registered backend and its sizes (only the parameters of the backend's builder apply). No
option is silently ignored.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kvforge.attn_backends.base import AttentionBackend
from kvforge.cli.formatting import UsageError, parse_size
from kvforge.models.base import MAX_LAYERS
from kvforge.models.registry import registered_backends
from kvforge.specs import DTYPE_ITEMSIZE, canonical_dtype, torch_dtype

__all__ = [
    "BACKEND_OPTIONS",
    "CACHE_DTYPES",
    "CONFIG_OPTIONS",
    "DEFAULT_LAYERS",
    "MODEL_OPTIONS",
    "add_model_args",
    "add_plugin_option",
    "build_backends",
    "build_parser",
    "check_list_models",
    "flag",
    "list_models",
    "plugin_parser",
]

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
CONFIG_OPTIONS = (
    "block_size",
    "dtype",
    "kv_cache_dtype",
    "tp_size",
    "num_speculative_tokens",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
)
MODEL_OPTIONS = (*BACKEND_OPTIONS, "layers", *CONFIG_OPTIONS[3:])
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
"""vLLM's ``MambaDType`` choices (``vllm/config/cache.py``)."""
DEFAULT_LAYERS = 32

CACHE_DTYPES = tuple(name for name in DTYPE_ITEMSIZE if torch_dtype(name).is_floating_point)
"""What ``--dtype`` may name: the floating-point dtypes kvforge stores. The integer storage
dtypes of :data:`~kvforge.specs.DTYPE_ITEMSIZE` hold packed bytes or indices inside a
backend's own roles; a key or value cache of ``int64`` is not a thing."""


def flag(dest: str) -> str:
    """The option an argparse ``dest`` comes from: ``kv_lora_rank`` -> ``--kv-lora-rank``."""
    return "--" + dest.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---------------------------------------------------------------------------------- types
# Each raises ArgumentTypeError, which argparse reports as "argument --flag: <message>".


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


def _cache_dtype(text: str) -> str | None:
    """``text`` when it names one of :data:`CACHE_DTYPES` (aliases such as ``bf16`` and
    ``fp8`` included). It is returned as given, so later messages quote what the user typed.
    ``auto`` is the default, returned as ``None`` (not given): a config model is served as the
    engines serve it (float32 configs in bfloat16), a ``--backend`` gets its builder's default.
    """
    if text == "auto":
        return None
    try:
        name = canonical_dtype(text)
    except ValueError:
        name = ""
    if name not in CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a cache dtype; use one of {', '.join(CACHE_DTYPES)} "
            "(or an alias: fp32, fp16, bf16, fp8), or auto"
        )
    return text


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
    _add_backend_sizes(src)
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
    src.add_argument(
        "--mamba-cache-dtype",
        choices=MAMBA_DTYPES,
        default=None,
        help="conv state dtype of Mamba2 and Gated DeltaNet (linear-attention) layers, as "
        "vLLM's option (default auto: the model dtype)",
    )
    src.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=MAMBA_DTYPES,
        default=None,
        help="SSM / recurrent state dtype of Mamba2 and Gated DeltaNet layers, as vLLM's "
        "option (default auto: the conv state's dtype; Nemotron-H: its config's or float32; "
        "Qwen3.5: its config's mamba_ssm_dtype)",
    )
    src.add_argument(
        "--list-models",
        action="store_true",
        help="list the bundled configs and the supported model types, and exit",
    )


def _add_backend_sizes(src: Any) -> None:
    """The sizes of a ``--backend`` model (and ``--block-size`` / ``--dtype``, which config
    models take too)."""
    # Backend options default to None, so that "given" is visible: the backend's builder
    # supplies the defaults of those not given (gqa: 8 kv heads of 128, mla: 512 + 64, ...).
    src.add_argument(
        "--num-kv-heads",
        type=_positive,
        default=None,
        help="key/value heads per layer with --backend gqa or mha (default 8)",
    )
    src.add_argument(
        "--head-dim",
        type=_positive,
        default=None,
        help="dims per key/value head with --backend gqa or mha (default 128)",
    )
    src.add_argument("--block-size", type=_positive, default=None, help="tokens per block")
    src.add_argument(
        "--dtype",
        type=_cache_dtype,
        default=None,
        help=f"model / cache dtype: {', '.join(CACHE_DTYPES)} or auto (default auto: with "
        "--model / --config the config's torch_dtype as engines serve it, float32 downcast to "
        "bfloat16 as vLLM does; with --backend the backend's default)",
    )
    src.add_argument(
        "--kv-cache-quant",
        choices=["fp8", "block_wise_fp8"],
        default=None,
        help="with --backend gqa or mha: keys and values in float8_e4m3fn (fp8), plus a "
        "float32 scale per token and kv head (block_wise_fp8); default: none",
    )
    src.add_argument(
        "--kv-lora-rank",
        type=_positive,
        default=None,
        help="latent (compressed KV) dims with --backend mla or dsa (default 512)",
    )
    src.add_argument(
        "--qk-rope-head-dim",
        type=_positive,
        default=None,
        help="rotary key dims stored beside the latent, --backend mla, dsa or deepseek-v4 "
        "(default 64)",
    )
    src.add_argument(
        "--index-head-dim",
        type=_positive,
        default=None,
        help="indexer key dims with --backend dsa or deepseek-v4 (default 128)",
    )


def _given(args: argparse.Namespace, dests: Sequence[str]) -> list[str]:
    return [d for d in dests if getattr(args, d, None) is not None]


def _refuse(extra: Sequence[str], where: str, takes: Sequence[str]) -> None:
    if extra:
        verb = "does" if len(extra) == 1 else "do"
        raise UsageError(
            f"{', '.join(flag(d) for d in extra)} {verb} not apply to {where}; it takes "
            f"{', '.join(flag(d) for d in takes)}"
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
            mamba_cache_dtype=args.mamba_cache_dtype,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
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
        raise UsageError(f"--backend {kind} needs {', '.join(flag(m) for m in missing)}")
    return entry.builder(**given)


def check_list_models(args: argparse.Namespace) -> None:
    """``--list-models`` takes no model options: refuse the ones given, by flag."""
    others = _given(args, ("model", "config", "backend", *MODEL_OPTIONS))
    if others:
        raise UsageError(
            f"--list-models lists the bundled configs and takes no model options, got "
            f"{', '.join(flag(d) for d in others)}"
        )


def list_models(args: argparse.Namespace) -> int:
    """``--list-models``: print the bundled configs and the supported model types
    (:mod:`kvforge.cli.plan_models`)."""
    from kvforge.cli.plan_models import print_models

    check_list_models(args)
    print_models()
    return 0


# ---------------------------------------------------------------------------------- parser


def add_plugin_option(parser: argparse.ArgumentParser, default: object) -> None:
    """``--plugin MODULE`` (repeatable), on the top level and on every subcommand."""
    # on a subcommand the default is SUPPRESS, so `kvforge --plugin M plan` keeps the
    # top-level value instead of the subparser overwriting it with None
    parser.add_argument(
        "--plugin",
        action="append",
        metavar="MODULE",
        default=default,
        help="import MODULE first, which registers backends and model types (repeatable)",
    )


def plugin_parser() -> argparse.ArgumentParser:
    """A parser that reads only ``--plugin``, wherever it stands (before the full parse: the
    plugins decide the choices of ``--backend``)."""
    pre = _Parser(prog="kvforge", add_help=False)
    pre.add_argument("--plugin", action="append", default=[])
    return pre


def build_parser() -> argparse.ArgumentParser:
    """The ``kvforge`` parser; the chosen subcommand is ``args.command``."""
    parser = _Parser(
        prog="kvforge", description="KV cache allocation, paging and offload for LLM inference"
    )
    add_plugin_option(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_plan(sub.add_parser("plan", help="size and name every cache of a model"))
    _add_demo(
        sub.add_parser(
            "demo", help="a serving loop that allocates, preempts, swaps and verifies every byte"
        )
    )
    _add_bench(
        sub.add_parser(
            "bench",
            help="swap throughput vs a contiguous copy and a per-block loop; --tiers: host "
            "and remote tier throughput and restore time",
        )
    )
    return parser


def _add_plan(plan: argparse.ArgumentParser) -> None:
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
        default=None,
        help="device memory budget, e.g. 60GiB (default 8GiB)",
    )
    plan.add_argument(
        "--vllm-specs",
        default=None,
        metavar="PATH",
        help="plan a vLLM model instead: a JSON file of its per-layer KV cache specs, as "
        "kvforge.integrations.vllm.specs.dump_vllm_specs writes it (needs kvforge[vllm])",
    )
    plan.add_argument("--host-memory", type=_size, default=None, help="host budget, e.g. 32GiB")
    plan.add_argument(
        "--own-pools",
        action="store_true",
        help="a pool per group, as CacheController(share_pools=False) allocates (default: "
        "groups whose pages differ draw on one slab arena)",
    )
    plan.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="longest sequence in tokens the plan holds (default: the config's "
        "max_position_embeddings, as vLLM defaults it)",
    )
    plan.add_argument(
        "--max-num-seqs",
        type=_positive,
        default=None,
        help="sequences running at once the plan must hold at --max-model-len (default 256, "
        "vLLM's); fewer fitting is a warning",
    )
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
    add_plugin_option(plan, argparse.SUPPRESS)


def _add_demo_stores(demo: argparse.ArgumentParser) -> None:
    """``kvforge demo``'s store addresses, for ``--tier redis`` and ``--tier mooncake``."""
    demo.add_argument(
        "--redis",
        default=None,
        metavar="HOST:PORT",
        help="with --tier redis: use this Redis server (default: start one)",
    )
    demo.add_argument(
        "--mooncake-master",
        default=None,
        metavar="HOST:PORT",
        help="with --tier mooncake: use this Mooncake master (default: start one)",
    )


def _add_demo(demo: argparse.ArgumentParser) -> None:
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
    demo.add_argument(
        "--tier",
        choices=["device", "host", "redis", "mooncake"],
        default="device",
        help="where the prefix-reuse phase keeps cached prefixes: device (default), host "
        "(a device of about one conversation, a host tier behind it), or redis / mooncake "
        "(that and a remote store: engine A publishes, a second controller reuses; the "
        "server is started for the run unless given below)",
    )
    _add_demo_stores(demo)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--json", default=None, metavar="PATH", help="also write the result here")
    demo.add_argument(
        "--self-test-corrupt",
        type=_positive,
        default=None,
        metavar="STEP",
        help="self-test: flip one cached byte after STEP steps (a step the run reaches with a "
        "request running); the run must fail (exit 1)",
    )
    add_plugin_option(demo, argparse.SUPPRESS)


def _add_bench(bench: argparse.ArgumentParser) -> None:
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
    tiers = bench.add_argument_group("tiers (kvforge bench --tiers)")
    tiers.add_argument(
        "--tiers",
        action="store_true",
        help="host and remote tier put/get throughput and prefix restore time, each against "
        "the same bytes copied contiguously or by the raw client (starts its own servers)",
    )
    tiers.add_argument(
        "--remote",
        default=None,
        metavar="LIST",
        help="remote tiers to measure: a comma list of redis, mooncake, or none "
        "(default: redis,mooncake)",
    )
    tiers.add_argument(
        "--redis",
        default=None,
        metavar="HOST:PORT",
        help="use this Redis server (default: start one)",
    )
    tiers.add_argument(
        "--mooncake-master",
        default=None,
        metavar="HOST:PORT",
        help="use this Mooncake master (default: start one)",
    )
    tiers.add_argument(
        "--mooncake-segment",
        choices=["remote", "here"],
        default=None,
        help="who lends Mooncake the memory values live in: remote (default) a second "
        "process, mooncake_client, started with the master (with --mooncake-master: the "
        "cluster's own clients), so puts and gets cross TCP; here: the bench's own client, "
        "so the raw put and get are a memcpy inside the process",
    )
    add_plugin_option(bench, argparse.SUPPRESS)
