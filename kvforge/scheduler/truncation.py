"""Rolling a request back (:meth:`~.block_manager.BlockManager.truncate`), and the copy on
write that gives it its own copy of a shared block it will write again.

Speculative decoding rejects draft tokens: the request returns to its first ``num_tokens``
tokens. Three steps, over the tables of :mod:`.tables` and the prefix cache, called by the
block manager under its lock once it has checked the request's state (resident, no swap in
flight, in no open step):

1. :func:`check_truncation`: ``num_tokens`` is an int in ``[1, current]`` and no window group
   released a block the shorter request would need again (a window cannot regrow them).
2. :func:`copy_on_write`: the block the new end falls in (its last, partial block) will be
   written again. If another request shares it, the request takes a fresh block and a
   :class:`~kvforge.core.values.BlockCopy` queued in ``tables.copies`` copies the bytes
   before the next step's kernels; if only the prefix cache knows it, its key goes. Every pool
   (or arena) is checked first: a short pool raises and nothing changes.
3. :func:`release_tail`: blocks past the new end go back to their pools, their cells become
   null, and the row's committed count and token count shrink to the new end.

Steps 2 and 3 run under an undo journal (:mod:`.undo`): an exception at any line,
``KeyboardInterrupt`` included, puts back the cells they changed, the row's counts, the
pools' references (a fresh block taken, shared and tail blocks released), the queued copies
and deltas. Each change saves what it changes just before it happens, so a truncation within
one block (most rejected draft tokens) saves two counts. Two changes stay: the request's
registration chain ends and the prefix cache forgets the key of the block the new end falls
in. Each only loses a cache entry (a later hit recomputes), and neither may wait: the request
writes that block again.

Invariants: a refused truncation changes nothing; after a truncation the row holds exactly
``cdiv(num_tokens, B)`` columns per group (from ``held_from``), no block it holds is shared
where it will write, and every cell change is queued as a table delta. Tested in
``tests/scheduler/test_truncation.py`` and ``tests/scheduler/test_block_tables.py``.
"""

from __future__ import annotations

import numpy as np

from kvforge.core.values import BlockCopy
from kvforge.errors import OutOfBlocksError
from kvforge.kinds import live_start
from kvforge.scheduler.arena import ArenaBlockPool, SlabArena
from kvforge.scheduler.block_pool import NULL_BLOCK
from kvforge.scheduler.prefix import PrefixCache
from kvforge.scheduler.tables import GroupTable, RequestTables
from kvforge.scheduler.undo import Undo, save_cells, save_counts

__all__ = ["check_truncation", "copy_on_write", "release_tail", "truncate"]

_WHAT = "truncate (copy on write)"


def truncate(
    tables: RequestTables, prefix: PrefixCache, request_id: str, row: int, num_tokens: int
) -> None:
    """Roll the request in ``row`` back to its first ``num_tokens`` tokens (the three steps
    above, in order); all or nothing.

    Raises:
        ValueError: ``num_tokens`` out of range or below a released window block.
        OutOfBlocksError: a pool lacks the fresh blocks the copies on write need.
    """
    current = check_truncation(tables, request_id, row, num_tokens)
    undo = Undo()  # each change below registers its undo just before it happens
    try:
        save_counts(undo, tables, row)
        copy_on_write(tables, prefix, row, num_tokens, undo)
        prefix.end_chain(request_id)  # its chain held the rolled-back tokens
        release_tail(tables, row, current, num_tokens, undo)
    except BaseException as exc:
        undo.rollback(exc)
        raise


def check_truncation(tables: RequestTables, request_id: str, row: int, num_tokens: object) -> int:
    """Step 1: the row's current token count, once ``num_tokens`` is known to be a valid new
    end. Reads the row's token count and window extents; changes nothing.

    Raises:
        ValueError: ``num_tokens`` not an int in ``[1, current]``, or below a block a window
            group already released.
    """
    current = int(tables.num_tokens[row])
    if (
        not isinstance(num_tokens, int | np.integer)
        or isinstance(num_tokens, bool)
        or not 1 <= num_tokens <= current
    ):
        raise ValueError(
            f"num_tokens must be an int in [1, {current}] for request {request_id!r}, got "
            f"{num_tokens!r}"
        )
    for g in tables.groups:
        if not g.windowed:
            continue
        if live_start(g.spec, num_tokens) // g.block_size < g.held_from[row]:
            raise ValueError(
                f"cannot truncate request {request_id!r} to {num_tokens} tokens: group "
                f"{g.spec.name!r} already released the blocks before token "
                f"{int(g.held_from[row]) * g.block_size}"
            )
    return current


