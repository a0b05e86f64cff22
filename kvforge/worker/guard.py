"""What the worker side checks before it mirrors a table delta or moves a byte.

The worker trusts nothing it receives: a delta, a step, a copy or a swap plan may be replayed
by an RPC retry, reordered by a transport, come from another scheduler, or be forged. Every
check here runs before the first change, so a refused call leaves the mirrored tables and the
caches exactly as they were, and raises a :class:`~kvforge.errors.WorkerRefusedError`
subclass.

- :func:`check_deltas`: ``TableDelta.seq`` continues the worker's sequence (no gap, repeat or
  reordering); rows, columns and block ids lie within the table and the group's pool (``0``
  is allowed in a delta: it clears a cell). Range checks are one reduction per array.
- :func:`check_step`: a step's rows lie within the tables (a negative row would read another
  request's table row, and its kernels would write there).
- :func:`check_copies`: source and destination ids lie in ``[1, num_blocks)``; a destination
  is held by no mirrored row other than ``BlockCopy.row`` (none at all for ``-1``), by no row
  of another group of its shared pool, and lies in ``row`` when ``row >= 0``.
- :func:`check_page_copies`: the host tier's offloads and onloads (``PageCopy``): device
  blocks in ``[1, num_blocks)``, host tier pages in ``[1, num_pages)`` of a group that has
  them, one page per block; an onload writes each device block once.
- :func:`check_plan`: the plan id was never executed (:class:`PlanLedger`); device blocks,
  block indices and host pages are in range; every move's blocks are what one mirrored row
  holds at the move's indices; a swap in writes only blocks that are in its row and in no
  other row (shared blocks are read-only); a swap out reads a row that serves its own
  request (from the steps applied). Then the host pages, against the worker's own
  :class:`~kvforge.worker.swap_ledger.SwapLedger` of the swap outs it executed: a swap out
  writes no page holding swapped data, a swap in reads exactly its request's pages.

:class:`Verifier` holds what a worker remembers between calls (the next ``seq``, the plan
ids executed, the rows steps wrote since they were last emptied) and binds the checks to the
storage's tables. Costs: a step pays a few attribute reads per delta and one reduction per
array kind and group (the max of its values viewed unsigned, so a negative id reads as huge);
ownership costs a pass over a group's table (a boolean lookup per cell), paid only by the
copies and plans that write blocks, never by a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvforge.core.arena import ArenaGeometry
from kvforge.core.swap_receipt import plan_receipt
from kvforge.core.values import (
    FEW_CELLS,
    NO_CELLS,
    BlockCopy,
    PageCopy,
    RequestMove,
    StepEffects,
    SwapPlan,
    TableDelta,
)
from kvforge.errors import (
    BlockOwnershipError,
    BlockRangeError,
    DeltaOrderError,
    PlanReplayError,
    WorkerRefusedError,
)
from kvforge.worker.swap_ledger import SwapLedger, check_swap_out_rows

__all__ = [
    "PlanLedger",
    "Verifier",
    "check_copies",
    "check_deltas",
    "check_page_copies",
    "check_plan",
    "check_step",
]

_UNSIGNED = {
    np.dtype(np.int32): np.dtype(np.uint32),
    np.dtype(np.int64): np.dtype(np.uint64),
    np.dtype(np.int16): np.dtype(np.uint16),
    np.dtype(np.int8): np.dtype(np.uint8),
}


_EMPTY = np.zeros(0, dtype=np.int32)
_I32 = np.dtype(np.int32)
_U32 = np.dtype(np.uint32)
_MAX = np.maximum.reduce
_SMALL = 40  # up to this many values, a Python max of the list beats a ufunc reduction


def _top(arr: np.ndarray) -> int:
    """The largest value of a non-empty int32 array read as uint32 (negatives read as huge)."""
    u = arr.view(_U32)
    return max(u.tolist()) if len(u) <= _SMALL else int(_MAX(u))


def _ints(value: object, action: str, what: str) -> np.ndarray:
    """``value`` as a 1-d integer array (no copy for one); anything else is refused."""
    if type(value) is np.ndarray and value.dtype is _I32 and value.ndim == 1:
        return value  # the scheduler side's arrays: no further look
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise WorkerRefusedError(
            f"{action}: {what} must be a 1-d integer array, got {arr.dtype} of shape "
            f"{arr.shape}; nothing changed"
        )
    return arr


def _below(arr: np.ndarray, high: int) -> bool:
    """Every value of ``arr`` in ``[0, high)``: one reduction (negatives read as huge)."""
    if not len(arr):
        return True
    if arr.dtype is _I32:
        return _top(arr) < high
    unsigned = _UNSIGNED.get(arr.dtype)
    if unsigned is not None:
        return int(_MAX(arr.view(unsigned))) < high
    return int(arr.min()) >= 0 and int(arr.max()) < high


def _range(arr: np.ndarray, low: int, high: int, action: str, what: str, group: str) -> None:
    """Refuse the first value of ``arr`` outside ``[low, high)``."""
    if not len(arr):
        return
    ok = _below(arr, high) if low == 0 else int(arr.min()) >= low and int(arr.max()) < high
    if not ok:
        bad = arr[(arr < low) | (arr >= high)]
        raise BlockRangeError(action, what, group, int(bad[0]), low, high)


# ====================================================================== deltas and steps


def check_deltas(
    deltas: Sequence[TableDelta],
    next_seq: int,
    tables: Mapping[str, np.ndarray],
    num_blocks: Mapping[str, int],
) -> None:
    """Refuse the whole batch unless delta ``i`` has ``seq == next_seq + i`` and every row,
    column and block id lies within its table and pool (block id ``0`` clears a cell).

    A delta costs a few attribute reads; the range checks run once per group and array over
    the batch (one reduction each), however many deltas it holds. A step's few small deltas
    (a decode step of one request) are accepted in Python ints (:func:`_few_cells_fit`);
    anything they do not accept takes the checks below, which name what is refused."""
    if len(deltas) <= _FEW_DELTAS and _few_cells_fit(deltas, next_seq, tables, num_blocks):
        return
    _check_every_delta(deltas, next_seq, tables, num_blocks)


def _check_every_delta(
    deltas: Sequence[TableDelta],
    next_seq: int,
    tables: Mapping[str, np.ndarray],
    num_blocks: Mapping[str, int],
) -> None:
    """:func:`check_deltas` by array reductions, for any deltas: refuses the first bad one."""
    cells: dict[str, tuple[list[np.ndarray], ...]] = {}  # group -> clears, rows, cols, ids
    all_rows: list[np.ndarray] = []  # every clear and written row, of every group
    for i, delta in enumerate(deltas):
        if type(delta) is not TableDelta:
            raise WorkerRefusedError(
                f"apply_deltas: expected TableDelta values, got {type(delta).__name__}; "
                "nothing was mirrored"
            )
        seq, group = delta.seq, delta.group
        if seq != next_seq + i or type(seq) is not int:
            raise DeltaOrderError(next_seq + i, seq, group)
        acc = cells.get(group) if type(group) is str else None
        if acc is None:
            if type(group) is not str or group not in tables:
                raise WorkerRefusedError(
                    f"table delta for unknown group {group!r}; nothing was mirrored"
                )
            acc = cells[group] = ([], [], [], [])
        _collect(delta, acc, all_rows)
    _check_cells(cells, all_rows, tables, num_blocks)


_FEW_DELTAS = 8  # deltas of one request's step (a few groups)
_FEW_CELLS = FEW_CELLS  # cells (or cleared rows) of one such delta


def _few_cells_fit(
    deltas: Sequence[TableDelta],
    next_seq: int,
    tables: Mapping[str, np.ndarray],
    num_blocks: Mapping[str, int],
) -> bool:
    """Whether :func:`check_deltas` accepts ``deltas``, decided in Python ints for a few
    deltas of a few ``int32`` cells each; ``False`` (never a refusal) for anything else,
    which the full checks then decide and word. ``tests/worker/test_guard_few.py`` compares
    the two."""
    passed, passed_rows = None, -1  # the clear_rows last accepted, for tables of that many rows
    for i, delta in enumerate(deltas):
        if type(delta) is not TableDelta:
            return False
        group, seq = delta.group, delta.seq
        if type(group) is not str or type(seq) is not int or seq != next_seq + i:
            return False
        table = tables.get(group)
        if table is None:
            return False
        clear, rows, cols, ids = delta.clear_rows, delta.rows, delta.cols, delta.block_ids
        num_rows = table.shape[0]
        # a finish's deltas share one frozen clear_rows: looked at once per run of deltas
        # that share it (the same object read again here, tables of as many rows)
        if clear is not passed or num_rows != passed_rows:
            if type(clear) is not np.ndarray or clear.dtype is not _I32 or clear.ndim != 1:
                return False
            if len(clear):
                if len(clear) > _FEW_CELLS:
                    return False
                listed = clear.tolist()
                if min(listed) < 0 or max(listed) >= num_rows:
                    return False
            passed, passed_rows = clear, num_rows
        if rows is NO_CELLS and cols is NO_CELLS and ids is NO_CELLS:
            continue  # it only clears rows (the one frozen empty array): nothing more to see
        if not (
            type(rows) is type(cols) is type(ids) is np.ndarray
            and rows.dtype is cols.dtype is ids.dtype is _I32
            and rows.ndim == cols.ndim == ids.ndim == 1
        ):
            return False
        n = len(rows)
        if n > _FEW_CELLS or len(cols) != n or len(ids) != n:
            return False
        if n:
            r, c, b = rows.tolist(), cols.tolist(), ids.tolist()
            if min(r) < 0 or max(r) >= num_rows or min(c) < 0 or max(c) >= table.shape[1]:
                return False
            if min(b) < 0 or max(b) >= num_blocks[group]:
                return False
    return True


def _collect(
    delta: TableDelta, acc: tuple[list[np.ndarray], ...], all_rows: list[np.ndarray]
) -> None:
    """Add ``delta``'s clears, rows, columns and ids (as int arrays of matching lengths) to
    its group's ``acc``, and its rows to ``all_rows``."""
    action, group = "apply_deltas", delta.group
    clear = delta.clear_rows
    if len(clear):
        clear = _ints(clear, action, "clear_rows")
        acc[0].append(clear)
        all_rows.append(clear)
    rows, cols, ids = delta.rows, delta.cols, delta.block_ids
    n = len(rows)
    if n or len(cols) or len(ids):
        # the scheduler side's int32 arrays need no further look
        if not (type(rows) is type(cols) is type(ids) is np.ndarray
                and rows.dtype is cols.dtype is ids.dtype is _I32
                and rows.ndim == cols.ndim == ids.ndim == 1):  # fmt: skip
            rows = _ints(rows, action, "rows")
            cols = _ints(cols, action, "cols")
            ids = _ints(ids, action, "block_ids")
        if len(cols) != n or len(ids) != n:
            raise WorkerRefusedError(
                f"{action}: delta of group {group!r} has {n} rows, {len(cols)} cols and "
                f"{len(ids)} block ids; nothing was mirrored"
            )
        acc[1].append(rows)
        acc[2].append(cols)
        acc[3].append(ids)
        all_rows.append(rows)


