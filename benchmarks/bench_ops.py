#!/usr/bin/env python
"""Benchmark kvforge.ops gather/scatter against baselines measured in the same run.

CPU (default, ``--device cpu``): for page sizes of 1168, 8448 and 37376 bytes per plane and 4
or 8 planes per row, moving ``--mib`` MiB of rows between randomly chosen blocks of the planes
and page-first rows, it times

- ``copy``: ``dst.copy_(src)`` of one contiguous uint8 tensor of the same total bytes;
- ``gather`` / ``scatter`` with every implementation available on CPU (``torch``, ``cpu``);
- ``loop``: a per-block Python copy loop
  (``for i, b in enumerate(ids): for p: out[i, off:off+nb].copy_(plane[b])``), run with one
  torch thread (faster and steadier than with intra-op threads for per-block copies).

and prints throughput ratios: ``impl / copy`` (1.0 = as fast as a contiguous copy) and
``impl / loop``. Timings are medians; baseline and candidates take turns in short bursts
(``--burst``, after a 50 ms pause), so a noisy neighbour hits them alike and each is timed in
its own steady state.

CUDA (``--device cuda``): checks ``triton`` against ``torch`` byte for byte on the GPU
(mixed odd sizes, -1 ids, repeated ids, 40 planes, n == 0, ids on CPU and on the GPU, strided
planes, a plane larger than 2 GiB), then times the offload data path: gather into a device
staging buffer plus one device->pinned-host copy, against one contiguous device->pinned copy of
the same bytes (and the mirror: pinned->device + scatter), plus kernel-only ratios against a
device-to-device copy.
``--tune`` sweeps the tile size and programs per SM.

Slot mapping (``--case slots``, also part of the default ``--case all``): one engine step of
256 tokens (256 decoding requests) and of 8192 tokens (8 prefills of 1024), mapped through a
1024 x 512 int32 block table with ``kvforge.ops.slot_mapping``, against baselines timed in the
same run: ``vllm_numpy``, the vectorised formula an engine's model runner uses
(``table.ravel()[rows * M + p // bs] * bs + p % bs``: block size 16, no compression, no null
block or past-the-table handling), and ``loop``, the per-token Python definition. Ratios are
``baseline time / kvforge time``; figures are reported, never asserted. On CUDA the Triton
kernel is timed against the torch-ops path and the same vectorised formula in torch.

Usage::

    python benchmarks/bench_ops.py [--quick] [--json PATH] [--case all|blocks|slots]
    PYTHONPATH=. python benchmarks/bench_ops.py --device cuda --quick [--tune]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PAGE_SIZES = (1168, 8448, 37376)
PLANE_COUNTS = (4, 8)


def import_ops() -> types.ModuleType:
    """Import ``kvforge.ops``; if the rest of the package does not import, load ops alone."""
    try:
        return importlib.import_module("kvforge.ops")
    except Exception as exc:
        print(f"note: 'import kvforge' failed ({exc!r}); loading kvforge.ops standalone")
        for name in [m for m in sys.modules if m == "kvforge" or m.startswith("kvforge.")]:
            del sys.modules[name]
        pkg = types.ModuleType("kvforge")
        pkg.__path__ = [str(Path(__file__).resolve().parents[1] / "kvforge")]
        sys.modules["kvforge"] = pkg
        return importlib.import_module("kvforge.ops")


def median_times(
    fns: dict[str, Callable[[], Any]],
    reps: int,
    sync: Callable[[], None] = lambda: None,
    slow: frozenset[str] = frozenset(),
    slow_reps: int = 3,
    burst: int = 1,
    settle: float = 0.0,
) -> dict[str, float]:
    """Median seconds per call of each function.

    Functions take turns in bursts of ``burst`` back-to-back calls (``reps`` calls each in all),
    so slow drifts and noisy neighbours hit every function alike. ``burst == 1`` alternates call
    by call; a larger burst times each function in its own steady state (on CPU, a call right
    after a multi-threaded torch op competes with torch's still-spinning OpenMP workers for a few
    milliseconds); ``settle`` seconds of sleep before each burst let such workers go idle.
    """
    for fn in fns.values():  # warm up (JIT, caches, page faults)
        fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(0, reps, burst):
        for name, fn in fns.items():
            if settle:
                time.sleep(settle)
            for _ in range(min(burst, reps - r)):
                if name in slow and len(times[name]) >= slow_reps:
                    break
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def rand_bytes(shape: tuple[int, ...], gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return t.to(device)


# ------------------------------------------------------------------------------------------ CPU


def bench_cpu(ops: types.ModuleType, args: argparse.Namespace) -> list[dict[str, Any]]:
    impls = [i for i in ops.available_impls("cpu") if i != "triton"]
    gen = torch.Generator().manual_seed(0)
    records = []
    row_counts: list[int | None] = [None] if args.quick else [None, 32]
    for nb in PAGE_SIZES:
        for num_planes in PLANE_COUNTS:
            for fixed_rows in row_counts:
                row_bytes = nb * num_planes
                n = fixed_rows or max(1, int(args.mib * 2**20) // row_bytes)
                planes = [rand_bytes((2 * n, nb), gen) for _ in range(num_planes)]
                ids = torch.randperm(2 * n, generator=gen)[:n]
                id_list = ids.tolist()
                out = torch.zeros(n, row_bytes, dtype=torch.uint8)
                src = rand_bytes((n, row_bytes), gen)
                flat_src = src.view(-1)
                flat_dst = torch.zeros_like(flat_src)
                offs = [p * nb for p in range(num_planes)]

                def loop(out=out, planes=planes, id_list=id_list, offs=offs, nb=nb) -> None:
                    # one torch thread: per-block copies gain nothing from intra-op threads, and
                    # OpenMP fork/join per 37 KiB copy makes the loop erratic (seconds) when
                    # another process holds a core; one thread is the faster, steadier baseline
                    threads = torch.get_num_threads()
                    torch.set_num_threads(1)
                    try:
                        for i, b in enumerate(id_list):
                            for plane, off in zip(planes, offs, strict=True):
                                out[i, off : off + nb].copy_(plane[b])
                    finally:
                        torch.set_num_threads(threads)

                fns: dict[str, Callable[[], Any]] = {
                    "copy": lambda d=flat_dst, s=flat_src: d.copy_(s)
                }
                for impl in impls:
                    fns[f"gather_{impl}"] = lambda i=impl, p=planes, x=ids, o=out: (
                        ops.gather_blocks(p, x, o, impl=i)
                    )
                    fns[f"scatter_{impl}"] = lambda i=impl, p=planes, x=ids, s=src: (
                        ops.scatter_blocks(p, x, s, impl=i)
                    )
                fns["loop"] = loop
                t = median_times(
                    fns, args.reps, slow=frozenset({"loop"}), burst=args.burst, settle=0.05
                )
                ref = torch.cat([p[ids] for p in planes], dim=1)
                ops.gather_blocks(planes, ids, out, impl=impls[-1])
                assert torch.equal(out, ref), "gather result differs from the reference"
                rec: dict[str, Any] = {
                    "device": "cpu",
                    "block_bytes": nb,
                    "planes": num_planes,
                    "rows": n,
                    "mib": n * row_bytes / 2**20,
                    "copy_gbps": n * row_bytes / t["copy"] / 1e9,
                    "seconds": t,
                }
                for name, sec in t.items():
                    if name not in ("copy", "loop"):
                        rec[f"{name}_vs_copy"] = t["copy"] / sec
                        rec[f"{name}_vs_loop"] = t["loop"] / sec
                rec["loop_vs_copy"] = t["copy"] / t["loop"]
                records.append(rec)
    return records


def target_verdict(rec: dict[str, Any], impl: str) -> str:
    """The brief's throughput targets, for transfers of at least 16 MiB: >= 0.8 x copy for pages
    >= 32 KiB; >= 0.3 x copy and >= 10 x loop for pages < 2 KiB (gather and scatter). Smaller
    transfers are latency-bound (per-call validation and dispatch) and are reported only."""
    g, s = rec.get(f"gather_{impl}_vs_copy"), rec.get(f"scatter_{impl}_vs_copy")
    if g is None or s is None:
        return "-"
    if rec["mib"] < 16:
        return "(latency)"
    if rec["block_bytes"] >= 32 * 1024:
        return "pass" if min(g, s) >= 0.8 else "FAIL"
    if rec["block_bytes"] < 2048:
        ok = min(g, s) >= 0.3 and rec[f"gather_{impl}_vs_loop"] >= 10
        return "pass" if ok else "FAIL"
    return "n/a"


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
        for r in rows:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*r)
    Console(width=200).print(table)


def report_cpu(records: list[dict[str, Any]]) -> None:
    impls = sorted(
        {
            k[len("gather_") : -len("_vs_copy")]
            for r in records
            for k in r
            if k.endswith("_vs_copy") and k.startswith("gather_")
        },
        key=lambda s: (s != "torch", s),
    )
    columns = ["page B", "planes", "rows", "MiB", "copy GB/s"]
    for impl in impls:
        columns += [f"gather {impl}/copy", f"scatter {impl}/copy"]
    columns += ["loop/copy"] + [f"gather {impl}/loop" for impl in impls]
    best = impls[-1]
    columns.append(f"target ({best})")
    rows = []
    for r in records:
        row = [
            str(r["block_bytes"]),
            str(r["planes"]),
            str(r["rows"]),
            f"{r['mib']:.1f}",
            f"{r['copy_gbps']:.1f}",
        ]
        for impl in impls:
            row += [f"{r[f'gather_{impl}_vs_copy']:.2f}", f"{r[f'scatter_{impl}_vs_copy']:.2f}"]
        row += [f"{r['loop_vs_copy']:.3f}"] + [f"{r[f'gather_{i}_vs_loop']:.1f}" for i in impls]
        row.append(target_verdict(r, best))
        rows.append(row)
    print_table(
        f"kvforge.ops CPU throughput ratios ({torch.get_num_threads()} torch threads; "
        "higher is better; X/copy = copy time / X time)",
        columns,
        rows,
    )


# ----------------------------------------------------------------------------------------- CUDA


def check_cuda_equality(ops: types.ModuleType, dev: str, gen: torch.Generator) -> list[str]:
    """triton == torch byte for byte on the GPU; return the names of the cases checked."""
    cases: list[tuple[str, list[int], list[int], list[int]]] = [
        ("mixed odd sizes, -1, repeats", [1168, 8448, 37376, 1, 3], [3, -1, 0, 3, 8, 5], [9] * 5),
        ("40 planes", [1, 3, 16, 64, 1168] * 8, [6, 0, -1, 2, 6], [7] * 40),
        ("n == 0", [1168, 3], [], [4, 4]),
        ("all -1", [1168, 3], [-1, -1], [4, 4]),
        ("w=4", [12, 1164], [4, 1, -1, 0], [5, 5]),
        ("w=2", [6, 1166], [4, 1, -1, 0], [5, 5]),
        ("one plane 37376", [37376], list(range(63, -1, -1)), [64]),
    ]
    done = []
    for name, sizes, id_list, counts in cases:
        planes = [rand_bytes((c, s), gen, dev) for s, c in zip(sizes, counts, strict=True)]
        row_bytes = sum(sizes)
        for ids_dev in ("cpu", dev):
            ids = torch.tensor(id_list, dtype=torch.int64, device=ids_dev)
            init = rand_bytes((len(id_list), row_bytes), gen, dev)
            outs = {}
            for impl in ("torch", "triton"):
                out = init.clone()
                ops.gather_blocks(planes, ids, out, impl=impl)
                outs[impl] = out
            assert torch.equal(outs["torch"], outs["triton"]), f"gather {name} ({ids_dev} ids)"
            sids = torch.tensor(
                [b if b < 0 or b not in id_list[:i] else -1 for i, b in enumerate(id_list)],
                dtype=torch.int64,
                device=ids_dev,
            )
            src = rand_bytes((len(id_list), row_bytes), gen, dev)
            res = {}
            for impl in ("torch", "triton"):
                pl = [p.clone() for p in planes]
                ops.scatter_blocks(pl, sids, src, impl=impl)
                res[impl] = pl
            assert all(
                torch.equal(a, b) for a, b in zip(res["torch"], res["triton"], strict=True)
            ), f"scatter {name} ({ids_dev} ids)"
        done.append(name)
    done.append(check_cuda_strided(ops, dev, gen))
    # > 2 GiB plane and > 2 GiB rows: 64-bit offsets
    nb, nblk = 37376, 60000  # 60000 * 37376 = 2,242,560,000 bytes > 2**31 = 2,147,483,648
    free = torch.cuda.mem_get_info()[0]
    if free > 4 * nb * nblk:
        plane = torch.empty(nblk, nb, dtype=torch.uint8, device=dev)
        plane.view(torch.int64).random_(generator=None)
        ids = torch.arange(nblk - 1, -1, -1, dtype=torch.int64, device=dev)
        out = torch.empty(nblk, nb, dtype=torch.uint8, device=dev)
        ops.gather_blocks([plane], ids, out, impl="triton")
        assert torch.equal(out, plane.flip(0)), "gather > 2 GiB"
        plane.zero_()
        ops.scatter_blocks([plane], ids, out, impl="triton")
        assert torch.equal(out, plane.flip(0)), "scatter > 2 GiB"
        del plane, out, ids
        torch.cuda.empty_cache()
        done.append("2.2 GiB plane and rows (64-bit offsets)")
    return done


def check_cuda_strided(ops: types.ModuleType, dev: str, gen: torch.Generator) -> str:
    """triton == torch on strided planes: blocks padded to multiples of 576 B (1168 -> 1728,
    37376 -> 37440) and a key [0, 8448) with its scale [8448, 8640) in one 8640-byte stride;
    the padding bytes must keep their sentinel through a scatter."""
    pad = 0xA5
    shared = rand_bytes((9, 8640), gen, dev)
    padded = [rand_bytes((9, s), gen, dev) for s in (1728, 37440)]
    for a, size in zip(padded, (1168, 37376), strict=True):
        a[:, size:] = pad
    planes = [shared[:, :8448], padded[0][:, :1168], shared[:, 8448:], padded[1][:, :37376]]
    row_bytes = 8448 + 1168 + 192 + 37376
    ids = torch.tensor([3, -1, 0, 3, 8], dtype=torch.int64, device=dev)
    outs = {}
    for impl in ("torch", "triton"):
        out = torch.zeros(5, row_bytes, dtype=torch.uint8, device=dev)
        ops.gather_blocks(planes, ids, out, impl=impl)
        outs[impl] = out
    assert torch.equal(outs["torch"], outs["triton"]), "gather strided"
    sids = torch.tensor([3, -1, 0, 8], dtype=torch.int64, device=dev)
    src = rand_bytes((4, row_bytes), gen, dev)
    after = {}
    for impl in ("torch", "triton"):
        allocs = [shared.clone(), *(a.clone() for a in padded)]
        views = [allocs[0][:, :8448], allocs[1][:, :1168], allocs[0][:, 8448:]]
        ops.scatter_blocks([*views, allocs[2][:, :37376]], sids, src, impl=impl)
        after[impl] = allocs
    assert all(torch.equal(a, b) for a, b in zip(after["torch"], after["triton"], strict=True)), (
        "scatter strided"
    )
    for a, size in zip(after["triton"][1:], (1168, 37376), strict=True):
        assert bool((a[:, size:] == pad).all()), "padding overwritten"
    return "strided planes (576-byte padding, key + scale in one stride)"


def bench_cuda(ops: types.ModuleType, args: argparse.Namespace) -> list[dict[str, Any]]:
    dev = "cuda"
    torch.cuda.init()
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    checked = check_cuda_equality(ops, dev, gen)
    print(
        f"triton == torch on {torch.cuda.get_device_name()}: {', '.join(checked)} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    sync = torch.cuda.synchronize
    records: list[dict[str, Any]] = []
    mib = args.mib
    for nb in PAGE_SIZES:
        for num_planes in PLANE_COUNTS:
            row_bytes = nb * num_planes
            n = max(1, int(mib * 2**20) // row_bytes)
            planes = [rand_bytes((2 * n, nb), gen, dev) for _ in range(num_planes)]
            ids_cpu = torch.randperm(2 * n, generator=gen)[:n]
            ids = ids_cpu.to(dev)
            staging = torch.empty(n, row_bytes, dtype=torch.uint8, device=dev)
            host = torch.empty(n, row_bytes, dtype=torch.uint8, pin_memory=True)
            dev_flat = torch.empty(n * row_bytes, dtype=torch.uint8, device=dev)
            dev_flat2 = torch.empty_like(dev_flat)
            host_flat = host.view(-1)

            def d2h(staging=staging, host=host, planes=planes, ids=ids) -> None:
                ops.gather_blocks(planes, ids, staging, impl="triton")
                host.copy_(staging, non_blocking=True)

            def h2d(staging=staging, host=host, planes=planes, ids=ids) -> None:
                staging.copy_(host, non_blocking=True)
                ops.scatter_blocks(planes, ids, staging, impl="triton")

            fns = {
                "d2d_copy": lambda a=dev_flat2, b=dev_flat: a.copy_(b),
                "gather_triton": lambda p=planes, x=ids, o=staging: ops.gather_blocks(
                    p, x, o, impl="triton"
                ),
                "scatter_triton": lambda p=planes, x=ids, s=staging: ops.scatter_blocks(
                    p, x, s, impl="triton"
                ),
                "gather_torch": lambda p=planes, x=ids, o=staging: ops.gather_blocks(
                    p, x, o, impl="torch"
                ),
                "d2h_copy": lambda h=host_flat, d=dev_flat: h.copy_(d, non_blocking=True),
                "gather_d2h": d2h,
                "h2d_copy": lambda h=host_flat, d=dev_flat: d.copy_(h, non_blocking=True),
                "h2d_scatter": h2d,
            }
            t = median_times(fns, args.reps, sync=sync)
            total = n * row_bytes
            rec = {
                "device": torch.cuda.get_device_name(),
                "block_bytes": nb,
                "planes": num_planes,
                "rows": n,
                "mib": total / 2**20,
                "d2d_gbps": 2 * total / t["d2d_copy"] / 1e9,  # read + write
                "d2h_gbps": total / t["d2h_copy"] / 1e9,
                "gather_triton_gbps": 2 * total / t["gather_triton"] / 1e9,
                "gather_triton_vs_d2d": t["d2d_copy"] / t["gather_triton"],
                "scatter_triton_vs_d2d": t["d2d_copy"] / t["scatter_triton"],
                "gather_torch_vs_d2d": t["d2d_copy"] / t["gather_torch"],
                "gather_d2h_vs_d2h": t["d2h_copy"] / t["gather_d2h"],
                "h2d_scatter_vs_h2d": t["h2d_copy"] / t["h2d_scatter"],
                "seconds": t,
            }
            records.append(rec)
            if args.tune and nb == 8448 and num_planes == 8:
                rec["tune_gather_vs_d2d"] = tune_cuda(
                    planes, ids, staging, fns["d2d_copy"], max(5, args.reps // 2)
                )
    return records


def tune_cuda(
    planes: list[torch.Tensor],
    ids: torch.Tensor,
    staging: torch.Tensor,
    d2d_copy: Callable[[], Any],
    reps: int,
) -> dict[str, float]:
    """Triton gather / d2d copy for access widths, tile sizes and programs per SM."""
    from kvforge.ops import _common, triton_kernels

    plan = _common.validate(planes, ids, staging, "out", "gather_blocks")
    sms = torch.cuda.get_device_properties(staging.device).multi_processor_count
    fns: dict[str, Callable[[], Any]] = {"d2d_copy": d2d_copy}
    for width in (16, 8):
        for block in (512, 1024, 2048, 4096):
            for per_sm in (2, 4, 8, 16, 32):
                fns[f"width={width} block={block} programs/SM={per_sm}"] = functools.partial(
                    triton_kernels.gather_blocks_triton,
                    planes,
                    plan,
                    staging,
                    block=block,
                    grid_cap=per_sm * sms,
                    max_width=width,
                )
    t = median_times(fns, reps, sync=torch.cuda.synchronize)
    base = t.pop("d2d_copy")
    return {k: base / v for k, v in t.items()}


def report_cuda(records: list[dict[str, Any]]) -> None:
    columns = [
        "page B",
        "planes",
        "rows",
        "MiB",
        "d2d GB/s",
        "D2H GB/s",
        "triton gather GB/s",
        "gather triton/d2d",
        "scatter triton/d2d",
        "gather torch/d2d",
        "gather+D2H / D2H",
        "H2D+scatter / H2D",
    ]
    rows = []
    for r in records:
        rows.append(
            [
                str(r["block_bytes"]),
                str(r["planes"]),
                str(r["rows"]),
                f"{r['mib']:.0f}",
                f"{r['d2d_gbps']:.0f}",
                f"{r['d2h_gbps']:.1f}",
                f"{r['gather_triton_gbps']:.0f}",
                f"{r['gather_triton_vs_d2d']:.2f}",
                f"{r['scatter_triton_vs_d2d']:.2f}",
                f"{r['gather_torch_vs_d2d']:.2f}",
                f"{r['gather_d2h_vs_d2h']:.2f}",
                f"{r['h2d_scatter_vs_h2d']:.2f}",
            ]
        )
    print_table(
        f"kvforge.ops CUDA ({records[0]['device']}); ratios = baseline time / path time",
        columns,
        rows,
    )
    for r in records:
        if "tune_gather_vs_d2d" in r:
            tune = sorted(r["tune_gather_vs_d2d"].items(), key=lambda kv: -kv[1])
            print_table(
                f"tuning: triton gather / d2d copy, {r['block_bytes']} B x {r['planes']} planes",
                ["config", "ratio"],
                [[k, f"{v:.2f}"] for k, v in tune],
            )


# ------------------------------------------------------------------------------- slot mapping

SLOT_STEPS = ((256, 256), (8192, 8))  # (tokens, requests) of one step
SLOT_TABLE = (1024, 512)  # max_num_seqs x max_blocks_per_req
SLOT_BLOCK = 16


def slot_step(ops: types.ModuleType, tokens: int, requests: int, seed: int = 0):
    """A step of ``tokens`` tokens over ``requests`` requests in scattered table rows, as numpy
    arrays: ``(table, rows int32, positions int64)``. Requests already hold 0-4000 tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    table = rng.integers(1, 1 << 20, size=SLOT_TABLE, dtype=np.int32)
    computed = rng.integers(0, 4000, size=requests)
    new = np.full(requests, tokens // requests, dtype=np.int64)
    step = ops.token_positions(computed, new)
    req_rows = rng.permutation(SLOT_TABLE[0])[:requests].astype(np.int32)
    return table, req_rows[step.request_index], step.positions, (computed, new)


def bench_slots(ops: types.ModuleType, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [slot_case_cpu(ops, args, tokens, requests) for tokens, requests in SLOT_STEPS]


def slot_case_cpu(
    ops: types.ModuleType, args: argparse.Namespace, tokens: int, requests: int
) -> dict[str, Any]:
    import numpy as np

    bs = SLOT_BLOCK
    table, rows, pos, (computed, new) = slot_step(ops, tokens, requests)
    out = np.empty(tokens, dtype=np.int64)
    max_blocks = table.shape[1]
    flat = table.reshape(-1)
    tensors = [torch.from_numpy(a) for a in (table, rows, pos)]

    def vllm_numpy() -> None:
        index = rows * max_blocks + pos // bs
        np.add(flat[index] * bs, pos % bs, out=out)

    def loop() -> list[int]:
        res = []
        for r, p in zip(rows.tolist(), pos.tolist(), strict=True):
            b = int(table[r, p // bs])
            res.append(b * bs + p % bs if b else -1)
        return res

    fns: dict[str, Callable[[], Any]] = {
        "vllm_numpy": vllm_numpy,
        "loop": loop,
        "numpy": lambda: ops.slot_mapping(table, rows, pos, bs, out=out),
        "numpy_nocheck": lambda: ops.slot_mapping(table, rows, pos, bs, out=out, check=False),
        "numpy_ratio4": lambda: ops.slot_mapping(table, rows, pos, 4 * bs, 4, out=out),
        "cpu_tensors": lambda: ops.slot_mapping(*tensors, bs),
        "torch": lambda: ops.slot_mapping(*tensors, bs, impl="torch"),
        "token_positions": lambda: ops.token_positions(computed, new),
    }
    reps = max(args.reps * 20, 200)
    t = median_times(fns, reps, slow=frozenset({"loop"}), slow_reps=max(3, reps // 50))
    assert ops.slot_mapping(table, rows, pos, bs).tolist() == loop(), "slot_mapping differs"
    rec: dict[str, Any] = {
        "device": "cpu",
        "tokens": tokens,
        "requests": requests,
        "us": {k: v * 1e6 for k, v in t.items()},
    }
    for name in ("numpy", "numpy_nocheck", "cpu_tensors", "torch"):
        rec[f"{name}_vs_vllm_numpy"] = t["vllm_numpy"] / t[name]
        rec[f"{name}_vs_loop"] = t["loop"] / t[name]
    return rec


def bench_slots_cuda(ops: types.ModuleType, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [slot_case_cuda(ops, args, tokens, requests) for tokens, requests in SLOT_STEPS]


def slot_case_cuda(
    ops: types.ModuleType, args: argparse.Namespace, tokens: int, requests: int
) -> dict[str, Any]:
    dev = "cuda"
    bs = SLOT_BLOCK
    table_np, rows_np, pos_np, _ = slot_step(ops, tokens, requests)
    table, rows, pos = (torch.from_numpy(a).to(dev) for a in (table_np, rows_np, pos_np))
    out = torch.empty(tokens, dtype=torch.int64, device=dev)
    max_blocks = table.shape[1]
    flat = table.reshape(-1)

    def vllm_torch() -> None:
        index = rows.long() * max_blocks + pos // bs
        torch.add(flat[index].long() * bs, pos % bs, out=out)

    def run(impl: str, check: bool) -> Any:
        return ops.slot_mapping(table, rows, pos, bs, out=out, impl=impl, check=check)

    fns: dict[str, Callable[[], Any]] = {
        "vllm_torch": vllm_torch,
        "triton_nocheck": lambda: run("triton", False),
        "triton": lambda: run("triton", True),
        "torch_nocheck": lambda: run("torch", False),
    }
    t = median_times(fns, max(args.reps * 4, 50), sync=torch.cuda.synchronize)
    want = ops.slot_mapping(table_np, rows_np, pos_np, bs)
    got = ops.slot_mapping(table, rows, pos, bs, impl="triton").cpu().numpy()
    assert (got == want).all(), "triton slot_mapping differs from numpy"
    rec: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "tokens": tokens,
        "requests": requests,
        "us": {k: v * 1e6 for k, v in t.items()},
    }
    for name in ("triton_nocheck", "triton", "torch_nocheck"):
        rec[f"{name}_vs_vllm_torch"] = t["vllm_torch"] / t[name]
    return rec


def report_slots(records: list[dict[str, Any]]) -> None:
    base = "vllm_numpy" if records[0]["device"] == "cpu" else "vllm_torch"
    cpu = records[0]["device"] == "cpu"
    columns = ["tokens", "requests", "path", "us / call", f"{base} / path"]
    if cpu:
        columns.append("loop / path")
    rows = []
    for r in records:
        us = r["us"]
        for name, t in us.items():
            row = [str(r["tokens"]), str(r["requests"]), name, f"{t:.1f}", f"{us[base] / t:.2f}"]
            if cpu:
                row.append(f"{us['loop'] / t:.1f}")
            rows.append(row)
    print_table(
        f"kvforge.ops.slot_mapping on {records[0]['device']} (median microseconds per call; "
        "ratios: baseline time / path time, higher is better)",
        columns,
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    parser.add_argument(
        "--case",
        choices=("all", "blocks", "slots"),
        default="all",
        help="gather/scatter throughput (blocks), slot mapping (slots), or both",
    )
    parser.add_argument("--json", type=Path, help="write the records to this file")
    parser.add_argument("--mib", type=float, help="MiB of rows per transfer")
    parser.add_argument("--reps", type=int, help="timed repetitions per case")
    parser.add_argument("--tune", action="store_true", help="CUDA: sweep tile size and grid")
    parser.add_argument(
        "--burst",
        type=int,
        default=5,
        help="CPU: back-to-back calls per turn (1 = strict call-by-call alternation)",
    )
    args = parser.parse_args(argv)
    if args.mib is None:
        args.mib = (24 if args.quick else 64) if args.device == "cpu" else 256
    if args.reps is None:
        args.reps = 10 if args.quick else 25
    ops = import_ops()
    records: list[dict[str, Any]] = []
    slot_records: list[dict[str, Any]] = []
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("CUDA is not available", file=sys.stderr)
            return 2
        if args.case in ("all", "blocks"):
            records = bench_cuda(ops, args)
            report_cuda(records)
        if args.case in ("all", "slots"):
            slot_records = bench_slots_cuda(ops, args)
            report_slots(slot_records)
    else:
        if args.case in ("all", "blocks"):
            print(
                f"impls on cpu: {ops.available_impls('cpu')} (auto -> "
                f"{ops.resolve_impl('auto', 'cpu')})"
            )
            records = bench_cpu(ops, args)
            report_cpu(records)
        if args.case in ("all", "slots"):
            slot_records = bench_slots(ops, args)
            report_slots(slot_records)
    if args.json:
        meta = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        doc = {"meta": meta, "records": records, "slot_records": slot_records}
        args.json.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
