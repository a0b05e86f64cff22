"""Faults mid-bookkeeping: an exception that strikes while a swap is planned or completed,
``KeyboardInterrupt`` included, leaves consistent books.

Each test runs one swap (out or in, of two or three requests, on a GQA layout with a sliding
window and on DeepSeek-V4) once per fault point ``k``: the ``k``-th call of a pool or table
method raises ``KeyboardInterrupt`` (every ``k`` until the swap runs with no fault), or, for
the scheduler side alone, the ``k``-th line executed in the swap book and the tables does.
After each interrupt:

- every request is exactly one of running, swapped out, or in a plan still in flight;
- the pools hold exactly what the tables and the swapped requests hold: each device block's
  reference count is the number of table cells naming it (free rows name none), and the used
  host pages are those of swapped requests and of swap-out plans in flight;
- an interrupt while planning changed nothing; one while completing left the plan in flight
  exactly as it was, and completing it again settles it;
- then the swap finishes, the bytes come back intact (through the facade), and once every
  request is freed every pool is fully free.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import pytest
from _helpers import arena_manager, grow, sweep_checks, sweep_lines

from kvforge import CacheController, GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.core.swap_receipt import plan_receipt
from kvforge.core.values import PrefixQuery, SwapFailure, SwapPlan, SwapResult
from kvforge.errors import StepError
from kvforge.models import from_hf_config
from kvforge.scheduler import arena, block_pool, host_tier, swap_book, tables
from kvforge.scheduler.block_manager import BlockManager
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.scheduler.host_tier import HostTier
from kvforge.scheduler.prefix import commit
from kvforge.scheduler.prefix import index as prefix_index
from kvforge.scheduler.tables import RequestTables
from kvforge.verify import verify_request, write_request

# ------------------------------------------------------------------ the layouts


def gqa():
    return {0: GQABackend(2, 8, 4), 1: GQABackend(2, 8, 4, sliding_window=8)}


def deepseek_v4():
    return from_hf_config("deepseek-v4-tiny")


@dataclass(frozen=True, eq=False)
class Case:
    backends: Callable[[], object]
    lengths: dict[str, int]  # b's 44 GQA tokens are the 11 kv pages of the issue's example
    blocks: int  # device blocks and host pages per group


CASES = {
    "gqa": Case(gqa, {"a": 13, "b": 44, "c": 7}, 40),
    "deepseek_v4": Case(deepseek_v4, {"a": 300, "b": 41, "c": 700}, 80),
}
#: (direction, the requests swapped before the swap under test, the batch under test)
SWAPS = [
    ("out", [], ["a", "b"]),
    ("out", [], ["c", "a", "b"]),
    ("in", ["a", "b"], ["b", "a"]),
    ("in", ["a", "b", "c"], ["a", "c", "b"]),
]
SWAP_IDS = [f"{d}-{''.join(batch)}" for d, _, batch in SWAPS]

# ------------------------------------------------------------------ fault injection


class Interrupt:
    """Raise ``KeyboardInterrupt`` at the ``k``-th fault point, once."""

    def __init__(self, k: int) -> None:
        self.k, self.seen, self.fired = k, 0, False

    def point(self) -> None:
        self.seen += 1
        if self.seen == self.k:
            self.fired = True
            raise KeyboardInterrupt(f"fault point {self.k}")


@contextmanager
def on_call(owner: type, name: str, fault: Interrupt) -> Iterator[None]:
    """Fault points: the calls of ``owner.name``, before it does anything."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        fault.point()
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, wrapper)
        yield


TRACED = {swap_book.__file__, tables.__file__}
#: and the pools' own lines: a take or a release struck part way (issue 33's undo gap)
TRACED_POOLS = TRACED | {block_pool.__file__, arena.__file__}


@contextmanager
def on_line(fault: Interrupt, files: frozenset[str] | set[str] = TRACED) -> Iterator[None]:
    """Fault points: every line the swap book and the tables (or ``files``) execute (between
    any two of their statements). A trace function that raises is unset by Python, so it
    fires once."""

    def local(frame, event, arg):
        if event == "line":
            fault.point()
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename in files else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous)


def on_pool_line(fault: Interrupt) -> contextlib.AbstractContextManager[None]:
    """:func:`on_line` of the pools' lines too: a reference store, a push or the free
    count's store of a take or a release may be the last to run."""
    return on_line(fault, TRACED_POOLS)


CALLS = [
    ("release", lambda f: on_call(BlockPool, "release", f)),
    ("release_held", lambda f: on_call(BlockPool, "release_held", f)),
    ("take", lambda f: on_call(BlockPool, "take", f)),
    ("release_rows", lambda f: on_call(RequestTables, "release_rows", f)),
]
#: (method, direction) pairs a successful swap may never call: release_rows frees the rows of a
#: swap out through release_held (the table's own cells), so a swap out may call no plain
#: release; a swap in only takes device blocks and releases host pages
UNCALLED = {("release_rows", "in"), ("release_held", "in"), ("release", "out")}


