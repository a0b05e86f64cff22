"""Break one 128 MiB Llama-3-8B swap on CUDA into its pieces (figures in docs/performance.md).

Times the one-launch gather into a staging buffer, the contiguous device-to-pinned copy, the
fixed host cost of one ``gather_blocks`` call and of validation alone (with the controller's
``PlaneSet`` and with a plain list of planes), and the swap data path
(``move_pages``) at several pipeline chunk sizes, against one contiguous pinned copy.

Usage (on a GPU machine)::

    PYTHONPATH=. TRITON_INTERPRET=0 python benchmarks/profile_swap.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvforge import NULL_BLOCK, CacheController, GQABackend, ops
from kvforge.ops import _common
from kvforge.worker import transfer as swap


def best_of(fn: Callable[[], object], reps: int = 10) -> float:
    """Best wall time of ``reps`` synchronised runs, after one warm-up run."""
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ctl = CacheController({i: GQABackend(8, 128, 16) for i in range(32)}, device="cuda")
    ctl.initialize_kv_cache(num_blocks=140)
    ctl.initialize_host_cache(num_pages=140)
    for i in range(1, 65):  # two requests in turns: interleaved blocks
        ctl.allocate("a", i * 16)
        ctl.allocate("b", i * 16)
    planes = ctl.storage.planes("kv")
    host = ctl.storage.host.groups["kv"]
    ids = [b for b in ctl.block_table("a", "kv") if b != NULL_BLOCK]
    pages = host.pool.take(len(ids)).tolist()
    nbytes = len(ids) * host.page_bytes
    staging = torch.empty((len(ids), host.page_bytes), dtype=torch.uint8, device="cuda")
    ids_cpu = torch.tensor(ids)
    print(f"moving {nbytes >> 20} MiB in {len(ids)} pages of {host.page_bytes:,} bytes")

    t = best_of(lambda: ops.gather_blocks(planes, ids_cpu, staging))
    print(f"gather into staging: {t * 1e3:.3f} ms, {nbytes / t / 1e9:.1f} GB/s")
    rows = host.pages[pages[0] : pages[0] + len(ids)]
    t = best_of(lambda: rows.copy_(staging, non_blocking=True))
    print(f"staging -> pinned host copy: {t * 1e3:.3f} ms, {nbytes / t / 1e9:.1f} GB/s")
    two = ids_cpu[:2]
    plane_list = list(planes)  # the controller holds a PlaneSet (checked once)
    for label, given in (("PlaneSet", planes), ("list of planes", plane_list)):
        t = best_of(lambda g=given: ops.gather_blocks(g, two, staging[:2]), 50)
        print(f"one small gather_blocks call, {label}: {t * 1e6:.0f} us")
        t = best_of(
            lambda g=given: _common.validate(g, two, staging[:2], "out", "gather_blocks"), 50
        )
        print(f"validation alone, {label}: {t * 1e6:.0f} us")

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    memcpy = nbytes / best_of(lambda: pinned.copy_(src, non_blocking=True)) / 1e9
    print(f"contiguous device -> pinned copy: {memcpy:.1f} GB/s")
    keep: list[torch.Tensor] = []
    for chunk in (1 << 40, 64 << 20, 32 << 20, 16 << 20, 8 << 20):
        swap.PIPELINE_CHUNK_BYTES = chunk
        args = (ctl.platform, ctl.storage.streams, planes, ids, host.pages, pages, keep)
        out = nbytes / best_of(lambda a=args: swap.move_pages("out", *a)) / 1e9
        back = nbytes / best_of(lambda a=args: swap.move_pages("in", *a)) / 1e9
        keep.clear()
        label = "unchunked" if chunk == 1 << 40 else f"{chunk >> 20} MiB chunks"
        print(f"{label}: out {out / memcpy:.2f}, in {back / memcpy:.2f} of memcpy")
    ctl.free()


if __name__ == "__main__":
    main()
