"""Offload benchmark: our swap path against two baselines on the same bytes, in one run.

For each case a controller is built, two requests grow in turns so their blocks interleave
(as in a live engine), and one of them is swapped out and in repeatedly. Each direction is
compared with, on the same number of bytes:

- ``memcpy``: one contiguous copy (device -> host on swap out, host -> device on swap in),
  the limit any paged transfer can approach;
- ``loop``: a per-block, per-plane copy loop between the same device blocks and host pages,
  what engines do today.

Each case runs ``repeats`` interleaved rounds (at least :data:`~kvforge.cli.timing.MIN_REPEATS`):
per round, our swap out and in, the ``memcpy`` baseline both ways and the loop baseline both
ways, one timed run each. GB/s is from the best run of each side; a ratio is the median over
the rounds of that round's throughput ratio, reported with its spread (min / median / max over
the rounds, ``*_spread`` in the JSON), so one lucky or unlucky run never makes a ratio.

On CPU every timed run starts with the bytes it moves out of cache (unless ``warm_cache``),
for the baselines and for our path alike: see :func:`cache_flusher`. Without that, a small
transfer repeated back to back is a cache-to-cache copy for the contiguous baseline (30-45 GB/s
for 1.6 MiB on a 2-core VM with an 8 MiB L3, against about 7 GB/s from memory), which says
nothing about a swap: the blocks of a preempted request and the host pages it goes to were
last touched long before.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from kvforge.attn_backends import DeepseekV4Backend, GQABackend
from kvforge.attn_backends.base import AttentionBackend, DeclaredBackend
from kvforge.cli.formatting import (
    UsageError,
    check_output_path,
    console,
    format_bytes,
    make_table,
)
from kvforge.cli.remotes import (
    ADDRESS_FLAGS,
    REMOTES,
    StoreUnavailable,
    check_available,
    given_addresses,
    parse_remotes,
)
from kvforge.cli.timing import MIN_REPEATS, Spread, cache_flusher, ratio_spread
from kvforge.cli.timing import samples as _samples
from kvforge.controller import CacheController
from kvforge.ops import PlaneSet
from kvforge.platform import Platform, get_platform
from kvforge.specs import CacheGroup, CacheRole, SwapPurpose
from kvforge.worker.swap_pages import HostGroupPool
from kvforge.worker.transfer import move_pages

__all__ = [
    "HARNESSES",
    "BenchCase",
    "BenchResult",
    "check_tier_flags",
    "cmd_bench",
    "default_cases",
    "run_bench",
]


class BenchResult(BaseModel):
    """One measured (case, direction)."""

    layout: str
    direction: str
    device: str
    impl: str
    page_bytes: int
    """Bytes of one host page (one block of every plane of the group)."""
    min_plane_bytes: int
    """Smallest contiguous unit the gather moves: one block of the smallest plane."""
    num_planes: int
    requests: int
    """Requests moved together in one data-path call."""
    blocks: int
    bytes: int
    seconds: float
    """Best of the rounds (what ``gbps`` is computed from)."""
    seconds_spread: list[float]
    """``[min, median, max]`` seconds of our side over the rounds."""
    cache: str
    """Cache state at the start of each timed run: ``"cold data"`` (the moved bytes evicted),
    ``"cold"`` (whole caches flushed), ``"warm"`` (``--warm-cache``) or ``"n/a"`` (GPU)."""
    gbps: float
    memcpy_gbps: float
    loop_gbps: float
    ratio_vs_memcpy: float
    """Median over the rounds of each round's throughput ratio to ``memcpy`` (below 1: slower)."""
    ratio_vs_memcpy_spread: list[float]
    """``[min, median, max]`` of that ratio over the rounds."""
    ratio_vs_loop: float
    """Median over the rounds of each round's throughput ratio to the per-block loop."""
    ratio_vs_loop_spread: list[float]
    """``[min, median, max]`` of that ratio over the rounds."""


