"""The scheduler side's step: rows, growth, release, truncation and finish, over the tables of
:mod:`.tables`, with the prefix cache (:mod:`.prefix_cache`) and the swap book
(:mod:`.swap_book`) as its two parts.

:class:`BlockManager` holds no device memory and no torch tensor. It decides which blocks
every request holds and returns plain values (:mod:`kvforge.core.values`) that a
worker process applies to its device caches. One call per engine step grows every scheduled
request (:meth:`BlockManager.schedule`); the cost of that call depends on the tokens scheduled
in the step, never on the tokens a request already holds. ``schedule`` is a short driver
that holds the lock and runs the stages of :mod:`.step_stages` (admission, adoption of prefix
hits, growth, commit); ``truncate`` and its copy on write live in :mod:`.truncation`.

Block tables are arrays: per group one ``int32 [max_num_seqs, max_blocks_per_req]`` table,
one row per running request, updated in place. A request of ``n`` tokens uses columns
``0 .. cdiv(n, block_size) - 1``; a window group keeps ``NULL_BLOCK`` in the columns it has
released::

    sliding window W = 128, block 64, after a step that took the request to 300 tokens
    col:    0      1      2      3      4
          | null | null |  17  |  18  |  22  |      tokens 128..299 still held
                          ^ held_from

Growth of a step (:mod:`.growth`, the growth stage of :meth:`BlockManager.schedule`), all on
arrays, per group:

1. *release*: blocks wholly before the first token the step's kernels read go back to the
   pool: for a window of ``W`` tokens that is ``num_computed + 1 - W`` (the first scheduled
   token reads ``W - 1`` tokens back); for a chunked group the start of the first scheduled
   token's chunk. Blocks that slide out *during* the step stay until the request's next step,
   because the kernel writes the whole chunk before it reads it: a 512-token prefill chunk
   through a 128-token window holds slots for all 512 tokens.
2. *grow*: new blocks for columns ``cdiv(num_computed, B) .. cdiv(num_computed + num_new, B)``.
3. *record*: the cells written in 1 and 2 become one :class:`TableDelta` per group
   (``RequestTables.record``, the one place a table delta is built).

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

Locks and the tiers (``tests/scheduler/test_host_tier_seams.py``,
``tests/scheduler/test_host_tier.py``): every public method of :class:`BlockManager` takes
its one ``RLock`` for the whole call and nothing else; it is the only lock on the scheduler
side. Its parts (pools, tables, the prefix cache, the swap book, the host tier) have none
and are entered only from inside its methods, with that lock held by the manager itself: a
pool's eviction listeners and keeper run inside the take that evicts, the host tier's
write-through inside the step that registers a block. No module takes another module's lock:
a caller that needs a part reaches it through a method here (``attach_host_tier``,
``take_tier_offloads``, ``reset_host_tier``, ``prompt_plan``).

Pins of the host tier: a device pool's eviction demotes a served block into a tier page,
pinned until the step (or :meth:`BlockManager.take_effects`,
:meth:`BlockManager.take_tier_offloads`) that hands its offload out; a lookup pins the pages
it brings back and holds the device blocks it fills until the step that hands their onloads
out. The tier alone unpins, when it hands a copy out; whoever receives the copy runs it on
the worker before the block is written again or read (:mod:`kvforge.scheduler.host_tier`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvforge._checks import ArgumentError, check_int, locked
from kvforge.core.arena import ArenaGeometry
from kvforge.core.layout import CacheLayout, check_share_pools, resolve_max_model_len, table_widths
from kvforge.core.memory_plan import DEFAULT_MAX_NUM_SEQS, check_allocatable
from kvforge.core.prefix_keys import Algorithm
from kvforge.core.values import (
    BlockCopy,
    PageCopy,
    PrefixEvent,
    PrefixMatch,
    PrefixQuery,
    StepAllocation,
    SwapPlan,
    SwapResult,
    TableDelta,
    check_request_id,
)
from kvforge.errors import RequestStateError, StepError
from kvforge.scheduler import step_stages, truncation
from kvforge.scheduler.arena import SlabArena, check_arena
from kvforge.scheduler.args import batch_ids
from kvforge.scheduler.block_pool import BlockPool
from kvforge.scheduler.growth import prompt_fits
from kvforge.scheduler.host_tier import (
    HostTier,
    check_attachable,
    check_host_tier_policy,
    check_snapshot_policy,
    check_tier_groups,
)
from kvforge.scheduler.prefix import (
    DEFAULT_PREFIX_RETENTION,
    PrefixCache,
    PrefixStats,
    Retention,
    StepWork,
    host_lookup,
)
from kvforge.scheduler.swap_book import SwapBook, SwapStats
from kvforge.scheduler.tables import GroupTable, RequestTables
from kvforge.specs import SwapPurpose

__all__ = ["MAX_OPEN_STEPS", "BlockManager", "PrefixStats", "SwapStats"]

MAX_OPEN_STEPS = 16
"""Steps scheduled and not yet ended that a scheduler keeps (engines have one or two)."""
_LISTS = (list, tuple)
# the rows and counts of a step of no request (``take_effects``): empty, so one of each serves
_NO_ROWS, _NO_COUNTS = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)


def _build_pools(
    layout: CacheLayout,
    num_blocks: Mapping[str, int],
    share_pools: bool,
    arena: ArenaGeometry | None,
) -> tuple[SlabArena | None, dict[str, BlockPool]]:
    """The slab arena (if any) and group -> device pool: one pool per set of groups that
    share one (``share_pools``), an arena's groups their arena pools.

    Raises:
        ValueError: ``num_blocks`` has no count for a group, or a bad ``arena``.
    """
    names = [g.name for g in layout.groups]
    missing = [n for n in names if n not in num_blocks]
    if missing:
        raise ValueError(f"num_blocks has no count for groups {missing} (groups: {names})")
    pools: dict[str, BlockPool] = {}
    slabs = None if arena is None else check_arena(layout, arena, num_blocks, share_pools)
    if slabs is not None:
        pools.update({p.name: p for p in slabs.pools})
    for members in layout.pools(share_pools, num_blocks):
        if members[0] in pools:
            continue
        pool = BlockPool(num_blocks[members[0]], "+".join(members))
        pools.update(dict.fromkeys(members, pool))
    return slabs, pools


def _snapshot_interval(value: object, boundary: int) -> int:
    """``value`` (default: the first multiple of ``boundary`` at or above 512), refused
    (:class:`ValueError`) unless a positive multiple of ``boundary``."""
    if value is None:
        return boundary * -(-512 // boundary)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value % boundary:
        raise ValueError(
            f"snapshot_interval must be a positive multiple of {boundary} (the LCM of "
            f"the groups' block sizes), got {value!r}"
        )
    return value


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
        key_algorithm: the digest of the prefix keys: ``"sha256"`` (default), ``"blake2b"``,
            or a callable ``bytes -> bytes`` (tests inject weak ones to force collisions,
            which the exact check turns into counted misses; see ``docs/prefix_keys.md``).
        prefix_retention: which completed sliding-window and state blocks stay reusable:
            ``"dense"`` (every one a boundary's tail needs) or ``"checkpoints"`` (only the
            tails where a later prompt can end: each prompt's replay boundary and the
            junctions lookups find, as vLLM 0.33 keeps them by default); see
            :func:`~kvforge.scheduler.prefix.check_prefix_retention`.
        prefix_retention_interval: with ``"checkpoints"``, also keep the tail at every
            multiple of this many tokens (a multiple of :attr:`boundary`); ``None``: none.

    Raises:
        ValueError: a bad count, ``num_blocks`` that does not name every group, or (with
            ``share_pools``) different counts for the groups of one pool; a bad
            ``prefix_retention`` or ``prefix_retention_interval``.
    """

    def __init__(
        self,
        layout: CacheLayout,
        num_blocks: Mapping[str, int],
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = False,
        snapshot_interval: int | None = None,
        share_pools: bool = True,
        key_algorithm: Algorithm = "sha256",
        prefix_retention: Retention = DEFAULT_PREFIX_RETENTION,
        prefix_retention_interval: int | None = None,
        arena: ArenaGeometry | None = None,
    ) -> None:
        # prefix_retention and its interval are checked once, by the prefix cache built
        # below (check_prefix_retention, against the boundary these pools give)
        self.layout = layout
        self.share_pools = check_share_pools(share_pools)
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, minimum=1)
        self.arena, pools = _build_pools(layout, num_blocks, share_pools, arena)
        self.max_model_len = resolve_max_model_len(layout, num_blocks, max_model_len)
        widths = table_widths(layout, self.max_num_seqs, self.max_model_len)
        check_allocatable(4 * self.max_num_seqs * sum(widths.values()), "cpu", "block tables")
        groups = [
            GroupTable.create(g, pools[g.name], self.max_num_seqs, widths[g.name])
            for g in layout.groups
        ]
        sizes = [g.block_size for g in groups if not g.per_request]
        self.boundary = math.lcm(*sizes) if sizes else 1
        self.snapshot_interval = snapshot_interval = _snapshot_interval(
            snapshot_interval, self.boundary
        )
        self._t = RequestTables(groups, self.max_num_seqs)
        self._prefix = PrefixCache(
            self._t,
            bool(enable_prefix_caching),
            self.boundary,
            snapshot_interval,
            key_algorithm,
            prefix_retention,
            prefix_retention_interval,
        )
        self._book = SwapBook(self._t, layout)
        self._lock = threading.RLock()
        self._issued = 0  # the last step id handed out
        #: what :meth:`take_effects` took from the parts and did not hand out (an exception
        #: struck in between): the next hand-out carries it first, in the order it was taken
        self._outbox: dict[str, tuple[Any, ...]] = {}
        self._last_step: StepAllocation | None = None  # the newest step handed out
        self._open_steps: dict[int, StepWork] = {}  # scheduled, not ended: oldest first
        self._host_tier: HostTier | None = None  # attach_host_tier

    @property
    def prefix_caching(self) -> bool:
        return self._prefix.enabled

    @property
    def prefix_unit(self) -> int:
        """Tokens per hashed unit of the prefix keys: the gcd of the groups' block sizes (and
        of the snapshot interval with per-request groups), so every block end is a unit end."""
        return self._prefix.unit

    @property
    @locked
    def prefix_stats(self) -> PrefixStats:
        return self._prefix.stats

    @property
    @locked
    def stats(self) -> SwapStats:
        """Counters of the swaps that completed."""
        return self._book.stats

    # ================================================================== read-only views

    @property
    def groups(self) -> list[str]:
        return [g.spec.name for g in self._t.groups]

    def pool(self, group: str) -> BlockPool:
        return self._group(group).pool

    @locked
    def table(self, group: str) -> np.ndarray:
        """The persistent table of ``group`` (read-only view ``int32 [max_num_seqs, width]``)."""
        view = self._group(group).table.view()
        view.flags.writeable = False
        return view

    @locked
    def row_of(self, request_id: str) -> int:
        """The table row of a request that holds device blocks."""
        row = self._t.row_of.get(check_request_id(request_id))
        if row is None:
            raise self._book.not_resident(request_id)
        return row

    @property
    @locked
    def requests(self) -> list[str]:
        """Ids of requests that hold device blocks, sorted."""
        return sorted(self._t.row_of)

    @property
    @locked
    def swapped_requests(self) -> list[str]:
        """Ids of requests whose blocks are in host pages, sorted."""
        return sorted(self._book.swapped)

    @locked
    def is_running(self, request_id: str) -> bool:
        """Whether ``request_id`` holds device blocks (a table row)."""
        return check_request_id(request_id) in self._t.row_of

    @locked
    def is_swapped(self, request_id: str) -> bool:
        return check_request_id(request_id) in self._book.swapped

    @locked
    def num_tokens(self, request_id: str) -> int:
        """Tokens ``request_id`` holds (resident or swapped out)."""
        swapped = self._book.swapped.get(check_request_id(request_id))
        if swapped is not None:
            return swapped.num_tokens
        return int(self._t.num_tokens[self.row_of(request_id)])

    @locked
    def residence(self, request_id: str) -> tuple[int, int]:
        """``(row, tokens)`` of a request that holds device blocks (raises as
        :meth:`row_of`): one call where a per-request read needs both."""
        row = self._t.row_of.get(check_request_id(request_id))
        if row is None:
            raise self._book.not_resident(request_id)
        return row, int(self._t.num_tokens[row])

    @locked
    def num_tokens_of(self, request_id: str) -> int:
        """Tokens ``request_id`` holds on the device, 0 for a request that holds no row
        (unknown, finished or swapped out): where its next step starts."""
        row = self._t.row_of.get(request_id)
        return int(self._t.num_tokens[row]) if row is not None else 0

    @locked
    def block_table(self, request_id: str, group: str) -> list[int]:
        """``request_id``'s table in ``group``: ``cdiv(num_tokens, block_size)`` entries
        (``slots_per_request`` for a per-request group), null id 0 where it holds no block."""
        g = self._group(group)
        row = self._t.row_of.get(check_request_id(request_id))
        if row is None:
            raise self._book.not_resident(request_id)
        if g.per_request:
            return g.table[row, : g.slots].tolist()
        n = int(self._t.num_tokens[row])
        return g.table[row, : -(-n // g.block_size)].tolist()

    @locked
    def num_free_blocks(self, group: str) -> int:
        return self._group(group).pool.num_free

    @locked
    def num_used_blocks(self, group: str) -> int:
        return self._group(group).pool.num_used

    def num_usable_blocks(self, group: str) -> int:
        return self._group(group).pool.num_usable

    @property
    @locked
    def num_free_rows(self) -> int:
        return len(self._t.free_rows)

    # ================================================================== the step

    @locked
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
        prefix = self._prefix
        if new_token_ids is None and prefix_matches is None and not prefix.enabled:
            step = self._schedule_one(request_ids, num_new_tokens)
            if step is not None:  # one running request: the same step in Python ints
                return step
        b = step_stages.check_batch(
            self._t, self._book, request_ids, num_new_tokens, new_token_ids, prefix_matches
        )
        if len(self._open_steps) >= MAX_OPEN_STEPS:
            self._drop_unended_steps()
        work = prefix.work = StepWork()
        step_stages.admit(b, self._t, self.max_num_seqs)
        if prefix_matches is not None or prefix.enabled:
            step_stages.adopt(b, prefix, prefix_matches)
        cut = self.snapshot_interval if prefix.enabled and prefix.snapshot_groups else None
        step_stages.bound(b, self._t, cut, self.max_model_len)
        step_stages.grow(b, self._t, self.arena, prefix.enabled)
        if b.n_fresh:
            step_stages.give_back_refused(b, self._t, prefix)
        copies_before, copies_after = step_stages.commit(b, self._t, prefix, new_token_ids)
        return self._open_step(b, work, copies_before, copies_after)

    def _schedule_one(self, request_ids: object, num_new_tokens: object) -> StepAllocation | None:
        """:meth:`schedule` of a batch of one running request that registers nothing (no
        token ids, no matches, prefix caching off), when :func:`step_stages.one_running`
        admits it and its growth fits (:func:`~.growth.grow_one`): the same step in Python
        ints. ``None`` where the general stages must decide (a new request, a refusal, an
        arena, a malformed call), having changed nothing but what they do first too (drop
        the steps left open past ``MAX_OPEN_STEPS``)."""
        if type(request_ids) not in _LISTS or len(request_ids) != 1:
            return None
        if self._prefix.tracks_requests:
            return None
        t = self._t
        one = step_stages.one_running(
            t, self._book, request_ids[0], num_new_tokens, self.max_model_len
        )
        if one is None:
            return None
        request_id, row, before, after = one
        if len(self._open_steps) >= MAX_OPEN_STEPS:  # as schedule: before any growth
            self._drop_unended_steps()
        if not step_stages.grow_one(t, row, False, before, after):
            return None
        work = self._prefix.work = StepWork()
        copies_before, t.copies = t.copies, []
        t.num_tokens[row] = after
        deltas = t.take_pending()
        self._issued += 1
        ids = work.request_ids = (request_id,)
        self._open_steps[self._issued] = work
        tier = self._host_tier
        step = StepAllocation(
            request_ids=ids,
            rows=np.array([row], dtype=np.int32),
            num_computed=np.array([before], dtype=np.int64),
            num_new=np.array([after - before], dtype=np.int64),
            refused=(),
            table_deltas=deltas,
            copies_before=tuple(copies_before),
            step_id=self._issued,
            moves=self.arena.take_moves() if self.arena is not None else (),
            offloads=tier.take_offloads() if tier is not None else (),
            onloads=host_lookup.take_onloads(tier) if tier is not None else (),
        )
        self._last_step = step = self._after_outbox(step) if self._outbox else step
        return step

    def _open_step(
        self,
        b: step_stages.StepBatch,
        work: StepWork,
        copies_before: list[BlockCopy],
        copies_after: list[BlockCopy],
    ) -> StepAllocation:
        """Number the step ``b`` committed, keep it open until its ``end_step``, and hand out
        what it carries: its rows and counts, every table delta since the previous step, its
        copies, and the arena's moves and the host tier's page copies queued meanwhile."""
        kept, deltas = b.kept, self._t.take_pending()
        self._issued += 1
        work.request_ids = b.kept_ids
        self._open_steps[self._issued] = work
        step = StepAllocation(
            request_ids=b.kept_ids,
            rows=b.safe_rows[kept].astype(np.int32),
            num_computed=b.before[kept],
            num_new=b.new[kept],
            refused=tuple(b.refused),
            table_deltas=deltas,
            copies_before=tuple(copies_before),
            copies_after=tuple(copies_after),
            step_id=self._issued,
            moves=self.arena.take_moves() if self.arena is not None else (),
            offloads=self._host_tier.take_offloads() if self._host_tier is not None else (),
            onloads=host_lookup.take_onloads(self._host_tier),
        )
        self._last_step = step = self._after_outbox(step) if self._outbox else step
        return step

    def _after_outbox(self, step: StepAllocation) -> StepAllocation:
        """``step`` carrying first what :meth:`take_effects` took and never handed out; the
        outbox is emptied in the same statement that hands the whole over."""
        box = self._outbox
        whole = dataclasses.replace(
            step,
            table_deltas=box.get("deltas", ()) + step.table_deltas,
            copies_before=box.get("copies", ()) + step.copies_before,
            moves=box.get("moves", ()) + step.moves,
            offloads=box.get("offloads", ()) + step.offloads,
            onloads=box.get("onloads", ()) + step.onloads,
        )
        self._outbox = {}
        return whole

    def _drop_unended_steps(self) -> None:
        """Steps left open past MAX_OPEN_STEPS are dropped, oldest first: they share nothing
        (their end_step is refused) and what they held goes back, so a caller that never
        ends its steps cannot pin blocks without bound."""
        while len(self._open_steps) >= MAX_OPEN_STEPS:
            oldest, work = next(iter(self._open_steps.items()))
            # finished before it leaves the open steps, as in end_step: cut short, it is
            # still the oldest, and the next drop finishes it (finish_step empties what ran)
            self._prefix.finish_step(work, kernels_ran=False, copies_ran=False)
            del self._open_steps[oldest]

    @locked
    def end_step(self, step: StepAllocation | int, copies_ran: bool = True) -> None:
        """End a step whose kernels (and ``copies_after``) ran: the blocks it completed become
        shareable, and what it held for its copies is released.

        The protocol, for synchronous and asynchronous engines and for threads alike: each
        ``schedule`` returns a step; ``end_step`` of it, once its kernels ran, in any order
        relative to other steps (``schedule(N)``, ``schedule(N + 1)``, ``end_step(N)``,
        ``end_step(N + 1)`` is an asynchronous engine's order). At most ``MAX_OPEN_STEPS``
        steps are open: scheduling one more drops the oldest unended step, which then
        registers nothing, releases what it held, and refuses its late ``end_step``.

        ``copies_ran=False`` (the worker could not run the step's ``copies_after``) ends it
        like an implicit end: no snapshot of it is registered.

        Raises:
            StepError: the step is unknown to this scheduler, already ended (explicitly or
                implicitly), or not an int / ``StepAllocation``; nothing changes.
        """
        step_id = step.step_id if isinstance(step, StepAllocation) else step
        if isinstance(step_id, bool) or not isinstance(step_id, int):
            raise StepError(
                f"end_step takes a StepAllocation or its step_id, got {type(step).__name__}"
            )
        work = self._open_steps.get(step_id)
        if work is None:
            issued = self._issued
            if 1 <= step_id <= issued:
                raise StepError(
                    f"step {step_id} already ended (or was dropped unended when "
                    f"{MAX_OPEN_STEPS} later steps were open); steps in flight: "
                    f"{list(self._open_steps)}"
                )
            raise StepError(f"step {step_id} is unknown: this scheduler issued steps 1..{issued}")
        # finished before it leaves the open steps: an end_step an exception cut short is
        # open still and may be called again (finish_step empties what it ran), and a step
        # dropped later runs nothing twice
        self._prefix.finish_step(work, kernels_ran=True, copies_ran=copies_ran is True)
        del self._open_steps[step_id]

    def _refuse_in_open_step(self, request_id: object, verb: str) -> None:
        # A step's kernels may still be writing its request's blocks: a swap out would copy
        # bytes not yet written, a truncation would hand back blocks still being written.
        # (Freeing is an abort and stays allowed: what the step held stays held until it
        # ends.) Scans at most MAX_OPEN_STEPS batches, so schedule pays nothing for it.
        for step_id, work in self._open_steps.items():
            if request_id in work.request_ids:
                raise RequestStateError(
                    f"request {request_id!r} is in step {step_id}, which has not ended; "
                    f"end_step({step_id}) before it is {verb}"
                )

    @property
    @locked
    def open_steps(self) -> list[int]:
        """Ids of the steps scheduled and not yet ended, oldest first."""
        return list(self._open_steps)

    # ================================================================== prefix cache

    @locked
    def prompt_fits(
        self, num_tokens: int, chunk: int, prefix_match: PrefixMatch | None = None
    ) -> bool:
        """Whether a new request's whole prompt fits now (``growth.prompt_fits``): the
        admission check of an engine that admits a request only when its prompt fits."""
        check_int("num_tokens", num_tokens, minimum=1)
        check_int("chunk", chunk, minimum=1)
        return prompt_fits(self._t, num_tokens, chunk, prefix_match)

    @locked
    def lookup(self, queries: Sequence[PrefixQuery]) -> list[PrefixMatch]:
        return host_lookup.lookup(self._prefix, self._host_tier, queries)  # host part first

    lookup.__doc__ = PrefixCache.lookup.__doc__

    @locked
    def cached_block(self, group: str, key: object) -> int | None:
        """The block the prefix cache holds for ``key`` in ``group``, or ``None``."""
        self._group(group)
        return self._prefix.block_of(group, key)

    @locked
    def registered_blocks(self, group: str) -> dict[int, tuple[object, int, str]]:
        """Every block of ``group``'s pool that the prefix cache knows (with ``share_pools``
        the pool's other groups' too): block -> (key, end token, group)."""
        return self._prefix.registered(self._group(group).pool)

    @locked
    def take_events(self) -> list[PrefixEvent]:
        """Blocks stored in and removed from the prefix cache since the last call."""
        return self._prefix.take_events()

    @locked
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix: evictable blocks go back to the free stacks and blocks
        in use lose their keys; so does the host tier, queued offloads included. Returns the
        number of device blocks evicted."""
        evicted = self._prefix.reset()
        if self._host_tier is not None:
            self._host_tier.reset()
        return evicted

    # ================================================================== the tiers

    @property
    @locked
    def host_tier(self) -> HostTier | None:
        """The host tier :meth:`attach_host_tier` gave this manager, or ``None``."""
        return self._host_tier

    @property
    def prefix_cache(self) -> PrefixCache:
        """The device prefix cache (its keys, unit records and served blocks), for the tiers
        that read it: call its methods only from inside this manager's methods (its lock
        held), or, as the tiers' wiring does, through listeners this manager registers."""
        return self._prefix

    @property
    def group_tables(self) -> tuple[GroupTable, ...]:
        """Every group's table (spec, pool, rows), in the layout's group order."""
        return tuple(self._t.groups)

    @locked
    def attach_host_tier(self, tier: HostTier) -> None:
        """Give this manager a host tier, all or nothing: every device pool tells the tier of
        its evictions (an eviction listener, :meth:`HostTier.demote_evicted`, which demotes
        the served blocks before the prefix cache forgets their keys); under
        ``policy="write_through"`` the prefix cache also tells it of every block a step
        registers (:meth:`HostTier.write_through`); lookups bring back what only the tier
        holds, and every step (or :meth:`take_effects`, :meth:`take_tier_offloads`) hands out
        its page copies. :func:`kvforge.scheduler.host_tier.attach` builds the tier and
        calls this.

        Locks: holds this manager's lock for the call. From then on the tier is entered only
        from inside this manager's methods, with that lock held (a take's eviction, a step's
        registration, a lookup, a hand-out of copies, :meth:`reset_prefix_cache`), or by its
        owner above the manager (the remote tier, under the controller's lock).

        Raises:
            ArgumentError: ``tier`` is not a :class:`HostTier`, keeps a group this manager
                does not have, keeps a bad policy, was not built on this manager's unit
                records (``prefix_cache.records``), or names other per-request groups.
            RuntimeError: prefix caching is off, or this manager has a host tier already.
        """
        self._check_host_tier(tier)
        listeners = [
            (pool, functools.partial(tier.demote_evicted, self._prefix, self._t.groups, pool))
            for pool, _ in self._t.pools
        ]
        on_store = self._prefix.on_store
        try:  # all or nothing at any line: no pool keeps a listener of a tier not attached
            for pool, listener in listeners:
                pool.add_eviction_listener(listener)
            if tier.policy == "write_through":
                self._prefix.on_store = functools.partial(
                    tier.write_through, self._prefix, self._t.groups
                )
            self._host_tier = tier
        except BaseException:
            for pool, listener in listeners:
                pool.remove_eviction_listener(listener)
            self._prefix.on_store = on_store
            self._host_tier = None
            raise

    def _check_host_tier(self, tier: object) -> None:
        """Refuse a tier :meth:`attach_host_tier` cannot take (nothing changed)."""
        if not isinstance(tier, HostTier):
            raise ArgumentError(f"tier must be a HostTier, got {type(tier).__name__}")
        check_attachable(self._prefix.enabled, self._host_tier)
        check_host_tier_policy(tier.policy)
        check_snapshot_policy(tier.snapshot_policy)
        check_tier_groups(tier.groups, self.groups, "the tier")
        if tier.records is not self._prefix.records:
            raise ArgumentError(
                "tier.records must be this manager's prefix_cache.records (a page keeps the "
                "reference its device block held)"
            )
        snapshots = {g.spec.name for g in self._t.groups if g.per_request} & set(tier.groups)
        if tier.per_request != snapshots:
            raise ArgumentError(
                f"tier.per_request is {sorted(tier.per_request)}; this manager's per-request "
                f"groups among the tier's are {sorted(snapshots)}"
            )

    @locked
    def take_tier_offloads(self) -> tuple[PageCopy, ...]:
        """The offloads the host tier queued since the last step (evictions outside a step:
        a swap in's or a truncation's takes), to run before those device blocks are written
        again (otherwise the next step carries them); ``()`` without a host tier. Their
        pages stay pinned until this hands them out."""
        tier = self._host_tier
        return tier.take_offloads() if tier is not None else ()

    @locked
    def reset_host_tier(self) -> int:
        """Forget every page of the host tier, its queued copies included (they will not be
        handed out), and let go of what they held; returns how many pages went (0 without a
        host tier). The device prefix cache keeps its blocks."""
        tier = self._host_tier
        if tier is None:
            return 0
        # the blocks a lookup filled from pages are keyed on the device already; their
        # onloads go with the reset, so their keys go first
        host_lookup.forget_pending(self._prefix, self._t.groups, tier)
        return tier.reset()

    @locked
    def prompt_plan(self, tokens: np.ndarray, query: PrefixQuery) -> host_lookup.PromptPlan:
        """The keys of ``query``'s boundaries (``tokens``: its token ids as an array) and what
        a hit at each reads, over this manager's prefix cache, group tables and host tier:
        what the remote tier asks of its store. Built under this manager's lock; the plan
        reads the prefix cache's key index live, so its caller uses it only while nothing else
        runs on this manager (the remote tier: under the controller's lock)."""
        return host_lookup.PromptPlan(self._prefix, self._t.groups, self._host_tier, tokens, query)

    # ================================================================== host pages, swaps

    @locked
    def init_host(
        self, num_pages: Mapping[str, int], then: Callable[[], None] | None = None
    ) -> None:
        """Create the host page pools (ids only: the memory is on the worker side); with
        ``then``, a call that must succeed first (the worker's pages), all or nothing."""
        self._book.init_host(num_pages, then)

    @locked
    def host_pool(self, group: str) -> BlockPool:
        return self._book.host_pool(group)

    @property
    @locked
    def host_groups(self) -> list[str]:
        return self._book.host_groups

    @locked
    def selection(self, request_id: str, purpose: SwapPurpose | str) -> dict[str, np.ndarray]:
        return self._book.selection(request_id, purpose)

    selection.__doc__ = SwapBook.selection.__doc__

    @locked
    def plan_swap_out(
        self, request_ids: Sequence[str], purpose: SwapPurpose | str = "preempt"
    ) -> SwapPlan:
        ids = batch_ids(request_ids)  # a malformed batch is refused as such, first
        for rid in ids if self._open_steps else ():
            self._refuse_in_open_step(rid, "swapped out")
        return self._book.plan_swap_out(ids, purpose)

    plan_swap_out.__doc__ = SwapBook.plan_swap_out.__doc__

    @locked
    def plan_swap_in(self, request_ids: Sequence[str]) -> SwapPlan:
        return self._book.plan_swap_in(request_ids)

    plan_swap_in.__doc__ = SwapBook.plan_swap_in.__doc__

    @locked
    def complete_swap(self, result: SwapResult) -> None:
        self._book.complete_swap(result)

    complete_swap.__doc__ = SwapBook.complete_swap.__doc__

    @locked
    def plans_in_flight(self) -> tuple[SwapPlan, ...]:
        return self._book.plans_in_flight()

    plans_in_flight.__doc__ = SwapBook.plans_in_flight.__doc__

    @locked
    def page_bytes(self, group: str) -> int:
        """Bytes of one host page of ``group`` (its offloaded roles, no padding)."""
        return self._book.page_bytes(group)

    # ================================================================== finish, truncate

    @locked
    def finish(self, request_ids: Sequence[str]) -> None:
        """Return every device block and host page of the requests and forget them, all or
        nothing (an exception midway, ``KeyboardInterrupt`` included, changes nothing).

        Raises:
            RequestStateError: an unknown request or one with a swap in flight (nothing
                changed).
        """
        ids = batch_ids(request_ids)
        row_of, busy, swapped = self._t.row_of, self._book.busy, self._book.swapped
        for rid in ids:
            if busy and rid in busy:
                raise RequestStateError(f"request {rid!r} has a swap in flight")
            if rid not in row_of and rid not in swapped:
                raise self._book.not_resident(rid)
        if self._prefix.tracks_requests:  # per-request work only when there is any
            for rid in ids:
                self._prefix.end_chain(rid)
        self._book.finish(ids)  # all or nothing (chains ended above stay ended: no harm)

    @locked
    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll ``request_id`` back to its first ``num_tokens`` tokens (rejected draft tokens
        of speculative decoding): blocks past the new end go back to their pools.

        Only blocks the request holds are touched. A window group cannot regrow blocks it
        already released, so truncating below them is refused. A block the new end falls in
        that another request shares is copied on write (:mod:`.truncation`): the copy comes
        with the next step's ``copies_before`` (or :meth:`take_copies`).

        Raises:
            ValueError: ``num_tokens`` not an int in ``[1, current]``, or below a released
                window block (nothing changed).
            OutOfBlocksError: no free block for a copy on write (nothing changed).
            RequestStateError: an unknown request, one with a swap in flight, or one in a
                step that has not ended (nothing changed).
        """
        row = self.row_of(request_id)
        if request_id in self._book.busy:
            raise RequestStateError(f"request {request_id!r} has a swap in flight")
        self._refuse_in_open_step(request_id, "truncated")
        truncation.truncate(self._t, self._prefix, request_id, row, num_tokens)

    @locked
    def take_copies(self) -> tuple[BlockCopy, ...]:
        """Block copies due before the next step's kernels (copy on write by
        :meth:`truncate`), for an engine that runs them between steps; otherwise the next
        :meth:`schedule` returns them in ``copies_before``."""
        copies, self._t.copies = tuple(self._t.copies), []
        return copies

    @locked
    def take_table_deltas(self) -> tuple[TableDelta, ...]:
        """Table changes since the last step or the last call (finishes, swaps, truncations),
        for an engine that mirrors them on its workers between steps."""
        deltas = self._t.take_pending()
        return deltas

    @locked
    def take_effects(self) -> StepAllocation | None:
        """Everything due on the worker since the last step (table changes of finishes, swaps
        and truncations, copies on write, the tiers' page copies, arena moves) as one step of
        no request, numbered in the sequence of steps (``step_id``): a worker ``apply``-s it
        once, in order, as it applies a step. ``None`` when nothing is due (no id is used)."""
        t, box = self._t, self._outbox
        if not (box or t.pending or t.copies) and self.arena is None and self._host_tier is None:
            return None  # the facade asks before most reads: nothing to hand out
        # each part's hand-out is kept in the statement that takes it: an exception between
        # two of them (an interrupt at any line) leaves them here for the next hand-out
        if "moves" not in box:
            box["moves"] = self.arena.take_moves() if self.arena is not None else ()
        tier = self._host_tier
        if "offloads" not in box:
            box["offloads"] = tier.take_offloads() if tier is not None else ()
        if "onloads" not in box:
            box["onloads"] = host_lookup.take_onloads(tier) if tier is not None else ()
        if "copies" not in box:  # kept in the statement that empties the queue
            box["copies"], t.copies = tuple(t.copies), []
        if "deltas" not in box:
            t.take_pending(into=box)  # numbered deltas last
        if not any(box.values()):
            self._outbox = {}
            return None
        step = StepAllocation(
            request_ids=(), rows=_NO_ROWS, num_computed=_NO_COUNTS, num_new=_NO_COUNTS,
            refused=(), table_deltas=box["deltas"], copies_before=box["copies"],
            step_id=self._issued + 1, offloads=box["offloads"], onloads=box["onloads"],
            moves=box["moves"],
        )  # fmt: skip
        # handed out whole, in one statement (and kept: see last_step)
        self._issued, self._outbox, self._last_step = step.step_id, {}, step
        return step

    @property
    def last_step(self) -> StepAllocation | None:
        """The newest step handed out (by :meth:`schedule` or :meth:`take_effects`): a
        caller that an exception kept from receiving it (an interrupt as the call returned)
        finds it here, and a worker whose next step is this one applies it."""
        return self._last_step

    # ================================================================== helpers

    def _group(self, name: str) -> GroupTable:
        g = self._t.by_name.get(name) if isinstance(name, str) else None
        if g is None:
            raise ValueError(f"group {name!r} does not exist; groups are {self.groups}")
        return g

    def __repr__(self) -> str:
        return (
            f"BlockManager({len(self._t.row_of)} running, {len(self._book.swapped)} swapped, "
            f"groups={self.groups})"
        )
