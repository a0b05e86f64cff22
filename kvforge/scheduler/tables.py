"""Per-request block tables of the scheduler side: rows, per-group tables, token counts, and
the table deltas and block copies a step hands to the worker side.

:class:`RequestTables` is the one owner of this state. :class:`~.block_manager.BlockManager`
creates it and grows rows in it; :class:`~.prefix.PrefixCache` and
:class:`~.swap_book.SwapBook` read and write it, always under the manager's lock.

Layout of one group's table (``int32 [max_num_seqs, width]``), a sliding window ``W = 128``
over 64-token blocks after a step that took the request in row 0 to 300 tokens::

    col:    0      1      2      3      4
          | null | null |  17  |  18  |  22  |      tokens 128..299 still held
                          ^ held_from[0] = 2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvforge.core.values import (
    NO_CELLS,
    BlockCopy,
    TableDelta,
    cleared_row_deltas,
    frozen_rows,
)
from kvforge.errors import add_note
from kvforge.kinds import GroupFamily, KindRule
from kvforge.scheduler.arena import ArenaBlockPool, SlabArena
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.specs import CacheGroup

__all__ = ["GroupTable", "RequestTables", "expand"]


@dataclass
class GroupTable:
    """One group's table, its pool and the per-row extent of the blocks rows hold."""

    spec: CacheGroup
    rule: KindRule
    history: bool  # keeps every block (full)
    windowed: bool  # releases blocks behind its window
    per_request: bool  # slots per request, snapshotted for reuse
    block_size: int
    window: int
    slots: int
    pool: BlockPool
    table: np.ndarray  # int32 [max_num_seqs, width]
    held_from: np.ndarray  # int64 [max_num_seqs]: first column that may hold a block
    plain_live: bool = False  # the rule's live_starts is KindRule's (window_start of one read)
    # the same arrays, read and written one cell at a time as Python ints (one request's row:
    # half the cost of numpy's scalars): ``cells`` is ``table`` flat (row r's column c at
    # ``r * width + c``), ``zeros`` a null row to clear from. The arrays are never rebound,
    # so the views stay theirs; a copy of the table builds its own (``__setstate__``).
    cells: memoryview = field(init=False, repr=False, compare=False)
    held_from_items: memoryview = field(init=False, repr=False, compare=False)
    zeros: memoryview = field(init=False, repr=False, compare=False)
    width: int = field(init=False, repr=False, compare=False)

    _VIEWS = ("cells", "held_from_items", "zeros")

    def __post_init__(self) -> None:
        self.width = self.table.shape[1]
        self.cells = memoryview(self.table).cast("B").cast(self.table.dtype.char)
        self.held_from_items = memoryview(self.held_from)
        self.zeros = memoryview(np.full(self.width, NULL_BLOCK, dtype=self.table.dtype))

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k not in self._VIEWS}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @classmethod
    def create(cls, spec: CacheGroup, pool: BlockPool, rows: int, width: int) -> GroupTable:
        rule = spec.rule
        return cls(
            spec=spec,
            rule=rule,
            history=rule.family is GroupFamily.HISTORY,
            windowed=rule.windowed,
            per_request=rule.per_request,
            block_size=spec.block_size,
            window=int(spec.window or 0),
            slots=spec.slots_per_request,
            pool=pool,
            table=np.zeros((rows, width), dtype=np.int32),
            held_from=np.zeros(rows, dtype=np.int64),
            plain_live=type(rule).live_starts is KindRule.live_starts,
        )


def expand(rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, ...]:
    """Cells ``(row, col)`` for ``col`` in ``[start[i], end[i])`` of each ``rows[i]``.

    >>> r, c = expand(np.array([3, 5]), np.array([0, 7]), np.array([2, 9]))
    >>> r.tolist(), c.tolist()
    ([3, 3, 5, 5], [0, 1, 7, 8])
    """
    counts = end - start
    total = int(counts.sum())
    r = np.repeat(rows, counts)
    firsts = np.cumsum(counts) - counts
    c = np.repeat(start - firsts, counts) + np.arange(total)
    return r, c


