"""What one worker remembers of the steps it applied: how far it ran the sequence of steps,
which request each table row serves (and which tokens its latest step wrote there), and the
block copies those steps issued that have not run yet.

A step (:class:`~kvforge.core.values.StepEffects`: a scheduled step's, or a batch of effects
made between steps, see ``BlockManager.take_effects``) carries its own number (``step_id``,
1, 2, ...), so a worker applies each step once and in order, whatever it carries: a step of
page copies and no table delta is as protected as any other. A step's block copies
(``copies_before``, ``copies_after``) run by ``CacheStorage.copy_blocks`` (``copies_before``
at the end of ``CacheStorage.run``), possibly after later steps; each runs only if a step
this worker applied issued it, and only once.

Invariants (``tests/worker/test_step_ledger.py``):

- a step is applied at most once, in its sequence: a repeat, a gap or a step never handed out
  is refused (:class:`~kvforge.errors.StepOrderError`);
- a row serves one request from the step that names it until the row is emptied: a step that
  names another request at that row, or one request at two rows, is refused
  (:class:`~kvforge.errors.BlockOwnershipError`);
- ``copy_blocks`` runs a copy only as issued (group, source, destination and row as the step
  named them), once (:class:`~kvforge.errors.UnissuedCopyError`);
- a refused call changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from kvforge.core.values import BlockCopy, StepEffects, SwapPlan, TableDelta
from kvforge.errors import (
    BlockOwnershipError,
    StepOrderError,
    UnissuedCopyError,
    WorkerRefusedError,
)

__all__ = ["StepLedger"]

#: issued copies of steps this many steps older than the newest are forgotten (the
#: scheduler side drops an unended step after 16 newer ones)
KEEP_STEPS = 64

CopyKey = tuple[str, int]  # (group, destination block)


class StepLedger:
    """The next step number, the request of each row, and the issued copies not yet run.

    Args:
        num_rows: rows of the mirrored tables.

    >>> ledger = StepLedger(num_rows=4)
    >>> ledger.next_step
    1
    """

    def __init__(self, num_rows: int) -> None:
        self.next_step = 1
        self.row_request: list[str | None] = [None] * num_rows
        self.request_row: dict[str, int] = {}
        #: per row, ``(request_ids, num_computed, num_new)`` of the latest step that named
        #: the request in that row (what :meth:`first_written` reads)
        self.latest: list[tuple[tuple[str, ...], np.ndarray, np.ndarray] | None] = [None] * num_rows
        #: step id -> (request ids, copies_after) of applied steps whose snapshots have not
        #: run (``CacheStorage.run_snapshots`` / ``end_snapshots``), and the steps whose
        #: snapshots failed there
        self.snapshots_due: dict[int, tuple[tuple[str, ...], tuple[BlockCopy, ...]]] = {}
        self.snapshots_failed: set[int] = set()
        #: (group, dst) -> (src, row, step_id) of each issued copy not yet run
        self.issued: dict[CopyKey, tuple[int, int, int]] = {}
        self._by_step: OrderedDict[int, list[CopyKey]] = OrderedDict()

    # ------------------------------------------------------------------ steps

    def check(self, step: StepEffects) -> None:
        """Refuse ``step`` unless it is the next in the sequence and each of its requests is
        the one its row serves (after the rows this step's deltas empty)."""
        step_id = step.step_id
        if type(step_id) is not int or step_id != self.next_step:
            raise StepOrderError("apply", f"step {step_id!r}", self.next_step, step_id, "step", 1)
        ids = step.request_ids
        rows = step.rows.tolist() if len(step.rows) else []
        if len(ids) != len(rows):
            raise WorkerRefusedError(
                f"apply: step {step_id} names {len(ids)} requests and {len(rows)} rows; "
                "nothing changed"
            )
        owners = self.row_request
        if [owners[r] for r in rows] == list(ids):
            return  # every row serves the request the step names: the common case
        emptied = _emptied(step.table_deltas)
        seen: dict[str, int] = {}
        for request_id, row in zip(ids, rows, strict=True):
            holder = None if row in emptied else owners[row]
            where = self.request_row.get(request_id)
            if where in emptied:
                where = None
            if holder is not None and holder != request_id:
                raise BlockOwnershipError(
                    f"apply: step {step_id} names request {request_id!r} at row {row}, which "
                    f"serves request {holder!r}: its tokens would be written into another "
                    "request's blocks; nothing changed",
                    "",
                    -1,
                    row,
                    row,
                )
            if (where is not None and where != row) or seen.setdefault(request_id, row) != row:
                other = where if where is not None and where != row else seen[request_id]
                raise BlockOwnershipError(
                    f"apply: step {step_id} names request {request_id!r} at row {row}, but "
                    f"it is served by row {other}; nothing changed",
                    "",
                    -1,
                    row,
                    other,
                )

    def record(self, step: StepEffects) -> None:
        """``step`` (checked by :meth:`check`) was applied: number it, bind its rows, and
        keep its copies until they run. The rows its deltas empty serve no request first."""
        self.next_step += 1
        self.mirrored(step.table_deltas)
        if len(step.rows):
            owners, where, latest = self.row_request, self.request_row, self.latest
            written = (step.request_ids, step.num_computed, step.num_new)
            for request_id, row in zip(step.request_ids, step.rows.tolist(), strict=True):
                owners[row] = request_id
                where[request_id] = row
                latest[row] = written
        if step.copies_after:
            self._due(step)
        keys: list[CopyKey] = []
        for copy in (*step.copies_before, *step.copies_after):
            src, dst = np.asarray(copy.src).tolist(), np.asarray(copy.dst).tolist()
            for s, d in zip(src, dst, strict=True):
                key = (copy.group, d)
                self.issued[key] = (s, copy.row, step.step_id)
                keys.append(key)
        if keys:
            self._by_step[step.step_id] = keys
            while self._by_step and next(iter(self._by_step)) <= step.step_id - KEEP_STEPS:
                _, old = self._by_step.popitem(last=False)
                for key in old:
                    entry = self.issued.get(key)
                    if entry is not None and entry[2] <= step.step_id - KEEP_STEPS:
                        del self.issued[key]

    def _due(self, step: StepEffects) -> None:
        """Keep ``step``'s snapshots until they run; forget those of steps ``KEEP_STEPS``
        older (their copies are forgotten too)."""
        due = self.snapshots_due
        due[step.step_id] = (step.request_ids, step.copies_after)
        for old in [s for s in due if s <= step.step_id - KEEP_STEPS]:
            del due[old]

    def first_written(self, row: int, request_id: str, num_tokens: int) -> int:
        """The first token the latest step of ``request_id`` (in ``row``) wrote, when that
        step took it to ``num_tokens`` tokens (nothing moved it since); else ``num_tokens``.
        A per-request slot mapping gives a step's slots with it, as the step's own inputs
        did (window blocks a step writes stay held until the request's next step)."""
        record = self.latest[row] if 0 <= row < len(self.latest) else None
        if record is None or request_id not in record[0]:
            return num_tokens  # no step yet, or the step of a request that held the row before
        request_ids, num_computed, num_new = record
        i = request_ids.index(request_id)
        first = int(num_computed[i])
        if first + int(num_new[i]) != num_tokens:
            return num_tokens  # truncated since
        return first

    def swapped_in(self, plan: SwapPlan, tables: Mapping[str, np.ndarray]) -> None:
        """A swap in (checked against the mirror) filled a row per request: each row serves
        its request from now on, as if a step had named it there."""
        for move in plan.requests:
            for g, blocks in move.device_blocks.items():
                blocks, cols = np.asarray(blocks), np.asarray(move.block_indices[g])
                if not len(blocks):
                    continue
                rows = np.flatnonzero((tables[g][:, cols] == blocks).all(axis=1))
                if len(rows):
                    row = int(rows[0])
                    self.row_request[row] = move.request_id
                    self.request_row[move.request_id] = row
                break

    def mirrored(self, deltas: Sequence[TableDelta]) -> None:
        """``deltas`` were mirrored: the rows they empty (a finish, a swap out) serve no
        request now."""
        owners, where = self.row_request, self.request_row
        for row in _emptied(deltas):
            request_id = owners[row]
            if request_id is not None:
                owners[row] = None
                if where.get(request_id) == row:
                    del where[request_id]

    # ------------------------------------------------------------------ copies

    def check_copies(self, copies: Sequence[BlockCopy]) -> None:
        """Refuse the batch unless each copy is one an applied step issued and that has not
        run: the same group, sources, destinations and row."""
        taken: set[CopyKey] = set()
        for copy in copies:
            src, dst = np.asarray(copy.src).tolist(), np.asarray(copy.dst).tolist()
            for s, d in zip(src, dst, strict=True):
                key = (copy.group, d)
                entry = self.issued.get(key)
                if entry is None or key in taken or entry[0] != s or entry[1] != copy.row:
                    why = (
                        "no applied step issued it, or it already ran (a forged copy or a retry)"
                        if entry is None or key in taken
                        else f"step {entry[2]} issued block {entry[0]} to it for row "
                        f"{entry[1]}, not block {s} for row {copy.row}"
                    )
                    raise UnissuedCopyError(
                        f"copy_blocks: the copy into block {d} of group {copy.group!r}: {why}; "
                        "nothing was copied",
                        copy.group,
                        d,
                    )
                taken.add(key)

    def ran(self, copies: Sequence[BlockCopy]) -> None:
        """``copies`` (checked by :meth:`check_copies`) ran: none runs again."""
        for copy in copies:
            for d in np.asarray(copy.dst).tolist():
                self.issued.pop((copy.group, d), None)


def _emptied(deltas: Sequence[TableDelta]) -> set[int]:
    """The rows ``deltas`` empty."""
    rows: set[int] = set()
    seen = None
    for delta in deltas:
        clear = delta.clear_rows
        if len(clear) and clear is not seen:  # a finish shares one array among its groups
            rows.update(np.asarray(clear).tolist())
            seen = clear
    return rows
