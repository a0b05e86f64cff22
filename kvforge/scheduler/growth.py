"""Growth of a step, over the tables: what each request needs per group, whether a batch fits
its pools in order, and applying it (release behind windows, then take new blocks).

Functions of :class:`~.tables.RequestTables`, called by ``BlockManager.schedule`` under its
lock. Every group releases before any group grows: groups that share a pool were checked
against the pool with all their releases counted.

A batch of one request that fits takes :func:`grow_one`, the same growth in Python ints (an
engine that calls the facade request by request pays numpy's per-call overhead otherwise);
``tests/scheduler/test_grow_one.py`` checks it gives the batch path's tables, pools, deltas
and refusals on random histories.
"""

from __future__ import annotations

import numpy as np

from kvforge.core.values import Refusal
from kvforge.scheduler.arena import SlabArena
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.scheduler.tables import RequestTables, expand

_SUM = np.add.reduce  # no Python-level wrapper per call

__all__ = [
    "apply_growth",
    "fits_in_order",
    "grow_one",
    "plan_growth",
    "prompt_fits",
    "schedule_one_by_one",
]


def plan_growth(
    t: RequestTables, rows: np.ndarray, fresh: np.ndarray, before: np.ndarray, after: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per group: (blocks needed, release from, release to, first new column)."""
    plans = []
    first_read = None  # the same for every group: computed once, when a group needs it
    for g in t.groups:
        if g.per_request:
            need = np.where(fresh, g.slots, 0).astype(np.int64)
            zero = np.zeros_like(need)
            plans.append((need, zero, zero, zero))
            continue
        bs = g.block_size
        old_len = (before + (bs - 1)) // bs  # cdiv (token counts are >= 0)
        need = (after + (bs - 1)) // bs - old_len
        if g.history:
            plans.append((need, old_len, old_len, old_len))
            continue
        # the first scheduled token (a new request: token 0); a step that schedules
        # nothing keeps the resting window, the newest token's view (see live_start)
        if g.plain_live:  # KindRule.live_starts, its first_read shared by the groups
            if first_read is None:
                first_read = np.where(after > before, before, np.maximum(before - 1, 0))
            start = g.rule.window_start(g.spec, first_read)
        else:
            start = g.rule.live_starts(g.spec, before, after)
        lo = g.held_from[rows]  # 0 for a new row, the shared tail's start after a hit
        hi = np.maximum(lo, np.minimum(start // bs, old_len))
        plans.append((need, lo, hi, old_len))
    return plans


def fits_in_order(
    t: RequestTables,
    pool: BlockPool | SlabArena,
    members: list[int],
    rows: np.ndarray,
    plans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> bool:
    """Whether every request of the batch, served in order, gets its blocks from
    ``pool`` (drawn on by the groups ``members``): each request's window releases count
    for itself and the requests after it (the same answer the one-by-one path gives, so
    the batch path never accepts more)."""
    if isinstance(pool, SlabArena):
        cumulative = {}
        for gi in members:
            g = t.groups[gi]
            left = plans[gi][0] - _credits(t, gi, rows, plans)
            cumulative[g.pool] = np.cumsum(left)
        return pool.fits_in_order(cumulative)
    free = pool.num_free
    need = plans[members[0]][0] if len(members) == 1 else sum(plans[gi][0] for gi in members)
    if int(_SUM(need)) <= free:
        return True
    credit = sum(_credits(t, gi, rows, plans) for gi in members)
    return bool((np.cumsum(need - credit) <= free).all())


def _credits(
    t: RequestTables,
    gi: int,
    rows: np.ndarray,
    plans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> np.ndarray:
    """Per request, the blocks of group ``gi`` its window releases give back to the pool."""
    credit = np.zeros(len(rows), dtype=np.int64)
    _, lo, hi, _ = plans[gi]
    if (hi > lo).any():
        g = t.groups[gi]
        index, c = expand(np.arange(len(rows)), lo, np.maximum(lo, hi))
        old = g.table[rows[index], c]
        gives = (old != NULL_BLOCK) & (g.pool.ref_counts[old] == 1)
        credit += np.bincount(index[gives], minlength=len(rows))
    return credit


def apply_growth(
    t: RequestTables,
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
    for g, (_, lo, hi, _) in zip(t.groups, plans, strict=True):
        if sel is not None:
            lo, hi = lo[sel], hi[sel]
            g_rows = rows[sel]
        else:
            g_rows = rows
        parts_r: list[np.ndarray] = []
        parts_c: list[np.ndarray] = []
        parts_v: list[np.ndarray] = []
        parts.append((parts_r, parts_c, parts_v))
        if g.windowed and (hi > lo).any():
            r, c = expand(g_rows, lo, hi)
            old = g.table[r, c]
            g.pool.release_held(old[old != NULL_BLOCK])  # the table's own cells
            g.table[r, c] = NULL_BLOCK
            g.held_from[g_rows] = hi
            parts_r.append(r)
            parts_c.append(c)
            parts_v.append(np.zeros(len(r), dtype=np.int32))
    _prepare_arenas(t, plans, sel)
    for g, (need, _, _, first_new), (parts_r, parts_c, parts_v) in zip(
        t.groups, plans, parts, strict=True
    ):
        g_rows = rows
        if sel is not None:
            need, first_new, g_rows = need[sel], first_new[sel], rows[sel]
        total = int(_SUM(need))
        if total:
            ids = g.pool.take(total)
            r, c = expand(g_rows, first_new, first_new + need)
            g.table[r, c] = ids
            parts_r.append(r)
            parts_c.append(c)
            parts_v.append(ids)
        if parts_r:
            t.record(g, np.concatenate(parts_r), np.concatenate(parts_c), np.concatenate(parts_v))


def _prepare_arenas(
    t: RequestTables,
    plans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    sel: np.ndarray | None,
) -> None:
    """Move slabs to the arena groups this growth takes from, all groups at once (taking
    one group at a time could hand one group the slabs another was counted on)."""
    for pool, members in t.arenas:
        needs = {}
        for gi in members:
            need = plans[gi][0] if sel is None else plans[gi][0][sel]
            needs[t.groups[gi].pool] = int(_SUM(need))
        pool.prepare(needs)


def schedule_one_by_one(
    t: RequestTables,
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
        for pool, members in t.capacity:
            if isinstance(pool, SlabArena):
                needs = {}
                for gi in members:
                    g, (g_need, lo, hi, _) = t.groups[gi], plans[gi]
                    credit = 0
                    if hi[i] > lo[i]:
                        old = g.table[rows[i], lo[i] : hi[i]]
                        old = old[old != NULL_BLOCK]
                        credit = int((g.pool.ref_counts[old] == 1).sum())
                    needs[g.pool] = int(g_need[i]) - credit
                missing = pool.shortfall(needs)
                if missing is not None:
                    short = Refusal(ids[i], "out_of_blocks", *missing)
                    break
                continue
            credit = need = 0
            for gi in members:
                g, (g_need, lo, hi, _) = t.groups[gi], plans[gi]
                need += int(g_need[i])
                if hi[i] > lo[i]:
                    old = g.table[rows[i], lo[i] : hi[i]]
                    old = old[old != NULL_BLOCK]
                    credit += int((pool.ref_counts[old] == 1).sum())
            available = pool.num_free + credit
            if need > available:
                # a shared pool is named by its first group that asked for blocks
                name = next(t.groups[gi].spec.name for gi in members if plans[gi][0][i])
                short = Refusal(ids[i], "out_of_blocks", name, need, available)
                break
        if short is not None:
            accept[i] = False
            refused.append(short)
            continue
        apply_growth(t, rows, fresh, before, after, plans, np.array([i]))
    return accept


# --- one request: the same growth in Python ints --------------------------------------------


def grow_one(t: RequestTables, row: int, fresh: bool, before: int, after: int) -> bool:
    """The growth of a batch of one request (``row``, from ``before`` to ``after`` tokens)
    when it fits its pools: what :func:`plan_growth`, :func:`fits_in_order` and
    :func:`apply_growth` do for a batch of one, in Python ints (numpy's per-call overhead
    dominates at one request). Same cells, same releases and takes in the same order, same
    deltas.

    Returns ``False``, having changed nothing, where the general path must decide: a slab
    arena, a kind with its own ``live_starts``, or a pool the request does not fit (its
    refusal is the general path's). ``tests/scheduler/test_grow_one.py`` compares the two on
    random states."""
    if t.arenas:
        return False
    plans = _plan_one(t, row, fresh, before, after)
    if plans is None:
        return False
    # a step that takes no block always fits, and one that neither takes nor releases
    # changes no cell (most decode steps: a block fills every block_size tokens)
    takes = releases = False
    for need, lo, hi, _ in plans:
        takes = takes or need > 0
        releases = releases or hi > lo
    if takes and not _fits_one(t, row, plans):
        return False
    if takes or releases:
        _apply_one(t, row, plans)
    return True


def _plan_one(
    t: RequestTables, row: int, fresh: bool, before: int, after: int
) -> list[tuple[int, int, int, int]] | None:
    """:func:`plan_growth` of one request: per group (blocks needed, release from, release
    to, first new column); ``None`` for a kind whose ``live_starts`` is its own."""
    plans = []
    for g in t.groups:
        if g.per_request:
            plans.append((g.slots if fresh else 0, 0, 0, 0))
            continue
        bs = g.block_size
        old_len = (before + (bs - 1)) // bs
        need = (after + (bs - 1)) // bs - old_len
        if g.history:
            plans.append((need, old_len, old_len, old_len))
            continue
        if not g.plain_live:
            return None
        first_read = before if after > before else max(before - 1, 0)
        start = int(g.rule.window_start(g.spec, first_read))
        lo = int(g.held_from[row])
        plans.append((need, lo, max(lo, min(start // bs, old_len)), old_len))
    return plans


def _fits_one(t: RequestTables, row: int, plans: list[tuple[int, int, int, int]]) -> bool:
    """:func:`fits_in_order` of one request, every pool (no arena): its needs fit the free
    blocks, its window releases counted."""
    for pool, members in t.capacity:
        need = plans[members[0]][0] if len(members) == 1 else sum([plans[gi][0] for gi in members])
        if not need or need <= pool.num_free:
            continue
        credit = 0
        for gi in members:
            _, lo, hi, _ = plans[gi]
            if hi > lo:
                old = t.groups[gi].table[row, lo:hi]
                old = old[old != NULL_BLOCK]
                credit += int(_SUM(pool.ref_counts[old] == 1))
        if need - credit > pool.num_free:
            return False
    return True


def _apply_one(t: RequestTables, row: int, plans: list[tuple[int, int, int, int]]) -> None:
    """:func:`apply_growth` of one request: every group releases behind its window, then
    every group takes its new blocks; one delta per group that changed."""
    # per group: the columns written and their new ids, as Python lists (a decode step
    # changes a cell or two per group: numpy's per-call overhead would dominate)
    parts: list[tuple[list[int], list[int]]] = []
    for g, (_, lo, hi, _) in zip(t.groups, plans, strict=True):
        cols: list[int] = []
        ids: list[int] = []
        parts.append((cols, ids))
        if g.windowed and hi > lo:
            old = g.table[row, lo:hi]  # a view: emptied in place below
            g.pool.release_listed([b for b in old.tolist() if b != NULL_BLOCK])  # own cells
            old[:] = NULL_BLOCK
            g.held_from[row] = hi
            cols += range(lo, hi)
            ids += [NULL_BLOCK] * (hi - lo)
    for g, (need, _, _, first_new), (cols, ids) in zip(t.groups, plans, parts, strict=True):
        if need:
            taken = g.pool.take(need)
            g.table[row, first_new : first_new + need] = taken
            cols += range(first_new, first_new + need)
            ids += taken.tolist()
        if cols:
            t.record_row(g, row, cols, ids)


def prompt_fits(t: RequestTables, num_tokens: int, chunk: int, match: object = None) -> bool:
    """Whether a new request of ``num_tokens`` prompt tokens, served ``match`` (a
    ``PrefixMatch`` or None) and prefilled ``chunk`` tokens a step, finds its peak blocks free
    now in every group: full groups every block of the prompt, window and state groups what
    they hold at rest plus one chunk's blocks (at most the prompt's), per-request groups their
    slots. Matched blocks already in use cost nothing more; evictable ones count, since taking
    them leaves the free count. Nothing changes (vLLM's whole-prompt admission,
    ``allocate_slots(full_sequence_must_fit=True)``)."""
    needs: list[int] = []
    for g in t.groups:
        if g.per_request:
            needs.append(g.slots)
            continue
        whole = -(-num_tokens // g.block_size)
        need = whole
        if not g.history:
            at_rest = g.spec.max_live_blocks(num_tokens)
            need = min(whole, at_rest + -(-chunk // g.block_size))
        held = getattr(match, "blocks", {}).get(g.spec.name)
        if held is not None and len(held):
            held = np.asarray(held)
            held = held[held != NULL_BLOCK]
            need -= int((g.pool.ref_counts[held] > 0).sum())
        needs.append(max(0, need))
    for pool, members in t.capacity:
        if isinstance(pool, SlabArena):
            if not pool.fits({t.groups[gi].pool: needs[gi] for gi in members}):
                return False
        elif sum(needs[gi] for gi in members) > pool.num_free:
            return False
    return True