def copy_on_write(
    tables: RequestTables, prefix: PrefixCache, row: int, num_tokens: int, undo: Undo
) -> None:
    """Step 2: give the row its own copy of each shared block the new end falls in, and drop
    the prefix cache's key of each unshared one.

    Reads the row's cells and the pools' reference counts; changes, once every pool was found
    to have the blocks: the pools (a fresh block taken, the shared one released), the cell,
    ``tables.copies`` and ``tables.pending``, and the prefix cache (forgotten keys).

    ``undo``: the cells, takes and releases it makes can be put back.

    Raises:
        OutOfBlocksError: a pool or arena lacks the fresh blocks (nothing changed).
    """
    partial = _partial_blocks(tables, row, num_tokens)
    _check_copy_capacity(partial)
    for g, col, block in partial:
        if g.pool.ref_counts[block] > 1:
            save_cells(undo, g, row, col)
            [fresh] = undo.take(g.pool, 1).tolist()
            g.table[row, col] = fresh
            g.pool.release(np.array([block], dtype=np.int32))
            old, new = np.array([block], np.int32), np.array([fresh], np.int32)
            tables.copies.append(BlockCopy(g.spec.name, old, new, row))
            tables.record(g, np.array([row]), np.array([col]), np.array([fresh]))
        else:
            prefix.forget_block(g, block)


def _partial_blocks(
    tables: RequestTables, row: int, num_tokens: int
) -> list[tuple[GroupTable, int, int]]:
    """Per group (per-request groups aside), the held block that ``num_tokens`` ends inside:
    ``(group, column, block)``; none where the end is on a block boundary."""
    partial: list[tuple[GroupTable, int, int]] = []
    for g in tables.groups:
        col = num_tokens // g.block_size
        if g.per_request or not num_tokens % g.block_size:
            continue
        block = int(g.table[row, col])
        if block != NULL_BLOCK:
            partial.append((g, col, block))
    return partial


def _check_copy_capacity(partial: list[tuple[GroupTable, int, int]]) -> None:
    """Raise unless every pool (an arena: all its member pools together) has the fresh blocks
    the shared ``partial`` blocks need; then let each arena move slabs for them."""
    wanted: dict[int, int] = {}  # pool -> fresh blocks the copies on write take
    in_arena: dict[SlabArena, dict[ArenaBlockPool, int]] = {}
    for g, _, block in partial:
        if g.pool.ref_counts[block] > 1:
            if isinstance(g.pool, ArenaBlockPool):  # checked with its arena below
                in_arena.setdefault(g.pool.arena, {})[g.pool] = 1
                continue
            wanted[id(g.pool)] = wanted.get(id(g.pool), 0) + 1
            if wanted[id(g.pool)] > g.pool.num_free:
                raise OutOfBlocksError(
                    "device", g.spec.name, wanted[id(g.pool)], g.pool.num_free, _WHAT
                )
    for arena, needs in in_arena.items():
        missing = arena.shortfall(needs)
        if missing is not None:
            raise OutOfBlocksError("device", *missing, _WHAT)
    for arena, needs in in_arena.items():
        arena.prepare(needs)


def release_tail(
    tables: RequestTables, row: int, current: int, num_tokens: int, undo: Undo | None = None
) -> None:
    """Step 3: free the row's blocks past ``num_tokens`` (null cells, one delta per group that
    shrinks), cap its committed blocks at the whole blocks kept, and set its token count.

    Reads and changes the row's cells, the pools, ``tables.committed``, ``tables.pending`` and
    ``tables.num_tokens``; refuses nothing (step 1 checked the bounds). ``undo``: the cells
    and references it changes can be put back (the counts: by the caller)."""
    for gi, g in enumerate(tables.groups):
        if g.per_request:
            continue
        kept = num_tokens // g.block_size
        tables.committed[gi, row] = min(int(tables.committed[gi, row]), kept)
        new_len = -(-num_tokens // g.block_size)
        old_len = -(-current // g.block_size)
        if new_len == old_len:
            continue
        cols = np.arange(new_len, old_len)
        old = g.table[row, cols] if undo is None else save_cells(undo, g, row, cols)
        g.pool.release(old[old != NULL_BLOCK])
        g.table[row, cols] = NULL_BLOCK
        tables.record(g, np.full(len(cols), row), cols, np.zeros(len(cols), dtype=np.int32))
    tables.num_tokens[row] = num_tokens