class RequestTables:
    """Rows and tables of every group.

    Attributes:
        groups: one :class:`GroupTable` per group, in the layout's order.
        by_name: group name -> its table.
        names: the groups' names, in the layout's order.
        pools: distinct pools, each with the indices of the groups that draw on it.
        capacity: what capacity checks count against: ``pools``, except that the member
            pools of one slab arena are one entry, the arena.
        arenas: the slab arena entries of ``capacity`` (none without an arena).
        num_tokens: ``int64 [max_num_seqs]``: tokens each row holds.
        committed: ``int64 [groups, max_num_seqs]``: blocks of each row the prefix cache has
            seen completed (it registers each block once).
        row_of: request id -> row, for requests that hold device blocks.
        free_rows: rows no request holds (popped from the end).
        pending: table changes not yet handed to the worker side.
        copies: block copies due before the next step's kernels (copy on write).
    """

    def __init__(self, groups: list[GroupTable], max_num_seqs: int) -> None:
        self.groups = groups
        self.by_name = {g.spec.name: g for g in groups}
        self.names = [g.spec.name for g in groups]
        self.pools: list[tuple[BlockPool, list[int]]] = []
        # what capacity checks count against: the pools, with a slab arena's member pools
        # as one entry (its groups' needs are checked together)
        self.capacity: list[tuple[BlockPool | SlabArena, list[int]]] = []
        for gi, g in enumerate(groups):
            for entries, pool in (
                (self.pools, g.pool),
                (self.capacity, g.pool.arena if isinstance(g.pool, ArenaBlockPool) else g.pool),
            ):
                known = next((m for p, m in entries if p is pool), None)
                if known is None:
                    entries.append((pool, [gi]))
                else:
                    known.append(gi)
        self.arenas = [(p, m) for p, m in self.capacity if isinstance(p, SlabArena)]
        # every pool feeds one group: a row's blocks per pool are its blocks per group
        self.one_group_pools = len(self.pools) == len(groups)
        # row r's ``int32 [1]`` clear_rows, over immutable bytes and shared by every
        # cleared-row delta of r (a worker only reads them): a finish builds no array
        self.one_row = frozen_rows(max_num_seqs)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.committed = np.zeros((len(groups), max_num_seqs), dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.pending: list[TableDelta] = []
        self.copies: list[BlockCopy] = []
        self.next_seq = 0  # the sequence number of the next delta handed out

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        del state["one_row"]  # a copy would thaw them: __setstate__ builds them frozen
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.one_row = frozen_rows(len(self.num_tokens))

    def record(self, g: GroupTable, rows: np.ndarray, cols: np.ndarray, ids: np.ndarray) -> None:
        """Queue the change of cells ``(rows[i], cols[i])`` of ``g``'s table to ``ids[i]`` (a
        block id, or ``NULL_BLOCK`` where a block was released) for the workers: the one way
        the scheduler side writes a :class:`TableDelta` of cells (growth, adoption of a hit,
        swap in, truncation, copy on write). The arrays are copied as ``int32``."""
        self.pending.append(
            TableDelta(
                group=g.spec.name,
                rows=rows.astype(np.int32),
                cols=cols.astype(np.int32),
                block_ids=ids.astype(np.int32),
            )
        )

    def record_row(self, g: GroupTable, row: int, cols: list[int], ids: list[int]) -> None:
        """:meth:`record` of cells of one ``row``, given as lists (the one-request growth):
        rows, columns and ids are three slices of one ``int32`` array (one conversion, not
        three)."""
        n = len(cols)
        cells = np.array([row] * n + cols + ids, dtype=np.int32)
        self.pending.append(
            TableDelta(g.spec.name, NO_CELLS, cells[:n], cells[n : 2 * n], cells[2 * n :])
        )

    def record_cleared(self, g: GroupTable, rows: np.ndarray) -> None:
        """Queue the emptying of whole ``rows`` of ``g``'s table (a request finished, swapped
        out or moved) for the workers: the :class:`TableDelta` of cleared rows."""
        self.pending.append(TableDelta(group=g.spec.name, clear_rows=rows.astype(np.int32)))

    def take_pending(self, into: dict[str, Any] | None = None) -> tuple[TableDelta, ...]:
        """Hand out the pending deltas, numbered in order (``TableDelta.seq``): a worker that
        mirrors them refuses a gap, a repeat or a reordering. ``into``: a dict that gets them
        as ``into["deltas"]`` in the statement that takes them, so that an exception at any
        line either takes nothing (numbering them again gives the same numbers) or leaves
        them there."""
        if not self.pending:  # the facade asks between most calls: nothing to number
            self.pending = []  # a fresh list, as below (an undo holds the one it saved)
            if into is not None:
                into["deltas"] = ()
            return ()
        deltas, number = tuple(self.pending), object.__setattr__
        # numbered in place: a pending delta is this object's alone until handed out (frozen
        # for everyone after), and a copy per delta costs as much as the step
        for seq, d in enumerate(deltas, self.next_seq):
            number(d, "seq", seq)
        if into is None:
            self.next_seq, self.pending = self.next_seq + len(deltas), []
        else:
            into["deltas"], self.next_seq, self.pending = deltas, self.next_seq + len(deltas), []
        return deltas

    def release_rows(self, rows: np.ndarray) -> None:
        """Free every block of ``rows``, clear them, and put the rows back. Only the columns
        the rows can hold are read (from the earliest ``held_from`` to the longest row's
        ``cdiv(num_tokens, B)``), so freeing costs the blocks held, not the table's width.
        Cells outside what a row holds are null (a window's released blocks were cleared), so
        the non-null cells, row by row, are exactly its blocks in chain order."""
        tokens = self.num_tokens[rows]
        longest = int(np.maximum.reduce(tokens)) if len(tokens) else 0
        for g in self.groups:
            # a window group holds only its tail: start at the earliest block a row holds
            first = int(np.minimum.reduce(g.held_from[rows])) if g.windowed and len(rows) else 0
            width = g.slots if g.per_request else -(-longest // g.block_size)
            cells = g.table[rows, first:width]
            held = cells[cells != NULL_BLOCK]
            g.pool.release_held(held)  # the table's own cells (the deepest evicts first)
            g.table[rows, first:width] = NULL_BLOCK
            g.held_from[rows] = 0
            self.record_cleared(g, rows)
        self.num_tokens[rows] = 0
        self.committed[:, rows] = 0
        self.free_rows.extend(rows[::-1].tolist())

    def row_cells(self, row: int) -> list[tuple[int, int, list[int], list[int]]]:
        """Per group, the cells ``row`` can hold and the blocks in them: ``(first, end, cells,
        blocks)``, columns ``[first, end)`` (from ``held_from`` in a window group, to
        ``cdiv(num_tokens, B)``; every cell outside is null), their ids as read, and the
        non-null ids in chain order, as :meth:`release_rows` reads them for one row."""
        longest = int(self.num_tokens[row])
        out = []
        for g in self.groups:
            first = g.held_from_items[row] if g.windowed else 0
            end = g.slots if g.per_request else -(-longest // g.block_size)
            end = min(end, g.width)  # as numpy's slice: the flat view runs on into row + 1
            at = row * g.width
            cells = g.cells[at + first : at + end].tolist() if end > first else []
            out.append((first, end, cells, [b for b in cells if b]))
        return out

    def release_row(self, row: int, cells: list[tuple[int, int, list[int], list[int]]]) -> None:
        """:meth:`release_rows` of one row whose :meth:`row_cells` are ``cells``: the same
        releases, cleared cells, deltas and free row, by basic indexing (a fancy index per
        group costs more than the release itself at one row; ``tests/scheduler/
        test_grow_one.py`` compares the two)."""
        for g, (_, _, _, held) in zip(self.groups, cells, strict=True):
            g.pool.release_listed(held)  # the table's own cells (the deepest evicts first)
        self._clear_row(row, cells)

    def pool_blocks(
        self, cells: list[tuple[int, int, list[int], list[int]]]
    ) -> list[tuple[BlockPool, list[int]]]:
        """Per pool, the blocks of one row whose :meth:`row_cells` are ``cells``, its groups'
        in the layout's order."""
        if self.one_group_pools:
            return [(g.pool, c[3]) for g, c in zip(self.groups, cells, strict=True)]
        return [
            (pool, cells[members[0]][3])
            if len(members) == 1
            else (pool, [b for gi in members for b in cells[gi][3]])
            for pool, members in self.pools
        ]

    def release_row_at_once(
        self, request_id: str, row: int, cells: list[tuple[int, int, list[int], list[int]]]
    ) -> bool:
        """:meth:`release_row` of ``request_id``'s ``row``, and the request forgotten, all or
        nothing by itself, when every pool can drop the row's blocks in scalar stores
        (``BlockPool.held_counts``: a few, each held once): an exception part way, an
        interrupt included, puts every pool, cell, count, pending delta and the request's
        row back (``BlockPool.restore_few``) and propagates. ``False``, having changed
        nothing, for any other row (an arena, many blocks): the caller releases it under its
        undo (``SwapBook``)."""
        saved = []  # per pool: its ids in the row, their counts, its free blocks
        for pool, ids in self.pool_blocks(cells):
            if ids:
                counts = pool.held_counts(ids)
                if counts is None:
                    return False
                saved.append((pool, ids, counts, pool.num_free))
        held_from = [g.held_from_items[row] for g in self.groups]
        tokens, committed = int(self.num_tokens[row]), self.committed[:, row].copy()
        num_free_rows, num_pending = len(self.free_rows), len(self.pending)
        try:
            # group by group, as release_row: a shared pool's evictable blocks keep the
            # order of the groups (the table's own cells; the deepest evicts first)
            for g, (_, _, _, held) in zip(self.groups, cells, strict=True):
                if held:
                    g.pool.release_few(held)
            self._clear_row(row, cells)
            del self.row_of[request_id]  # last: until here a retry finds the request
        except BaseException as exc:
            steps = [
                *(lambda s=s: s[0].restore_few(*s[1:]) for s in saved),
                lambda: self._restore_row(row, cells, held_from, tokens, committed),
                lambda: self._restore_lists(request_id, row, num_free_rows, num_pending),
            ]
            for step in steps:  # each runs, whatever another raises (noted on ``exc``)
                try:
                    step()
                except BaseException as failure:
                    add_note(exc, f"kvforge: putting a released row back failed: {failure!r}")
            raise
        return True

    def _restore_row(
        self,
        row: int,
        cells: list[tuple[int, int, list[int], list[int]]],
        held_from: list[int],
        tokens: int,
        committed: np.ndarray,
    ) -> None:
        """Put back ``row``'s cells (as :meth:`row_cells` read them), extents and counts."""
        for g, (first, end, row_cells, _), start in zip(self.groups, cells, held_from, strict=True):
            if end > first:
                g.table[row, first:end] = row_cells
            g.held_from[row] = start
        self.num_tokens[row], self.committed[:, row] = tokens, committed

    def _restore_lists(
        self, request_id: str, row: int, num_free_rows: int, num_pending: int
    ) -> None:
        """Put back the free rows and pending deltas as long as they were, and the request."""
        del self.free_rows[num_free_rows:], self.pending[num_pending:]
        self.row_of[request_id] = row

    def _clear_row(self, row: int, cells: list[tuple[int, int, list[int], list[int]]]) -> None:
        """Empty ``row`` (whose blocks were released), queue its cleared deltas, put it back."""
        clear = self.one_row[row]  # frozen, shared by the groups' deltas
        for g, (first, end, _, _) in zip(self.groups, cells, strict=True):
            if end > first:  # NULL_BLOCK in every cell the row held
                at = row * g.width
                g.cells[at + first : at + end] = g.zeros[: end - first]
            g.held_from_items[row] = 0
        self.pending += cleared_row_deltas(self.names, clear)
        self.num_tokens[row] = 0
        self.committed[:, row] = 0
        self.free_rows.append(row)