class _SynthBackend(DeclaredBackend):
    """One uint8 role per layer with ``plane_bytes`` per block (block size 1 token)."""

    def __init__(self, plane_bytes: int) -> None:
        self.plane_bytes = plane_bytes
        self.declare(
            [CacheGroup(name="kv", block_size=1)],
            [CacheRole(name="key", group="kv", entry_shape=(plane_bytes,), dtype="uint8")],
        )

    def __repr__(self) -> str:
        return f"_SynthBackend({self.plane_bytes})"


@dataclass(frozen=True)
class BenchCase:
    """A model and what of it to swap.

    Attributes:
        name: label in reports.
        backends: layer id -> backend.
        group: the group whose pages are measured through the swap data path
            (``move_pages``); ``None``: whole requests through ``swap_out_many`` /
            ``swap_in_many``, every group, hooks and bookkeeping included.
        target_bytes: with a group, roughly how many bytes one request should move; without,
            the request length in tokens.
        requests: how many requests move together, in one data-path call per group (as
            ``swap_out_many`` does); 1 measures a single swap.
    """

    name: str
    backends: Mapping[int, AttentionBackend]
    group: str | None
    target_bytes: int
    requests: int = 1


def _flash_backends(layers: int = 43) -> dict[int, AttentionBackend]:
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(layers - 2)] + [0]
    kinds = {r: DeepseekV4Backend(r) for r in (0, 4, 128)}
    return {layer: kinds[r] for layer, r in enumerate(ratios)}


def default_cases(quick: bool) -> list[BenchCase]:
    """Llama-3-8B GQA, the DeepSeek-V4-Flash groups, and a sweep of plane sizes."""
    mib = 1 << 20
    big = (32 if quick else 128) * mib  # well above the last-level cache
    llama = {i: GQABackend(8, 128, 16, "bfloat16") for i in range(32)}
    flash = _flash_backends()
    cases = [BenchCase("llama3-8b/kv", llama, "kv", big)]
    groups = ["swa", "compressed"] if quick else ["swa", "compressed", "c4_state", "c128_state"]
    cases += [BenchCase(f"dsv4-flash/{g}", flash, g, big) for g in groups]
    # One request's window or state is a small transfer (latency); an engine preempting
    # several requests in one step moves them in one call (throughput).
    batched = ["swa"] if quick else ["swa", "c4_state"]
    cases += [BenchCase(f"dsv4-flash/{g} x16", flash, g, big, requests=16) for g in batched]
    # One whole request, all four groups through the controller: what an engine waits for.
    lengths = (4096,) if quick else (1024, 4096, 16384)
    cases += [BenchCase(f"dsv4-flash/request {n // 1024}k", flash, None, n) for n in lengths]
    sweep = (1_168, 37_376) if quick else (1_168, 8_448, 32_768, 37_376)
    for size in sweep:
        cases.append(
            BenchCase(f"planes-{size}B", {i: _SynthBackend(size) for i in range(20)}, "kv", big)
        )
    return cases


def _grow_interleaved(ctl: CacheController, names: list[str], tokens: int, step: int) -> None:
    """Grow ``names`` and ``"other"`` in turns, ``step`` tokens at a time, so their blocks
    interleave as in a live engine."""
    for end in range(step, tokens + step, step):
        for name in (*names, "other"):
            ctl.allocate(name, min(end, tokens))