def each_fault() -> Iterator[Interrupt]:
    """Interrupts at points 1, 2, ... until one does not fire (the swap ran through)."""
    k = 1
    while True:
        fault = Interrupt(k)
        yield fault
        if not fault.fired:
            return
        k += 1


# ------------------------------------------------------------------ the state checks


def scheduler_state(m: BlockManager) -> dict[str, object]:
    """Everything a swap may change, comparable with ``==``."""
    book = m._book  # the swap book's maps: the manager passes none of them through
    pools = {id(m.pool(g)): m.pool(g) for g in m.groups}
    return {
        "tables": {g: m.table(g).tolist() for g in m.groups},
        "refs": sorted((p.name, p.ref_counts.tolist()) for p in pools.values()),
        "host": {g: m.host_pool(g).ref_counts.tolist() for g in m.host_groups},
        "running": {r: m.row_of(r) for r in m.requests},
        "swapped": {r: book.swapped[r].host_pages for r in m.swapped_requests},
        "busy": dict(book.busy),
        "in_flight": [p.plan_id for p in book.plans_in_flight()],
        "free_rows": m.num_free_rows,
        "tokens": {r: m.num_tokens(r) for r in [*m.requests, *m.swapped_requests]},
    }


def check_books(m: BlockManager, requests: list[str]) -> dict[str, str]:
    """Assert the books are consistent; return where each request is."""
    book = m._book
    plans = book.plans_in_flight()
    busy = {mv.request_id: p for p in plans for mv in p.requests}
    assert busy.keys() == book.busy.keys()
    where = {}
    for r in requests:
        running, swapped = m.is_running(r), m.is_swapped(r)
        if r in busy:
            # a swap out in flight keeps the request running, a swap in keeps it swapped
            assert (running, swapped) == (
                (True, False) if busy[r].direction == "out" else (False, True)
            )
            where[r] = f"in flight {busy[r].direction}"
        else:
            assert running != swapped, f"request {r!r}: running={running}, swapped={swapped}"
            where[r] = "running" if running else "swapped"
    # device pools: a block's references are the table cells naming it; free rows name none
    pools: dict[int, tuple[BlockPool, list[str]]] = {}
    for g in m.groups:
        pools.setdefault(id(m.pool(g)), (m.pool(g), []))[1].append(g)
    in_flight_rows = {
        row
        for p in plans
        if p.direction == "in"
        for row in book._in_flight[p.plan_id].rows.values()
    }
    held_rows = sorted({m.row_of(r) for r in m.requests} | in_flight_rows)
    assert len(held_rows) + m.num_free_rows == m.max_num_seqs
    for pool, members in pools.values():
        cells = np.concatenate([m.table(g).ravel() for g in members])
        cells = cells[cells != NULL_BLOCK]
        expected = np.bincount(cells, minlength=pool.num_blocks)
        assert pool.ref_counts.tolist() == expected.tolist(), f"pool {pool.name!r}"
        free_rows = sorted(set(range(m.max_num_seqs)) - set(held_rows))
        assert not any(m.table(g)[free_rows].any() for g in members)
    # host pools: the pages of swapped requests and of swap-out plans in flight, each once
    pages: dict[str, list[int]] = {g: [] for g in m.host_groups}
    for r in m.swapped_requests:
        for g, ids in book.swapped[r].host_pages.items():
            pages[g] += ids.tolist()
    for p in plans:
        if p.direction == "out":
            for mv in p.requests:
                for g, ids in mv.host_pages.items():
                    pages[g] += ids.tolist()
    for g in m.host_groups:
        refs = m.host_pool(g).ref_counts
        assert sorted(pages[g]) == np.flatnonzero(refs).tolist() and refs.max(initial=0) <= 1
    return where


def check_all_free(m: BlockManager) -> None:
    for g in m.groups:
        assert m.num_free_blocks(g) == m.num_usable_blocks(g), g
    for g in m.host_groups:
        assert m.host_pool(g).num_used == 0, g
    assert m.num_free_rows == m.max_num_seqs and m._book.plans_in_flight() == ()


def settle(m: BlockManager, result: Callable[[SwapPlan], SwapResult]) -> None:
    """Complete every plan still in flight: what an engine does after an interrupt."""
    for plan in m._book.plans_in_flight():
        m.complete_swap(result(plan))


def executed(plan: SwapPlan) -> SwapResult:
    """The result a worker that executed ``plan`` answers (with its receipt): these tests
    drive the scheduler side alone."""
    return SwapResult(plan.plan_id, receipt=plan_receipt(plan))


def failed(plan: SwapPlan) -> SwapResult:
    return SwapResult(plan.plan_id, FAILED)


# ------------------------------------------------------------------ the scheduler side alone


