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
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kvforge.core.layout import CacheLayout
from kvforge.core.values import RequestMove, SwapPlan, SwapResult, TableDelta
from kvforge.errors import OutOfBlocksError, RequestStateError
from kvforge.kinds import live_start
from kvforge.scheduler.args import batch_ids, swap_purpose
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.scheduler.tables import RequestTables
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

    def row(self, request_id: str) -> int:
        """The table row of a request that holds device blocks."""
        row = self._t.row_of.get(request_id)
        if row is None:
            raise self.not_resident(request_id)
        return row

    def not_resident(self, request_id: str) -> RequestStateError:
        if request_id in self.swapped:
            return RequestStateError(
                f"request {request_id!r} is swapped out; swap it in first"
            )
        return RequestStateError(
            f"request {request_id!r} has no blocks on the device (never allocated, freed, "
            "or swapped out)"
        )

    def check_idle(self, request_id: str) -> None:
        """Refuse a request whose swap is in flight."""
        if request_id in self.busy:
            raise RequestStateError(f"request {request_id!r} has a swap in flight")

    def release_host(self, request_id: str) -> None:
        """Return the host pages of a swapped-out request that finishes."""
        swapped = self.swapped.pop(request_id, None)
        if swapped is not None:
            for name, pages in swapped.host_pages.items():
                self._host[name].release(pages)

    def init_host(self, num_pages: Mapping[str, int]) -> None:
        """Create the host page pools (ids only: the memory is on the worker side)."""
        if self._host:
            raise RuntimeError("host pages were already initialised for this BlockManager")
        pools = {}
        for g in self.layout.groups:
            page_bytes = self.layout.host_page_bytes(g.name)
            if page_bytes:
                if g.name not in num_pages:
                    raise ValueError(f"num_pages has no count for group {g.name!r}")
                pools[g.name] = BlockPool(num_pages[g.name], g.name, kind="host")
                self._page_bytes[g.name] = page_bytes
        self._host = pools

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
            RequestStateError: an unknown request, a swapped one, or one already in a swap.
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
        taken = {name: self._host[name].take(count) for name, count in totals.items()}
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
        return self._launch("out", moves, {})

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
        for pool, members in self._t.pools:
            total = sum(totals[self._t.groups[gi].spec.name] for gi in members)
            if total > pool.num_free:
                name = self._t.groups[members[0]].spec.name
                raise OutOfBlocksError("device", name, total, pool.num_free, "swap_in")
        rows: dict[str, int] = {}
        moves = []
        for rid, cols in zip(ids, cols_of, strict=True):
            entry = self.swapped[rid]
            row = self._t.free_rows.pop()
            rows[rid] = row
            for g in self._t.groups:
                c = cols[g.spec.name]
                ids_ = g.pool.take(len(c))
                g.table[row, c] = ids_
                g.held_from[row] = int(c[0]) if len(c) and not g.per_request else 0
                if len(c):
                    self._t.pending.append(
                        TableDelta(
                            group=g.spec.name,
                            rows=np.full(len(c), row, dtype=np.int32),
                            cols=c.astype(np.int32),
                            block_ids=ids_,
                        )
                    )
            self._t.num_tokens[row] = entry.num_tokens
            for gi, g in enumerate(self._t.groups):  # restored blocks are not registered again
                self._t.committed[gi, row] = entry.num_tokens // g.block_size
            moves.append(
                RequestMove(
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
            )
        return self._launch("in", moves, rows)

    def _launch(
        self, direction: Literal["out", "in"], moves: list[RequestMove], rows: dict[str, int]
    ) -> SwapPlan:
        moved = {name for m in moves for name in m.device_blocks}
        groups = tuple(g.spec.name for g in self._t.groups if g.spec.name in moved)
        plan = SwapPlan(next(self._plan_ids), direction, tuple(moves), groups)
        self._in_flight[plan.plan_id] = InFlight(plan, rows)
        for m in moves:
            self.busy[m.request_id] = plan.plan_id
        return plan

    def complete_swap(self, result: SwapResult) -> None:
        """Finish the bookkeeping of a swap plan once the worker side answered.

        On success a swap out frees the device blocks and rows (the requests are now
        swapped out) and a swap in frees the host pages. On failure everything the plan
        reserved is given back: the host pages of a swap out (the requests stay resident),
        the rows and device blocks of a swap in (the requests stay swapped out).

        Raises:
            ValueError: ``result`` names no plan in flight.
        """
        if not isinstance(result, SwapResult):
            raise TypeError(f"result must be a SwapResult, got {type(result).__name__}")
        flight = self._in_flight.pop(result.plan_id, None)
        if flight is None:
            raise ValueError(f"swap plan {result.plan_id!r} is not in flight")
        plan = flight.plan
        for m in plan.requests:
            del self.busy[m.request_id]
        if plan.direction == "out":
            if result.ok:
                rows = [self._t.row_of.pop(m.request_id) for m in plan.requests]
                self._t.release_rows(np.array(rows, dtype=np.int64))
                for m in plan.requests:
                    self.swapped[m.request_id] = Swapped(
                        m.num_tokens, m.purpose, m.block_indices, m.host_pages
                    )
                    self._count(m, "out")
            else:
                for m in plan.requests:
                    for name, pages in m.host_pages.items():
                        self._host[name].release(pages)
            return
        if result.ok:
            for m in plan.requests:
                del self.swapped[m.request_id]
                for name, pages in m.host_pages.items():
                    self._host[name].release(pages)
                self._t.row_of[m.request_id] = flight.rows[m.request_id]
                self._count(m, "in")
        else:
            self._t.release_rows(
                np.array([flight.rows[m.request_id] for m in plan.requests], dtype=np.int64)
            )

    def _count(self, move: RequestMove, direction: Literal["out", "in"]) -> None:
        stats = self.stats
        per_group = stats.blocks_out if direction == "out" else stats.blocks_in
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
