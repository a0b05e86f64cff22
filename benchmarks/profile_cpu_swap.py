"""Host-side costs of a CPU swap (the figures behind the small-transfer notes in
docs/performance.md).

Times, on this machine:

- the fixed cost of one small ``gather_blocks`` call with a ``PlaneSet`` and with a plain list
  of 44 planes, and of ``validate`` alone;
- the selection step of a DeepSeek-V4-Flash swap (``BlockManager.selection``);
- handing one task to the kernel's worker pool, warm and after 10 ms idle;
- one request's ``swa`` and ``c4_state`` transfer (and the kernel alone, validation and
  dispatch left out) against a one-thread and a two-thread contiguous ``copy_`` of the same
  bytes, with exactly the moved bytes evicted first (x86-64).

Usage::

    python benchmarks/profile_cpu_swap.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from kvforge import CacheController, SwapPurpose, ops
from kvforge.cli.bench import _flash_backends, _group_moves, _grow_interleaved, _moved_bytes
from kvforge.ops import _common, cpu_fast
from kvforge.worker.transfer import move_pages


def best_us(
    fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None
) -> float:
    """Best wall time of ``reps`` runs in microseconds; ``before`` runs untimed first."""
    best = float("inf")
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter_ns()
        fn()
        best = min(best, time.perf_counter_ns() - start)
    return best / 1000


def fixed_costs() -> None:
    tensors = [torch.zeros((8, 64), dtype=torch.uint8) for _ in range(44)]
    plane_set = ops.PlaneSet(tensors)
    rows = torch.zeros((8, 64 * 44), dtype=torch.uint8)
    ids, row_ids = np.array([3, 5]), np.array([1, 2])
    for label, planes in (("PlaneSet", plane_set), ("list of 44 planes", tensors)):
        t = best_us(lambda p=planes: ops.gather_blocks(p, ids, rows, row_ids=row_ids), 2000)
        v = best_us(
            lambda p=planes: _common.validate(p, ids, rows, "out", "gather_blocks", row_ids), 2000
        )
        print(f"small gather_blocks call, {label}: {t:.0f} us (validate {v:.0f} us)")


def selection_cost(flash: dict) -> None:
    ctl = CacheController(flash)
    ctl.initialize_kv_cache(num_blocks={g.name: 40 for g in ctl.layout.groups})
    ctl.allocate("r", 1024)
    t = best_us(lambda: ctl.scheduler.selection("r", SwapPurpose.PREEMPT), 200)
    print(f"selection of a V4-Flash swap ({len(ctl.layout.buffers)} buffers): {t:.0f} us")


def pool_handoff() -> None:
    pool = cpu_fast._pool()
    pool.submit(lambda: None).result()
    warm = best_us(lambda: pool.submit(lambda: None).result(), 200)
    idle = best_us(lambda: pool.submit(lambda: None).result(), 10, lambda: time.sleep(0.01))
    print(f"worker-pool handoff: {warm:.0f} us warm, {idle:.0f} us after 10 ms idle")


def small_transfers(flash: dict) -> None:
    if not cpu_fast.can_evict():
        print("small transfers: needs x86-64 (clflush)")
        return
    for group, tokens in (("swa", 256), ("c4_state", 256)):
        ctl = CacheController(flash)
        ctl.initialize_kv_cache(num_blocks={g.name: 80 for g in ctl.layout.groups})
        ctl.initialize_host_cache(num_pages={g.name: 80 for g in ctl.layout.groups})
        _grow_interleaved(ctl, ["r"], tokens, 128)
        [m] = _group_moves(ctl, ["r"], [group])
        nbytes = len(m.ids) * m.host.page_bytes
        a = torch.full((nbytes,), 1, dtype=torch.uint8)
        b = torch.full((nbytes,), 2, dtype=torch.uint8)
        # exactly the moved bytes, as kvforge bench does: evicting whole pools takes long
        # enough that the code path goes cold too
        buffers = [*_moved_bytes([m]), a, b]

        def evict(bufs: list[torch.Tensor] = buffers) -> None:
            cpu_fast.evict_from_caches(bufs)

        args = ("out", ctl.platform, None, m.planes, m.ids, m.host.pages, m.pages, [])
        move_pages(*args)
        ours = best_us(lambda a_=args: move_pages(*a_), 15, evict)
        plan = _common.validate(
            m.planes, np.array(m.ids), m.host.pages, "out", "gather_blocks", np.array(m.pages)
        )
        kernel = best_us(
            lambda p=plan, m_=m: cpu_fast.gather_blocks_cpu(m_.planes, p, m_.host.pages), 15, evict
        )
        two = best_us(lambda s=a, d=b: d.copy_(s), 15, evict)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        one = best_us(lambda s=a, d=b: d.copy_(s), 15, evict)
        torch.set_num_threads(threads)
        print(
            f"{group} of one request, {nbytes / 2**20:.2f} MiB: ours {ours:.0f} us (kernel "
            f"{kernel:.0f} us), copy_ "
            f"{one:.0f} us on 1 thread ({one / ours:.2f}), {two:.0f} us on {threads} "
            f"({two / ours:.2f})"
        )


def main() -> None:
    flash = _flash_backends()
    fixed_costs()
    selection_cost(flash)
    pool_handoff()
    small_transfers(flash)


if __name__ == "__main__":
    main()
