"""The worker's own record of which host swap pages hold which swapped request's data.

The scheduler side's swap book decides which pages a swap out writes and which a swap in
reads; the worker does not take its word for it. :class:`SwapLedger` remembers, from the swap
outs this worker *executed*, which pages of each group hold which request's swapped data and
at which block-table indices, and forgets them only when the scheduler side says it released
them (:class:`~kvforge.core.values.PageRelease`, sequence-numbered, carried by the next plans
until one of them completes). Against that record:

- a swap out writes only pages that hold no swapped request's data, and never swaps out a
  request whose data the ledger holds (its blocks would overwrite its own swapped pages: a
  swap-in plan with its direction flipped);
- a swap in reads exactly the pages, at exactly the indices, that the ledger holds for its
  request (a swap in of a request whose swap out this worker never executed, or of pages
  another request's data is in, is refused).

A refused plan raises :class:`~kvforge.errors.PageOwnershipError` (or
:class:`~kvforge.errors.WorkerRefusedError` for a malformed or out-of-order release) naming
the plan, request, group and page, and changes nothing. Checking is separate from changing:
:meth:`SwapLedger.check` computes what the plan's releases leave without touching the
ledger, :meth:`SwapLedger.accept` applies them once the whole plan was accepted, and
:meth:`SwapLedger.executed` records a swap out's pages once its copies succeeded; each
change replaces the ledger's state in one assignment.

Costs: a dict lookup per page a plan names, on swaps only (never on a step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvforge.core.values import PageRelease, RequestMove, SwapPlan
from kvforge.errors import BlockOwnershipError, PageOwnershipError, WorkerRefusedError

__all__ = ["SwapLedger", "check_swap_out_rows"]

#: request -> group -> (block indices, host pages) of its swapped data
#: one swapped request's data: group -> (block indices, host pages)
Held = dict[str, tuple[np.ndarray, np.ndarray]]
Records = dict[str, Held]
#: what a plan leaves: records, group -> page -> request, the next release seq
Pending = tuple[Records, dict[str, dict[int, str]], int]


class SwapLedger:
    """Which swap pages hold which swapped request's data, on this worker."""

    def __init__(self) -> None:
        # (request -> group -> (indices, pages), group -> page -> request, next release seq):
        # one tuple, replaced in one assignment, so a change is whole or absent
        self.state: tuple[Records, dict[str, dict[int, str]], int] = ({}, {}, 0)

    @property
    def records(self) -> Records:
        return self.state[0]

    @property
    def next_release(self) -> int:
        """The :attr:`PageRelease.seq` this ledger applies next."""
        return self.state[2]

    def holder(self, group: str, page: int) -> str | None:
        """The request whose swapped data ``page`` of ``group`` holds, or ``None``."""
        return self.state[1].get(group, {}).get(page)

    # ------------------------------------------------------------------ checks

    def check(self, plan: SwapPlan, num_pages: Mapping[str, int]) -> Pending:
        """Refuse ``plan`` unless it agrees with the ledger once its new releases are
        applied; return that state (for :meth:`accept`). Changes nothing."""
        releases = self._new_releases(plan, num_pages)
        records, owner = _after(self.state[0], self.state[1], releases)
        for move in plan.requests:
            held = records.get(move.request_id)
            if plan.direction == "out":
                _check_swap_out(plan.plan_id, move, held, owner)
            else:
                _check_swap_in(plan.plan_id, move, held, owner)
        return records, owner, self.state[2] + len(releases)

    def _new_releases(self, plan: SwapPlan, num_pages: Mapping[str, int]) -> list[PageRelease]:
        """The plan's releases this ledger has not applied, checked: in ``seq`` order, with no
        gap after the last one applied."""
        released = plan.released
        if not isinstance(released, tuple):
            raise WorkerRefusedError(
                f"execute: plan {plan.plan_id}'s released must be a tuple of PageRelease, got "
                f"{type(released).__name__}; nothing moved"
            )
        fresh: list[PageRelease] = []
        expected = self.next_release
        for rel in released:
            if type(rel) is not PageRelease or type(rel.seq) is not int:
                raise WorkerRefusedError(
                    f"execute: plan {plan.plan_id} carries a release that is not a PageRelease "
                    f"with an int seq ({rel!r:.80}); nothing moved"
                )
            if rel.seq < expected and not fresh:
                continue  # applied with an earlier plan
            if rel.seq != expected:
                raise WorkerRefusedError(
                    f"execute: plan {plan.plan_id} carries page release {rel.seq}, expected "
                    f"{expected}: releases {expected}..{rel.seq - 1} never arrived (or they "
                    "are out of order); nothing moved"
                )
            if not isinstance(rel.request_id, str) or not isinstance(rel.host_pages, dict):
                raise WorkerRefusedError(
                    f"execute: page release {rel.seq} of plan {plan.plan_id} is malformed; "
                    "nothing moved"
                )
            for g, pages in rel.host_pages.items():
                arr = np.asarray(pages)
                if g not in num_pages or arr.ndim != 1 or arr.dtype.kind not in "iu":
                    raise WorkerRefusedError(
                        f"execute: page release {rel.seq} of plan {plan.plan_id} names group "
                        f"{g!r} or pages of dtype {arr.dtype}; nothing moved"
                    )
            fresh.append(rel)
            expected += 1
        return fresh

    # ------------------------------------------------------------------ changes

    def accept(self, pending: Pending) -> None:
        """The plan :meth:`check` returned ``pending`` for was accepted: apply its releases."""
        self.state = pending

    def executed(self, plan: SwapPlan) -> None:
        """A plan's copies succeeded: a swap out's pages now hold its requests' data."""
        if plan.direction != "out":
            return
        records, owner, next_release = self.state
        records, owner = dict(records), dict(owner)
        for g in {g for move in plan.requests for g in move.host_pages}:
            owner[g] = dict(owner.get(g, {}))
        for move in plan.requests:
            rec: dict[str, tuple[np.ndarray, np.ndarray]] = {}
            for g, pages in move.host_pages.items():
                held = np.array(pages, dtype=np.int64)
                owners = owner.setdefault(g, {})
                for p in held.tolist():
                    owners[p] = move.request_id
                rec[g] = (np.array(move.block_indices[g], dtype=np.int64), held)
            records[move.request_id] = rec
        self.state = (records, owner, next_release)


