"""The swap book of the scheduler side: host page pools, swapped-out requests, swap plans in
flight and their completion.

:class:`SwapBook` decides which device blocks of a request move to which host pages
(:meth:`plan_swap_out`), which fresh device blocks a swapped request comes back to
(:meth:`plan_swap_in`), and settles a plan once the worker side answers
(:meth:`complete_swap`): on success the source is freed, on failure everything the plan
reserved is given back. Host pages are ids only; their memory is on the worker side. Like
the prefix cache it holds no lock: the block manager calls it under its own.

Invariants: a request is in exactly one of running (``tables.row_of``), swapped out
(``swapped``) or neither; a request with a plan in flight (``busy``) keeps its blocks or pages
until the plan completes, and no other call may touch it.

Faults mid-bookkeeping. Planning and completing a swap change many things: pools, table rows,
deltas, the maps of running, swapped and busy requests. Each call first checks everything it
can, then applies its change through an undo journal (:class:`~kvforge.scheduler.undo.Undo`):
every step registers how to take it back *before* it happens, and an exception of any kind
(``KeyboardInterrupt`` included) between any two statements undoes the steps taken, newest
first, and propagates.
So a plan is either made in full or not at all, and a completion either settles the plan in
full or leaves it in flight exactly as it was: calling :meth:`SwapBook.complete_swap` again
(with the same result, or a failed one) settles it. A plan leaves flight as the last step of
its completion. (The facade settles such a plan as failed at once: its swaps roll back.)

What the worker is told. Each plan carries a random ``token``: the worker answers a plan it
executed with a receipt keyed by it (:mod:`kvforge.core.swap_receipt`), and
:meth:`SwapBook.complete_swap` accepts a success only with the receipt of the plan it issued.
Each plan also carries the host pages the book gave back since the last plan that completed
with a receipt (:class:`~kvforge.core.values.PageRelease`, numbered): a request freed while
swapped out, one swapped back in, a swap out that failed. The worker's swap ledger
(:mod:`kvforge.worker.swap_ledger`) forgets those pages' data only then, so it can refuse a
plan that would overwrite swapped data or read another request's pages.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Literal

import numpy as np

from kvforge.core.layout import CacheLayout
from kvforge.core.swap_receipt import check_receipt, new_token
from kvforge.core.values import PageRelease, RequestMove, SwapPlan, SwapResult
from kvforge.errors import OutOfBlocksError, RequestStateError, add_note
from kvforge.kinds import live_start
from kvforge.scheduler.arena import SlabArena
from kvforge.scheduler.args import batch_ids, swap_purpose
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.scheduler.tables import RequestTables
from kvforge.scheduler.undo import Undo, all_or_nothing, save_rows
from kvforge.specs import SwapPurpose, TokenRange

__all__ = ["InFlight", "SwapBook", "SwapStats", "Swapped"]


@dataclass
class SwapStats:
    """Counters of the swaps that completed."""

    swaps_out: int = 0
    swaps_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    blocks_out: dict[str, int] = field(default_factory=dict)
    blocks_in: dict[str, int] = field(default_factory=dict)


@dataclass
class Swapped:
    """A request whose blocks live in host pages."""

    num_tokens: int
    purpose: SwapPurpose
    block_indices: dict[str, np.ndarray]
    host_pages: dict[str, np.ndarray]


@dataclass
class InFlight:
    """A swap plan handed to the worker side and not yet completed."""

    plan: SwapPlan
    rows: dict[str, int]  # swap in: rows adopted for the plan


class SwapBook:
    """Host pages and swaps of every group.

    Args:
        tables: the scheduler side's tables (owned by the block manager).
        layout: the model's layout (host page bytes, offloaded roles).
    """

    def __init__(self, tables: RequestTables, layout: CacheLayout) -> None:
        self._t = tables
        self.layout = layout
        self.swapped: dict[str, Swapped] = {}
        self.busy: dict[str, int] = {}  # request -> plan id of its swap in flight
        self._in_flight: dict[int, InFlight] = {}
        self._plan_ids = itertools.count(1)
        self._host: dict[str, BlockPool] = {}
        self._page_bytes: dict[str, int] = {}
        self.stats = SwapStats()
        # pages given back that the worker may not have heard of: each plan carries them
        # until one that carries them completes with the worker's receipt
        self._releases: list[PageRelease] = []
        self._release_seq = 0

    def row(self, request_id: str) -> int:
        """The table row of a request that holds device blocks."""
        row = self._t.row_of.get(request_id)
        if row is None:
            raise self.not_resident(request_id)
        return row

    def not_resident(self, request_id: str) -> RequestStateError:
        if request_id in self.swapped:
            return RequestStateError(f"request {request_id!r} is swapped out; swap it in first")
        return RequestStateError(
            f"request {request_id!r} has no blocks on the device (never allocated, freed, "
            "or swapped out)"
        )

    def finish(self, request_ids: Sequence[str]) -> None:
        """Free the rows and blocks of the resident requests among ``request_ids`` and the
        host pages of the swapped ones (checked by the caller: each is one or the other and
        none is busy), all or nothing: an exception midway, ``KeyboardInterrupt`` included,
        undoes every change and propagates."""
        row_of = self._t.row_of
        resident = [rid for rid in request_ids if rid in row_of]
        if len(request_ids) == 1 and resident and self._finish_one(resident[0]):
            return
        with all_or_nothing() as undo:
            for rid in request_ids if self.swapped else ():
                swapped = self.swapped.get(rid)
                if swapped is not None:
                    for name, pages in swapped.host_pages.items():
                        undo.release(self._host[name], pages)
                    self._note_release(undo, rid, swapped.host_pages)
                    undo.pop(self.swapped, rid)
            if resident:
                self._release_rows(undo, np.array([row_of[r] for r in resident], np.int64))
                for rid in resident:
                    undo.pop(row_of, rid)

    def _finish_one(self, request_id: str) -> bool:
        """:meth:`finish` of one running request, the engine's common call: its row read once
        (``RequestTables.row_cells``) and released at once when its pools allow
        (``RequestTables.release_row_at_once``, all or nothing by itself), else under an
        undo (:meth:`_release_row`), all or nothing as the batch path. Returns ``True`` (a
        batch of one always takes this path; ``tests/scheduler/test_grow_one.py`` compares it
        with the batch path)."""
        t = self._t
        row_of = t.row_of
        row = row_of[request_id]
        cells = t.row_cells(row)
        if t.release_row_at_once(request_id, row, cells):  # the request forgotten too
            return True
        undo = Undo()
        try:
            self._release_row(undo, row, cells)
            undo.pop(row_of, request_id)
        except BaseException as exc:
            undo.rollback(exc)
            raise
        return True

    def plans_in_flight(self) -> tuple[SwapPlan, ...]:
        """The plans handed out and not yet completed, oldest first: an engine interrupted
        between executing a plan and completing it finds it here, and settles it with
        :meth:`complete_swap`."""
        return tuple(flight.plan for flight in self._in_flight.values())

    def init_host(
        self, num_pages: Mapping[str, int], then: Callable[[], None] | None = None
    ) -> None:
        """Create the host page pools (ids only: the memory is on the worker side).

        ``then``: called once the pools are built and before the book keeps them (the
        facade allocates the worker's pages there): if it raises, the book has no host pages,
        so a retry starts afresh."""
        if self._host:
            raise RuntimeError("host pages were already initialised for this BlockManager")
        pools, page_bytes_of = {}, {}
        for g in self.layout.groups:
            page_bytes = self.layout.host_page_bytes(g.name)
            if page_bytes:
                if g.name not in num_pages:
                    raise ValueError(f"num_pages has no count for group {g.name!r}")
                pools[g.name] = BlockPool(num_pages[g.name], g.name, kind="host")
                page_bytes_of[g.name] = page_bytes
        if then is not None:
            then()
        self._page_bytes = page_bytes_of
        self._host = pools  # last: until here the book has no host pages

    def host_pool(self, group: str) -> BlockPool:
        if group not in self._t.by_name:
            raise ValueError(f"group {group!r} does not exist; groups are {list(self._t.by_name)}")
        if group not in self._host:
            raise ValueError(f"group {group!r} has no host pages")
        return self._host[group]

    @property
    def host_groups(self) -> list[str]:
        return [g for g in self._t.by_name if g in self._host]

    def selection(self, request_id: str, purpose: SwapPurpose | str) -> dict[str, np.ndarray]:
        """Block-table indices that a swap of ``request_id`` moves, per group, asked of each
        (backend, role) through ``offload_selection``."""
        purpose = swap_purpose(purpose)
        row = self.row(request_id)
        return self._selection(row, purpose)

    def _selection(self, row: int, purpose: SwapPurpose) -> dict[str, np.ndarray]:
        n = int(self._t.num_tokens[row])
        selected: dict[str, np.ndarray] = {}
        for g in self._t.groups:
            name = g.spec.name
            start, end = n, 0
            for backend, role in self.layout.offload_roles(name):
                r = backend.offload_selection(role, n, purpose)
                if not isinstance(r, TokenRange) or r.end > n:
                    raise ValueError(
                        f"{backend!r}.offload_selection({role.name!r}, {n}, {purpose.value!r}) "
                        f"returned {r!r}; expected a TokenRange within [0, {n})"
                    )
                if not r.empty:
                    start, end = min(start, r.start), max(end, r.end)
            if start >= end:
                continue
            if g.per_request:
                cols = np.arange(g.slots)
            else:
                cols = np.arange(start // g.block_size, (end - 1) // g.block_size + 1)
            cols = cols[g.table[row, cols] != NULL_BLOCK]
            if len(cols):
                selected[name] = cols
        return selected

    def plan_swap_out(
        self, request_ids: Sequence[str], purpose: SwapPurpose | str = "preempt"
    ) -> SwapPlan:
        """Reserve host pages for the live blocks of the requests and describe the move.

        The requests keep their device blocks until :meth:`complete_swap` hears that the
        copies succeeded; until then they cannot be scheduled, freed or swapped again.

        Raises:
            OutOfBlocksError: the host pools lack pages for the whole batch (nothing changed).
            RequestStateError: an unknown request, a swapped one, one already in a swap, or
                (checked by the block manager) one in a step that has not ended.
            ValueError: a repeated id or an unknown purpose.
        """
        purpose = swap_purpose(purpose)
        self._ready_host()
        ids = batch_ids(request_ids)
        for rid in ids:
            if rid in self.busy:
                raise RequestStateError(f"request {rid!r} has a swap in flight")
            if rid in self.swapped:
                raise RequestStateError(f"request {rid!r} is already swapped out")
            self.row(rid)
        selections = [self._selection(self._t.row_of[rid], purpose) for rid in ids]
        totals: dict[str, int] = {}
        for sel in selections:
            for name, cols in sel.items():
                totals[name] = totals.get(name, 0) + len(cols)
        for name, count in totals.items():
            pool = self._host[name]
            if count > pool.num_free:
                raise OutOfBlocksError("host", name, count, pool.num_free, "swap_out")
        with all_or_nothing() as undo:
            taken = {name: undo.take(self._host[name], count) for name, count in totals.items()}
            offsets = dict.fromkeys(totals, 0)
            moves = []
            for rid, sel in zip(ids, selections, strict=True):
                row = self._t.row_of[rid]
                pages, blocks = {}, {}
                for name, cols in sel.items():
                    pages[name] = taken[name][offsets[name] : offsets[name] + len(cols)]
                    offsets[name] += len(cols)
                    blocks[name] = self._t.by_name[name].table[row, cols].copy()
                moves.append(
                    RequestMove(
                        request_id=rid,
                        num_tokens=int(self._t.num_tokens[row]),
                        purpose=purpose,
                        block_indices=sel,
                        device_blocks=blocks,
                        host_pages=pages,
                    )
                )
            return self._launch(undo, "out", moves, {})

    def plan_swap_in(self, request_ids: Sequence[str]) -> SwapPlan:
        """Give swapped-out requests fresh rows and device blocks and describe the move.

        Blocks are taken for each request's live window in every group (plus any block the
        swap out moved outside it), all or nothing for the batch; they generally differ from
        the blocks it had before.

        Raises:
            OutOfBlocksError: the device pools lack blocks for the whole batch.
            RequestStateError: a request that is not swapped out, or has a swap in flight.
            ValueError: a repeated id; or no free table row.
        """
        ids = batch_ids(request_ids)
        self._check_swap_in(ids)
        cols_of, totals = self._live_columns(ids)
        arenas = self._check_device_blocks(totals)
        for arena, needs in arenas:  # slabs for every group at once, then the takes
            arena.prepare(needs)
        # the rows free_rows.pop() hands out, in order
        chosen = self._t.free_rows[len(self._t.free_rows) - len(ids) :][::-1]
        with all_or_nothing() as undo:
            save_rows(undo, self._t, np.array(chosen, dtype=np.int64))
            rows: dict[str, int] = {}
            moves = []
            for rid, cols in zip(ids, cols_of, strict=True):
                row = rows[rid] = self._t.free_rows.pop()
                moves.append(self._restore_row(undo, rid, row, cols))
            return self._launch(undo, "in", moves, rows)

    def _check_swap_in(self, ids: list[str]) -> None:
        """Refuse a swap in of ``ids`` unless each is swapped out and idle, and enough table
        rows are free; changes nothing."""
        for rid in ids:
            if rid in self.busy:
                raise RequestStateError(f"request {rid!r} has a swap in flight")
            if rid not in self.swapped:
                raise RequestStateError(
                    f"request {rid!r} is not swapped out (swapped out: {sorted(self.swapped)})"
                )
        if len(ids) > len(self._t.free_rows):
            raise OutOfBlocksError(
                "device", "table rows", len(ids), len(self._t.free_rows), "swap_in"
            )

    def _live_columns(self, ids: list[str]) -> tuple[list[dict[str, np.ndarray]], dict[str, int]]:
        """Per swapped request, the columns it comes back to in each group (its live window,
        plus any column the swap out moved outside it), and the blocks per group in all."""
        cols_of: list[dict[str, np.ndarray]] = []
        totals = {g.spec.name: 0 for g in self._t.groups}
        for rid in ids:
            entry = self.swapped[rid]
            cols: dict[str, np.ndarray] = {}
            for g in self._t.groups:
                if g.per_request:
                    live = np.arange(g.slots)
                else:
                    first = live_start(g.spec, entry.num_tokens) // g.block_size
                    live = np.arange(first, -(-entry.num_tokens // g.block_size))
                moved = entry.block_indices.get(g.spec.name)
                if moved is not None and len(moved):
                    live = np.union1d(live, moved)
                cols[g.spec.name] = live
                totals[g.spec.name] += len(live)
            cols_of.append(cols)
        return cols_of, totals

    def _check_device_blocks(
        self, totals: dict[str, int]
    ) -> list[tuple[SlabArena, dict[BlockPool, int]]]:
        """Raise unless every pool (an arena: its member pools together) has ``totals``'s
        blocks free; changes nothing. Returns each arena's needs, for its ``prepare``."""
        arenas = []
        for pool, members in self._t.capacity:
            if isinstance(pool, SlabArena):
                needs = {
                    self._t.groups[gi].pool: totals[self._t.groups[gi].spec.name] for gi in members
                }
                missing = pool.shortfall(needs)
                if missing is not None:
                    raise OutOfBlocksError("device", *missing, "swap_in")
                arenas.append((pool, needs))
                continue
            total = sum(totals[self._t.groups[gi].spec.name] for gi in members)
            if total > pool.num_free:
                name = self._t.groups[members[0]].spec.name
                raise OutOfBlocksError("device", name, total, pool.num_free, "swap_in")
        return arenas

    def _restore_row(
        self, undo: Undo, rid: str, row: int, cols: dict[str, np.ndarray]
    ) -> RequestMove:
        """Take fresh blocks for ``rid``'s ``cols`` into ``row`` (undoably: ``undo`` saved the
        row), queue the table deltas, restore its token and committed counts, and describe
        the move of its host pages into those blocks."""
        entry = self.swapped[rid]
        for g in self._t.groups:
            c = cols[g.spec.name]
            ids_ = undo.take(g.pool, len(c))
            g.table[row, c] = ids_
            g.held_from[row] = int(c[0]) if len(c) and not g.per_request else 0
            if len(c):
                self._t.record(g, np.full(len(c), row), c, ids_)
        self._t.num_tokens[row] = entry.num_tokens
        for gi, g in enumerate(self._t.groups):  # restored blocks are not registered again
            self._t.committed[gi, row] = entry.num_tokens // g.block_size
        return RequestMove(
            request_id=rid,
            num_tokens=entry.num_tokens,
            purpose=entry.purpose,
            block_indices=entry.block_indices,
            device_blocks={
                name: self._t.by_name[name].table[row, idx].copy()
                for name, idx in entry.block_indices.items()
            },
            host_pages=entry.host_pages,
        )

    def _launch(
        self,
        undo: Undo,
        direction: Literal["out", "in"],
        moves: list[RequestMove],
        rows: dict[str, int],
    ) -> SwapPlan:
        moved = {name for m in moves for name in m.device_blocks}
        groups = tuple(g.spec.name for g in self._t.groups if g.spec.name in moved)
        plan = SwapPlan(
            next(self._plan_ids),
            direction,
            tuple(moves),
            groups,
            released=tuple(self._releases),
            token=new_token(),
        )
        undo.put(self._in_flight, plan.plan_id, InFlight(plan, rows))
        for m in moves:
            undo.put(self.busy, m.request_id, plan.plan_id)
        return plan

    def complete_swap(self, result: SwapResult) -> None:
        """Finish the bookkeeping of a swap plan once the worker side answered.

        On success a swap out frees the device blocks and rows (the requests are now
        swapped out) and a swap in frees the host pages. On failure everything the plan
        reserved is given back: the host pages of a swap out (the requests stay resident),
        the rows and device blocks of a swap in (the requests stay swapped out).

        All or nothing: if an exception (``KeyboardInterrupt`` included) strikes midway,
        every change is undone and the plan is still in flight, its requests busy, exactly as
        before the call; calling ``complete_swap`` again settles it.

        A successful result is accepted only with the worker's receipt of this very plan
        (:mod:`kvforge.core.swap_receipt`): a result the worker did not produce, or produced
        for another plan under the same id, is refused. A failed result needs none.

        Raises:
            TypeError: ``result`` is not a :class:`SwapResult`.
            ValueError: ``result`` names no plan in flight.
            SwapReceiptError: a successful result without this plan's receipt (nothing
                changed: the plan is still in flight).
        """
        if not isinstance(result, SwapResult):
            raise TypeError(f"result must be a SwapResult, got {type(result).__name__}")
        plan_id = result.plan_id
        known = isinstance(plan_id, Integral) and not isinstance(plan_id, bool)
        flight = self._in_flight.get(int(plan_id)) if known else None
        if flight is None:
            raise ValueError(f"swap plan {plan_id!r} is not in flight")
        plan = flight.plan
        if result.ok:
            check_receipt(plan, result)
        self._check_flight(flight)
        try:
            self._settle(flight, result.ok)
        except BaseException as exc:
            add_note(
                exc,
                f"kvforge: swap plan {plan.plan_id} is still in flight, as it was before "
                "complete_swap; calling complete_swap again settles it",
            )
            raise

    def _settle(self, flight: InFlight, ok: bool) -> None:
        plan = flight.plan
        with all_or_nothing() as undo:
            if plan.direction == "out" and ok:
                rows = [self._t.row_of[m.request_id] for m in plan.requests]
                self._release_rows(undo, np.array(rows, dtype=np.int64))
                for m in plan.requests:
                    undo.pop(self._t.row_of, m.request_id)
                    entry = Swapped(m.num_tokens, m.purpose, m.block_indices, m.host_pages)
                    undo.put(self.swapped, m.request_id, entry)
                self._count_swaps(undo, plan.requests, "out")
            elif plan.direction == "out":
                self._release_pages(undo, plan.requests)
            elif ok:
                self._release_pages(undo, plan.requests)
                for m in plan.requests:
                    undo.pop(self.swapped, m.request_id)
                    undo.put(self._t.row_of, m.request_id, flight.rows[m.request_id])
                self._count_swaps(undo, plan.requests, "in")
            else:
                rows = [flight.rows[m.request_id] for m in plan.requests]
                self._release_rows(undo, np.array(rows, dtype=np.int64))
            if ok and plan.released:  # the worker applied the releases the plan carried
                last = plan.released[-1].seq
                self._keep_releases(undo, [r for r in self._releases if r.seq > last])
            # the plan leaves flight last: until here a retry finds it as it was
            for m in plan.requests:
                undo.pop(self.busy, m.request_id)
            undo.pop(self._in_flight, plan.plan_id)

    def _check_flight(self, flight: InFlight) -> None:
        """Refuse to complete a plan whose requests are not where the plan left them (the
        book was corrupted): nothing is changed."""
        plan = flight.plan
        for m in plan.requests:
            rid = m.request_id
            where = (self.busy.get(rid), rid in self._t.row_of, rid in self.swapped)
            if plan.direction == "out":
                expected = (plan.plan_id, True, False)
            else:
                expected = (plan.plan_id, False, True)
            if where != expected or (plan.direction == "in" and rid not in flight.rows):
                raise RuntimeError(
                    f"swap plan {plan.plan_id} cannot complete: request {rid!r} is not where "
                    f"the plan left it (busy with plan, running, swapped = {where})"
                )

    def _release_row(
        self, undo: Undo, row: int, cells: list[tuple[int, int, list[int], list[int]]]
    ) -> None:
        """:meth:`_release_rows` of one row, undoable, whose cells were read once
        (``RequestTables.row_cells``): the saved state is the cells it can hold, its extents,
        token count and commits, the free rows and the pending deltas, and the references
        its blocks drop."""
        t = self._t
        save_rows(undo, self._t, row, [slice(first, end) for first, end, _, _ in cells])
        for pool, ids in t.pool_blocks(cells):
            undo.guard_listed(pool, ids)
        t.release_row(row, cells)

    def _release_rows(self, undo: Undo, rows: np.ndarray) -> None:
        """``tables.release_rows(rows)``, undoable: the rows and every reference their
        blocks drop."""
        t = self._t
        # the cells the rows can hold (as release_rows reads them): beyond, every cell is null
        longest = int(t.num_tokens[rows].max()) if len(rows) else 0
        widths = [g.slots if g.per_request else -(-longest // g.block_size) for g in t.groups]
        save_rows(undo, self._t, rows, [slice(0, w) for w in widths])
        for pool, members in t.pools:
            cells = [t.groups[gi].table[rows, : widths[gi]].ravel() for gi in members]
            held = cells[0] if len(cells) == 1 else np.concatenate(cells)
            undo.guard(pool, held[held != NULL_BLOCK])
        t.release_rows(rows)

    def _release_pages(self, undo: Undo, moves: Sequence[RequestMove]) -> None:
        """Give back the host pages of ``moves``: one release per group."""
        per_group: dict[str, list[np.ndarray]] = {}
        for m in moves:
            for name, pages in m.host_pages.items():
                per_group.setdefault(name, []).append(pages)
        for name, pages in per_group.items():
            undo.release(self._host[name], np.concatenate(pages))
        for m in moves:
            self._note_release(undo, m.request_id, m.host_pages)

    def _keep_releases(self, undo: Undo, releases: list[PageRelease]) -> None:
        """``self._releases = releases``, undoable (with the release counter)."""
        saved, seq = list(self._releases), self._release_seq

        def restore() -> None:
            self._releases[:] = saved
            self._release_seq = seq

        undo.add(restore)
        self._releases[:] = releases

    def _note_release(self, undo: Undo, request_id: str, pages: Mapping[str, np.ndarray]) -> None:
        """Tell the worker (with the next plans) that ``pages`` no longer hold
        ``request_id``'s data."""
        release = PageRelease(self._release_seq, request_id, dict(pages))
        self._keep_releases(undo, [*self._releases, release])
        self._release_seq += 1

    def _count_swaps(
        self, undo: Undo, moves: Sequence[RequestMove], direction: Literal["out", "in"]
    ) -> None:
        """Add ``moves`` to :attr:`stats` (swaps, bytes and pages per group), undoably."""
        stats = self.stats
        saved = (stats.swaps_out, stats.swaps_in, stats.bytes_out, stats.bytes_in)
        blocks_out, blocks_in = dict(stats.blocks_out), dict(stats.blocks_in)

        def restore() -> None:
            stats.swaps_out, stats.swaps_in, stats.bytes_out, stats.bytes_in = saved
            stats.blocks_out.clear()
            stats.blocks_out.update(blocks_out)
            stats.blocks_in.clear()
            stats.blocks_in.update(blocks_in)

        undo.add(restore)
        per_group = stats.blocks_out if direction == "out" else stats.blocks_in
        for move in moves:
            moved = 0
            for name, pages in move.host_pages.items():
                per_group[name] = per_group.get(name, 0) + len(pages)
                moved += len(pages) * self._page_bytes[name]
            if direction == "out":
                stats.swaps_out += 1
                stats.bytes_out += moved
            else:
                stats.swaps_in += 1
                stats.bytes_in += moved

    def page_bytes(self, group: str) -> int:
        """Bytes of one host page of ``group`` (its offloaded roles, no padding)."""
        return self._page_bytes.get(group, 0)

    def _ready_host(self) -> None:
        if not self._host:
            raise RuntimeError("call initialize_host_cache before swapping")
