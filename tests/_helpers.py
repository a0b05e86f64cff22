"""Helpers shared by the tests."""

from __future__ import annotations

import operator
import sys

import kvforge


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


def strike(op, m, k: int, only=None) -> list:
    """Run ``op(m)`` with ``KeyboardInterrupt`` raised at the ``k``-th line of kvforge it
    executes (a call counts as its first line; ``only``: counting only the lines of the
    functions of these qualified names); returns the lines it reached, ``(qualified name,
    line)``: fewer than ``k`` when ``op`` ran whole."""
    root = kvforge.__file__.rsplit("/", 1)[0]
    seen: list = []

    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(root):
            return None
        if event in ("call", "line"):
            if only is not None and frame.f_code.co_qualname not in only:
                return trace
            seen.append((frame.f_code.co_qualname, frame.f_lineno))
            if len(seen) == k:
                raise KeyboardInterrupt(f"{seen[-1]}")
        return trace

    previous = sys.gettrace()  # coverage's tracer, when it runs: put back after
    sys.settrace(trace)
    try:
        op(m)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(previous)
    return seen


def sweep_lines(build, op, view, same=operator.eq, done=None, lines=None) -> dict[str, int]:
    """Run ``op(build())`` once per line of kvforge it executes, with ``KeyboardInterrupt``
    raised at that line (a call counts as its first line): each time the object ends exactly
    as before (``view``, compared with ``same``), and then ``op`` runs whole, or ``op``
    completed; either way it ends as ``done`` (default: as an uninterrupted ``op`` leaves
    it). Returns how often each happened; ``lines`` gets every line of the whole run."""
    if done is None:
        m = build()
        op(m)
        done = view(m)
    k, outcomes = 0, {"rolled back": 0, "completed": 0}
    while True:
        k += 1
        m = build()
        before = view(m)
        seen = strike(op, m, k)
        if len(seen) < k:  # every line was swept
            if lines is not None:
                lines[:] = seen
            return outcomes
        if same(view(m), before):
            outcomes["rolled back"] += 1
            op(m)
        else:
            outcomes["completed"] += 1
        assert same(view(m), done), seen[-1]


def sweep_checks(build, op, check, lines=None, only=None) -> int:
    """Run ``op(build())`` once per line of kvforge it executes, with ``KeyboardInterrupt``
    raised at that line, and ``check(m, struck_at)`` what it left (for an ``op`` whose
    interrupted runs may end in more than two states, each of them sound). Returns the
    number of lines; ``lines`` gets every line of the whole run; ``only``: as in
    :func:`strike`."""
    k = 0
    while True:
        k += 1
        m = build()
        seen = strike(op, m, k, only)
        if len(seen) < k:
            if lines is not None:
                lines[:] = seen
            return k - 1
        check(m, seen[-1])


def arena_manager(finished: bool = True):
    """DeepSeek-V4-tiny's scheduler side in a slab arena with prefix caching, after one step of
    two requests sharing a 499-token prefix (700 and 1,000 tokens); ``finished``: both ended,
    leaving many evictable blocks whose keys the prefix index holds."""
    from kvforge.core.arena import plan_arena
    from kvforge.core.layout import CacheLayout
    from kvforge.models import from_hf_config
    from kvforge.scheduler.block_manager import BlockManager

    layout = CacheLayout(from_hf_config("deepseek-v4-tiny"))
    geometry = plan_arena(layout, 160 << 20)
    assert geometry is not None
    tokens = [list(range(1, 700)), list(range(1, 500)) + list(range(900, 1400))]
    m = BlockManager(
        layout,
        {g: geometry.num_blocks(g) for g in geometry.groups},
        4,
        8192,
        enable_prefix_caching=True,
        arena=geometry,
    )
    m.end_step(m.schedule(["a", "b"], [len(t) for t in tokens], tokens))
    if finished:
        m.finish(["a", "b"])
    m.take_effects()
    return m