def _after(
    records: Records, owner: dict[str, dict[int, str]], releases: list[PageRelease]
) -> tuple[Records, dict[str, dict[int, str]]]:
    """``records`` and ``owner`` once ``releases`` are applied (copies of what they change):
    a released page no longer holds its request's data; a page the ledger holds for another
    request, or for none, is left alone."""
    if not releases:
        return records, owner
    records, owner = dict(records), dict(owner)
    copied: set[str] = set()
    for rel in releases:
        rid = rel.request_id
        rec = records.get(rid)
        rec = dict(rec) if rec is not None else None
        for g, pages in rel.host_pages.items():
            if g not in owner:
                continue
            if g not in copied:
                owner[g] = dict(owner[g])
                copied.add(g)
            owners = owner[g]
            freed = [p for p in np.asarray(pages).tolist() if owners.get(p) == rid]
            for p in freed:
                del owners[p]
            if rec is not None and g in rec and freed:
                cols, held = rec[g]
                keep = ~np.isin(held, freed)
                if keep.any():
                    rec[g] = (cols[keep], held[keep])
                else:
                    del rec[g]
        if rec is not None:
            if rec:
                records[rid] = rec
            else:
                del records[rid]
    return records, owner


def check_swap_out_rows(
    plan: SwapPlan, tables: Mapping[str, np.ndarray], row_request: Sequence[str | None]
) -> None:
    """A swap out reads its own request's row: among the mirrored rows that hold every block
    of a move at its indices (several when blocks are shared), one serves the move's request,
    or no request yet (``row_request[row]``, from the steps the worker applied). Run after
    :func:`~kvforge.worker.guard.check_plan` (the arrays are in range)."""
    for move in plan.requests:
        candidates: np.ndarray | None = None
        first = ""
        for g, blocks in sorted(move.device_blocks.items()):
            blocks = np.asarray(blocks)
            if len(blocks):
                cols = np.asarray(move.block_indices[g])
                same = (tables[g][:, cols] == blocks).all(axis=1)
                candidates = same if candidates is None else candidates & same
                first = first or g
        if candidates is None:
            continue
        rows = np.flatnonzero(candidates).tolist()
        if not rows or any(row_request[r] in (None, move.request_id) for r in rows):
            continue  # no row at all is check_plan's refusal
        raise BlockOwnershipError(
            f"execute: swap-out plan {plan.plan_id} reads the blocks of row {rows[0]} for "
            f"request {move.request_id!r}, but that row serves request "
            f"{row_request[rows[0]]!r}: another request's KV would be stored as this one's; "
            "nothing moved",
            first,
            int(np.asarray(move.device_blocks[first])[0]),
            -1,
            rows[0],
        )


