"""The scheduler side: block pools, persistent block tables, windows and swap bookkeeping.

:class:`BlockManager` holds no device memory and no torch tensor. It decides which blocks
every request holds and returns plain values (:mod:`kvforge.cache_controller.values`) that a
worker process applies to its device caches. One call per engine step grows every scheduled
request (:meth:`BlockManager.schedule`); the cost of that call depends on the tokens scheduled
in the step, never on the tokens a request already holds.

Block tables are arrays: per group one ``int32 [max_num_seqs, max_blocks_per_req]`` table,
one row per running request, updated in place. A request of ``n`` tokens uses columns
``0 .. cdiv(n, block_size) - 1``; a window group keeps ``NULL_BLOCK`` in the columns it has
released::

    sliding window W = 128, block 64, after a step that took the request to 300 tokens
    col:    0      1      2      3      4
          | null | null |  17  |  18  |  22  |      tokens 128..299 still held
                          ^ held_from

Stages of :meth:`BlockManager.schedule` (all on arrays, per group):

1. *release*: blocks wholly before the first token the step's kernels read go back to the
   pool: for a window of ``W`` tokens that is ``num_computed + 1 - W`` (the first scheduled
   token reads ``W - 1`` tokens back); for a chunked group the start of the first scheduled
   token's chunk. Blocks that slide out *during* the step stay until the request's next step,
   because the kernel writes the whole chunk before it reads it: a 512-token prefill chunk
   through a 128-token window holds slots for all 512 tokens.
2. *grow*: new blocks for columns ``cdiv(num_computed, B) .. cdiv(num_computed + num_new, B)``.
3. *record*: the cells written in 1 and 2 become one :class:`TableDelta` per group.

Invariants (tested in ``tests/test_block_manager.py``):

- a table row holds exactly the blocks the pool counts as used by its request; every block
  id outside ``[held_from, cdiv(num_tokens, B))`` of a row is ``NULL_BLOCK``;
- a refused request of a step changes nothing; the others proceed;
- every public method is serialised by one lock: the scheduler side may be called from
  several threads, and the worker side (a different object) runs concurrently with it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from kvforge.cache_controller.block_pool import NULL_BLOCK, BlockPool
from kvforge.cache_controller.layout import CacheLayout
from kvforge.cache_controller.memory_plan import check_allocatable
from kvforge.cache_controller.values import (
    Refusal,
    RequestMove,
    StepAllocation,
    SwapPlan,
    SwapResult,
    TableDelta,
)
from kvforge.errors import OutOfBlocksError, RequestStateError
from kvforge.specs import CacheGroup, SwapPurpose, TokenRange

__all__ = [
    "DEFAULT_MAX_NUM_SEQS",
    "BlockManager",
    "SwapStats",
    "check_request_id",
    "held_blocks",
    "live_start",
]

DEFAULT_MAX_NUM_SEQS = 256
#: Table width (tokens) used when no ``max_model_len`` is given and no full group bounds it.
DEFAULT_WINDOWED_MAX_MODEL_LEN = 1 << 17

_FULL, _WINDOW, _CHUNKED, _PER_REQUEST = 0, 1, 2, 3
_KIND_CODES = {
    "full": _FULL,
    "sliding_window": _WINDOW,
    "state": _WINDOW,
    "chunked": _CHUNKED,
    "per_request": _PER_REQUEST,
}

_T = TypeVar("_T")


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise RequestStateError(f"request_id must be a non-empty str, got {request_id!r}")
    return request_id


def live_start(group: CacheGroup, num_computed: int, num_tokens: int | None = None) -> int:
    """First token a step's kernels may still read, for a request that held ``num_computed``
    tokens before the step (``num_tokens`` after it; only the resting state of a request that
    is not running a step, ``num_computed == num_tokens``, uses the plain window).

    The one source of truth for "which blocks does a request hold live in a group": a request
    holds block ``i`` of a non-per-request group exactly when
    ``live_start(...) // block_size <= i < cdiv(num_tokens, block_size)``.

    >>> from kvforge.specs import CacheGroup
    >>> swa = CacheGroup(name="swa", block_size=64, kind="sliding_window", window=128)
    >>> live_start(swa, 0, 512)        # a 512-token first chunk: every token is written
    0
    >>> live_start(swa, 511, 512)      # a decode step: token 511 reads tokens 384..511
    384
    >>> live_start(swa, 512)           # at rest after 512 tokens: the last 128
    384
    """
    code = _KIND_CODES[group.kind.value]
    if code in (_FULL, _PER_REQUEST):
        return 0
    if num_tokens is None or num_tokens == num_computed:
        first_read = max(0, num_computed - 1)  # at rest: the newest token's view
    else:
        first_read = num_computed  # the first scheduled token's view
    window = int(group.window or 0)
    if code == _WINDOW:
        return max(0, first_read + 1 - window)
    return (first_read // window) * window


def held_blocks(group: CacheGroup, num_computed: int, num_tokens: int) -> int:
    """Blocks a request holds in ``group`` once a step took it from ``num_computed`` to
    ``num_tokens`` tokens (``num_computed == num_tokens``: between steps).

    >>> from kvforge.specs import CacheGroup
    >>> swa = CacheGroup(name="swa", block_size=64, kind="sliding_window", window=128)
    >>> held_blocks(swa, 0, 512), held_blocks(swa, 512, 513), held_blocks(swa, 513, 513)
    (8, 4, 3)
    """
    code = _KIND_CODES[group.kind.value]
    if code == _PER_REQUEST:
        return _slots(group)
    end = -(-num_tokens // group.block_size)
    return end - live_start(group, num_computed, num_tokens) // group.block_size


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
class _Group:
    """Per-group scheduler state: the spec, its pool, its table and per-row extents."""

    spec: CacheGroup
    code: int
    block_size: int
    window: int
    slots: int
    pool: BlockPool
    table: np.ndarray  # int32 [max_num_seqs, width]
    held_from: np.ndarray  # int64 [max_num_seqs]: first column that may hold a block


@dataclass
class _Swapped:
    """A request whose blocks live in host pages."""

    num_tokens: int
    purpose: SwapPurpose
    block_indices: dict[str, np.ndarray]
    host_pages: dict[str, np.ndarray]


@dataclass
class _InFlight:
    """A swap plan handed to the worker side and not yet completed."""

    plan: SwapPlan
    rows: dict[str, int]  # swap in: rows adopted for the plan


def _expand(rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, ...]:
    """Cells ``(row, col)`` for ``col`` in ``[start[i], end[i])`` of each ``rows[i]``.

    >>> r, c = _expand(np.array([3, 5]), np.array([0, 7]), np.array([2, 9]))
    >>> r.tolist(), c.tolist()
    ([3, 3, 5, 5], [0, 1, 7, 8])
    """
    counts = end - start
    total = int(counts.sum())
    r = np.repeat(rows, counts)
    firsts = np.cumsum(counts) - counts
    c = np.repeat(start - firsts, counts) + np.arange(total)
    return r, c


def _locked(method: Callable[..., _T]) -> Callable[..., _T]:
    def wrapper(self: BlockManager, *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__qualname__ = method.__qualname__
    wrapper.__doc__ = method.__doc__
    return wrapper


def _int_arg(name: str, value: object, low: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


class BlockManager:
    """Pools, tables and swap bookkeeping of every group; no device memory.

    Args:
        layout: the model's :class:`CacheLayout` (declarations only).
        num_blocks: physical blocks per group, the null block included (from a
            :class:`~kvforge.cache_controller.memory_plan.MemoryPlan`).
        max_num_seqs: table rows: requests that may hold device blocks at once.
        max_model_len: longest request in tokens (the tables' width). Default: what the
            smallest full group can hold, or 131,072 tokens when every group is windowed.

    Raises:
        ValueError: a bad count, or ``num_blocks`` that does not name every group.
    """

    def __init__(
        self,
        layout: CacheLayout,
        num_blocks: Mapping[str, int],
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int | None = None,
    ) -> None:
        self.layout = layout
        self.max_num_seqs = _int_arg("max_num_seqs", max_num_seqs, 1)
        names = [g.name for g in layout.groups]
        missing = [n for n in names if n not in num_blocks]
        if missing:
            raise ValueError(f"num_blocks has no count for groups {missing} (groups: {names})")
        pools = {n: BlockPool(num_blocks[n], n) for n in names}
        self.max_model_len = resolve_max_model_len(layout, num_blocks, max_model_len)
        widths = table_widths(layout, self.max_num_seqs, self.max_model_len)
        check_allocatable(
            4 * self.max_num_seqs * sum(widths.values()), "cpu", "block tables"
        )
        self._groups: list[_Group] = []
        for g in layout.groups:
            code = _KIND_CODES[g.kind.value]
            slots = _slots(g)
            width = widths[g.name]
            self._groups.append(
                _Group(
                    spec=g,
                    code=code,
                    block_size=g.block_size,
                    window=int(g.window or 0),
                    slots=slots,
                    pool=pools[g.name],
                    table=np.zeros((self.max_num_seqs, width), dtype=np.int32),
                    held_from=np.zeros(self.max_num_seqs, dtype=np.int64),
                )
            )
        self._by_name = {g.spec.name: g for g in self._groups}
        self._num_tokens = np.zeros(self.max_num_seqs, dtype=np.int64)
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(self.max_num_seqs - 1, -1, -1))
        self._swapped: dict[str, _Swapped] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._busy: dict[str, int] = {}  # request -> plan id of its swap in flight
        self._plan_ids = itertools.count(1)
        self._pending: list[TableDelta] = []
        self._host: dict[str, BlockPool] = {}
        self._page_bytes: dict[str, int] = {}
        self.stats = SwapStats()
        self._lock = threading.RLock()

    # ================================================================== read-only views

    @property
    def groups(self) -> list[str]:
        return [g.spec.name for g in self._groups]

    def pool(self, group: str) -> BlockPool:
        return self._group(group).pool

    def table(self, group: str) -> np.ndarray:
        """The persistent table of ``group`` (read-only view ``int32 [max_num_seqs, width]``)."""
        view = self._group(group).table.view()
        view.flags.writeable = False
        return view

    def row_of(self, request_id: str) -> int:
        """The table row of a request that holds device blocks."""
        row = self._row_of.get(check_request_id(request_id))
        if row is None:
            raise self._not_resident(request_id)
        return row

    @property
    def requests(self) -> list[str]:
        """Ids of requests that hold device blocks, sorted."""
        return sorted(self._row_of)

    @property
    def swapped_requests(self) -> list[str]:
        """Ids of requests whose blocks are in host pages, sorted."""
        return sorted(self._swapped)

    def is_swapped(self, request_id: str) -> bool:
        return check_request_id(request_id) in self._swapped

    def num_tokens(self, request_id: str) -> int:
        """Tokens ``request_id`` holds (resident or swapped out)."""
        swapped = self._swapped.get(check_request_id(request_id))
        if swapped is not None:
            return swapped.num_tokens
        return int(self._num_tokens[self.row_of(request_id)])

    def block_table(self, request_id: str, group: str) -> list[int]:
        """``request_id``'s table in ``group``: ``cdiv(num_tokens, block_size)`` entries
        (``slots_per_request`` for a per-request group), null id 0 where it holds no block."""
        g = self._group(group)
        row = self.row_of(request_id)
        if g.code == _PER_REQUEST:
            return g.table[row, : g.slots].tolist()
        n = int(self._num_tokens[row])
        return g.table[row, : -(-n // g.block_size)].tolist()

    def num_free_blocks(self, group: str) -> int:
        return self._group(group).pool.num_free

    def num_used_blocks(self, group: str) -> int:
        return self._group(group).pool.num_used

    def num_usable_blocks(self, group: str) -> int:
        return self._group(group).pool.num_usable

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    # ================================================================== the step

    @_locked
    def schedule(
        self,
        request_ids: Sequence[str],
        num_new_tokens: Sequence[int] | np.ndarray,
        new_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> StepAllocation:
        """Grow every scheduled request by its new tokens, in one call for the whole batch.

        A request id not seen before starts a new request (0 tokens, a free table row).
        Each request is all-or-nothing: one that cannot get every block it needs, a row, or
        would exceed ``max_model_len`` is refused (see :class:`Refusal`) and nothing changes
        for it; requests after it may still be scheduled. Requests are served in the order
        given.

        Args:
            request_ids: the scheduled requests (distinct).
            num_new_tokens: tokens each grows by this step (ints >= 0).
            new_token_ids: optional token ids of the new tokens (one sequence per request,
                of length ``num_new_tokens[i]``); checked for length, kept for prefix reuse.

        Returns:
            a :class:`StepAllocation` carrying every table change since the previous step.

        Raises:
            RequestStateError / ValueError / TypeError: a malformed batch (bad or repeated
                ids, a swapped-out or swapping request, counts of the wrong kind or length);
                nothing changes then.
        """
        ids = _batch_ids(request_ids)
        new = _counts(num_new_tokens, len(ids))
        if new_token_ids is not None:
            _check_token_ids(new_token_ids, new)
        batch = len(ids)
        rows = np.empty(batch, dtype=np.int64)
        fresh = np.zeros(batch, dtype=bool)
        row_of = self._row_of
        for i, rid in enumerate(ids):
            row = row_of.get(rid)
            if row is None:
                if rid in self._swapped:
                    raise RequestStateError(
                        f"request {rid!r} is swapped out; swap it in before scheduling it"
                    )
                if rid in self._busy:
                    raise RequestStateError(f"request {rid!r} has a swap in flight")
                fresh[i] = True
                rows[i] = -1
            else:
                if rid in self._busy:
                    raise RequestStateError(f"request {rid!r} has a swap in flight")
                rows[i] = row
        refused: list[Refusal] = []
        accept = np.ones(batch, dtype=bool)
        n_fresh = int(fresh.sum())
        if n_fresh:
            fresh_idx = np.flatnonzero(fresh)
            if n_fresh > len(self._free_rows):
                for i in fresh_idx[len(self._free_rows) :]:
                    accept[i] = False
                    refused.append(
                        Refusal(ids[i], "max_num_seqs", "", 1, self.max_num_seqs)
                    )
                fresh_idx = fresh_idx[: len(self._free_rows)]
            taken = [self._free_rows.pop() for _ in range(len(fresh_idx))]
            rows[fresh_idx] = taken
        safe_rows = np.where(rows < 0, 0, rows)
        before = np.where(fresh, 0, self._num_tokens[safe_rows])
        after = before + new
        too_long = after > self.max_model_len
        if too_long.any():
            for i in np.flatnonzero(too_long & accept):
                accept[i] = False
                refused.append(
                    Refusal(ids[i], "max_model_len", "", int(after[i]), self.max_model_len)
                )
        plans = self._plan_growth(safe_rows, fresh, before, after)
        if accept.all() and all(
            int(need.sum()) <= g.pool.num_free for g, (need, _, _, _) in zip(
                self._groups, plans, strict=True
            )
        ):
            self._apply_growth(safe_rows, fresh, before, after, plans, None)
        else:
            accept = self._schedule_one_by_one(
                ids, safe_rows, fresh, before, after, plans, accept, refused
            )
        # rows taken for fresh requests that were refused go back
        for i in np.flatnonzero(fresh & ~accept):
            if rows[i] >= 0:
                self._free_rows.append(int(rows[i]))
        for i in np.flatnonzero(fresh & accept):
            row_of[ids[i]] = int(rows[i])
        if accept.all():
            kept_ids = tuple(ids)
            kept = slice(None)
        else:
            kept_ids = tuple(r for r, a in zip(ids, accept, strict=True) if a)
            kept = accept
        self._num_tokens[safe_rows[kept]] = after[kept]
        deltas = tuple(self._pending)
        self._pending = []
        refused.sort(key=lambda r: ids.index(r.request_id))
        return StepAllocation(
            request_ids=kept_ids,
            rows=safe_rows[kept].astype(np.int32),
            num_computed=before[kept],
            num_new=new[kept],
            refused=tuple(refused),
            table_deltas=deltas,
        )

    def _plan_growth(
        self, rows: np.ndarray, fresh: np.ndarray, before: np.ndarray, after: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per group: (blocks needed, release from, release to, first new column)."""
        plans = []
        for g in self._groups:
            if g.code == _PER_REQUEST:
                need = np.where(fresh, g.slots, 0).astype(np.int64)
                zero = np.zeros_like(need)
                plans.append((need, zero, zero, zero))
                continue
            bs = g.block_size
            old_len = -(-before // bs)
            need = -(-after // bs) - old_len
            if g.code == _FULL:
                plans.append((need, old_len, old_len, old_len))
                continue
            first_read = before  # the first scheduled token (fresh requests: token 0)
            if g.code == _WINDOW:
                start = np.maximum(0, first_read + 1 - g.window)
            else:
                start = (first_read // g.window) * g.window
            lo = np.where(fresh, 0, g.held_from[rows])
            hi = np.maximum(lo, np.minimum(start // bs, old_len))
            plans.append((need, lo, hi, old_len))
        return plans

    def _apply_growth(
        self,
        rows: np.ndarray,
        fresh: np.ndarray,
        before: np.ndarray,
        after: np.ndarray,
        plans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        sel: np.ndarray | None,
    ) -> None:
        """Release, grow and record for the requests ``sel`` (all when ``None``)."""
        for g, (need, lo, hi, first_new) in zip(self._groups, plans, strict=True):
            if sel is not None:
                need, lo, hi, first_new = need[sel], lo[sel], hi[sel], first_new[sel]
                g_rows, g_fresh = rows[sel], fresh[sel]
            else:
                g_rows, g_fresh = rows, fresh
            parts_r: list[np.ndarray] = []
            parts_c: list[np.ndarray] = []
            parts_v: list[np.ndarray] = []
            if g.code != _FULL and g.code != _PER_REQUEST:
                g.held_from[g_rows[g_fresh]] = 0
                if (hi > lo).any():
                    r, c = _expand(g_rows, lo, hi)
                    old = g.table[r, c]
                    g.pool.release(old[old != NULL_BLOCK])
                    g.table[r, c] = NULL_BLOCK
                    g.held_from[g_rows] = hi
                    parts_r.append(r)
                    parts_c.append(c)
                    parts_v.append(np.zeros(len(r), dtype=np.int32))
            total = int(need.sum())
            if total:
                ids = g.pool.take(total)
                r, c = _expand(g_rows, first_new, first_new + need)
                g.table[r, c] = ids
                parts_r.append(r)
                parts_c.append(c)
                parts_v.append(ids)
            if parts_r:
                self._pending.append(
                    TableDelta(
                        group=g.spec.name,
                        rows=np.concatenate(parts_r).astype(np.int32),
                        cols=np.concatenate(parts_c).astype(np.int32),
                        block_ids=np.concatenate(parts_v).astype(np.int32),
                    )
                )

    def _schedule_one_by_one(
        self,
        ids: list[str],
        rows: np.ndarray,
        fresh: np.ndarray,
        before: np.ndarray,
        after: np.ndarray,
        plans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        accept: np.ndarray,
        refused: list[Refusal],
    ) -> np.ndarray:
        """The slow path when the batch as a whole does not fit: requests in order."""
        for i in range(len(ids)):
            if not accept[i]:
                continue
            short: Refusal | None = None
            for g, (need, lo, hi, _) in zip(self._groups, plans, strict=True):
                credit = 0
                if hi[i] > lo[i]:
                    old = g.table[rows[i], lo[i] : hi[i]]
                    old = old[old != NULL_BLOCK]
                    credit = int((g.pool._ref[old] == 1).sum())
                available = g.pool.num_free + credit
                if int(need[i]) > available:
                    short = Refusal(ids[i], "out_of_blocks", g.spec.name, int(need[i]), available)
                    break
            if short is not None:
                accept[i] = False
                refused.append(short)
                continue
            self._apply_growth(rows, fresh, before, after, plans, np.array([i]))
        return accept

    # ================================================================== finish, truncate

    @_locked
    def finish(self, request_ids: Sequence[str]) -> None:
        """Return every device block and host page of the requests and forget them.

        Raises:
            RequestStateError: an unknown request or one with a swap in flight (nothing
                changed).
        """
        ids = _batch_ids(request_ids)
        for rid in ids:
            if rid in self._busy:
                raise RequestStateError(f"request {rid!r} has a swap in flight")
            if rid not in self._row_of and rid not in self._swapped:
                raise self._not_resident(rid)
        resident = [rid for rid in ids if rid in self._row_of]
        for rid in ids:
            swapped = self._swapped.pop(rid, None)
            if swapped is not None:
                for name, pages in swapped.host_pages.items():
                    self._host[name].release(pages)
        if resident:
            self._release_rows(np.array([self._row_of.pop(r) for r in resident]))

    def _release_rows(self, rows: np.ndarray) -> None:
        """Free every block of ``rows``, clear them, and put the rows back."""
        for g in self._groups:
            table = g.table[rows]
            held = table[table != NULL_BLOCK]
            g.pool.release(held)
            g.table[rows] = NULL_BLOCK
            g.held_from[rows] = 0
            self._pending.append(TableDelta(group=g.spec.name, clear_rows=rows.astype(np.int32)))
        self._num_tokens[rows] = 0
        self._free_rows.extend(int(r) for r in rows[::-1])

    @_locked
    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll ``request_id`` back to its first ``num_tokens`` tokens (rejected draft tokens
        of speculative decoding): blocks past the new end go back to their pools.

        Only blocks the request holds are touched. A window group cannot regrow blocks it
        already released, so truncating below them is refused.

        Raises:
            ValueError: ``num_tokens`` not an int in ``[1, current]``, or below a released
                window block (nothing changed).
        """
        row = self.row_of(request_id)
        if request_id in self._busy:
            raise RequestStateError(f"request {request_id!r} has a swap in flight")
        current = int(self._num_tokens[row])
        if (
            not isinstance(num_tokens, int | np.integer)
            or isinstance(num_tokens, bool)
            or not 1 <= num_tokens <= current
        ):
            raise ValueError(
                f"num_tokens must be an int in [1, {current}] for request {request_id!r}, got "
                f"{num_tokens!r}"
            )
        for g in self._groups:
            if g.code in (_FULL, _PER_REQUEST):
                continue
            if -(-num_tokens // g.block_size) <= g.held_from[row]:
                raise ValueError(
                    f"cannot truncate request {request_id!r} to {num_tokens} tokens: group "
                    f"{g.spec.name!r} already released the blocks before token "
                    f"{int(g.held_from[row]) * g.block_size}"
                )
        for g in self._groups:
            if g.code == _PER_REQUEST:
                continue
            new_len = -(-num_tokens // g.block_size)
            old_len = -(-current // g.block_size)
            if new_len == old_len:
                continue
            cols = np.arange(new_len, old_len)
            old = g.table[row, cols]
            g.pool.release(old[old != NULL_BLOCK])
            g.table[row, cols] = NULL_BLOCK
            self._pending.append(
                TableDelta(
                    group=g.spec.name,
                    rows=np.full(len(cols), row, dtype=np.int32),
                    cols=cols.astype(np.int32),
                    block_ids=np.zeros(len(cols), dtype=np.int32),
                )
            )
        self._num_tokens[row] = num_tokens

    @_locked
    def take_table_deltas(self) -> tuple[TableDelta, ...]:
        """Table changes since the last step or the last call (finishes, swaps, truncations),
        for an engine that mirrors them on its workers between steps."""
        deltas = tuple(self._pending)
        self._pending = []
        return deltas

    # ================================================================== host pages, swaps

    @_locked
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
        self._group(group)
        if group not in self._host:
            raise ValueError(f"group {group!r} has no host pages")
        return self._host[group]

    @property
    def host_groups(self) -> list[str]:
        return [g for g in self.groups if g in self._host]

    def selection(self, request_id: str, purpose: SwapPurpose | str) -> dict[str, np.ndarray]:
        """Block-table indices that a swap of ``request_id`` moves, per group, asked of each
        (backend, role) through ``offload_selection``."""
        purpose = _purpose(purpose)
        row = self.row_of(request_id)
        return self._selection(row, purpose)

    def _selection(self, row: int, purpose: SwapPurpose) -> dict[str, np.ndarray]:
        n = int(self._num_tokens[row])
        selected: dict[str, np.ndarray] = {}
        for g in self._groups:
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
            if g.code == _PER_REQUEST:
                cols = np.arange(g.slots)
            else:
                cols = np.arange(start // g.block_size, (end - 1) // g.block_size + 1)
            cols = cols[g.table[row, cols] != NULL_BLOCK]
            if len(cols):
                selected[name] = cols
        return selected

    @_locked
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
        purpose = _purpose(purpose)
        self._ready_host()
        ids = _batch_ids(request_ids)
        for rid in ids:
            if rid in self._busy:
                raise RequestStateError(f"request {rid!r} has a swap in flight")
            if rid in self._swapped:
                raise RequestStateError(f"request {rid!r} is already swapped out")
            self.row_of(rid)
        selections = [self._selection(self._row_of[rid], purpose) for rid in ids]
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
            row = self._row_of[rid]
            pages, blocks = {}, {}
            for name, cols in sel.items():
                pages[name] = taken[name][offsets[name] : offsets[name] + len(cols)]
                offsets[name] += len(cols)
                blocks[name] = self._by_name[name].table[row, cols].copy()
            moves.append(
                RequestMove(
                    request_id=rid,
                    num_tokens=int(self._num_tokens[row]),
                    purpose=purpose,
                    block_indices=sel,
                    device_blocks=blocks,
                    host_pages=pages,
                )
            )
        return self._launch("out", moves, {})

    @_locked
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
        ids = _batch_ids(request_ids)
        for rid in ids:
            if rid in self._busy:
                raise RequestStateError(f"request {rid!r} has a swap in flight")
            if rid not in self._swapped:
                raise RequestStateError(
                    f"request {rid!r} is not swapped out (swapped out: {self.swapped_requests})"
                )
        if len(ids) > len(self._free_rows):
            raise OutOfBlocksError(
                "device", "table rows", len(ids), len(self._free_rows), "swap_in"
            )
        cols_of: list[dict[str, np.ndarray]] = []
        totals = {g.spec.name: 0 for g in self._groups}
        for rid in ids:
            entry = self._swapped[rid]
            cols: dict[str, np.ndarray] = {}
            for g in self._groups:
                if g.code == _PER_REQUEST:
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
        for g in self._groups:
            if totals[g.spec.name] > g.pool.num_free:
                raise OutOfBlocksError(
                    "device", g.spec.name, totals[g.spec.name], g.pool.num_free, "swap_in"
                )
        rows: dict[str, int] = {}
        moves = []
        for rid, cols in zip(ids, cols_of, strict=True):
            entry = self._swapped[rid]
            row = self._free_rows.pop()
            rows[rid] = row
            for g in self._groups:
                c = cols[g.spec.name]
                ids_ = g.pool.take(len(c))
                g.table[row, c] = ids_
                g.held_from[row] = int(c[0]) if len(c) and g.code != _PER_REQUEST else 0
                if len(c):
                    self._pending.append(
                        TableDelta(
                            group=g.spec.name,
                            rows=np.full(len(c), row, dtype=np.int32),
                            cols=c.astype(np.int32),
                            block_ids=ids_,
                        )
                    )
            self._num_tokens[row] = entry.num_tokens
            moves.append(
                RequestMove(
                    request_id=rid,
                    num_tokens=entry.num_tokens,
                    purpose=entry.purpose,
                    block_indices=entry.block_indices,
                    device_blocks={
                        name: self._by_name[name].table[row, idx].copy()
                        for name, idx in entry.block_indices.items()
                    },
                    host_pages=entry.host_pages,
                )
            )
        return self._launch("in", moves, rows)

    def _launch(
        self, direction: Literal["out", "in"], moves: list[RequestMove], rows: dict[str, int]
    ) -> SwapPlan:
        groups = tuple(
            g.spec.name for g in self._groups if any(g.spec.name in m.device_blocks for m in moves)
        )
        plan = SwapPlan(next(self._plan_ids), direction, tuple(moves), groups)
        self._in_flight[plan.plan_id] = _InFlight(plan, rows)
        for m in moves:
            self._busy[m.request_id] = plan.plan_id
        return plan

    @_locked
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
            del self._busy[m.request_id]
        if plan.direction == "out":
            if result.ok:
                rows = [self._row_of.pop(m.request_id) for m in plan.requests]
                self._release_rows(np.array(rows, dtype=np.int64))
                for m in plan.requests:
                    self._swapped[m.request_id] = _Swapped(
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
                del self._swapped[m.request_id]
                for name, pages in m.host_pages.items():
                    self._host[name].release(pages)
                self._row_of[m.request_id] = flight.rows[m.request_id]
                self._count(m, "in")
        else:
            self._release_rows(
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

    # ================================================================== helpers

    def _ready_host(self) -> None:
        if not self._host:
            raise RuntimeError("call initialize_host_cache before swapping")

    def _group(self, name: str) -> _Group:
        g = self._by_name.get(name) if isinstance(name, str) else None
        if g is None:
            raise ValueError(f"group {name!r} does not exist; groups are {self.groups}")
        return g

    def _not_resident(self, request_id: str) -> RequestStateError:
        if request_id in self._swapped:
            return RequestStateError(
                f"request {request_id!r} is swapped out; swap it in first"
            )
        return RequestStateError(
            f"request {request_id!r} has no blocks on the device (never allocated, freed, "
            "or swapped out)"
        )

    def __repr__(self) -> str:
        return (
            f"BlockManager({len(self._row_of)} running, {len(self._swapped)} swapped, groups="
            f"{self.groups})"
        )


# ====================================================================== module helpers


def _slots(group: CacheGroup) -> int:
    return int(getattr(group, "slots_per_request", 1) or 1)


def resolve_max_model_len(
    layout: CacheLayout, num_blocks: Mapping[str, int], max_model_len: int | None
) -> int:
    """``max_model_len``, or its default: the tokens the smallest full group holds, at most
    131,072 (the tables are ``max_num_seqs x max_model_len / block_size`` ids: a default
    must not make them larger than the caches)."""
    if max_model_len is None:
        full = [
            (num_blocks[g.name] - 1) * g.block_size
            for g in layout.groups
            if _KIND_CODES[g.kind.value] == _FULL
        ]
        max_model_len = min([*full, DEFAULT_WINDOWED_MAX_MODEL_LEN])
    return _int_arg("max_model_len", max_model_len, 1)


def table_widths(layout: CacheLayout, max_num_seqs: int, max_model_len: int) -> dict[str, int]:
    """Columns of each group's table: the blocks ``max_model_len`` tokens span, or the slots
    of a per-request group. Shared by both sides so their tables have one shape."""
    _int_arg("max_num_seqs", max_num_seqs, 1)
    return {
        g.name: _slots(g)
        if _KIND_CODES[g.kind.value] == _PER_REQUEST
        else g.blocks_for(max_model_len)
        for g in layout.groups
    }


def _batch_ids(request_ids: object) -> list[str]:
    if isinstance(request_ids, str) or not isinstance(request_ids, Sequence):
        raise TypeError(
            f"request_ids must be a sequence of request ids, got {type(request_ids).__name__}"
        )
    ids = [check_request_id(r) for r in request_ids]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        for r in ids:
            if r in seen:
                raise ValueError(f"request_ids lists {r!r} twice")
            seen.add(r)
    return ids


def _counts(values: object, n: int) -> np.ndarray:
    if isinstance(values, np.ndarray):
        arr = values
    elif isinstance(values, Sequence) and not isinstance(values, str):
        for v in values:
            if not isinstance(v, int | np.integer) or isinstance(v, bool):
                raise ValueError(f"num_new_tokens must hold ints, got {v!r}")
        arr = np.asarray(values, dtype=np.int64)
    else:
        raise TypeError(f"num_new_tokens must be a sequence of ints, got {type(values).__name__}")
    if arr.dtype.kind not in "iu" or arr.dtype == bool:
        raise ValueError(f"num_new_tokens must be integers, got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"num_new_tokens has shape {arr.shape}, expected ({n},) like request_ids")
    if n and int(arr.min()) < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {int(arr.min())}")
    return arr.astype(np.int64, copy=False)


def _check_token_ids(token_ids: Sequence[Sequence[int]], new: np.ndarray) -> None:
    if len(token_ids) != len(new):
        raise ValueError(
            f"new_token_ids has {len(token_ids)} entries for {len(new)} requests"
        )
    for i, (ids, n) in enumerate(zip(token_ids, new, strict=True)):
        if len(ids) != int(n):
            raise ValueError(
                f"new_token_ids[{i}] has {len(ids)} token ids but num_new_tokens[{i}] is {int(n)}"
            )


def _purpose(purpose: object) -> SwapPurpose:
    try:
        return SwapPurpose(purpose)
    except ValueError:
        raise ValueError(
            f"purpose must be one of {[p.value for p in SwapPurpose]}, got {purpose!r}"
        ) from None