def _check_cells(
    cells: Mapping[str, tuple[list[np.ndarray], ...]],
    all_rows: list[np.ndarray],
    tables: Mapping[str, np.ndarray],
    num_blocks: Mapping[str, int],
) -> None:
    """Refuse a row, column or block id :func:`_collect` gathered outside its table or pool.

    Every array listed is non-empty. The rows of all groups first, against the fewest rows
    of a table; only when that fails (or a dtype is not int32) per group, in order, which
    names the first bad value as the per-group checks always did."""
    rows_ok = True
    if all_rows:
        fewest = min(tables[group].shape[0] for group in cells)
        for arr in all_rows:
            if arr.dtype is not _I32 or _top(arr) >= fewest:
                rows_ok = False
                break
    for group, (clears, rows, cols, ids) in cells.items():
        num_rows, width = tables[group].shape
        if not rows_ok:
            _within(clears, num_rows, "row", group)
            _within(rows, num_rows, "row", group)
        if cols:
            _within(cols, width, "column", group)
            _within(ids, num_blocks[group], "block id", group)


def _within(arrays: list[np.ndarray], high: int, what: str, group: str) -> None:
    """Refuse a value of ``arrays`` outside ``[0, high)``: an int32 array in range costs one
    reduction; anything else goes through :func:`_range`, which names the bad value."""
    if arrays:
        arr = arrays[0] if len(arrays) == 1 else _cat(arrays)
        if arr.dtype is not _I32 or _top(arr) >= high:
            _range(arr, 0, high, "apply_deltas", what, group)


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    """One array of ``arrays`` (int64 when their dtypes differ: a huge unsigned value wraps
    negative, and is refused as such)."""
    if len(arrays) == 1:
        return arrays[0]
    if not arrays:
        return _EMPTY
    if any(a.dtype != arrays[0].dtype for a in arrays):
        arrays = [a.astype(np.int64) for a in arrays]
    return np.concatenate(arrays)