def _first_difference(pages: np.ndarray, mine: np.ndarray) -> int:
    n = min(len(pages), len(mine))
    diff = np.flatnonzero(pages[:n] != mine[:n])
    if len(diff):
        return int(pages[diff[0]])
    return int(pages[n]) if len(pages) > n else int(mine[n])


def _check_swap_out(
    plan_id: int, move: RequestMove, held: Held | None, owner: dict[str, dict[int, str]]
) -> None:
    """Refuse a swap out of a request whose swapped data this worker holds (a flipped swap
    in, a replay), or into a page that holds another request's swapped data."""
    rid = move.request_id
    if held is not None:
        g = min(held)
        pages = held[g][1]
        raise PageOwnershipError(
            f"execute: swap-out plan {plan_id} swaps out request {rid!r}, "
            f"whose swapped data this worker holds in host pages "
            f"{pages.tolist()[:8]} of group {g!r} (a swap-in plan with its "
            "direction flipped, or a replay): its data would be overwritten; "
            "nothing moved",
            g,
            int(pages[0]) if len(pages) else -1,
        )
    for g, pages in move.host_pages.items():
        owners = owner.get(g, {})
        for p in np.asarray(pages).tolist():
            other = owners.get(p)
            if other is not None:
                raise PageOwnershipError(
                    f"execute: swap-out plan {plan_id} writes host page {p} "
                    f"of group {g!r} for request {rid!r}, but the page holds the "
                    f"swapped data of request {other!r}; nothing moved",
                    g,
                    p,
                )


def _check_swap_in(
    plan_id: int, move: RequestMove, held: Held | None, owner: dict[str, dict[int, str]]
) -> None:
    """Refuse a swap in that reads other pages, groups or block indices than the ones its
    request's swapped data is in."""
    rid = move.request_id
    if held is None:
        g = min(move.host_pages, default="")
        first = np.asarray(move.host_pages[g]) if g else np.zeros(0)
        raise PageOwnershipError(
            f"execute: swap-in plan {plan_id} reads host pages for request "
            f"{rid!r}, which has no swapped data on this worker (its swap out was "
            "never executed here, or its pages were released); nothing moved",
            g,
            int(first[0]) if len(first) else -1,
        )
    if set(held) != set(move.host_pages):
        raise PageOwnershipError(
            f"execute: swap-in plan {plan_id} reads groups "
            f"{sorted(move.host_pages)} for request {rid!r}, whose swapped data is in "
            f"groups {sorted(held)}; nothing moved",
            min(set(held) ^ set(move.host_pages)),
            -1,
        )
    for g, pages in move.host_pages.items():
        cols, mine = held[g]
        pages = np.asarray(pages)
        cols_in = np.asarray(move.block_indices[g])
        if len(pages) != len(mine) or not (pages == mine).all():
            bad = _first_difference(pages, mine)
            raise PageOwnershipError(
                f"execute: swap-in plan {plan_id} reads host page {bad} of group "
                f"{g!r} for request {rid!r}, but its swapped data is in pages "
                f"{mine.tolist()[:8]} (page {bad} holds the data of "
                f"{owner.get(g, {}).get(bad)!r}); nothing moved",
                g,
                bad,
            )
        if len(cols_in) != len(cols) or not (cols_in == cols).all():
            raise PageOwnershipError(
                f"execute: swap-in plan {plan_id} restores request {rid!r}'s "
                f"pages of group {g!r} at block indices {cols_in.tolist()[:8]}, but they "
                f"hold the blocks of indices {cols.tolist()[:8]}; nothing moved",
                g,
                int(mine[0]) if len(mine) else -1,
            )
