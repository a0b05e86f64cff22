"""The scheduler side's undo journal: an all-or-nothing change under any exception.

A change that touches many things (pools, table rows, deltas, the swap book's maps) goes
through an :class:`Undo`: each step registers how to take it back *before* it happens, by a
saved value, never by reversing a delta, so an exception of any kind between any two
statements, ``KeyboardInterrupt`` included, undoes the steps taken, newest first
(:func:`all_or_nothing`). The swap book's plans, completions and frees and a truncation
(:mod:`.truncation`) use it; a pool's own undo verbs (``BlockPool.put_back``,
``BlockPool.restore_counts``) take back a take or a release cut short at any line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvforge.errors import add_note
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.scheduler.tables import GroupTable, RequestTables

__all__ = ["Undo", "all_or_nothing", "restore_item", "save_cells", "save_counts", "save_rows"]

_MISSING = object()


class Undo:
    """How to take back the steps of one change, newest first.

    Each helper registers its undo step *before* it changes anything, and every undo step
    restores a saved value rather than reversing a delta, so undoing a step that never ran
    (an interrupt struck in between) changes nothing.
    """

    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def add(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def put(self, mapping: dict[Any, Any], key: Any, value: Any) -> None:
        """``mapping[key] = value``."""
        old = mapping.get(key, _MISSING)
        self.add(lambda: restore_item(mapping, key, old))
        mapping[key] = value

    def pop(self, mapping: dict[Any, Any], key: Any) -> Any:
        """``mapping.pop(key)``."""
        value = mapping[key]
        self.add(lambda: restore_item(mapping, key, value))
        del mapping[key]
        return value

    def take(self, pool: BlockPool, count: int) -> np.ndarray:
        """``pool.take(count)``: undone by putting the blocks back (``BlockPool.put_back``);
        the pool records them in ``taken`` before any leaves its free stack."""
        taken: list[np.ndarray] = []
        self.add(lambda: [pool.put_back(ids) for ids in taken])
        return pool.take(count, into=taken)

    def guard(self, pool: BlockPool, block_ids: np.ndarray) -> None:
        """Let the references that ``pool`` drops on ``block_ids`` from now on be undone."""
        if len(block_ids) <= 40:  # one request's blocks: a Python set beats a sort and a mask
            self.guard_listed(pool, block_ids.tolist())
        else:  # unique, without np.unique's overhead (a free is hot)
            ids = np.sort(block_ids)
            ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]
            before = pool.counts_of(ids)  # a fancy index: a copy
            self.add(lambda: pool.restore_counts(ids, before))

    def guard_listed(self, pool: BlockPool, block_ids: list[int]) -> None:
        """:meth:`guard` of ids given as a Python list."""
        if block_ids:
            unique = set(block_ids)
            ids = np.array(block_ids if len(unique) == len(block_ids) else list(unique), np.int32)
            before = pool.counts_of(ids)  # a fancy index: a copy
            self.add(lambda: pool.restore_counts(ids, before))

    def release(self, pool: BlockPool, block_ids: np.ndarray) -> None:
        """``pool.release(block_ids)``."""
        self.guard(pool, block_ids)
        pool.release(block_ids)

    def rollback(self, cause: BaseException) -> None:
        """Run every undo step, newest first. A step that fails is noted on ``cause`` and the
        others still run."""
        while self._steps:
            step = self._steps.pop()
            try:
                step()
            except BaseException as failure:  # finish undoing, then re-raise the cause
                add_note(cause, f"kvforge: undoing a swap bookkeeping step failed: {failure!r}")


@contextmanager
def all_or_nothing() -> Iterator[Undo]:
    """Apply a change through an :class:`Undo`; any exception undoes it and propagates."""
    undo = Undo()
    try:
        yield undo
    except BaseException as exc:
        undo.rollback(exc)
        raise


def restore_item(mapping: dict[Any, Any], key: Any, value: Any) -> None:
    if value is _MISSING:
        mapping.pop(key, None)
    else:
        mapping[key] = value


def save_counts(undo: Undo, t: RequestTables, rows: np.ndarray | int) -> None:
    """Let ``t``'s token counts and commits of ``rows`` (an array, or one row as an int), the
    pending deltas and the queued copies be put back."""
    tokens, committed = t.num_tokens[rows].copy(), t.committed[:, rows].copy()
    pending, copies = t.pending, t.copies
    num_pending, num_copies = len(pending), len(copies)

    def restore() -> None:
        t.num_tokens[rows], t.committed[:, rows] = tokens, committed
        del pending[num_pending:], copies[num_copies:]

    undo.add(restore)


def save_cells(undo: Undo, g: GroupTable, row: int, cols: np.ndarray | int) -> np.ndarray:
    """Let ``g``'s cells ``(row, cols)`` and the references their blocks hold be put back
    (a change may release those blocks); returns the cells (a copy, 1-d)."""
    cells = g.table[row, cols]
    if isinstance(cells, np.ndarray):
        cells = cells.copy()
    table = g.table
    undo.add(lambda: table.__setitem__((row, cols), cells))
    held = np.atleast_1d(cells)
    undo.guard(g.pool, held[held != NULL_BLOCK])
    return held


def save_rows(
    undo: Undo, t: RequestTables, rows: np.ndarray | int, spans: Sequence[slice] | None = None
) -> None:
    """Let every change to ``t``'s rows ``rows`` (an array, or one row as an int) be undone:
    their cells (of each group's columns ``spans[i]``: those a change may touch; all by
    default), extents, token counts and commits (:func:`save_counts`), the free rows, the
    pending deltas and the queued copies. The references the cells hold: the caller's
    (``Undo.guard``)."""
    if spans is None:
        spans = [slice(0, g.table.shape[1]) for g in t.groups]
    save_counts(undo, t, rows)
    saved = [
        (g, span, g.table[rows, span].copy(), g.held_from[rows].copy())
        for g, span in zip(t.groups, spans, strict=True)
    ]
    free_rows = list(t.free_rows)

    def restore() -> None:
        for g, span, table, held_from in saved:
            g.table[rows, span] = table
            g.held_from[rows] = held_from
        t.free_rows[:] = free_rows

    undo.add(restore)
