"""The stages of one scheduler step (:meth:`~.block_manager.BlockManager.schedule`), in order.

``BlockManager.schedule`` is a short driver that holds the manager's lock and runs these stages
over one :class:`StepBatch`; each stage is a function given exactly the parts it needs (the
tables, the prefix cache, the swap book, the arena): none reads the manager itself.

1. :func:`check_batch`: validate the call and find each request's row; raises on a malformed
   batch, before anything changes.
2. :func:`admit`: give each new request a free table row (``max_num_seqs`` refusals).
3. :func:`adopt`: new requests with a prefix hit take its blocks (``stale_prefix`` refusals).
4. :func:`bound`: the step's token counts (cut at a snapshot boundary) and ``max_model_len``
   refusals.
5. :func:`grow`: release blocks behind windows and take new ones, for the whole batch at once
   when it fits, else request by request (``out_of_blocks`` refusals); a batch of one that
   fits takes :func:`~.growth.grow_one`, the same growth in Python ints.
6. :func:`give_back_refused`: a refused new request returns what stages 2 and 3 gave it.
7. :func:`commit`: accepted requests keep their rows and token counts; the prefix cache records
   the step's hits and completed blocks.

The per-request path: a batch of one running request that registers nothing (no token ids,
no prefix matches, prefix caching off), the call ``CacheController.allocate`` makes each step,
is checked and bounded by :func:`one_running` and grown by :func:`~.growth.grow_one`, both in
Python ints, and committed by ``BlockManager._schedule_one``; whatever either declines (a new
request, a refusal, an arena, a malformed call) these stages decide, with their words.

All or nothing per request: a request refused at any stage ends the step exactly as it started
it (its row back on the free stack, its adopted blocks released, no table cell changed, no
delta queued); the requests after it proceed. Refusals come back in request order.

Invariants checked by ``tests/scheduler/test_step_stages.py`` (each stage on its own) and by
the scheduler's tests of ``schedule`` (``tests/scheduler/test_block_tables.py``,
``test_step_semantics.py``, ``tests/properties``).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np

from kvforge.core.values import BlockCopy, PrefixMatch, Refusal
from kvforge.errors import RequestStateError
from kvforge.scheduler.arena import SlabArena, packing
from kvforge.scheduler.args import batch_ids, check_matches, check_token_ids, new_token_counts
from kvforge.scheduler.growth import (
    apply_growth,
    fits_in_order,
    grow_one,
    plan_growth,
    schedule_one_by_one,
)
from kvforge.scheduler.prefix import PrefixCache
from kvforge.scheduler.swap_book import SwapBook
from kvforge.scheduler.tables import RequestTables

__all__ = [
    "StepBatch",
    "admit",
    "adopt",
    "bound",
    "check_batch",
    "commit",
    "give_back_refused",
    "grow",
    "one_running",
]


_ALL = slice(None)  # every entry (an index that copies nothing)


@dataclass(slots=True, eq=False)
class StepBatch:
    """One step's batch as the stages see it (arrays, one entry per request, in call order).

    Attributes:
        ids: the request ids.
        new: ``int64``: tokens each grows by (cut by :func:`bound` at a snapshot boundary).
        rows: ``int64``: each request's table row; ``-1`` for a new request without one.
        fresh: ``bool``: the request is new (held no row when the step began).
        n_fresh: how many are new.
        accept: ``bool``: still accepted (stages clear entries as they refuse).
        refused: the refusals so far (any order; :func:`commit` sorts them).
        safe_rows: ``rows`` with ``-1`` as ``0`` (index-safe; a refused entry's row is unused).
        before: tokens each held when the step began (0 for a new or refused new request).
        after: ``before + new``.
        adopted: index -> the prefix hit an accepted new request adopted.
        kept_ids: the accepted ids, in order (set by :func:`commit`).
        kept: index of the accepted entries (set by :func:`commit`): a ``slice`` when all
            are, else ``accept``.
    """

    ids: list[str]
    new: np.ndarray
    rows: np.ndarray
    fresh: np.ndarray
    n_fresh: int
    accept: np.ndarray
    refused: list[Refusal]
    adopted: dict[int, PrefixMatch]
    safe_rows: np.ndarray | None = None
    before: np.ndarray | None = None
    after: np.ndarray | None = None
    kept_ids: tuple[str, ...] = ()
    kept: slice | np.ndarray | None = None


def check_batch(
    tables: RequestTables,
    book: SwapBook,
    request_ids: Sequence[str],
    num_new_tokens: Sequence[int] | np.ndarray,
    new_token_ids: Sequence[Sequence[int]] | None,
    prefix_matches: Sequence[PrefixMatch | None] | None,
) -> StepBatch:
    """Stage 1: validate a step's arguments and find each request's row.

    Reads ``tables.row_of`` and the book's ``swapped`` and ``busy`` maps; changes nothing.

    Raises:
        RequestStateError: a swapped-out request, or one with a swap in flight.
        ValueError / TypeError: bad or repeated ids, counts of the wrong kind or length,
            token ids that do not match the counts, a prefix match for a running request.
    """
    ids = batch_ids(request_ids)
    new = new_token_counts(num_new_tokens, len(ids))
    if new_token_ids is not None:
        check_token_ids(new_token_ids, new)
    if prefix_matches is not None:
        check_matches(prefix_matches, len(ids))
    row_of, swapped, busy = tables.row_of, book.swapped, book.busy
    rows = np.array([row_of.get(rid, -1) for rid in ids], dtype=np.int64)  # -1: new
    fresh = rows < 0
    # nothing to refuse without swaps or matches
    if swapped or busy or prefix_matches is not None:
        _refuse_malformed(ids, fresh, swapped, busy, prefix_matches)
    n_fresh = int(np.count_nonzero(fresh))
    return StepBatch(ids, new, rows, fresh, n_fresh, np.ones(len(ids), dtype=bool), [], {})


def one_running(
    tables: RequestTables,
    book: SwapBook,
    request_id: object,
    num_new_tokens: object,
    max_model_len: int,
) -> tuple[str, int, int, int] | None:
    """Stages 1, 2 and 4 of a batch of one running request, in Python ints:
    ``(request_id, row, before, after)`` when the request holds a row, has no swap in flight,
    grows by a plain int count (``[n]``, ``n >= 0``) and stays within ``max_model_len``.

    ``None`` where the general stages must decide (a new request, a refusal, a malformed
    call, which they refuse with its message). Reads only; changes nothing."""
    if type(request_id) is not str or type(num_new_tokens) not in (list, tuple):
        return None
    if len(num_new_tokens) != 1:
        return None
    new = num_new_tokens[0]
    if type(new) is not int or new < 0:
        return None
    row = tables.row_of.get(request_id)
    if row is None or (book.busy and request_id in book.busy):
        return None
    before = int(tables.num_tokens[row])
    after = before + new
    if after > max_model_len:
        return None
    return request_id, row, before, after


def _refuse_malformed(
    ids: list[str],
    fresh: np.ndarray,
    swapped: Container[str],
    busy: Container[str],
    prefix_matches: Sequence[PrefixMatch | None] | None,
) -> None:
    """The first request, in order, that cannot be in a step at all (raises)."""
    for i, rid in enumerate(ids):
        if fresh[i] and rid in swapped:
            raise RequestStateError(
                f"request {rid!r} is swapped out; swap it in before scheduling it"
            )
        if rid in busy:
            raise RequestStateError(f"request {rid!r} has a swap in flight")
        if not fresh[i] and prefix_matches is not None and prefix_matches[i] is not None:
            raise ValueError(
                f"prefix_matches[{i}] is given for request {rid!r}, which is already "
                "running; a match applies to a new request only"
            )


def admit(batch: StepBatch, tables: RequestTables, max_num_seqs: int) -> None:
    """Stage 2: pop a free table row for each new request, in order; refuse the new requests
    past the last free row (``max_num_seqs``).

    Reads and changes ``tables.free_rows``; sets ``batch.rows`` of the admitted, ``accept``
    and ``refused`` of the others, and ``batch.safe_rows``. Undone for a request refused later
    by :func:`give_back_refused`.
    """
    if batch.n_fresh:
        free_rows = tables.free_rows
        fresh_idx = np.flatnonzero(batch.fresh)
        if batch.n_fresh > len(free_rows):
            for i in fresh_idx[len(free_rows) :]:
                batch.accept[i] = False
                batch.refused.append(Refusal(batch.ids[i], "max_num_seqs", "", 1, max_num_seqs))
            fresh_idx = fresh_idx[: len(free_rows)]
        batch.rows[fresh_idx] = [free_rows.pop() for _ in range(len(fresh_idx))]
    rows = batch.rows
    batch.safe_rows = np.where(rows < 0, 0, rows)


def adopt(
    batch: StepBatch,
    prefix: PrefixCache,
    prefix_matches: Sequence[PrefixMatch | None] | None,
) -> None:
    """Stage 3: each admitted new request adopts its prefix hit (``prefix_matches[i]``, or
    none) through ``prefix.adopt``: its row starts at the hit's tokens, sharing its blocks.

    Reads the matches; changes the prefix cache (the request's chain, references on the
    matched blocks, the step's pins) and the request's table row; records each hit kept in
    ``batch.adopted``. A match the cache no longer holds refuses the request
    (``stale_prefix``). Undone for a request refused later by :func:`give_back_refused`.
    """
    ids, rows = batch.ids, batch.rows
    for i in np.flatnonzero(batch.fresh & batch.accept):
        match = prefix_matches[i] if prefix_matches is not None else None
        stale, match = prefix.adopt(ids[i], int(rows[i]), match)
        if stale is not None:
            batch.accept[i] = False
            batch.refused.append(Refusal(ids[i], "stale_prefix", stale, 0, 0))
        elif match is not None and match.num_tokens:
            batch.adopted[int(i)] = match


def bound(
    batch: StepBatch,
    tables: RequestTables,
    snapshot_interval: int | None,
    max_model_len: int,
) -> None:
    """Stage 4: the step's token counts: ``before`` (what each row holds; 0 for a refused new
    request), ``new`` cut to end on the next snapshot boundary when ``snapshot_interval`` is
    given (per-request groups with prefix caching), and ``after``; a request that would grow
    past ``max_model_len`` is refused.

    Reads ``tables.num_tokens``; changes only ``batch``.
    """
    accept = batch.accept
    before = np.where(batch.fresh & ~accept, 0, tables.num_tokens[batch.safe_rows])
    new = batch.new
    if snapshot_interval is not None:
        due = (before // snapshot_interval + 1) * snapshot_interval
        new = batch.new = np.minimum(new, due - before)
    after = before + new
    too_long = after > max_model_len
    if too_long.any():
        for i in np.flatnonzero(too_long & accept):
            accept[i] = False
            batch.refused.append(
                Refusal(batch.ids[i], "max_model_len", "", int(after[i]), max_model_len)
            )
    batch.before, batch.after = before, after


def grow(batch: StepBatch, tables: RequestTables, arena: SlabArena | None, pack: bool) -> None:
    """Stage 5: release the blocks behind each window and take the new blocks
    (:mod:`.growth`), in one pass when every request fits its pools in order, else request by
    request, refusing those a pool cannot serve (``out_of_blocks``).

    Changes the pools, the table cells of accepted requests and ``tables.pending`` (one delta
    per group); an arena's takes may move cached blocks when ``pack`` (its moves are handed
    out with the step). A refused request's cells and pools are never touched.
    """
    rows, fresh, before, after = batch.safe_rows, batch.fresh, batch.before, batch.after
    if len(rows) == 1 and batch.accept[0]:  # one request: Python ints when it fits
        with packing(arena, pack):
            if grow_one(tables, int(rows[0]), bool(fresh[0]), int(before[0]), int(after[0])):
                return
    plans = plan_growth(tables, rows, fresh, before, after)
    with packing(arena, pack):  # takes may move cached blocks
        if batch.accept.all() and all(
            fits_in_order(tables, pool, members, rows, plans) for pool, members in tables.capacity
        ):
            apply_growth(tables, rows, fresh, before, after, plans, None)
        else:
            batch.accept = schedule_one_by_one(
                tables, batch.ids, rows, fresh, before, after, plans, batch.accept, batch.refused
            )


def give_back_refused(batch: StepBatch, tables: RequestTables, prefix: PrefixCache) -> None:
    """Stage 6, the undo of stages 2 and 3: a refused new request gives its adopted hit back
    (``prefix.unadopt``), ends its chain, and returns its row to ``tables.free_rows``."""
    ids, rows, adopted = batch.ids, batch.rows, batch.adopted
    for i in (batch.fresh & ~batch.accept).nonzero()[0]:
        if int(i) in adopted:
            prefix.unadopt(int(rows[i]), adopted.pop(int(i)))
        prefix.end_chain(ids[i])
        if rows[i] >= 0:
            tables.free_rows.append(int(rows[i]))


def commit(
    batch: StepBatch,
    tables: RequestTables,
    prefix: PrefixCache,
    new_token_ids: Sequence[Sequence[int]] | None,
) -> tuple[list[BlockCopy], list[BlockCopy]]:
    """Stage 7: the accepted requests keep what they grew.

    Takes the copies due before the step (``tables.copies``, copy on write) and adds the
    restore copies and table deltas of each adopted hit; maps each accepted new request to its
    row (``tables.row_of``) and sets every accepted row's token count; the prefix cache
    records the blocks the step completes (``prefix.commit``, when it tracks requests). Sets
    ``batch.kept_ids`` / ``batch.kept`` and sorts ``batch.refused`` into request order.
    Nothing here refuses.

    Returns:
        ``(copies_before, copies_after)`` of the step.
    """
    ids, rows, accept = batch.ids, batch.rows, batch.accept
    copies_before: list[BlockCopy] = tables.copies
    tables.copies = []
    for i, match in batch.adopted.items():
        copies_before += prefix.record_adoption(int(rows[i]), match)
    if batch.n_fresh:
        for i in (batch.fresh & accept).nonzero()[0]:
            tables.row_of[ids[i]] = int(rows[i])
    if accept.all():
        batch.kept_ids, batch.kept = tuple(ids), _ALL
    else:
        batch.kept_ids = tuple(r for r, a in zip(ids, accept, strict=True) if a)
        batch.kept = accept
    safe_rows, before, after = batch.safe_rows, batch.before, batch.after
    tables.num_tokens[safe_rows[batch.kept]] = after[batch.kept]
    copies_after: list[BlockCopy] = []
    if prefix.tracks_requests:
        for i in np.flatnonzero(accept):
            tokens = None if new_token_ids is None else new_token_ids[i]
            copies_after += prefix.commit(
                ids[i], int(safe_rows[i]), int(before[i]), int(after[i]), tokens
            )
    batch.refused.sort(key=lambda r: ids.index(r.request_id))
    return copies_before, copies_after