def check_step(step: StepEffects, num_rows: int) -> None:
    """Refuse a step whose rows lie outside the tables (before any delta is mirrored)."""
    if type(step) is not StepEffects:
        raise WorkerRefusedError(
            f"apply: expected a StepEffects (StepAllocation.effects), got "
            f"{type(step).__name__}; nothing changed"
        )
    rows = step.rows
    n = len(rows)
    if len(step.num_computed) != n or len(step.num_new) != n:
        raise WorkerRefusedError(
            f"apply: a step of {n} rows has {len(step.num_computed)} num_computed and "
            f"{len(step.num_new)} num_new; nothing changed"
        )
    fast = type(rows) is np.ndarray and rows.dtype is _I32 and rows.ndim == 1
    if fast and (not n or _top(rows) < num_rows):  # one reduction, the common case
        return
    _range(_ints(rows, "apply", "rows"), 0, num_rows, "apply", "row", "")


# ====================================================================== copies


def check_copies(
    copies: Sequence[BlockCopy],
    tables: Mapping[str, np.ndarray],
    num_blocks: Mapping[str, int],
    pool_mates: Mapping[str, tuple[str, ...]],
) -> None:
    """Refuse the whole batch unless every copy writes only blocks its row may write.

    ``pool_mates[g]``: the other groups of ``g``'s shared pool (their rows hold none of
    ``g``'s blocks, so a destination must lie in none of them)."""
    action = "copy_blocks"
    for copy in copies:
        if type(copy) is not BlockCopy:
            raise WorkerRefusedError(
                f"{action}: expected BlockCopy values, got {type(copy).__name__}; nothing "
                "was copied"
            )
        group, row = copy.group, copy.row
        table = tables.get(group)
        if table is None:
            raise WorkerRefusedError(f"{action}: unknown group {group!r}; nothing was copied")
        src = _ints(copy.src, action, "src")
        dst = _ints(copy.dst, action, "dst")
        if len(src) != len(dst):
            raise WorkerRefusedError(
                f"{action}: copy of group {group!r} has {len(src)} sources and {len(dst)} "
                "destinations; nothing was copied"
            )
        if not len(dst):
            continue
        nb = num_blocks[group]
        _range(src, 1, nb, action, "block id", group)
        _range(dst, 1, nb, action, "block id", group)
        num_rows = table.shape[0]
        if type(row) is not int or not -1 <= row < num_rows:
            raise BlockRangeError(action, "row", group, row, -1, num_rows)  # type: ignore[arg-type]
        if len(np.unique(dst)) != len(dst):
            raise WorkerRefusedError(
                f"{action}: copy of group {group!r} writes a block twice ({dst.tolist()}); "
                "nothing was copied"
            )
        mark = np.zeros(nb, dtype=bool)
        mark[dst] = True
        if row >= 0:
            mine = table[row]
            missing = ~np.isin(dst, mine)
            if missing.any():
                block = int(dst[missing][0])
                raise BlockOwnershipError(
                    f"{action}: block {block} of group {group!r} is not in row {row}, which "
                    "the copy writes for; nothing was copied",
                    group,
                    block,
                    row,
                    -1,
                )
        _refuse_held(mark, table, row, group, action, "the copy")
        for mate in pool_mates.get(group, ()):
            _refuse_held(mark, tables[mate], -1, mate, action, "the copy")


