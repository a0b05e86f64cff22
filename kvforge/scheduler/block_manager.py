"""The scheduler side: block pools, persistent block tables, windows and swap bookkeeping.

:class:`BlockManager` holds no device memory and no torch tensor. It decides which blocks
every request holds and returns plain values (:mod:`kvforge.core.values`) that a
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

Invariants (tested in ``tests/scheduler/test_block_tables.py``):

- a table row holds exactly the blocks the pool counts as used by its request; every block
  id outside ``[held_from, cdiv(num_tokens, B))`` of a row is ``NULL_BLOCK``;
- with ``share_pools=True`` the groups of one set of ``CacheLayout.pool_sets`` draw on one
  pool: a block id is held by at most one of them at a time, the pool's used count is the
  distinct blocks all their rows hold, and every capacity check sums the members' needs and
  releases (``tests/scheduler/test_shared_pools.py``, the shared config of
  ``tests/properties/test_prefix_property.py`` and the soak's ``--share-pools`` mode check it);
- a refused request of a step changes nothing; the others proceed;
- every public method is serialised by one lock: the scheduler side may be called from
  several threads, and the worker side (a different object) runs concurrently with it.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from kvforge.core.layout import CacheLayout, check_share_pools
from kvforge.core.memory_plan import check_allocatable
from kvforge.core.values import (
    BlockCopy,
    PrefixEvent,
    PrefixMatch,
    PrefixQuery,
    Refusal,
    RequestMove,
    StepAllocation,
    SwapPlan,
    SwapResult,
    TableDelta,
)
from kvforge.errors import OutOfBlocksError, RequestStateError
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.scheduler.prefix_hash import PrefixHasher
from kvforge.specs import CacheGroup, SwapPurpose, TokenRange

__all__ = [
    "DEFAULT_MAX_NUM_SEQS",
    "BlockManager",
    "PrefixStats",
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
    (8, 3, 3)
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
class PrefixStats:
    """Counters of the prefix cache.

    Attributes:
        queries: prompts looked up.
        query_tokens: their tokens.
        hit_tokens: tokens served from cache (``sum(L)``).
        hit_tokens_by_group: per group, the tokens its shared blocks cover.
        stored_blocks: blocks that became reusable, per group.
        evictions: blocks evicted, per family (``history``, ``window``, ``snapshot``).
    """

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_group: dict[str, int] = field(default_factory=dict)
    stored_blocks: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Display only: ``hit_tokens / query_tokens``."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


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
    cached: dict[object, int] = field(default_factory=dict)  # prefix key -> block (caching on)


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
            :class:`~kvforge.core.memory_plan.MemoryPlan`).
        max_num_seqs: table rows: requests that may hold device blocks at once.
        max_model_len: longest request in tokens (the tables' width). Default: what the
            smallest full group can hold, or 131,072 tokens when every group is windowed.
        enable_prefix_caching: keep the blocks finished requests release reusable (see
            :meth:`lookup`).
        snapshot_interval: tokens between snapshots of per-request state (a multiple of
            :attr:`boundary`; default the first multiple at or above 512).
        share_pools: groups whose pages pair up byte for byte
            (:attr:`CacheLayout.pool_sets`) draw on one pool: one id space, one free list,
            one eviction order. ``num_blocks`` then gives every member the same count, the
            pool's blocks, paid for once (the worker side places the members' buffers in
            the same bytes: ``CacheStorage.create(..., share_pools=True)``).

    Raises:
        ValueError: a bad count, ``num_blocks`` that does not name every group, or (with
            ``share_pools``) different counts for the groups of one pool.
    """

    def __init__(
        self,
        layout: CacheLayout,
        num_blocks: Mapping[str, int],
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = False,
        snapshot_interval: int | None = None,
        share_pools: bool = False,
    ) -> None:
        self.layout = layout
        self.share_pools = check_share_pools(share_pools)
        self.max_num_seqs = _int_arg("max_num_seqs", max_num_seqs, 1)
        names = [g.name for g in layout.groups]
        missing = [n for n in names if n not in num_blocks]
        if missing:
            raise ValueError(f"num_blocks has no count for groups {missing} (groups: {names})")
        pools: dict[str, BlockPool] = {}
        for members in layout.pools(share_pools, num_blocks):
            pool = BlockPool(num_blocks[members[0]], "+".join(members))
            pools.update(dict.fromkeys(members, pool))
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
        # distinct pools, each with the indices of the groups that draw on it
        self._pools: list[tuple[BlockPool, list[int]]] = []
        for gi, g in enumerate(self._groups):
            known = next((m for p, m in self._pools if p is g.pool), None)
            if known is None:
                self._pools.append((g.pool, [gi]))
            else:
                known.append(gi)
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
        self.prefix_caching = bool(enable_prefix_caching)
        self.prefix_stats = PrefixStats()
        self._events: list[PrefixEvent] = []
        self._hashers: dict[int, PrefixHasher] = {}  # row -> key chain of its tokens
        self._committed = np.zeros((len(self._groups), self.max_num_seqs), dtype=np.int64)
        self._pins: list[tuple[_Group, np.ndarray]] = []  # snapshot blocks held for one step
        self._copies: list[BlockCopy] = []  # copies on write, run before the next step
        sizes = [g.block_size for g in self._groups if g.code != _PER_REQUEST]
        self.boundary = math.lcm(*sizes) if sizes else 1
        if snapshot_interval is None:
            snapshot_interval = self.boundary * -(-512 // self.boundary)
        if (
            not isinstance(snapshot_interval, int)
            or isinstance(snapshot_interval, bool)
            or snapshot_interval < 1
            or snapshot_interval % self.boundary
        ):
            raise ValueError(
                f"snapshot_interval must be a positive multiple of {self.boundary} (the LCM of "
                f"the groups' block sizes), got {snapshot_interval!r}"
            )
        self.snapshot_interval = snapshot_interval
        if self.prefix_caching:
            for pool, _ in self._pools:
                pool.enable_caching(functools.partial(self._evicted, pool))

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
        prefix_matches: Sequence[PrefixMatch | None] | None = None,
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
            new_token_ids: token ids of the new tokens (one sequence per request, of length
                ``num_new_tokens[i]``). With prefix caching, the blocks they complete become
                reusable by later requests; a step without them ends that request's chain.
            prefix_matches: for new requests, what :meth:`lookup` returned for their prompt
                (``None`` elsewhere): a request with a hit starts at ``match.num_tokens``
                sharing the matched blocks, and ``num_new_tokens`` counts the tokens after
                them. With per-request (linear-attention) groups and prefix caching, a step
                is cut to end on the next snapshot boundary (see :attr:`snapshot_interval`):
                read the scheduled counts from the result's ``num_new``.

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
        if prefix_matches is not None:
            _check_matches(prefix_matches, len(ids))
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
                if prefix_matches is not None and prefix_matches[i] is not None:
                    raise ValueError(
                        f"prefix_matches[{i}] is given for request {rid!r}, which is already "
                        "running; a match applies to a new request only"
                    )
                rows[i] = row
        self._release_pins()
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
        adopted: dict[int, PrefixMatch] = {}
        if prefix_matches is not None or self.prefix_caching:
            for i in np.flatnonzero(fresh & accept):
                match = prefix_matches[i] if prefix_matches is not None else None
                stale = self._adopt(ids[i], int(rows[i]), match)
                if stale is not None:
                    accept[i] = False
                    refused.append(Refusal(ids[i], "stale_prefix", stale, 0, 0))
                elif match is not None and match.num_tokens:
                    adopted[int(i)] = match
        before = np.where(fresh & ~accept, 0, self._num_tokens[safe_rows])
        if self.prefix_caching and self._snapshot_groups:
            interval = self.snapshot_interval
            due = (before // interval + 1) * interval
            new = np.minimum(new, due - before)
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
            self._fits_in_order(pool, members, safe_rows, plans) for pool, members in self._pools
        ):
            self._apply_growth(safe_rows, fresh, before, after, plans, None)
        else:
            accept = self._schedule_one_by_one(
                ids, safe_rows, fresh, before, after, plans, accept, refused
            )
        # rows taken for fresh requests that were refused go back
        for i in np.flatnonzero(fresh & ~accept):
            if int(i) in adopted:
                self._unadopt(int(rows[i]), adopted.pop(int(i)))
            self._hashers.pop(ids[i], None)
            if rows[i] >= 0:
                self._free_rows.append(int(rows[i]))
        copies_before: list[BlockCopy] = self._copies
        self._copies = []
        for i, match in adopted.items():
            copies_before += self._record_adoption(int(rows[i]), match)
        for i in np.flatnonzero(fresh & accept):
            row_of[ids[i]] = int(rows[i])
        if accept.all():
            kept_ids = tuple(ids)
            kept = slice(None)
        else:
            kept_ids = tuple(r for r, a in zip(ids, accept, strict=True) if a)
            kept = accept
        self._num_tokens[safe_rows[kept]] = after[kept]
        copies_after: list[BlockCopy] = []
        if self._hashers:
            for i in np.flatnonzero(accept):
                tokens = None if new_token_ids is None else new_token_ids[i]
                copies_after += self._commit(
                    ids[i], int(safe_rows[i]), int(before[i]), int(after[i]), tokens
                )
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
            copies_before=tuple(copies_before),
            copies_after=tuple(copies_after),
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
            # the first scheduled token (a new request: token 0); a step that schedules
            # nothing keeps the resting window, the newest token's view (see live_start)
            first_read = np.where(after > before, before, np.maximum(before - 1, 0))
            if g.code == _WINDOW:
                start = np.maximum(0, first_read + 1 - g.window)
            else:
                start = (first_read // g.window) * g.window
            lo = g.held_from[rows]  # 0 for a new row, the shared tail's start after a hit
            hi = np.maximum(lo, np.minimum(start // bs, old_len))
            plans.append((need, lo, hi, old_len))
        return plans

    def _fits_in_order(
        self,
        pool: BlockPool,
        members: list[int],
        rows: np.ndarray,
        plans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    ) -> bool:
        """Whether every request of the batch, served in order, gets its blocks from
        ``pool`` (drawn on by the groups ``members``): each request's window releases count
        for itself and the requests after it (the same answer the one-by-one path gives, so
        the batch path never accepts more)."""
        free = pool.num_free
        need = sum(plans[gi][0] for gi in members)
        if int(need.sum()) <= free:
            return True
        credit = np.zeros(len(rows), dtype=np.int64)
        for gi in members:
            _, lo, hi, _ = plans[gi]
            if (hi > lo).any():
                index, c = _expand(np.arange(len(rows)), lo, np.maximum(lo, hi))
                old = self._groups[gi].table[rows[index], c]
                gives = (old != NULL_BLOCK) & (pool._ref[old] == 1)
                credit += np.bincount(index[gives], minlength=len(rows))
        return bool((np.cumsum(need - credit) <= free).all())

    def _apply_growth(
        self,
        rows: np.ndarray,
        fresh: np.ndarray,
        before: np.ndarray,
        after: np.ndarray,
        plans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        sel: np.ndarray | None,
    ) -> None:
        """Release, grow and record for the requests ``sel`` (all when ``None``).

        Every group releases before any group grows: groups that share a pool were checked
        against the pool with all their releases counted."""
        parts: list[tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]] = []
        for g, (_, lo, hi, _) in zip(self._groups, plans, strict=True):
            if sel is not None:
                lo, hi = lo[sel], hi[sel]
                g_rows = rows[sel]
            else:
                g_rows = rows
            parts_r: list[np.ndarray] = []
            parts_c: list[np.ndarray] = []
            parts_v: list[np.ndarray] = []
            parts.append((parts_r, parts_c, parts_v))
            if g.code not in (_FULL, _PER_REQUEST) and (hi > lo).any():
                r, c = _expand(g_rows, lo, hi)
                old = g.table[r, c]
                g.pool.release(old[old != NULL_BLOCK])
                g.table[r, c] = NULL_BLOCK
                g.held_from[g_rows] = hi
                parts_r.append(r)
                parts_c.append(c)
                parts_v.append(np.zeros(len(r), dtype=np.int32))
        for g, (need, _, _, first_new), (parts_r, parts_c, parts_v) in zip(
            self._groups, plans, parts, strict=True
        ):
            g_rows = rows
            if sel is not None:
                need, first_new, g_rows = need[sel], first_new[sel], rows[sel]
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
            for pool, members in self._pools:
                credit = need = 0
                for gi in members:
                    g, (g_need, lo, hi, _) = self._groups[gi], plans[gi]
                    need += int(g_need[i])
                    if hi[i] > lo[i]:
                        old = g.table[rows[i], lo[i] : hi[i]]
                        old = old[old != NULL_BLOCK]
                        credit += int((pool._ref[old] == 1).sum())
                available = pool.num_free + credit
                if need > available:
                    # a shared pool is named by its first group that asked for blocks
                    name = next(
                        self._groups[gi].spec.name for gi in members if plans[gi][0][i]
                    )
                    short = Refusal(ids[i], "out_of_blocks", name, need, available)
                    break
            if short is not None:
                accept[i] = False
                refused.append(short)
                continue
            self._apply_growth(rows, fresh, before, after, plans, np.array([i]))
        return accept


    # ================================================================== prefix cache

    @property
    def _snapshot_groups(self) -> list[_Group]:
        return [g for g in self._groups if g.code == _PER_REQUEST]

    def _window_start(self, g: _Group, num_tokens: int) -> int:
        """First token the step after a prefix of ``num_tokens`` reads in group ``g``."""
        if g.code == _WINDOW:
            return max(0, num_tokens + 1 - g.window)
        if g.code == _CHUNKED:
            return (num_tokens // g.window) * g.window
        return 0

    @_locked
    def lookup(self, queries: Sequence[PrefixQuery]) -> list[PrefixMatch]:
        """The longest reusable prefix of each prompt, for many prompts at once.

        ``L`` is the largest multiple of :attr:`boundary` (the LCM of the groups' block sizes)
        below the prompt's length such that every full group holds the whole chain
        ``[0, L)``, every sliding-window and state group the blocks covering the window the
        next token reads (``[L + 1 - W, L)``), every chunked group the blocks of the current
        chunk (``[L // C * C, L)``), and every per-request group a snapshot taken at exactly
        ``L``. Nothing changes but the counters; pass the matches to :meth:`schedule`.

        Worked example, DeepSeek-V4 (``swa`` block 64 window 128; ``compressed`` block 256;
        ``c4_state`` block 4 window 8; ``c128_state`` block 8 window 128; LCM 256), a prompt
        of 1,000 tokens whose first 768 are cached: ``L = 768``; ``compressed`` shares blocks
        0..2 (tokens 0..767); ``swa`` needs tokens 641..767: blocks 10 and 11; ``c4_state``
        tokens 761..767: blocks 190 and 191; ``c128_state`` tokens 641..767: blocks 80..95.
        """
        if isinstance(queries, PrefixQuery) or not isinstance(queries, Sequence):
            raise TypeError(
                f"queries must be a sequence of PrefixQuery, got {type(queries).__name__}"
            )
        for i, q in enumerate(queries):  # every query checked before any counter moves
            if not isinstance(q, PrefixQuery):
                raise TypeError(f"queries[{i}] is a {type(q).__name__}, not a PrefixQuery")
            _token_array(q.token_ids, f"queries[{i}].token_ids")
        return [self._lookup_one(q, i) for i, q in enumerate(queries)]

    def _lookup_one(self, query: PrefixQuery, index: int) -> PrefixMatch:
        if not isinstance(query, PrefixQuery):
            raise TypeError(f"queries[{index}] is a {type(query).__name__}, not a PrefixQuery")
        tokens = _token_array(query.token_ids, f"queries[{index}].token_ids")
        n = len(tokens)
        hasher = PrefixHasher(query.extra_keys, token_keys=query.token_keys)
        stats = self.prefix_stats
        stats.queries += 1
        stats.query_tokens += n
        step = self.boundary
        top = ((n - 1) // step) * step if n else 0
        if not self.prefix_caching or top == 0:
            return PrefixMatch(0, {}, {}, {}, hasher)
        sizes = [g.block_size for g in self._groups if g.code != _PER_REQUEST]
        if self._snapshot_groups:
            sizes.append(self.snapshot_interval)
        unit = math.gcd(*sizes)
        keys = hasher.extend(tokens[:top], at=np.arange(unit, top + 1, unit))

        def key_at(t: int) -> object:
            return keys[t // unit - 1]

        upper = top
        for g in self._groups:
            if g.code == _FULL:
                i = 0
                bs = g.block_size
                while (i + 1) * bs <= upper and key_at((i + 1) * bs) in g.cached:
                    i += 1
                upper = min(upper, i * g.block_size)
        length = (upper // step) * step
        while length > 0:
            if self._tails_present(length, key_at):
                break
            length -= step
        if length == 0:
            fresh = PrefixHasher(query.extra_keys, token_keys=query.token_keys)
            return PrefixMatch(0, {}, {}, {}, fresh)
        first: dict[str, int] = {}
        blocks: dict[str, np.ndarray] = {}
        used: dict[str, tuple[object, ...]] = {}
        for g in self._groups:
            name = g.spec.name
            if g.code == _PER_REQUEST:
                found = (key_at(length),)
                first[name] = 0
            else:
                c0 = self._window_start(g, length) // g.block_size
                found = tuple(
                    key_at((c + 1) * g.block_size) for c in range(c0, length // g.block_size)
                )
                first[name] = c0
            used[name] = found
            blocks[name] = np.array([g.cached[k] for k in found], dtype=np.int32)
            covered = length if g.code in (_FULL, _PER_REQUEST) else len(found) * g.block_size
            stats.hit_tokens_by_group[name] = stats.hit_tokens_by_group.get(name, 0) + covered
        stats.hit_tokens += length
        return PrefixMatch(length, first, blocks, used, hasher.at_prefix(length))

    def _tails_present(self, length: int, key_at: Callable[[int], object]) -> bool:
        for g in self._groups:
            if g.code == _PER_REQUEST:
                if (
                    g.slots != 1
                    or length % self.snapshot_interval
                    or key_at(length) not in g.cached
                ):
                    return False
            elif g.code != _FULL:
                c0 = self._window_start(g, length) // g.block_size
                for c in range(c0, length // g.block_size):
                    if key_at((c + 1) * g.block_size) not in g.cached:
                        return False
        return True

    def _adopt(self, request_id: str, row: int, match: PrefixMatch | None) -> str | None:
        """Share a match's blocks into ``row``; the name of a group whose blocks were evicted
        since the lookup (nothing changed then), else ``None``."""
        if self.prefix_caching:
            hasher = match.hasher if match is not None else PrefixHasher()
            if not isinstance(hasher, PrefixHasher):
                raise TypeError(f"prefix match of {request_id!r} carries no PrefixHasher")
            self._hashers[request_id] = hasher.at_prefix(hasher.num_tokens)
        if match is None or not match.num_tokens:
            return None
        for g in self._groups:
            keys = match.keys.get(g.spec.name, ())
            blocks = match.blocks.get(g.spec.name)
            if blocks is None or len(blocks) != len(keys):
                return g.spec.name
            if any(g.cached.get(k) != int(b) for k, b in zip(keys, blocks.tolist(), strict=True)):
                self._hashers.pop(request_id, None)
                return g.spec.name
        for gi, g in enumerate(self._groups):
            blocks = match.blocks[g.spec.name]
            g.pool.share(blocks.tolist())
            if g.code == _PER_REQUEST:
                self._pins.append((g, blocks))  # the restore copy reads it during the step
                continue
            c0 = match.first_col[g.spec.name]
            g.table[row, c0 : c0 + len(blocks)] = blocks
            g.held_from[row] = c0
            self._committed[gi, row] = match.num_tokens // g.block_size
        self._num_tokens[row] = match.num_tokens
        return None

    def _unadopt(self, row: int, match: PrefixMatch) -> None:
        for gi, g in enumerate(self._groups):
            blocks = match.blocks[g.spec.name]
            if g.code == _PER_REQUEST:
                self._pins = [(pg, pb) for pg, pb in self._pins if pb is not blocks]
            else:
                c0 = match.first_col[g.spec.name]
                g.table[row, c0 : c0 + len(blocks)] = NULL_BLOCK
                g.held_from[row] = 0
                self._committed[gi, row] = 0
            g.pool.release(blocks)
        self._num_tokens[row] = 0

    def _record_adoption(self, row: int, match: PrefixMatch) -> list[BlockCopy]:
        """Table deltas of an accepted hit, and the copies restoring per-request state."""
        copies = []
        for g in self._groups:
            blocks = match.blocks[g.spec.name]
            if g.code == _PER_REQUEST:
                copies.append(BlockCopy(g.spec.name, blocks, g.table[row, : g.slots].copy()))
                continue
            c0 = match.first_col[g.spec.name]
            self._pending.append(
                TableDelta(
                    group=g.spec.name,
                    rows=np.full(len(blocks), row, dtype=np.int32),
                    cols=np.arange(c0, c0 + len(blocks), dtype=np.int32),
                    block_ids=blocks.astype(np.int32),
                )
            )
        return copies

    def _commit(
        self, request_id: str, row: int, before: int, after: int, tokens: Sequence[int] | None
    ) -> list[BlockCopy]:
        """Make the blocks this step completed reusable; snapshot per-request state."""
        hasher = self._hashers.get(request_id)
        if hasher is None or after == before:
            return []
        if tokens is None or hasher.num_tokens != before:
            del self._hashers[request_id]  # the chain is broken: stop registering
            return []
        toks = _token_array(tokens, "new_token_ids")[: after - before]
        wanted: set[int] = set()
        for gi, g in enumerate(self._groups):
            if g.code != _PER_REQUEST:
                done = int(self._committed[gi, row])
                wanted.update((c + 1) * g.block_size for c in range(done, after // g.block_size))
        snapshot = bool(self._snapshot_groups) and after % self.snapshot_interval == 0
        if snapshot:
            wanted.add(after)
        at = np.array(sorted(wanted), dtype=np.int64)
        keys = hasher.extend(toks, at=at)
        key_of = dict(zip(at.tolist(), keys.tolist(), strict=True))
        stats, events = self.prefix_stats, self._events
        for gi, g in enumerate(self._groups):
            if g.code == _PER_REQUEST:
                continue
            done, full = int(self._committed[gi, row]), after // g.block_size
            for c in range(done, full):
                block = int(g.table[row, c])
                end = (c + 1) * g.block_size
                key = key_of[end]
                if block == NULL_BLOCK or key in g.cached or block in g.pool.keys:
                    continue
                if g.code != _FULL and not self._in_some_tail(g, c):
                    continue  # no match can ever read it: keep the pool for blocks that can
                g.cached[key] = block
                g.pool.keys[block] = (key, end, gi)
                events.append(PrefixEvent("stored", g.spec.name, key, end))
                stats.stored_blocks[g.spec.name] = stats.stored_blocks.get(g.spec.name, 0) + 1
            self._committed[gi, row] = full
        copies: list[BlockCopy] = []
        if snapshot:
            key = key_of[after]
            for gi, g in enumerate(self._groups):
                # one slot per request is what linear attention holds; several are not
                # snapshotted (their blocks would have to be evicted together)
                if (
                    g.code != _PER_REQUEST
                    or g.slots != 1
                    or key in g.cached
                    or g.pool.num_free < g.slots
                ):
                    continue
                dst = g.pool.take(g.slots)
                for b in dst.tolist():
                    g.pool.keys[b] = (key, after, gi)
                g.cached[key] = int(dst[0])
                self._pins.append((g, dst))  # written by the copy after the step's kernels
                copies.append(BlockCopy(g.spec.name, g.table[row, : g.slots].copy(), dst))
                events.append(PrefixEvent("stored", g.spec.name, key, after))
                stats.stored_blocks[g.spec.name] = stats.stored_blocks.get(g.spec.name, 0) + 1
        return copies

    def _in_some_tail(self, g: _Group, col: int) -> bool:
        """Whether block ``col`` of window group ``g`` lies in the tail some boundary needs.

        Tails move forward with ``L``, so the first boundary at or after the block's end
        decides: a 4-token ``c4_state`` block (window 8, boundary 256) is in a tail only if it
        is one of the two blocks before a multiple of 256 (2 of every 64 blocks).
        """
        end = (col + 1) * g.block_size
        first = -(-end // self.boundary) * self.boundary
        return self._window_start(g, first) // g.block_size <= col

    def _release_pins(self) -> None:
        pins, self._pins = self._pins, []
        for g, blocks in pins:
            g.pool.release(np.asarray(blocks, dtype=np.int32))

    def _evicted(self, pool: BlockPool, victims: list[int]) -> None:
        ev = self.prefix_stats.evictions
        for b in victims:
            key, end, gi = pool.keys[b]  # type: ignore[index, misc]
            g = self._groups[gi]
            if g.cached.get(key) == b:
                del g.cached[key]
            self._events.append(PrefixEvent("removed", g.spec.name, key, end))  # type: ignore[arg-type]
            family = g.spec.family.value
            ev[family] = ev.get(family, 0) + 1

    @_locked
    def take_events(self) -> list[PrefixEvent]:
        """Blocks stored in and removed from the prefix cache since the last call."""
        events, self._events = self._events, []
        return events

    @_locked
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix: evictable blocks go back to the free stacks and blocks
        in use lose their keys. Returns the number of blocks evicted."""
        self._release_pins()
        evicted = 0
        for g in self._groups:
            if g.pool.keys is None:
                continue
            evicted += len(g.pool.evict(g.pool.num_evictable))
            for key, block in g.cached.items():
                _, end, _ = g.pool.keys.pop(block)  # type: ignore[misc]
                self._events.append(PrefixEvent("removed", g.spec.name, key, end))  # type: ignore[arg-type]
            g.cached.clear()
        return evicted

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
            self._hashers.pop(rid, None)
            swapped = self._swapped.pop(rid, None)
            if swapped is not None:
                for name, pages in swapped.host_pages.items():
                    self._host[name].release(pages)
        if resident:
            self._release_rows(np.array([self._row_of.pop(r) for r in resident]))

    def _release_rows(self, rows: np.ndarray) -> None:
        """Free every block of ``rows``, clear them, and put the rows back. Only the columns a
        row can hold are read (``held_from .. cdiv(num_tokens, B)``), so freeing costs the
        blocks held, not the table's width."""
        tokens = self._num_tokens[rows]
        for g in self._groups:
            if g.code == _PER_REQUEST:
                start, end = np.zeros_like(tokens), np.full_like(tokens, g.slots)
            else:
                start, end = g.held_from[rows], -(-tokens // g.block_size)
            r, c = _expand(rows, start, np.maximum(start, end))
            held = g.table[r, c]
            g.pool.release(held[held != NULL_BLOCK])  # (release evicts the deepest first)
            g.table[r, c] = NULL_BLOCK
            g.held_from[rows] = 0
            self._pending.append(TableDelta(group=g.spec.name, clear_rows=rows.astype(np.int32)))
        self._num_tokens[rows] = 0
        self._committed[:, rows] = 0
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
            if live_start(g.spec, num_tokens) // g.block_size < g.held_from[row]:
                raise ValueError(
                    f"cannot truncate request {request_id!r} to {num_tokens} tokens: group "
                    f"{g.spec.name!r} already released the blocks before token "
                    f"{int(g.held_from[row]) * g.block_size}"
                )
        # The block the new end falls in will be written again. If another request shares
        # it, the request gets its own copy (copy on write, checked first: nothing changes
        # when a pool is short); if only the prefix cache knows it, its key goes.
        partial: list[tuple[_Group, int, int]] = []
        for g in self._groups:
            col = num_tokens // g.block_size
            if g.code == _PER_REQUEST or not num_tokens % g.block_size:
                continue
            block = int(g.table[row, col])
            if block != NULL_BLOCK:
                partial.append((g, col, block))
        wanted: dict[int, int] = {}  # pool -> fresh blocks the copies on write take
        for g, _, block in partial:
            if g.pool._ref[block] > 1:
                wanted[id(g.pool)] = wanted.get(id(g.pool), 0) + 1
                if wanted[id(g.pool)] > g.pool.num_free:
                    raise OutOfBlocksError(
                        "device", g.spec.name, wanted[id(g.pool)], g.pool.num_free,
                        "truncate (copy on write)",
                    )
        for g, col, block in partial:
            if g.pool._ref[block] > 1:
                [fresh] = g.pool.take(1).tolist()
                g.table[row, col] = fresh
                g.pool.release(np.array([block], dtype=np.int32))
                self._copies.append(
                    BlockCopy(g.spec.name, np.array([block], np.int32), np.array([fresh], np.int32))
                )
                self._pending.append(
                    TableDelta(
                        group=g.spec.name,
                        rows=np.array([row], dtype=np.int32),
                        cols=np.array([col], dtype=np.int32),
                        block_ids=np.array([fresh], dtype=np.int32),
                    )
                )
            elif g.pool.keys and block in g.pool.keys:
                key, end, _ = g.pool.keys.pop(block)  # type: ignore[misc]
                if g.cached.get(key) == block:
                    del g.cached[key]
                self._events.append(PrefixEvent("removed", g.spec.name, key, end))  # type: ignore[arg-type]
        self._hashers.pop(request_id, None)  # its chain held the rolled-back tokens
        for gi, g in enumerate(self._groups):
            if g.code == _PER_REQUEST:
                continue
            kept = num_tokens // g.block_size
            self._committed[gi, row] = min(int(self._committed[gi, row]), kept)
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
    def take_copies(self) -> tuple[BlockCopy, ...]:
        """Block copies due before the next step's kernels (copy on write by
        :meth:`truncate`), for an engine that runs them between steps; otherwise the next
        :meth:`schedule` returns them in ``copies_before``."""
        copies, self._copies = tuple(self._copies), []
        return copies

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
        for pool, members in self._pools:
            total = sum(totals[self._groups[gi].spec.name] for gi in members)
            if total > pool.num_free:
                name = self._groups[members[0]].spec.name
                raise OutOfBlocksError("device", name, total, pool.num_free, "swap_in")
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
            for gi, g in enumerate(self._groups):  # restored blocks are not registered again
                self._committed[gi, row] = entry.num_tokens // g.block_size
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
        arr = _token_array(ids, f"new_token_ids[{i}]")  # checked before anything changes
        if arr.size and int(arr.min()) < 0:
            raise ValueError(f"new_token_ids[{i}] holds a negative token id {int(arr.min())}")


def _token_array(tokens: object, name: str) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and (arr.dtype == bool or arr.dtype.kind not in "iu")):
        raise ValueError(f"{name} must be a 1-d sequence of int token ids, got {tokens!r:.80}")
    return arr.astype(np.int64, copy=False)


def _check_matches(matches: object, n: int) -> None:
    if isinstance(matches, str) or not isinstance(matches, Sequence) or len(matches) != n:
        raise ValueError(
            f"prefix_matches must be a sequence of {n} PrefixMatch or None, got {matches!r:.80}"
        )
    for i, m in enumerate(matches):
        if m is not None and not isinstance(m, PrefixMatch):
            raise TypeError(f"prefix_matches[{i}] is a {type(m).__name__}, not a PrefixMatch")


def _purpose(purpose: object) -> SwapPurpose:
    try:
        return SwapPurpose(purpose)
    except ValueError:
        raise ValueError(
            f"purpose must be one of {[p.value for p in SwapPurpose]}, got {purpose!r}"
        ) from None