def _case_blocks(ctl: CacheController, case: BenchCase) -> int:
    assert case.group is not None
    page = ctl.layout.host_page_bytes(case.group)
    group = ctl.layout.group(case.group)
    blocks = max(4, case.target_bytes // page)
    if group.window is not None:  # only the window moves: keep the request inside it
        blocks = min(blocks, max(1, group.window // group.block_size))
    return blocks


@dataclass
class _GroupMove:
    """One group's part of a measured move: the requests' device blocks and host pages."""

    planes: PlaneSet
    host: HostGroupPool
    ids: list[int]
    pages: list[int]


def _group_moves(ctl: CacheController, names: list[str], groups: list[str]) -> list[_GroupMove]:
    """The blocks a swap of ``names`` moves in ``groups``, with host pages taken for them."""
    host = ctl.storage.host
    manager = ctl.scheduler
    moves = []
    for g in groups:
        indices = {r: manager.selection(r, SwapPurpose.PREEMPT).get(g, ()) for r in names}
        ids = [ctl.block_table(r, g)[i] for r in names for i in indices[r]]
        if ids:
            pages = manager.host_pool(g).take(len(ids)).tolist()
            moves.append(_GroupMove(ctl.storage.planes(g), host.groups[g], ids, pages))
    return moves


def _moved_bytes(moves: list[_GroupMove]) -> list[torch.Tensor]:
    """Exactly the bytes ``moves`` read and write: each moved block of each plane and each
    host page they use, as contiguous views (what a "cold data" flush evicts)."""
    views = [p[b] for m in moves for p in m.planes for b in m.ids]
    return views + [m.host.pages[page] for m in moves for page in m.pages]


def _allocation(cache: torch.Tensor) -> torch.Tensor:
    """The whole allocation under ``cache`` as one contiguous uint8 tensor."""
    storage = cache.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)


def _block_loop(moves: list[_GroupMove], direction: str) -> None:
    """What engines do today: one copy per block per plane."""
    for m in moves:
        sizes = [p.shape[1] for p in m.planes]
        for b, page in zip(m.ids, m.pages, strict=True):
            row = m.host.pages[page]
            for plane, off, size in zip(m.planes, m.host.offsets, sizes, strict=True):
                if direction == "out":
                    row[off : off + size].copy_(plane[b], non_blocking=True)
                else:
                    plane[b].copy_(row[off : off + size], non_blocking=True)


@dataclass
class _CaseRun:
    """A case set up for timing: its controller and requests, the moves one swap makes, two
    contiguous buffers of the same bytes (the ``memcpy`` baseline), and the cache flush."""

    ctl: CacheController
    names: list[str]
    moves: list[_GroupMove]
    nbytes: int
    src: torch.Tensor
    dst: torch.Tensor
    flush: Callable[[], None] | None
    cache: str


def _case_controller(case: BenchCase, platform: Platform) -> tuple[CacheController, int, int]:
    """A controller sized for ``case`` (host pages included), the request length in tokens
    and the growth step."""
    probe = CacheController(case.backends, device=platform.device)
    if case.group is not None:
        blocks = _case_blocks(probe, case)
        step = probe.layout.group(case.group).block_size
        tokens = blocks * step
    else:
        tokens = case.target_bytes
        step = max(g.block_size for g in probe.layout.groups)
    # Every request fits in every group; window and state groups stay small. Whole-request
    # swaps take host pages of their own besides those of the loop baseline: twice as many.
    copies = case.requests + 1 if case.group is not None else 2 * case.requests + 1
    # a window group also holds the blocks of the step that grew it (one ``step`` of tokens)
    num_blocks = {
        g.name: copies * (g.max_live_blocks(tokens) + -(-step // g.block_size) + 1) + 2
        for g in probe.layout.groups
    }
    ctl = CacheController(case.backends, device=platform.device)
    ctl.initialize_kv_cache(num_blocks=num_blocks)
    ctl.initialize_host_cache(num_pages=num_blocks)
    return ctl, tokens, step


def _set_up(case: BenchCase, platform: Platform, warm_cache: bool) -> _CaseRun:
    """The requests grown, what one swap of them moves per group (with host pages of their own
    for the data-path cases and for the per-block loop baseline), and the flush."""
    ctl, tokens, step = _case_controller(case, platform)
    names = [f"bench{k}" for k in range(case.requests)]
    _grow_interleaved(ctl, names, tokens, step)
    groups = [case.group] if case.group is not None else [g.name for g in ctl.layout.groups]
    moves = _group_moves(ctl, names, groups)
    nbytes = sum(len(m.ids) * m.host.page_bytes for m in moves)
    src = platform.empty((nbytes,), torch.uint8)
    dst = platform.empty_host((nbytes,), torch.uint8)
    # Touch both first: an untouched CPU buffer reads as the kernel's shared zero page, which
    # would make the baseline a copy out of one cached 4 KiB page.
    src.fill_(0x5A)
    dst.fill_(0xA5)
    if case.group is not None:
        buffers = _moved_bytes(moves)
    else:  # the blocks a whole-request swap picks are known only once it runs: every pool
        # (a padded cache is a strided view: evict its whole allocation)
        buffers = [_allocation(t) for t in ctl.kv_caches]
        buffers += [p.pages for p in ctl.storage.host.groups.values()]
    buffers += [src, dst]
    flush, cache = (None, "warm") if warm_cache else cache_flusher(platform, buffers)
    return _CaseRun(ctl, names, moves, nbytes, src, dst, flush, cache)


def _swaps(run: _CaseRun, case: BenchCase, platform: Platform) -> tuple[Callable, Callable]:
    """Our swap out and swap in of the case, warmed up once (kernel compilation, first touch
    of pages): the data path of one group on the requests' real (interleaved) blocks, all in
    one call as ``swap_out_many`` moves them; or whole requests through the controller."""
    if case.group is None:
        ctl, names = run.ctl, run.names
        out, back = (lambda: ctl.swap_out_many(names)), (lambda: ctl.swap_in_many(names))
    else:
        [m] = run.moves
        keep: list[torch.Tensor] = []  # what an asynchronous copy reads, until synchronized
        args = (platform, run.ctl.storage.streams, m.planes, m.ids, m.host.pages, m.pages, keep)
        move_out = functools.partial(move_pages, "out", *args)
        move_in = functools.partial(move_pages, "in", *args)
        out, back = (lambda: (move_out(), keep.clear())), (lambda: (move_in(), keep.clear()))
    out()
    back()
    return out, back


def _rounds(run: _CaseRun, case: BenchCase, platform: Platform, repeats: int) -> dict[str, list]:
    """Seconds of each timed run, ``repeats`` interleaved rounds: per round our swap out and
    in (they alternate: each needs the other's result), the ``memcpy`` baseline both ways and
    the per-block loop both ways, each run after the flush."""
    out, back = _swaps(run, case, platform)
    src, dst = run.src, run.dst
    fns = {
        "out": out,
        "in": back,
        "memcpy_out": lambda: dst.copy_(src, non_blocking=True),
        "memcpy_in": lambda: src.copy_(dst, non_blocking=True),
        "loop_out": lambda: _block_loop(run.moves, "out"),
        "loop_in": lambda: _block_loop(run.moves, "in"),
    }
    times: dict[str, list] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            times[key] += _samples(platform, fn, 1, run.flush)
    return times


def _result(
    case: BenchCase, run: _CaseRun, platform: Platform, direction: str, times: dict[str, list]
) -> BenchResult:
    """One direction's record: GB/s from the best run of each side, ratios over the rounds."""
    from kvforge import ops

    ours, memcpy, loop = times[direction], times[f"memcpy_{direction}"], times[f"loop_{direction}"]
    sizes = [p.shape[1] for m in run.moves for p in m.planes]
    gbps = run.nbytes / min(ours) / 1e9
    vs_memcpy, vs_loop = ratio_spread(ours, memcpy), ratio_spread(ours, loop, digits=2)
    return BenchResult(
        layout=case.name,
        direction=direction,
        device=str(platform.device),
        impl=ops.resolve_impl("auto", platform.device),
        page_bytes=max(m.host.page_bytes for m in run.moves),
        min_plane_bytes=min(sizes),
        num_planes=len(sizes),
        requests=case.requests,
        blocks=sum(len(m.ids) for m in run.moves),
        bytes=run.nbytes,
        seconds=min(ours),
        seconds_spread=Spread.of(ours, 6).as_list(),
        cache=run.cache,
        gbps=round(gbps, 3),
        memcpy_gbps=round(run.nbytes / min(memcpy) / 1e9, 3),
        loop_gbps=round(run.nbytes / min(loop) / 1e9, 3),
        ratio_vs_memcpy=vs_memcpy.median,
        ratio_vs_memcpy_spread=vs_memcpy.as_list(),
        ratio_vs_loop=vs_loop.median,
        ratio_vs_loop_spread=vs_loop.as_list(),
    )


def _measure_case(
    case: BenchCase, platform: Platform, repeats: int, warm_cache: bool
) -> list[BenchResult]:
    """Both directions of ``case``, each side timed in ``repeats`` interleaved rounds."""
    run = _set_up(case, platform, warm_cache)
    try:
        times = _rounds(run, case, platform, repeats)
        return [_result(case, run, platform, d, times) for d in ("out", "in")]
    finally:
        run.ctl.free()


def run_bench(
    quick: bool = False,
    device: str | None = None,
    repeats: int | None = None,
    cases: list[BenchCase] | None = None,
    progress: bool = True,
    warm_cache: bool = False,
) -> list[BenchResult]:
    """Measure every case in both directions; see the module docstring."""
    reps = repeats if repeats is not None else (3 if quick else 5)
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < MIN_REPEATS:
        raise ValueError(
            f"repeats must be an int >= {MIN_REPEATS} (each ratio is reported with its spread "
            f"over the repeats), got {repeats!r}"
        )
    platform = get_platform(device)
    chosen = cases if cases is not None else default_cases(quick)
    results: list[BenchResult] = []
    if progress:
        from rich.progress import track

        iterator = track(chosen, description="benchmarking swaps", transient=True)
    else:
        iterator = iter(chosen)
    for case in iterator:
        results += _measure_case(case, platform, reps, warm_cache)
    return results


def print_results(results: list[BenchResult]) -> None:
    table = make_table(
        "kvforge swap throughput vs baselines (same bytes, same run; GB/s: best run; ratios: "
        "median (min-max) over interleaved rounds; at the start of each run the caches were "
        f"{', '.join(sorted({r.cache for r in results}))})",
        (
            "layout",
            "dir",
            "impl",
            "page",
            "min plane",
            "moved",
            "GB/s",
            "memcpy GB/s",
            "loop GB/s",
            "vs memcpy",
            "vs loop",
        ),
        left=("layout", "dir", "impl"),
    )
    for r in results:
        table.add_row(
            r.layout,
            r.direction,
            r.impl,
            f"{r.page_bytes:,}",
            f"{r.min_plane_bytes:,}",
            format_bytes(r.bytes),
            f"{r.gbps:.2f}",
            f"{r.memcpy_gbps:.2f}",
            f"{r.loop_gbps:.2f}",
            Spread(*r.ratio_vs_memcpy_spread).text(".2f"),
            Spread(*r.ratio_vs_loop_spread).text(".1f", "x"),
        )
    console().print(table)


def write_json(results: list[BenchResult], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([r.model_dump() for r in results], fh, indent=2)


# ---------------------------------------------------------------------------------- command

#: ``kvforge bench`` flag -> the research harness that replaced it. The harnesses compare
#: kvforge with vLLM's own code and live in the checkout's ``benchmarks/``, not in the wheel.
HARNESSES = {"--step": "benchmarks/bench_step.py", "--prefix": "benchmarks/bench_prefix.py"}


def _moved_to_checkout(flag: str) -> UsageError:
    return UsageError(
        f"kvforge bench {flag} is a research harness that is not installed with kvforge; "
        f"from a checkout run: python {HARNESSES[flag]} --no-vllm (with vLLM installed, "
        "without --no-vllm)"
    )


#: ``kvforge bench`` flags that mean nothing with ``--tiers``, and their defaults.
IGNORED_WITH_TIERS = {"step": False, "prefix": False, "warm_cache": False}
#: flags that mean something only with ``--tiers``.
TIERS_ONLY = {"redis": None, "mooncake_master": None, "remote": None, "mooncake_segment": None}


def check_tier_flags(args: argparse.Namespace) -> None:
    """A usage error for a flag ``--tiers`` would ignore, or a tiers flag without it."""

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    if args.tiers:
        used = [flag(n) for n, d in IGNORED_WITH_TIERS.items() if getattr(args, n) != d]
        if used:
            raise UsageError(f"--tiers does not take {', '.join(used)}")
    else:
        used = [flag(n) for n, d in TIERS_ONLY.items() if getattr(args, n) != d]
        if used:
            raise UsageError(f"{', '.join(used)} only applies with --tiers")


def tier_choice(args: argparse.Namespace) -> tuple[tuple[str, ...], dict[str, str], list[str]]:
    """The remote tiers ``--tiers`` measures, their given addresses, and those that must run,
    under the rules and messages of ``kvforge demo --tier`` (:mod:`kvforge.cli.remotes`).

    A tier named by ``--remote`` or given an address must run here (else a usage error naming
    it, before any work); the default, no ``--remote``, measures those of redis and mooncake
    that can run and notes why the others were skipped.
    """
    value = ",".join(REMOTES) if args.remote is None else args.remote
    remotes = REMOTES if args.remote is None else parse_remotes(args.remote)
    given = {"redis": args.redis, "mooncake": args.mooncake_master}
    addresses = given_addresses(given, remotes, "--remote", value)
    if args.mooncake_segment is not None and "mooncake" not in remotes:
        raise UsageError(f"--mooncake-segment applies with --remote mooncake, not --remote {value}")
    required = list(remotes if args.remote is not None else addresses)
    for remote in required:
        try:
            check_available(remote, addresses.get(remote))
        except StoreUnavailable as exc:
            raise UsageError(f"{_chose(args, remote, addresses)}: {exc}") from None
    return remotes, addresses, required


def _chose(args: argparse.Namespace, remote: str, addresses: dict[str, str]) -> str:
    """The option that asked for ``remote``, for a message."""
    if args.remote is None and remote in addresses:
        return f"{ADDRESS_FLAGS[remote]} {addresses[remote]}"
    return f"--remote {remote}"


def cmd_tiers(args: argparse.Namespace) -> int:
    """``kvforge bench --tiers`` (after :func:`check_tier_flags`): see
    :mod:`kvforge.cli.bench_tiers`."""
    from kvforge.cli.bench_tiers import default_cases, print_records, run_tiers

    remotes, addresses, required = tier_choice(args)
    notes: list[str] = []
    started = time.perf_counter()
    try:
        records = run_tiers(
            default_cases(args.quick),
            remotes,
            addresses,
            repeats=args.repeats or (3 if args.quick else 5),
            device=args.device,
            progress=not args.no_progress,
            notes=notes,
            mooncake_segment=args.mooncake_segment or "remote",
            required=required,
        )
    except StoreUnavailable as exc:  # a tier asked for whose server did not start or answer
        raise UsageError(f"{_chose(args, exc.remote or '', addresses)}: {exc}") from None
    print_records(records, notes)
    if args.json:
        report = {"records": records, "notes": notes, "seconds": time.perf_counter() - started}
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``kvforge bench``: the offload benchmark (``--tiers``: the tiers' benchmark,
    :mod:`kvforge.cli.bench_tiers`; ``--step`` / ``--prefix``: exit 2, naming the harness to
    run from a checkout)."""
    check_tier_flags(args)
    if args.repeats is not None and args.repeats < MIN_REPEATS:
        raise UsageError(
            f"--repeats must be at least {MIN_REPEATS}: each ratio is reported with its spread "
            f"(min / median / max over the repeats), got {args.repeats}"
        )
    if args.json is not None:
        check_output_path(args.json, "--json")
    if args.tiers:
        return cmd_tiers(args)
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