def check_page_copies(
    offloads: Sequence[PageCopy],
    onloads: Sequence[PageCopy],
    num_blocks: Mapping[str, int],
    num_pages: Mapping[str, int],
) -> None:
    """Refuse the whole batch of host tier copies unless every one is a :class:`PageCopy` of
    a group with host tier pages, with as many device blocks as pages, every device block in
    ``[1, num_blocks)`` and every page in ``[1, num_pages)``, and no device block written
    twice by the onloads of one group."""
    action = "HostTierPages.move"
    written: dict[str, list[np.ndarray]] = {}
    for kind, copies in (("offload", offloads), ("onload", onloads)):
        if isinstance(copies, PageCopy) or not isinstance(copies, Sequence):
            raise WorkerRefusedError(
                f"{action}: {kind}s must be a sequence of PageCopy, got "
                f"{type(copies).__name__}; nothing moved"
            )
        for copy in copies:
            if type(copy) is not PageCopy:
                raise WorkerRefusedError(
                    f"{action}: expected PageCopy values, got {type(copy).__name__}; nothing moved"
                )
            group = copy.group
            if not isinstance(group, str) or group not in num_pages or group not in num_blocks:
                raise WorkerRefusedError(
                    f"{action}: {kind} of group {group!r}, which has no host tier pages "
                    f"(groups with them: {sorted(num_pages)}); nothing moved"
                )
            blocks = _ints(copy.device_blocks, action, "device_blocks")
            pages = _ints(copy.host_pages, action, "host_pages")
            if len(blocks) != len(pages):
                raise WorkerRefusedError(
                    f"{action}: {kind} of group {group!r} names {len(blocks)} device blocks "
                    f"and {len(pages)} host pages; nothing moved"
                )
            _range(blocks, 1, num_blocks[group], action, "block id", group)
            _range(pages, 1, num_pages[group], action, "host page", group)
            if kind == "onload":
                written.setdefault(group, []).append(blocks)
    for group, arrays in written.items():
        blocks = np.concatenate(arrays)
        if len(np.unique(blocks)) != len(blocks):
            raise WorkerRefusedError(
                f"{action}: the onloads of group {group!r} write a device block twice "
                f"({blocks.tolist()}); nothing moved"
            )


