"""Integer search over a monotone predicate: the one helper every sizer shares.

Plans (:mod:`kvforge.core.memory_plan`), the slab arena's concurrency
(:mod:`kvforge.core.flow`) and the demo's pool share (:mod:`kvforge.cli.demo_sizing`) each ask
"the largest count that still fits": :func:`largest` answers it exactly, in integers, with
``O(log n)`` calls of the predicate. ``tests/core/test_search.py`` checks it against a linear
scan.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["largest"]


def largest(fits: Callable[[int], bool], lo: int, hi: int | None = None) -> int:
    """The largest ``x >= lo`` with ``fits(x)``, given ``fits(lo)`` and ``fits`` monotone
    (true up to the answer, false past it).

    ``hi`` is a known upper bound (inclusive); without one the search doubles from ``lo``
    until ``fits`` fails, so ``fits`` must fail somewhere.

    >>> largest(lambda x: x * x <= 50, 0)
    7
    >>> largest(lambda x: x <= 40, 1, 10)
    10
    """
    if hi is None:
        hi = max(1, lo * 2)
        while fits(hi):
            lo, hi = hi, hi * 2
        hi -= 1
    while lo < hi:  # fits(lo); the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
