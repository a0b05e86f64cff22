"""Timing helpers of the benchmarks ``kvforge bench`` runs (offload and tiers): every
synchronized run of ``repeats`` (:func:`samples`; :func:`timed` keeps the best), the spread of a
ratio over those runs (:class:`Spread`, :func:`ratio_spread`), and what to run before each run
so that it starts with the moved bytes out of the CPU caches. Shared by
:mod:`kvforge.cli.bench` and :mod:`kvforge.cli.bench_tiers`, which import it and not each other.

Invariant: a ratio is never reported from one sample; :func:`ratio_spread` refuses fewer than
:data:`MIN_REPEATS` pairs, and ``kvforge bench --repeats`` fewer than that many runs
(``tests/cli/test_bench_spread.py``)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvforge.platform import Platform

__all__ = [
    "FLUSH_MIN_BYTES",
    "MIN_REPEATS",
    "Spread",
    "cache_flusher",
    "ratio_spread",
    "samples",
    "timed",
]


#: Fewest timed runs a ratio is reported from (its spread needs a min, a median and a max).
MIN_REPEATS = 3

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


def samples(
    platform: Platform,
    fn: Callable[[], Any],
    repeats: int,
    flush: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds of each of ``repeats`` synchronized runs of ``fn``, in run order, each after
    ``flush`` (when given)."""
    out = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        platform.synchronize()
        start = time.perf_counter()
        fn()
        platform.synchronize()
        out.append(time.perf_counter() - start)
    return out


def timed(
    platform: Platform,
    fn: Callable[[], Any],
    repeats: int,
    flush: Callable[[], None] | None = None,
) -> float:
    """The best (least) seconds of :func:`samples`."""
    return min(samples(platform, fn, repeats, flush))


@dataclass(frozen=True)
class Spread:
    """Least, median and greatest of a few samples (of a ratio, or of seconds)."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float], digits: int = 3) -> Spread:
        """The spread of ``values`` (at least one), each rounded to ``digits``."""
        if not values:
            raise ValueError("a spread needs at least one value, got none")
        return cls(
            round(min(values), digits),
            round(statistics.median(values), digits),
            round(max(values), digits),
        )

    def as_list(self) -> list[float]:
        """``[min, median, max]``, as the JSON reports carry it."""
        return [self.min, self.median, self.max]

    def text(self, fmt: str = ".2f", suffix: str = "") -> str:
        """``"median (min-max)"``, e.g. ``"4.10x (3.90-4.30)"``."""
        return f"{self.median:{fmt}}{suffix} ({self.min:{fmt}}-{self.max:{fmt}})"


def ratio_spread(ours: Sequence[float], baseline: Sequence[float], digits: int = 3) -> Spread:
    """Spread of the throughput ratio ``baseline[k] / ours[k]`` over paired runs (seconds of the
    same bytes: above 1, ours is faster); run ``k`` of each side pairs with run ``k`` of the
    other, so pairs measured in the same round share the machine's state at that moment.

    Raises:
        ValueError: the two sides have different counts, or fewer than :data:`MIN_REPEATS`.
    """
    if len(ours) != len(baseline):
        raise ValueError(
            f"ratio_spread needs as many runs of each side, got {len(ours)} and {len(baseline)}"
        )
    if len(ours) < MIN_REPEATS:
        raise ValueError(
            f"a ratio needs at least {MIN_REPEATS} runs of each side for its spread, got "
            f"{len(ours)}"
        )
    return Spread.of([b / o for o, b in zip(ours, baseline, strict=True)], digits)