def manager_for(case: Case, swapped: list[str], prefix: bool = False) -> BlockManager:
    """A fresh copy of the manager with ``case``'s requests grown (built once per case)."""
    base = _built(case, tuple(swapped), prefix)
    return copy.deepcopy(base, {id(base._lock): threading.RLock()})


@functools.cache
def _built(case: Case, swapped: tuple[str, ...], prefix: bool) -> BlockManager:
    layout = CacheLayout(case.backends())
    blocks = dict.fromkeys((g.name for g in layout.groups), case.blocks)
    m = BlockManager(layout, blocks, 8, 1024, enable_prefix_caching=prefix)
    m.init_host({g.name: case.blocks for g in layout.groups if layout.host_page_bytes(g.name)})
    tokens = {r: [i * 1000 + t for t in range(n)] for i, (r, n) in enumerate(case.lengths.items())}
    if prefix:  # b starts with a's first 12 tokens: it shares a's cached blocks
        tokens["b"][:12] = tokens["a"][:12]
    for r, n in case.lengths.items():
        done, match = 0, None
        if prefix:
            [match] = m.lookup([PrefixQuery(tokens[r])])
            done = match.num_tokens
        while done < n:
            count = min(64, n - done)
            step = m.schedule(
                [r],
                [count],
                new_token_ids=[tokens[r][done : done + count]] if prefix else None,
                prefix_matches=[match] if match is not None else None,
            )
            assert step.request_ids == (r,), step.refused
            m.end_step(step)
            done, match = done + int(step.num_new[0]), None
    if swapped:
        m.complete_swap(executed(m.plan_swap_out(list(swapped))))
    return m


FAILED = SwapFailure("copy", "", "RuntimeError", "the worker failed")


def run_manager_swap(m, direction, batch, ok, inject=None, fault=None, states=None) -> None:
    """Plan the swap, then complete it, with faults injected in each call (not in the state
    snapshots taken before each, into ``states``)."""
    region = (lambda: inject(fault)) if inject is not None else nullcontext
    if states is not None:
        states.append(scheduler_state(m))
    with region():
        plan = m.plan_swap_out(batch) if direction == "out" else m.plan_swap_in(batch)
    if states is not None:
        states.append(scheduler_state(m))
    with region():
        m.complete_swap(executed(plan) if ok else failed(plan))


def sweep_manager(
    case: Case, swapped, direction, batch, inject, ok=True, prefix=False, check=None, setup=None
):
    requests = list(case.lengths)
    fired = 0
    for fault in each_fault():
        m = manager_for(case, swapped, prefix)
        if setup is not None:
            setup(m)
        states: list = []
        try:
            run_manager_swap(m, direction, batch, ok, inject, fault, states)
        except KeyboardInterrupt:
            assert fault.fired
        else:
            assert not fault.fired
        where = check_books(m, requests)
        if check is not None:
            check(m)
        if fault.fired:
            fired += 1
            # struck while planning: nothing changed; while completing: the plan is still in
            # flight exactly as it was
            assert scheduler_state(m) == states[-1]
            if len(states) == 2:
                assert [where[r] for r in batch] == [f"in flight {direction}"] * len(batch)
                settle(m, executed if ok else failed)
            else:
                assert m._book.plans_in_flight() == ()
                run_manager_swap(m, direction, batch, ok)
        where = check_books(m, requests)
        moved = (direction == "out") == ok
        target = "swapped" if moved else "running"
        assert all(where[r] == target for r in batch), where
        assert all(
            where[r] == ("swapped" if r in swapped else "running")
            for r in requests
            if r not in batch
        )
        if check is not None:
            check(m)
        m.finish(requests)
        check_all_free(m)
    return fired


@pytest.mark.parametrize(("direction", "swapped", "batch"), SWAPS, ids=SWAP_IDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("method", "inject"), CALLS, ids=[c[0] for c in CALLS])
def test_manager_interrupted_at_every_call(case, direction, swapped, batch, method, inject):
    fired = sweep_manager(CASES[case], swapped, direction, batch, inject)
    assert fired >= (0 if (method, direction) in UNCALLED else 1)