def _refuse_held(
    mark: np.ndarray, table: np.ndarray, own: int | np.ndarray, group: str, action: str, what: str
) -> None:
    """Refuse when a block marked in ``mark`` lies in a row of ``table`` other than ``own``
    (``-1``: no row may hold one; an array: the one row each block may lie in, ``+1``)."""
    hit = mark[table]
    if isinstance(own, np.ndarray):
        allowed = (np.arange(table.shape[0], dtype=own.dtype) + 1)[:, None]
        hit = hit & (own[table] != allowed)
    elif own >= 0:
        hit[own] = False
    if not hit.any():
        return
    holder, col = (int(x[0]) for x in np.nonzero(hit))
    block = int(table[holder, col])
    row = int(own[block]) - 1 if isinstance(own, np.ndarray) else own
    raise BlockOwnershipError(
        f"{action}: block {block} of group {group!r} is held by row {holder} (column {col}), "
        f"which {what} does not write for: another request's blocks are read-only; "
        "nothing changed",
        group,
        block,
        row,
        holder,
    )


def _refuse_onload_into_held(
    mark: np.ndarray, table: np.ndarray, group: str, deltas: Sequence[TableDelta]
) -> None:
    """Refuse when a block marked in ``mark`` lies in a cell of ``table`` that still holds it
    once ``deltas`` are mirrored (a cell they empty, or fill with another block, no longer
    holds it when the step's kernels run; one they write the same block back into does)."""
    hit = mark[table]
    if not hit.any():
        return
    mine = [d for d in deltas if d.group == group]
    if mine:
        after = table.copy()
        for delta in mine:
            delta.apply(after)
        hit &= after == table
    if hit.any():
        holder, col = (int(x[0]) for x in np.nonzero(hit))
        block = int(table[holder, col])
        raise BlockOwnershipError(
            f"HostTierPages.move: an onload writes block {block} of group {group!r}, which row "
            f"{holder} holds (column {col}): another request's blocks are read-only; nothing "
            "moved",
            group,
            block,
            -1,
            holder,
        )


# ====================================================================== plans


class PlanLedger:
    """The plan ids a worker executed, so that none runs twice.

    Ids are remembered in a set; past ``keep`` ids the oldest half folds into a floor (every
    id at or below it counts as executed), so memory stays bounded while plans that arrive
    out of order within the last ``keep`` are still told apart.
    """

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._ids: set[int] = set()
        self._floor = 0  # plan ids start at 1

    def check(self, plan_id: object) -> None:
        if type(plan_id) is not int:
            raise WorkerRefusedError(
                f"execute: plan_id must be an int, got {plan_id!r}; nothing moved"
            )
        if plan_id in self._ids:
            raise PlanReplayError(plan_id, "was already executed by this worker (a replay)")
        if plan_id <= self._floor:
            raise PlanReplayError(
                plan_id,
                f"is not above {self._floor}: plan ids start at 1 and every id up to "
                f"{self._floor} counts as executed (a replay, or older than the last "
                f"{self.keep} plans)",
            )

    def record(self, plan_id: int) -> None:
        self._ids.add(plan_id)
        if len(self._ids) > 2 * self.keep:
            oldest = sorted(self._ids)[: self.keep]
            self._floor = max(self._floor, oldest[-1])
            self._ids.difference_update(oldest)

    def __contains__(self, plan_id: object) -> bool:
        return plan_id in self._ids or (type(plan_id) is int and plan_id <= self._floor)


