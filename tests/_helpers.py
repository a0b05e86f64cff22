"""Helpers shared by the tests."""

from __future__ import annotations


def grow(ctl, request_id: str, num_tokens: int, chunk: int = 64) -> None:
    """Grow a request to ``num_tokens`` tokens in prefill chunks of ``chunk`` tokens, one
    ``allocate`` per step, as an engine does; window groups then hold at most one chunk
    beyond their window (a single ``allocate`` of the whole prompt holds every token's
    block until the next step, by design)."""
    current = ctl.num_tokens(request_id) if request_id in ctl.requests else 0
    while current < num_tokens:
        current = min(num_tokens, current + chunk)
        ctl.allocate(request_id, current)


def next_step(storage, **fields):
    """A step of no request numbered as ``storage``'s next one (``CacheStorage.next_step``),
    carrying ``fields``: what a forged or a scheduler-made step looks like to the worker."""
    import numpy as np

    from kvforge.core.values import StepAllocation

    none32, none64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
    base = dict(
        request_ids=(),
        rows=none32,
        num_computed=none64,
        num_new=none64,
        refused=(),
        table_deltas=(),
        step_id=storage.next_step,
    )
    base.update(fields)
    return StepAllocation(**base)
