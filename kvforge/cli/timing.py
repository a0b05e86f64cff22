"""Timing helpers of the benchmarks ``kvforge bench`` runs (offload and tiers): the best of
``repeats`` synchronized runs, and what to run before each one so that it starts with the
moved bytes out of the CPU caches. Shared by :mod:`kvforge.cli.bench` and
:mod:`kvforge.cli.bench_tiers`, which import it and not each other."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvforge.platform import Platform

__all__ = ["FLUSH_MIN_BYTES", "cache_flusher", "timed"]


#: Least bytes a whole-cache flush touches; more when the last-level cache is larger.
FLUSH_MIN_BYTES = 64 << 20


def _last_level_cache_bytes() -> int:
    """Size of the last-level CPU cache as the OS reports it, 0 where it does not."""
    for name in ("SC_LEVEL4_CACHE_SIZE", "SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size > 0:
            return size
    return 0


def cache_flusher(
    platform: Platform, buffers: list[torch.Tensor]
) -> tuple[Callable[[], None] | None, str]:
    """What to run before each timed run so that it starts with the moved bytes out of cache,
    and its label for reports.

    - accelerators: nothing (``"n/a"``): their swaps cross the host link, not a host cache;
    - x86-64 CPU with numba: evict exactly ``buffers`` line by line (``"cold data"``); the code
      stays warm, as in a serving loop where the swap path runs often but the preempted
      request's bytes were last touched long ago;
    - other CPUs: read and write a scratch buffer of ``max(FLUSH_MIN_BYTES, 2 * last-level
      cache)`` bytes (``"cold"``), which evicts the code too. It runs on the calling thread
      (numpy): a torch op would leave OpenMP workers spinning into the timed run.
    """
    if platform.is_accelerator:
        return None, "n/a"
    try:
        from kvforge.ops import cpu_fast
    except Exception:  # numba missing or broken: fall back to the whole-cache flush
        cpu_fast = None  # type: ignore[assignment]
    if cpu_fast is not None and cpu_fast.can_evict():
        return (lambda: cpu_fast.evict_from_caches(buffers)), "cold data"
    size = max(FLUSH_MIN_BYTES, 2 * _last_level_cache_bytes())
    scratch = np.zeros(size // 8, dtype=np.int64)

    def flush() -> None:
        np.add(scratch, 1, out=scratch)

    return flush, "cold"


def timed(
    platform: Platform,
    fn: Callable[[], Any],
    repeats: int,
    flush: Callable[[], None] | None = None,
) -> float:
    best = float("inf")
    for _ in range(repeats):
        if flush is not None:
            flush()
        platform.synchronize()
        start = time.perf_counter()
        fn()
        platform.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