def check_plan(
    plan: SwapPlan,
    ledger: PlanLedger,
    tables: Mapping[str, np.ndarray],
    num_blocks: Mapping[str, int],
    pool_mates: Mapping[str, tuple[str, ...]],
    num_pages: Mapping[str, int],
    stepped: np.ndarray | None = None,
) -> None:
    """Refuse a plan unless it is new, in range and owned (see the module docstring).

    ``num_pages``: host pages per offloaded group (the null page 0 included). ``stepped``:
    ``bool [rows]``, the rows a step wrote since they were last emptied; a swap in writes
    fresh rows only (its row was emptied, then filled by the plan's own deltas)."""
    action = "execute"
    if plan.direction not in ("out", "in"):
        raise WorkerRefusedError(
            f"{action}: direction must be 'out' or 'in', got {plan.direction!r}; nothing moved"
        )
    ledger.check(plan.plan_id)
    groups = tuple(plan.groups)
    if len(set(groups)) != len(groups):
        raise WorkerRefusedError(f"{action}: plan groups {groups} repeat one; nothing moved")
    for g in groups:
        if g not in tables or g not in num_pages:
            raise WorkerRefusedError(
                f"{action}: plan moves group {g!r}, which has no offloaded planes or host "
                "pages here; nothing moved"
            )
    per_move = [_move_arrays(move, groups, tables, num_blocks, num_pages) for move in plan.requests]
    _refuse_double_writes(plan, groups, per_move)
    rows = [
        _row_of(move, arrays, tables, action)
        for move, arrays in zip(plan.requests, per_move, strict=True)
    ]
    if plan.direction == "in":
        _check_swap_in(plan, per_move, rows, tables, num_blocks, pool_mates, stepped, action)