@pytest.mark.parametrize(("direction", "swapped", "batch"), SWAPS[::2], ids=SWAP_IDS[::2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_manager_interrupted_at_every_line(case, direction, swapped, batch):
    assert sweep_manager(CASES[case], swapped, direction, batch, on_line) > 50


@pytest.mark.slow
@pytest.mark.parametrize(("direction", "swapped", "batch"), SWAPS[::2], ids=SWAP_IDS[::2])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("ok", [True, False], ids=["executed", "failed"])
def test_manager_interrupted_at_every_line_of_the_pools(case, direction, swapped, batch, ok):
    # a take or a release cut short inside the pool (between a count store and its push,
    # after the pushes and before the free count moves) is undone whole: the undo restores
    # the saved counts and rebuilds the free stack (BlockPool.restore_counts / put_back)
    # rather than popping the top of the stack
    fired = sweep_manager(CASES[case], swapped, direction, batch, on_pool_line, ok=ok)
    assert fired > 80


@pytest.mark.parametrize(("direction", "swapped", "batch"), SWAPS[::2], ids=SWAP_IDS[::2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_failed_swaps_interrupted_at_every_line(case, direction, swapped, batch):
    # a failed result gives back what the plan reserved; that too is all or nothing
    assert sweep_manager(CASES[case], swapped, direction, batch, on_line, ok=False) > 50


@pytest.mark.parametrize(("direction", "swapped", "batch"), SWAPS[:1] + SWAPS[2:3])
def test_shared_and_cached_blocks_interrupted_at_every_line(direction, swapped, batch):
    # with prefix caching b shares a's first blocks (two references, released twice in one
    # call) and released blocks become evictable rather than free: undone by share
    m = manager_for(CASES["gqa"], swapped, prefix=True)
    if not swapped:
        assert m.pool("kv").ref_counts.max() == 2
    fired = sweep_manager(CASES["gqa"], swapped, direction, batch, on_line, prefix=True)
    assert fired > 50


def check_keys(m: BlockManager) -> None:
    """No key names a block its pool may hand out: each key's block is served (its entry in
    place) and retained (in use, or evictable, never on the free stack)."""
    prefix = m._prefix  # the prefix cache's live key view: the manager passes none through
    for g in m.groups:
        pool, served = m.pool(g), m.registered_blocks(g)
        for key, block in prefix.cached_keys(g).items():
            assert block in served and served[block][0] == key, (g, block)
            assert pool.is_retained(block), (g, block)
            assert block not in pool._stack[: pool._num_free], (g, block)


def with_tier(m: BlockManager) -> None:
    """A host tier of 3 pages per group, some holding keys already, so that the swap's
    evictions demote device blocks and the demotions evict pages."""
    m.attach_host_tier(HostTier(dict.fromkeys(m.groups, 3), m.prefix_cache.records))
    for pool in {id(m.pool(g)): m.pool(g) for g in m.groups}.values():
        pool.evict(2)  # demoted: their pages hold keys, pinned until handed out
    m.take_effects()  # handed out: the pages are evictable
    m.offloads_before = {g: set(m.host_tier._index[g].values()) for g in m.groups}


def check_tier(m: BlockManager) -> None:
    """:func:`check_keys`, and no tier key naming a page its pool may hand out or a page
    whose bytes are not on their way: each indexed page holds its key's entry, is retained,
    and was indexed before the swap or has its offload queued."""
    check_keys(m)
    tier = m.host_tier
    for g in m.groups:
        pool, queued = tier.pool(g), {page for _, page in tier._offloads[g]}
        for key, page in tier._index[g].items():
            assert tier.page_key(g, page) == key and pool.is_retained(page), (g, page)
            assert page not in pool._stack[: pool._num_free], (g, page)
            assert page in queued or page in m.offloads_before[g], (g, page)
        # a page is held only by its queued offload (none is lost), and the worker is told
        # a page was released only once its key went (or for the key it is queued to take)
        assert set(np.flatnonzero(pool.ref_counts).tolist()) == queued, g
        assert set(tier._released[g]) & set(tier._index[g].values()) <= queued, g


def on_eviction_line(fault: Interrupt) -> contextlib.AbstractContextManager[None]:
    """:func:`on_line` of the pools' and the prefix index's lines: an eviction's listeners,
    its keeper and the pool's stores."""
    return on_line(fault, TRACED_POOLS | {prefix_index.__file__, host_tier.__file__})


def most_evictable(m: BlockManager) -> BlockPool:
    assert m.arena is not None
    return max(m.arena.pools, key=lambda p: p.num_evictable)


def arena_view(m: BlockManager) -> list:
    """The arena's pools, their slab counts checked against their blocks."""
    assert m.arena is not None
    m.arena.check()
    return [
        (p.ref_counts, p.num_free, p.free_stack, p.live, p.cached, list(p._evictable))
        for p in m.arena.pools
    ]


def same_pools(a: list, b: list) -> bool:
    return all(
        all(
            np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
            for x, y in zip(one, other, strict=True)
        )
        for one, other in zip(a, b, strict=True)
    )


def test_an_arena_eviction_struck_at_any_line_completes_or_changes_no_pool():
    """An arena pool's eviction (its slabs count their cached blocks) cut short at any line
    of the pool, the arena or the index: the pools are as before (the victims still
    evictable, some with no key) and the next eviction completes it, or it completed; the
    slab counts agree with the blocks either way (``ArenaBlockPool._free_victims`` counts
    them again after a run cut short)."""

    def view(m: BlockManager) -> list:
        check_keys(m)
        return arena_view(m)

    assert most_evictable(arena_manager()).num_evictable > 10
    lines: list = []
    evict = lambda m: most_evictable(m).evict(8)  # noqa: E731
    outcomes = sweep_lines(arena_manager, evict, view, same_pools, lines=lines)
    assert outcomes["rolled back"] > 10 and outcomes["completed"] >= 1, outcomes
    assert {"ArenaBlockPool._free_victims", "PrefixIndex.evicted"} <= {q for q, _ in lines}


def test_a_forget_struck_at_any_line_completes_or_changes_nothing():
    """``forget`` of an evictable block (the keeper dropped its key: it is free again) and
    of a block in use, cut short at any line, on a plain pool and on an arena pool: nothing
    changed, or it completed, the slab counts agreeing with the blocks either way."""
    plain = BlockPool(16, "g")

    def build_plain() -> BlockPool:
        pool = copy.deepcopy(plain)
        ids = pool.take(6).tolist()
        for b in ids:
            pool.retain(b)
        pool.release(ids[:4])  # four evictable, two in use
        return pool

    def view_plain(pool: BlockPool) -> tuple:
        free = pool._stack[: pool._num_free].tolist()
        held = np.flatnonzero(pool.ref_counts).tolist()  # each block exactly one of the three
        assert sorted(free + list(pool._evictable) + held) == list(range(1, pool.num_blocks))
        return (pool.ref_counts.tolist(), free, list(pool._evictable), pool._retained.tolist())

    for which in (0, 5):  # evictable, in use
        forget = lambda pool, which=which: pool.forget(sorted(pool._retained.nonzero()[0])[which])  # noqa: E731
        outcomes = sweep_lines(build_plain, forget, view_plain)
        assert outcomes["rolled back"] >= 2 and outcomes["completed"] >= 1, outcomes
    # an arena pool: its slab counts follow (ArenaBlockPool.forget counts them again)
    evictable = lambda m: most_evictable(m).forget(next(iter(most_evictable(m)._evictable)))  # noqa: E731
    lines: list = []
    outcomes = sweep_lines(arena_manager, evictable, arena_view, same_pools, lines=lines)
    assert outcomes["rolled back"] >= 2 and outcomes["completed"] >= 1, outcomes
    assert "ArenaBlockPool.forget" in {q for q, _ in lines}


def test_a_keyless_cached_block_moves_with_the_keyed_ones():
    # an eviction cut short after the keeper ran (PrefixIndex.evicted) and before the pool's
    # stores leaves its victim evictable with no key; an arena packing may move it
    m = arena_manager()
    p = most_evictable(m)
    index = m._prefix._index  # the index's own hooks, driven as the pool drives them
    keyless, served = itertools.islice(p._evictable, 2)
    index.evicted(p, np.array([keyless], dtype=np.int32))  # the keeper's part only
    key = index.served(p, served).key
    top = p._num_free
    dst = p._stack[:2].copy()
    p._move(np.array([keyless, served], dtype=np.int32), dst, p._stack[:top], top)
    assert index.served(p, int(dst[1])).key == key and index.served(p, int(dst[0])) is None
    check_keys(m)
    m.arena.check()


def packing_arena(group: str):
    """:func:`arena_manager` with group ``group``'s free slots all held and one more slab
    settled, packing forced on: its next take moves cached (keyed) blocks out of the busy
    slab to the new one (``ArenaBlockPool._pack``)."""
    m = arena_manager()
    assert m.arena is not None
    p = m.arena.pool(group)
    p.take(p.own_free - p.num_evictable)  # a holder outside the tables
    m.arena.prepare({p: p.blocks_per_slab})
    m.arena.packing, m.arena.pack_below = True, m.arena.geometry.num_slabs + 1
    m.arena.take_moves()  # settles the new slab's slots
    return m


def check_packing(m: BlockManager, before: dict) -> None:
    """What a packing leaves, whole or cut short: no key names a block its pool may hand out,
    a key's entry lives in one block only (its unit record is released once), every block is
    free, evictable or held exactly once, and every block that caches bytes it did not cache
    before the packing gets them by a recorded copy from a block that cached them."""
    check_keys(m)
    assert m.arena is not None
    m.arena.check()
    for g in m.groups:
        keys = [entry[0] for entry in m.registered_blocks(g).values()]
        assert len(keys) == len(set(keys)), g
    for p in m.arena.pools:
        free, idle = p.free_stack.tolist(), list(p._evictable)
        held = np.flatnonzero(p.ref_counts).tolist()
        assert len(free) + len(idle) + len(held) == len(set(free) | set(idle) | set(held))
        copies = {**p._moved}
        for b in idle:
            if b not in before[p.name]:
                assert copies.get(b) in before[p.name], (p.name, b)


def test_a_packing_struck_at_any_line_never_lets_a_key_name_a_free_block():
    """An arena packing (a take under pressure moves cached blocks to free slots of an
    emptier slab, their keys following, ``PrefixIndex.moved``) cut short at any line of the
    pool or the index: no key names a freed block, no entry lives twice, nothing is lost, and
    the pool then takes, packs and evicts as usual. Before, the moved blocks went back to
    the free stack before their keys followed them."""
    build = functools.partial(packing_arena, "c4_state")

    def cached_before() -> dict:
        m = build()
        return {p.name: set(p._evictable) for p in m.arena.pools}

    before = cached_before()
    # the packing part of a take of 3 (the take's own lines are its caller's to undo)
    pack = lambda m: m.arena.pool("c4_state")._pack(3)  # noqa: E731

    def check(m: BlockManager, struck_at) -> None:
        check_packing(m, before)
        p = m.arena.pool("c4_state")
        p.take(3)  # the next take packs and takes as usual
        p.evict(p.num_evictable)
        check_keys(m)
        m.arena.check()

    whole = build()
    pack(whole)
    assert whole.arena.moved_blocks == 3
    check_packing(whole, before)
    lines: list = []
    assert sweep_checks(build, pack, check, lines=lines) > 50
    assert {"ArenaBlockPool._move", "PrefixIndex.moved"} <= {q for q, _ in lines}


def test_a_slab_handed_over_struck_at_any_line_loses_no_capacity():
    """``SlabArena.prepare`` giving a group the free slabs and another group's idle slab
    (whose cached blocks it evicts), cut short at any line: each slab is free or owned, its
    blocks on its owner's free stack, in use or cached (``SlabArena.check``), no key names
    a freed block, and the prepare and the take then succeed. Before, a slab taken off its
    donor's free stack and not yet on the new owner's was lost for good."""
    name = "c128_state"

    def need(m: BlockManager) -> int:
        p = m.arena.pool(name)
        return p.own_free + p.blocks_per_slab * (len(m.arena.free_slabs()) + 1)

    count = need(arena_manager())
    prepare = lambda m: m.arena.prepare({m.arena.pool(name): count})  # noqa: E731

    def check(m: BlockManager, struck_at) -> None:
        m.arena.check()
        check_keys(m)
        prepare(m)
        m.arena.pool(name).take(count)
        m.arena.check()
        check_keys(m)

    whole = arena_manager()
    owners = whole.arena.owner.copy()
    prepare(whole)
    assert whole.arena.moves >= 1 and (whole.arena.owner != owners).sum() >= 6
    lines: list = []
    assert sweep_checks(arena_manager, prepare, check, lines=lines) > 50
    assert {"SlabArena._move", "ArenaBlockPool._free_victims"} <= {q for q, _ in lines}


def test_a_waiting_copy_struck_at_any_line_never_gets_a_free_block_its_key():
    # add_waiting retains the block before the key's list names it: struck between, a later
    # promotion never gives the key to a block back on the free stack
    layout = CacheLayout({0: GQABackend(2, 8, 4)})
    files = {prefix_index.__file__, block_pool.__file__}
    for fault in each_fault():
        m = BlockManager(layout, {"kv": 40}, 8, 1024, enable_prefix_caching=True)
        m.end_step(m.schedule(["a", "b"], [4, 4], [[1, 2, 3, 4], [5, 6, 7, 8]]))
        index, pool = m._prefix._index, m.pool("kv")
        a_block = index.block_of("kv", next(iter(index.keys_of("kv"))))
        entry = index.served(pool, a_block)
        b_block = next(b for b in m.table("kv")[m.row_of("b")].tolist() if b)
        group = m.group_tables[0]
        index.forget_block(group, b_block)  # b's block is about to hold a newer copy of a's key
        with contextlib.suppress(KeyboardInterrupt), on_line(fault, files):
            index.add_waiting(group, b_block, entry._replace(ref=None))
        m.finish(["b"])
        m.finish(["a"])
        pool.evict(pool.num_evictable)  # a's copy goes: the waiting copy, if listed, takes over
        check_keys(m)


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_eviction_struck_at_any_line_of_the_pool_or_the_index(case):
    # a swap in whose takes evict cached blocks: an eviction cut short leaves its victims
    # evictable, some with no key (the pool evicts them again, the index skips them), and
    # never a key naming a block the pool may hand out
    swapped, batch = SWAPS[2][1], SWAPS[2][2]
    fired = sweep_manager(
        CASES[case], swapped, "in", batch, on_eviction_line, prefix=True, check=check_keys
    )
    assert fired > 80


def test_a_demotion_struck_at_any_line_of_the_pools_the_index_or_the_tier():
    # the swap in's evictions demote device blocks into a host tier of 3 pages a group,
    # whose takes evict pages in turn: a key is indexed last, withdrawn first, on both tiers
    swapped, batch = SWAPS[2][1], SWAPS[2][2]
    m = manager_for(CASES["gqa"], swapped, True)
    with_tier(m)
    run_manager_swap(m, "in", batch, True)
    assert m.host_tier.pool("kv").evictions  # a take of a page evicts one, too
    fired = sweep_manager(
        CASES["gqa"], swapped, "in", batch, on_eviction_line, True, True, check_tier, with_tier
    )
    assert fired > 150


def test_retrying_with_a_failed_result_settles_too():
    # an interrupt while completing a swap out: the engine may also report the swap failed
    m = manager_for(CASES["gqa"], [])
    plan = m.plan_swap_out(["a", "b"])
    fault = Interrupt(2)
    with pytest.raises(KeyboardInterrupt), on_call(BlockPool, "release_held", fault):
        m.complete_swap(executed(plan))
    assert check_books(m, ["a", "b", "c"]) == {
        "a": "in flight out",
        "b": "in flight out",
        "c": "running",
    }
    m.complete_swap(failed(plan))
    assert check_books(m, ["a", "b", "c"]) == dict.fromkeys("abc", "running")
    with pytest.raises(ValueError, match=f"swap plan {plan.plan_id} is not in flight"):
        m.complete_swap(executed(plan))
    m.finish(["a", "b", "c"])
    check_all_free(m)


# ------------------------------------------------------------------ through the facade


def controller_for(
    case: Case, swapped: list[str], write: bool = True
) -> tuple[CacheController, dict[str, int]]:
    ctl = CacheController(case.backends())
    ctl.initialize_kv_cache(num_blocks=case.blocks, max_num_seqs=8, max_model_len=1024)
    ctl.initialize_host_cache(num_pages=case.blocks)
    written = {}
    for i, (r, n) in enumerate(case.lengths.items()):
        grow(ctl, r, n)
        if write:  # DeepSeek-V4's 512-wide entries take a second per request to write
            written[r] = write_request(ctl, r, seed=i, positions=range(n))
    if swapped:
        ctl.swap_out_many(swapped)
    return ctl, written


def check_resident_bytes(ctl: CacheController, written: dict[str, int]) -> None:
    """Every resident request still holds its own bytes (nothing is swapped in for it)."""
    for r in ctl.requests:
        if r in written:
            check = verify_request(ctl, r, seed=list(written).index(r))
            assert (check.entries, check.mismatched) == (written[r], 0), r


def check_bytes(ctl: CacheController, written: dict[str, int]) -> None:
    for r in ctl.requests + ctl.swapped_requests:
        if ctl.is_swapped(r):
            ctl.swap_in(r)
        if r in written:
            check = verify_request(ctl, r, seed=list(written).index(r))
            assert (check.entries, check.mismatched) == (written[r], 0), r


@pytest.mark.parametrize(("direction", "swapped", "batch"), SWAPS[::2], ids=SWAP_IDS[::2])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("method", "inject"), CALLS, ids=[c[0] for c in CALLS])
def test_facade_interrupted_at_every_call(case, direction, swapped, batch, method, inject):
    requests = list(CASES[case].lengths)
    fired = 0
    for fault in each_fault():
        ctl, written = controller_for(CASES[case], swapped, write=case == "gqa")
        m = ctl.scheduler
        before = scheduler_state(m)
        swap = ctl.swap_out_many if direction == "out" else ctl.swap_in_many
        target = "swapped" if direction == "out" else "running"
        try:
            with inject(fault):
                swap(batch)
        except KeyboardInterrupt:
            fired += 1
            # complete or rolled back, never half done: no plan is left in flight
            assert m._book.plans_in_flight() == ()
            where = check_books(m, requests)
            if not all(where[r] == target for r in batch):
                assert scheduler_state(m) == before  # rolled back: as before the call
                check_resident_bytes(ctl, written)
                swap(batch)
        where = check_books(m, requests)
        assert all(where[r] == target for r in batch), where
        check_bytes(ctl, written)
        ctl.free_requests(requests)
        check_all_free(m)
        ctl.free()
    assert fired >= (0 if (method, direction) in UNCALLED else 1)


def test_the_issue_example_loses_no_request_and_no_page():
    # a KeyboardInterrupt inside complete_swap during swap_out_many(["a", "b"]) made b vanish
    # and leaked its 11 host pages; then it left the plan in flight, so free_request was
    # refused and the pages stayed held for good. Now the swap rolls back.
    ctl, written = controller_for(CASES["gqa"], [])
    m = ctl.scheduler
    stats = ctl.stats.swaps_out
    with (
        pytest.raises(KeyboardInterrupt) as info,
        on_call(RequestTables, "release_rows", Interrupt(1)),
    ):
        ctl.swap_out_many(["a", "b"])
    assert "is still in flight, as it was before complete_swap" in info.value.__notes__[0]
    assert m._book.plans_in_flight() == ()
    assert check_books(m, ["a", "b", "c"]) == dict.fromkeys("abc", "running")
    assert ctl.host_pool_usage()["kv"] == (0, 39)  # the plan's 4 + 11 pages given back
    assert ctl.stats.swaps_out == stats
    check_resident_bytes(ctl, written)
    ctl.free_request("b")  # refused while the plan was left in flight
    ctl.swap_out_many(["a"])  # the worker heard of the released pages: a reuses them
    assert ctl.swapped_requests == ["a"] and ctl.requests == ["c"]
    check_bytes(ctl, written)
    ctl.free_requests(["a", "c"])
    check_all_free(m)


@pytest.mark.parametrize("case", sorted(CASES))
def test_freeing_a_swapped_request_interrupted_keeps_or_frees_all_its_pages(case):
    requests = list(CASES[case].lengths)
    for fault in each_fault():
        m = manager_for(CASES[case], ["a", "b"])
        before = scheduler_state(m)
        try:
            with on_call(BlockPool, "release", fault):
                m.finish(["b"])
        except KeyboardInterrupt:
            assert fault.fired
            assert check_books(m, requests) == {"a": "swapped", "b": "swapped", "c": "running"}
            assert scheduler_state(m) == before
            m.finish(["b"])
        assert check_books(m, ["a", "c"]) == {"a": "swapped", "c": "running"}
        assert not m.is_swapped("b") and not m.is_running("b")
        m.finish(["a", "c"])
        check_all_free(m)


def test_a_failed_fill_struck_at_any_line_leaves_no_key_on_its_page():
    # a remote fill whose bytes never arrived: its key goes before its page is unpinned, so
    # no lookup finds a page that holds nothing (or, once reused, another key's bytes)
    layout = CacheLayout({0: GQABackend(2, 8, 4)})
    key = bytes(range(1, 33))
    fired = 0
    for fault in each_fault():
        m = BlockManager(layout, {"kv": 40}, 8, 1024, enable_prefix_caching=True)
        tier = HostTier({"kv": 4}, m.prefix_cache.records)
        page = tier.reserve("kv", key, 16, None, None)
        with contextlib.suppress(KeyboardInterrupt), on_line(fault, {host_tier.__file__}):
            tier.filled("kv", [page], [False])
        fired += fault.fired
        pool = tier.pool("kv")
        assert not tier.holds("kv", key) or pool.ref_count(page) == 1, fault
        assert page not in pool._stack[: pool._num_free] or not tier.holds("kv", key)
    assert fired >= 5


@pytest.mark.parametrize(("case", "n"), [("gqa", 16), ("deepseek_v4", 64)])
def test_an_end_step_struck_at_any_line_of_its_registrations_holds_nothing_after(case, n):
    # the step's pins (blocks held for its snapshot copies and registrations) are released
    # whatever line of the registrations an interrupt strikes, each once; the step leaves
    # the open steps only once it is done, so an engine's retry finishes what was cut short
    files = {commit.__file__, prefix_index.__file__}
    tokens = np.arange(1, n + 1)
    fired = 0
    for fault in each_fault():
        m = manager_for(CASES[case], [], True)
        step = m.schedule(["d"], [n], new_token_ids=[tokens])
        assert step.request_ids == ("d",), step.refused
        with contextlib.suppress(KeyboardInterrupt), on_line(fault, files):
            m.end_step(step)
        fired += fault.fired
        check_keys(m)
        if step.step_id in m.open_steps:  # cut short before it was done: the engine retries
            m.end_step(step)
        with pytest.raises(StepError, match="already ended"):
            m.end_step(step)
        m.finish([*CASES[case].lengths, "d"])
        check_all_free(m)
    assert fired >= 5


def test_a_step_dropped_unended_struck_at_any_line_holds_nothing_after():
    # past MAX_OPEN_STEPS the oldest open step is dropped (its pins released, nothing
    # registered); cut short at any line of the drop, the step stays open until a later
    # drop or its end_step finishes it, and nothing stays pinned. Before, the step left the
    # open steps before its pins were released, and they stayed held for good.
    from kvforge.scheduler import block_manager

    files = {commit.__file__, block_manager.__file__, prefix_index.__file__}
    fired = 0
    for fault in each_fault():
        m = manager_for(CASES["gqa"], [], True)
        tokens = np.arange(1, 17 + block_manager.MAX_OPEN_STEPS) + 50_000
        [match] = m.lookup([PrefixQuery(tokens[:16])])
        steps = [m.schedule(["d"], [16], new_token_ids=[tokens[:16]], prefix_matches=[match])]
        assert m._open_steps[steps[0].step_id].pins  # the blocks it completes, pinned
        for i in range(16, 15 + block_manager.MAX_OPEN_STEPS):  # open steps of one token
            steps.append(m.schedule(["d"], [1], new_token_ids=[tokens[i : i + 1]]))
        assert len(m.open_steps) == block_manager.MAX_OPEN_STEPS
        with contextlib.suppress(KeyboardInterrupt), on_line(fault, files):
            m._drop_unended_steps()
        fired += fault.fired
        check_keys(m)
        for step in steps:
            if step.step_id in m.open_steps:  # cut short or not yet dropped: ended now
                m.end_step(step)
        m.finish([*CASES["gqa"].lengths, "d"])
        check_all_free(m)
    assert fired >= 5