def _move_arrays(
    move: RequestMove,
    groups: tuple[str, ...],
    tables: Mapping[str, np.ndarray],
    num_blocks: Mapping[str, int],
    num_pages: Mapping[str, int],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A move's ``group -> (device blocks, block indices)``, once its groups are the plan's
    and its blocks, indices and host pages are ints of matching lengths, in range."""
    action = "execute"
    if type(move) is not RequestMove:
        raise WorkerRefusedError(
            f"{action}: expected RequestMove values, got {type(move).__name__}; nothing moved"
        )
    keys = set(move.device_blocks)
    if keys != set(move.host_pages) or keys != set(move.block_indices):
        raise WorkerRefusedError(
            f"{action}: request {move.request_id!r} names groups {sorted(keys)} for device "
            f"blocks, {sorted(move.block_indices)} for indices and "
            f"{sorted(move.host_pages)} for host pages; nothing moved"
        )
    if not keys <= set(groups):
        raise WorkerRefusedError(
            f"{action}: request {move.request_id!r} moves groups "
            f"{sorted(keys - set(groups))} the plan does not list; nothing moved"
        )
    arrays = {}
    for g in keys:
        blocks = _ints(move.device_blocks[g], action, "device_blocks")
        cols = _ints(move.block_indices[g], action, "block_indices")
        pages = _ints(move.host_pages[g], action, "host_pages")
        if not len(blocks) == len(cols) == len(pages):
            raise WorkerRefusedError(
                f"{action}: request {move.request_id!r} has {len(blocks)} device blocks, "
                f"{len(cols)} indices and {len(pages)} host pages in group {g!r}; "
                "nothing moved"
            )
        _range(blocks, 1, num_blocks[g], action, "block id", g)
        _range(cols, 0, tables[g].shape[1], action, "column", g)
        _range(pages, 1, num_pages[g], action, "host page", g)
        arrays[g] = (blocks, cols)
    return arrays


def _refuse_double_writes(
    plan: SwapPlan,
    groups: tuple[str, ...],
    per_move: list[dict[str, tuple[np.ndarray, np.ndarray]]],
) -> None:
    """Refuse a plan that writes a host page (or, swapping in, a device block) twice."""
    for g in groups:
        pages = [np.asarray(m.host_pages[g]) for m in plan.requests if g in m.host_pages]
        written = (
            [pages] if plan.direction == "out" else [pages, [a[g][0] for a in per_move if g in a]]
        )
        for arrays, what in zip(written, ("host page", "block"), strict=False):
            flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
            if len(np.unique(flat)) != len(flat):
                raise WorkerRefusedError(
                    f"execute: the plan writes a {what} of group {g!r} twice; nothing moved"
                )


def _row_of(
    move: RequestMove,
    arrays: Mapping[str, tuple[np.ndarray, np.ndarray]],
    tables: Mapping[str, np.ndarray],
    action: str,
) -> int:
    """The mirrored row that holds every block of ``move`` at the move's indices (the
    lowest if several share them all), ``-1`` for a move of no block."""
    candidates: np.ndarray | None = None
    for g, (blocks, cols) in sorted(arrays.items()):
        if not len(blocks):
            continue
        same = (tables[g][:, cols] == blocks).all(axis=1)
        candidates = same if candidates is None else candidates & same
        if not candidates.any():
            raise BlockOwnershipError(
                f"{action}: request {move.request_id!r}: no mirrored row holds its blocks "
                f"{blocks.tolist()[:8]} of group {g!r} at indices {cols.tolist()[:8]} (a plan "
                "of another scheduler, a forged plan, or deltas not mirrored before the "
                "plan); nothing moved",
                g,
                int(blocks[0]),
                -1,
                -1,
            )
    return -1 if candidates is None else int(np.flatnonzero(candidates)[0])


def _check_swap_in(
    plan: SwapPlan,
    per_move: list[dict[str, tuple[np.ndarray, np.ndarray]]],
    rows: list[int],
    tables: Mapping[str, np.ndarray],
    num_blocks: Mapping[str, int],
    pool_mates: Mapping[str, tuple[str, ...]],
    stepped: np.ndarray | None,
    action: str,
) -> None:
    """A swap in writes its blocks: each in its request's row and in no other row, and that
    row is fresh (no step wrote it since it was emptied: it holds no running request)."""
    used = [r for r in rows if r >= 0]
    for move, arrays, row in zip(plan.requests, per_move, rows, strict=True):
        if row >= 0 and stepped is not None and stepped[row]:
            g = next(k for k in sorted(arrays) if len(arrays[k][0]))
            block = int(arrays[g][0][0])
            raise BlockOwnershipError(
                f"{action}: request {move.request_id!r}: its blocks are those of row {row}, "
                "which a step wrote since the row was last emptied (a running request's "
                "row, not one a swap in just filled); nothing moved",
                g,
                block,
                row,
                row,
            )
    if len(set(used)) != len(used):
        raise WorkerRefusedError(
            f"{action}: two requests of swap-in plan {plan.plan_id} resolve to one table row "
            f"({rows}); nothing moved"
        )
    for g in plan.groups:
        owner = np.zeros(num_blocks[g], dtype=np.int32)  # block -> its row + 1
        for arrays, row in zip(per_move, rows, strict=True):
            if g in arrays:
                owner[arrays[g][0]] = row + 1
        _refuse_held(owner.astype(bool), tables[g], owner, g, action, "the swap in")
        for mate in pool_mates.get(g, ()):
            _refuse_held(owner.astype(bool), tables[mate], -1, mate, action, "the swap in")


# ====================================================================== the worker's memory


class Verifier:
    """What one worker verified so far, and the checks bound to its tables and pools.

    It remembers the next ``TableDelta.seq``, the plan ids executed (:class:`PlanLedger`)
    and the rows a step wrote since they were last emptied (a swap in writes only fresh
    rows). The rows of recent steps are folded in lazily, before a clear, a plan, or every
    64 steps, so a step pays a list append, not an array write.

    Args:
        tables: group -> the mirrored table (the storage's own arrays, read live).
        num_blocks: group -> blocks of its pool.
        pool_mates: group -> the other groups of its shared pool.
    """

    def __init__(
        self,
        tables: Mapping[str, np.ndarray],
        num_blocks: Mapping[str, int],
        pool_mates: Mapping[str, tuple[str, ...]],
        arena: ArenaGeometry | None = None,
    ) -> None:
        self.tables, self.num_blocks, self.pool_mates = tables, num_blocks, pool_mates
        self.arena = arena
        self.num_rows = next(iter(tables.values())).shape[0] if tables else 0
        self.next_seq = 0
        self.plans = PlanLedger()
        self.swaps = SwapLedger()  # which swap pages hold which swapped request's data
        self._stepped = np.zeros(self.num_rows, dtype=bool)
        self._step_rows: list[tuple[np.ndarray, bool]] = []

    def deltas(self, deltas: Sequence[TableDelta]) -> None:
        check_deltas(deltas, self.next_seq, self.tables, self.num_blocks)

    def step(self, step: StepEffects) -> None:
        check_step(step, self.num_rows)
        check_deltas(step.table_deltas, self.next_seq, self.tables, self.num_blocks)

    def mirrored(self, deltas: Sequence[TableDelta]) -> None:
        """Deltas checked by :meth:`deltas` were mirrored: count them, forget emptied rows."""
        clears = [delta.clear_rows for delta in deltas if len(delta.clear_rows)]
        if clears:  # logged in order with the steps (a copy: the caller keeps its arrays)
            first = clears[0]
            # one row cleared in every group (a finish) shares one array: log it once
            same = all(clear is first for clear in clears)
            self._log_rows(first.copy() if same else np.concatenate(clears), False)
        self.next_seq += len(deltas)

    def stepped(self, rows: np.ndarray) -> None:
        """A step (checked by :meth:`step`) will write ``rows``."""
        self._log_rows(rows, True)

    def _log_rows(self, rows: np.ndarray, stepped: bool) -> None:
        """Rows that stepped (True) or were emptied (False), folded into ``_stepped`` in
        order when a plan is checked or the log grows long."""
        self._step_rows.append((rows, stepped))
        if len(self._step_rows) >= 64:
            self._fold()

    def copies(self, copies: Sequence[BlockCopy]) -> None:
        check_copies(copies, self.tables, self.num_blocks, self.pool_mates)
        for copy in copies:
            self._arena_writes(copy.group, np.asarray(copy.dst), "copy_blocks", "the copy")

    def page_copies(
        self,
        offloads: Sequence[PageCopy],
        onloads: Sequence[PageCopy],
        num_pages: Mapping[str, int],
        deltas: Sequence[TableDelta] = (),
    ) -> None:
        """Check host tier copies (:func:`check_page_copies`), and that an onload writes only
        blocks that no mirrored row holds (nor a row of its pool's other groups, nor, in an
        arena, a slab another group's row holds) once ``deltas``, the step's own table
        changes mirrored right after its copies, empty or overwrite their cells."""
        check_page_copies(offloads, onloads, self.num_blocks, num_pages)
        for copy in onloads:
            blocks = np.asarray(copy.device_blocks)
            if not len(blocks):
                continue
            mark = np.zeros(self.num_blocks[copy.group], dtype=bool)
            mark[blocks] = True
            for group in (copy.group, *self.pool_mates.get(copy.group, ())):
                _refuse_onload_into_held(mark, self.tables[group], group, deltas)
            self._arena_writes(copy.group, blocks, "HostTierPages.move", "an onload")

    def _arena_writes(self, group: str, blocks: np.ndarray, action: str, what: str) -> None:
        """Refuse a write to blocks of arena group ``group`` whose slab holds a block another
        arena group's row holds: the slab is that group's, its bytes another request's."""
        arena = self.arena
        if arena is None or group not in arena.groups or not len(blocks):
            return
        k = arena.blocks_per_slab[arena.groups.index(group)]
        slabs = np.zeros(arena.num_slabs + 1, dtype=bool)  # the whole slabs and the tail
        slabs[blocks.astype(np.int64) // k] = True
        for other, k_other in zip(arena.groups, arena.blocks_per_slab, strict=True):
            if other == group:
                continue
            table = self.tables[other]
            hit = slabs[table // k_other] & (table != 0)
            if hit.any():
                holder, col = (int(x[0]) for x in np.nonzero(hit))
                block = int(table[holder, col])
                raise BlockOwnershipError(
                    f"{action}: a block {what} writes in group {group!r} lies in slab "
                    f"{block // k_other} of the arena, which holds block {block} of group "
                    f"{other!r} in row {holder} (column {col}): another request's bytes; "
                    "nothing changed",
                    other,
                    block,
                    -1,
                    holder,
                )

    def plan(
        self,
        plan: SwapPlan,
        num_pages: Mapping[str, int],
        row_request: Sequence[str | None] | None = None,
    ) -> None:
        """Check ``plan``, then remember its id: from here on its bytes may move.
        ``row_request``: the request each row serves, from the steps applied; a swap out
        reads a row that serves its own request
        (:func:`~kvforge.worker.swap_ledger.check_swap_out_rows`)."""
        self._fold()
        check_plan(
            plan,
            self.plans,
            self.tables,
            self.num_blocks,
            self.pool_mates,
            num_pages,
            self._stepped,
        )
        if plan.direction == "out" and row_request is not None:
            check_swap_out_rows(plan, self.tables, row_request)
        pending = self.swaps.check(plan, num_pages)  # the pages, against what it executed
        if plan.direction == "in":
            for move in plan.requests:
                for g, blocks in move.device_blocks.items():
                    self._arena_writes(g, np.asarray(blocks), "execute", "the swap in")
        self.plans.record(plan.plan_id)
        self.swaps.accept(pending)

    def executed(self, plan: SwapPlan) -> bytes:
        """``plan`` (checked by :meth:`plan`) ran without a fault: record a swap out's pages
        in the swap ledger; return the receipt the scheduler side checks."""
        self.swaps.executed(plan)
        return plan_receipt(plan)

    def _fold(self) -> None:
        log, i = self._step_rows, 0
        while i < len(log):  # each run of one kind in one write, runs in log order
            value, j = log[i][1], i + 1
            while j < len(log) and log[j][1] is value:
                j += 1
            self._stepped[np.concatenate([r for r, _ in log[i:j]]).astype(np.intp)] = value
            i = j
        log.clear()
