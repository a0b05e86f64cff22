"""Slabs that move between groups: the scheduler side of a slab arena.

Each member group keeps a :class:`ArenaBlockPool` (its own ids, ref counts, free stack and
evictable set) whose ids span the whole arena, but only the ids of the slabs it *owns* are
ever on its free stack. :class:`SlabArena` owns which group holds which slab; before blocks
are taken it moves slabs to the groups that run short (:meth:`SlabArena.prepare`), from the
free slabs first, then from other groups' slabs that hold no block in use (their cached
blocks are evicted, the prefix cache hears of it as of any eviction).

With prefix caching on, once fewer slabs could change hands than one step needs
(:attr:`SlabArena.pack_below`), a step's takes also *move cached blocks* within their group
(:meth:`ArenaBlockPool._pack`): the blocks a take hands out go to the slabs with the most
blocks in use, and the cached blocks there move to free slots of emptier slabs (one block
copy each: :meth:`SlabArena.take_moves`, ``StepAllocation.moves``, which the worker runs
before anything else of the step writes). Blocks in use then gather in few slabs, so others
drain to cached blocks and can change hands, while every group still evicts least recently
released first. Without moves, a group's blocks in use spread over all its slabs (each take
lands where the oldest cached block was) and a group that must grow finds no slab it may
take: a preemption where one pool of uniform blocks would have had room. Moves start only
under that pressure because they cost copies and mix the ages of a slab's cached blocks.

Invariants (``tests/scheduler/test_arena.py``):

- a slab is free or owned by exactly one group; slab 0 (the null blocks and the home
  group's ids past them) and the tail (index ``num_slabs``: home blocks past the last whole
  slab) are the home group's for good, and never move;
- a group's free stack holds exactly the ids of its owned slabs that are neither in use nor
  evictable; ``live[s]`` / ``cached[s]`` count the others, per slab;
- a slab changes hands only when no block of it is in use, so no block a request holds is
  ever addressed by another group;
- capacity checks (:meth:`SlabArena.fits`, :meth:`SlabArena.fits_in_order`) and
  :meth:`SlabArena.prepare` count alike: whatever a check accepts, ``prepare`` then the
  takes deliver; what it refuses changes nothing;
- a move reads a block cached before it and writes only a free slot that no table has
  addressed since the moves were last taken (so the worker's mirror shows no row holding
  it) and, with a host tier, that no queued offload reads; moves taken together have
  distinct destinations and each source holds its bytes from before the batch, so they run
  as one batch that reads every source before it writes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from kvforge._checks import ArgumentError, check_int
from kvforge.core.arena import ArenaGeometry
from kvforge.core.layout import CacheLayout
from kvforge.core.values import BlockCopy
from kvforge.errors import OutOfBlocksError
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool, run_whole

__all__ = ["PACK_TOKENS", "ArenaBlockPool", "SlabArena", "check_arena", "packing"]

FREE = -1
RESERVED = -2
#: tokens of one step whose takes :attr:`SlabArena.pack_below` keeps room for: vLLM's
#: default ``max_num_batched_tokens`` (``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS``),
#: one prefill chunk. Chosen by ``benchmarks/prefix_vs_vllm.py`` (``docs/vs_vllm.md``).
PACK_TOKENS = 2048


class ArenaBlockPool(BlockPool):
    """The block pool of one member group of a :class:`SlabArena`.

    ``num_free`` counts what a take can get: the group's free and evictable blocks, plus
    every slab the arena could hand it (free slabs and other groups' slabs with no block in
    use) at ``blocks_per_slab`` blocks each.
    """

    def __init__(self, arena: SlabArena, index: int, name: str) -> None:
        k = arena.geometry.blocks_per_slab[index]
        super().__init__(arena.geometry.num_blocks(name), name)
        self._num_free = 0  # no slab is owned yet
        self.arena = arena
        self.index = index
        self.blocks_per_slab = k
        n = arena.geometry.num_slabs + 1  # the whole slabs and the tail
        self.live = np.zeros(n, dtype=np.int64)  # blocks in use, per slab
        self.cached = np.zeros(n, dtype=np.int64)  # evictable blocks, per slab
        self.released_at = np.zeros(self.num_blocks, dtype=np.int64)
        #: told ``(src, dst)`` when cached blocks move (the prefix cache re-points its keys);
        #: ``None`` (no prefix caching: nothing is cached) turns moves off
        self.on_move: Callable[[np.ndarray, np.ndarray], None] | None = None
        # slots freed or granted since the moves were last taken (and evicted, while an
        # eviction listener hears of evictions: the host tier queues an offload of each
        # block it demotes): a move may not write them, because the worker's mirror may
        # still show a row holding them or a queued offload may still read them
        self._unsettled = np.zeros(self.num_blocks, dtype=bool)
        self._moved: dict[int, int] = {}  # move destination -> the block its bytes come from

    # ------------------------------------------------------------------ capacity

    @property
    def own_free(self) -> int:
        """Free and evictable blocks in the slabs this group owns."""
        return self._num_free + len(self._evictable)

    @property
    def num_free(self) -> int:
        return self.own_free + self.blocks_per_slab * self.arena.spare_slabs(exclude=self)

    @property
    def num_used(self) -> int:
        return int(self.live.sum())

    @property
    def num_owned_slabs(self) -> int:
        return int((self.arena.owner == self.index).sum())

    # ------------------------------------------------------------------ verbs

    def take(self, count: int, into: list[np.ndarray] | None = None) -> np.ndarray:
        if not isinstance(count, int | np.integer) or isinstance(count, bool) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        count = int(count)
        if count > self.own_free:  # a joint prepare (a step's growth) already ran otherwise
            self.arena.prepare({self: count})
        if count > self._num_free:
            self.evict(count - self._num_free)
        arena = self.arena
        if count and arena.packing and arena.short_of_spare_slabs():
            self._pack(count)
        top, k = self._num_free, self.blocks_per_slab
        stack = self._stack[:top]
        if 0 < count < top:
            # the busiest slabs first: blocks in use gather in few slabs, so the others
            # drain to cached blocks only and can move to a group that needs them
            slabs = stack // k
            score = self.live[slabs] * (k + 1) + self.cached[slabs]
            pick = np.argpartition(-score, count - 1)[:count]
            keep = np.ones(top, dtype=bool)
            keep[pick] = False
            ids = stack[pick]
            if into is not None:
                into.append(ids)
            # one store: at any line the free region holds every id once (a put_back's view)
            self._stack[:top] = np.concatenate((stack[keep], ids[::-1]))
        else:
            ids = stack[top - count :][::-1].copy()
            if into is not None:
                into.append(ids)
        self._num_free = top - count
        self._ref[ids] = 1
        np.add.at(self.live, ids // k, 1)
        return ids

    def _pack(self, count: int) -> None:
        """Free slots for the next ``count`` takes in the slabs with the most blocks in use:
        cached blocks there move to settled free slots of slabs with fewer blocks in use.

        Worked example, ``blocks_per_slab = 4``, a take of 2: slab 1 holds 3 blocks in use
        and 1 cached block (id 7), slab 2 one block in use and 3 free slots (9, 10, 11).
        Without a move both blocks land in slab 2 (1 + 2 in use in slab 2, 3 in slab 1);
        with one (7 -> 9: the cached bytes keep their key and their place in LRU order)
        the take gets ids 7 and 10: slab 1 is full of blocks in use, slab 2 holds 2.
        """
        k, top = self.blocks_per_slab, self._num_free
        stack = self._stack[:top]
        slab_of = stack // k
        free_per = np.bincount(slab_of, minlength=len(self.live))
        owned = np.flatnonzero(self.arena.owner == self.index)
        order = owned[np.lexsort((-free_per[owned], -self.live[owned]))]  # busiest first
        need, srcs, busy = count, [], []
        for s in order.tolist():
            busy.append(s)
            need -= int(free_per[s])
            if need <= 0:
                break
            if self.cached[s]:
                ids = np.arange(s * k, min(s * k + k, self.num_blocks))
                cached = ids[self._retained[ids] & (self._ref[ids] == 0)][:need]
                srcs.append(cached)
                need -= len(cached)
                if need <= 0:
                    break
        if not srcs:
            return
        src = np.concatenate(srcs).astype(np.int32)
        # destinations: settled free slots outside the slabs the take fills, emptiest first
        ok = ~np.isin(slab_of, busy) & ~self._unsettled[stack]
        dst = stack[ok]
        dst = dst[np.argsort(self.live[dst // k] * (k + 1) + self.cached[dst // k], kind="stable")]
        n = min(len(src), len(dst))
        src, dst = src[:n], dst[:n]
        gain = self.live[src // k] > self.live[dst // k]  # only toward busier slabs
        src, dst = src[gain], dst[gain]
        if not len(src):
            return
        self._move(src, dst, stack, top)

    def _move(self, src: np.ndarray, dst: np.ndarray, stack: np.ndarray, top: int) -> None:
        """Cached blocks ``src`` move to free slots ``dst``; ``src`` become free slots.

        Three parts, so that no key ever names a block the pool may hand out (the prefix
        index's rule: a key is written last and withdrawn first): ``dst`` become cached
        copies (taken off the free stack, retained, their copies recorded), the keys follow
        (``on_move``), and only then ``src`` go back to the free stack. The first and the
        last part each complete once begun (every store sets a value read before the first
        one, so the part runs again whole under an exception at any line). A listener cut
        short leaves ``src`` cached beside ``dst``, each block keyed or keyless (the index
        moves a block's entry whole): the pool evicts them in their turn.
        """
        to = dict(zip(src.tolist(), dst.tolist(), strict=True))
        both = {}  # LRU order, each copy beside its source
        for b in self._evictable:
            both[b] = None
            if b in to:
                both[to[b]] = None
        after = {to.get(b, b): None for b in self._evictable}  # same LRU order
        rest = stack[~np.isin(stack, dst)]
        ages = self.released_at[src]
        # a block moved twice is copied once, from where it was
        copies = {b: self._moved.get(a, a) for a, b in to.items()}
        slabs = np.concatenate((src, dst))

        def copied() -> None:
            self._stack[: len(rest)] = rest
            self._num_free = len(rest)
            self._retained[dst] = True
            self.released_at[dst] = ages
            self._moved.update(copies)
            self._evictable = both
            self._recount(slabs)

        def freed() -> None:
            self._evictable = after
            self._retained[src] = False
            for a in to:  # a block moved here before: its bytes go on, not to a free slot
                self._moved.pop(a, None)
            self._stack[len(rest) : top] = src
            self._num_free = top
            self._unsettled[src] = True
            self._recount(slabs)

        run_whole(copied)
        assert self.on_move is not None
        self.on_move(src, dst)
        run_whole(freed)
        self.arena.moved_blocks += len(src)

    def take_moves(self) -> BlockCopy | None:
        """The moves since the last call, as one copy (``None``: none); settles every slot."""
        self._unsettled[:] = False
        if not self._moved:
            return None
        moved, self._moved = self._moved, {}
        dst = np.fromiter(moved.keys(), dtype=np.int32, count=len(moved))
        src = np.fromiter(moved.values(), dtype=np.int32, count=len(moved))
        return BlockCopy(self.name, src, dst)

    def share(self, block_ids: Sequence[int] | np.ndarray) -> None:
        ids = self._check_ids(np.asarray(block_ids), "share")
        revived = np.unique(ids[self._ref[ids] == 0])
        super().share(ids)
        if len(revived):
            slabs = revived // self.blocks_per_slab
            np.add.at(self.live, slabs, 1)
            np.subtract.at(self.cached, slabs, 1)

    def release(self, block_ids: Sequence[int] | np.ndarray) -> None:
        self.release_held(self._check_ids(np.asarray(block_ids), "release"))

    def release_listed(self, block_ids: list[int]) -> None:
        self.release_held(np.array(block_ids, dtype=np.int32))  # with the slabs' counts

    def held_counts(self, block_ids: list[int]) -> list[int] | None:
        return None  # release_few would leave the slabs' counts behind

    def release_held(self, ids: np.ndarray) -> None:
        self._release(ids)
        if not len(ids):
            return
        gone = np.unique(ids)
        gone = gone[self._ref[gone] == 0]
        if len(gone):
            np.subtract.at(self.live, gone // self.blocks_per_slab, 1)
            self._unsettled[gone] = True
            kept = gone[self._retained[gone]]
            if len(kept):
                np.add.at(self.cached, kept // self.blocks_per_slab, 1)
                self.arena.clock += 1
                self.released_at[kept] = self.arena.clock

    def put_back(self, block_ids: np.ndarray) -> None:
        super().put_back(block_ids)
        self._recount(block_ids)

    def restore_counts(self, block_ids: np.ndarray, counts: np.ndarray) -> None:
        idle = block_ids[counts == 0]
        listed = [b in self._evictable for b in idle.tolist()]
        super().restore_counts(block_ids, counts)
        readded = idle[~np.array(listed, dtype=bool)] if len(idle) else idle
        if len(readded):  # evictable again, the most recently released (oldest_release)
            self.arena.clock += 1
            self.released_at[readded[self._retained[readded]]] = self.arena.clock
        self._recount(block_ids)

    def _recount(self, block_ids: np.ndarray) -> None:
        """The counts of blocks in use and cached of the slabs of ``block_ids``, read again
        from the reference counts (an undo's: a take or a release cut short may have moved
        some of them and not others)."""
        k = self.blocks_per_slab
        slabs = np.unique(block_ids // k)
        ids = slabs[:, None] * k + np.arange(k)[None, :]
        inside = ids < self.num_blocks  # the tail slab is short
        ids = np.where(inside, ids, 0)
        ref, retained = self._ref[ids], self._retained[ids]
        self.live[slabs] = ((ref > 0) & inside).sum(axis=1)
        self.cached[slabs] = (retained & (ref == 0) & inside).sum(axis=1)

    def forget(self, block_id: int) -> None:
        was_evictable = block_id in self._evictable
        try:
            super().forget(block_id)
            if was_evictable:
                self.cached[block_id // self.blocks_per_slab] -= 1
                self._unsettled[block_id] = True
        except BaseException:  # the pool's part completed or never began: count again
            self._recount(np.array([block_id]))
            if was_evictable and block_id not in self._evictable:
                self._unsettled[block_id] = True
            raise

    def _free_victims(
        self, victims: np.ndarray, listed: list[int], top: int, evictions: int, again: bool
    ) -> None:
        super()._free_victims(victims, listed, top, evictions, again)
        if again:  # a first run cut short may or may not have counted them: count again
            self._recount(victims)
        else:
            np.subtract.at(self.cached, victims // self.blocks_per_slab, 1)
        if self.has_eviction_listeners:  # (never clears a slot freed this period)
            self._unsettled[victims] = True

    # ------------------------------------------------------------------ slabs

    def _slab_ids(self, slabs: np.ndarray) -> np.ndarray:
        k = self.blocks_per_slab
        return (slabs[:, None] * k + np.arange(k)[None, :]).ravel().astype(np.int32)

    def _grant(self, slabs: np.ndarray, ids: np.ndarray | None = None) -> Callable[[], None]:
        """How to put the ids of ``slabs`` (just given to this group; or ``ids``) on the
        free stack: a change whose stores set values read now, so it runs again whole."""
        ids = (self._slab_ids(slabs) if ids is None else ids)[::-1]
        top = self._num_free

        def grant() -> None:
            self._unsettled[ids] = True
            self._stack[top : top + len(ids)] = ids
            self._num_free = top + len(ids)

        return grant

    def _evict_slabs(self, slabs: np.ndarray) -> None:
        """Evict what ``slabs`` cache (no block of them is in use): an eviction, whole or
        not begun."""
        ids = self._slab_ids(slabs)
        cached = ids[self._retained[ids] & (self._ref[ids] == 0)]
        if len(cached):
            self.evict(block_ids=cached)

    def _give_up(self, slabs: np.ndarray) -> Callable[[], None]:
        """How to take the ids of ``slabs`` (evicted: all free) off the free stack, as
        :meth:`_grant` puts them on."""
        stack = self._stack[: self._num_free]
        keep = stack[~np.isin(stack // self.blocks_per_slab, slabs)]

        def give_up() -> None:
            self._stack[: len(keep)] = keep
            self._num_free = len(keep)

        return give_up

    def newest_release(self, slabs: np.ndarray) -> np.ndarray:
        """Per slab of ``slabs``, when its most recently released evictable block was
        released (``int64``; 0 where the slab caches none)."""
        k = self.blocks_per_slab
        ids = (slabs[:, None] * k + np.arange(k)[None, :]).astype(np.int64)
        evictable = self._retained[ids] & (self._ref[ids] == 0)
        return np.where(evictable, self.released_at[ids], 0).max(axis=1)

    @property
    def free_stack(self) -> np.ndarray:
        """The ids on this group's free stack, bottom first (a read-only view)."""
        view = self._stack[: self._num_free].view()
        view.flags.writeable = False
        return view

    def oldest_release(self) -> int | None:
        """When the least recently released evictable block was released (None: none)."""
        for b in self._evictable:
            return int(self.released_at[b])
        return None

    def __repr__(self) -> str:
        return (
            f"ArenaBlockPool({self.name!r}: {self.num_used} used, {self.num_owned_slabs} "
            f"slabs of {self.blocks_per_slab})"
        )


@contextlib.contextmanager
def packing(arena: SlabArena | None, on: bool) -> Iterator[None]:
    """Within: ``arena``'s takes may move cached blocks (a step's growth, whose
    ``StepAllocation.moves`` carries the copies)."""
    if arena is not None:
        arena.packing = on
    try:
        yield
    finally:
        if arena is not None:
            arena.packing = False


class SlabArena:
    """Which group owns which slab, and the moves that let a group grow.

    Args:
        geometry: the arena's geometry (from :func:`kvforge.core.arena.plan_arena`).
    """

    def __init__(
        self,
        geometry: ArenaGeometry,
        block_sizes: Sequence[int] | None = None,
        pack_tokens: int = PACK_TOKENS,
    ) -> None:
        pack_tokens = check_int("pack_tokens", pack_tokens, minimum=1)
        if block_sizes is not None:
            if isinstance(block_sizes, str | bytes) or not isinstance(block_sizes, Sequence):
                raise ArgumentError(
                    f"block_sizes must be a sequence of ints, got {type(block_sizes).__name__}"
                )
            if len(block_sizes) != len(geometry.groups):
                raise ArgumentError(
                    f"block_sizes has {len(block_sizes)} sizes for the arena's "
                    f"{len(geometry.groups)} groups {list(geometry.groups)}"
                )
            block_sizes = [
                check_int(f"block_sizes[{i}]", b, minimum=1) for i, b in enumerate(block_sizes)
            ]
        self.geometry = geometry
        #: takes move cached blocks (``_pack``) only inside a step's growth, whose
        #: ``StepAllocation`` carries the copies to the worker (the manager sets it)
        self.packing = False
        #: ... and only while fewer slabs could change hands than one step of
        #: ``pack_tokens`` tokens takes in its hungriest group (0, never, without
        #: ``block_sizes``). V4-Flash at 3 GiB: ``c4_state`` takes 2,048 / 4 = 512 blocks,
        #: 15 per slab: 35 slabs.
        self.pack_below = 0
        for b, k in zip(block_sizes or (), geometry.blocks_per_slab, strict=False):
            blocks = math.ceil(pack_tokens / b)
            self.pack_below = max(self.pack_below, math.ceil(blocks / k))
        n = geometry.num_slabs
        self.owner = np.full(n + 1, FREE, dtype=np.int64)  # index n: the tail
        self.pinned = np.zeros(n + 1, dtype=bool)  # the home group's for good
        self.pinned[[0, n]] = True
        self.clock = 0  # release order across every member (ages of cached blocks)
        self.moves = 0  # slabs that changed hands between groups
        self.moved_blocks = 0  # cached blocks moved within their group (block copies)
        self.pools = [ArenaBlockPool(self, i, g) for i, g in enumerate(geometry.groups)]
        self.name = "+".join(geometry.groups)
        home = self.pools[geometry.home]
        k = home.blocks_per_slab
        self.owner[0] = home.index
        self.owner[n] = home.index if geometry.tail_blocks else RESERVED
        pinned_ids = np.concatenate(
            [np.arange(geometry.home_reserved, k), n * k + np.arange(geometry.tail_blocks)]
        )
        home._grant(np.empty(0, dtype=np.int64), pinned_ids.astype(np.int32))()

    def pool(self, group: str) -> ArenaBlockPool:
        return self.pools[self.geometry.index(group)]

    def take_moves(self) -> tuple[BlockCopy, ...]:
        """The block copies of every cached block moved since the last call (one per group
        that moved some), to run before anything else of the step writes a block."""
        return tuple(c for c in (p.take_moves() for p in self.pools) if c is not None)

    # ------------------------------------------------------------------ counting

    def free_slabs(self) -> np.ndarray:
        return np.flatnonzero(self.owner == FREE)

    def idle_slabs(self, pool: ArenaBlockPool) -> np.ndarray:
        """Slabs ``pool`` owns with no block in use (free or cached blocks only) that can
        move (not slab 0 or the tail)."""
        return np.flatnonzero((self.owner == pool.index) & (pool.live == 0) & ~self.pinned)

    def spare_slabs(self, exclude: ArenaBlockPool | None = None) -> int:
        """Slabs a group could be handed now: free ones and other groups' idle ones."""
        spare = int((self.owner == FREE).sum())
        for p in self.pools:
            if p is not exclude:
                spare += len(self.idle_slabs(p))
        return spare

    def short_of_spare_slabs(self) -> bool:
        """Whether fewer slabs could change hands than :attr:`pack_below` (free slabs are
        counted first: one array pass decides while they are plenty)."""
        free = int((self.owner == FREE).sum())
        return free < self.pack_below and self.spare_slabs() < self.pack_below

    def _budget(
        self, needs: Mapping[ArenaBlockPool, int]
    ) -> tuple[dict[ArenaBlockPool, int], dict[ArenaBlockPool, int], int]:
        """(slabs each short group must get, slabs each group can give, free slabs)."""
        must: dict[ArenaBlockPool, int] = {}
        give: dict[ArenaBlockPool, int] = {}
        for p in self.pools:
            need = int(needs.get(p, 0))
            short = need - p.own_free
            if short > 0:
                must[p] = -(-short // p.blocks_per_slab)
                give[p] = 0
            else:
                give[p] = min(len(self.idle_slabs(p)), -short // p.blocks_per_slab)
        return must, give, int((self.owner == FREE).sum())

    def fits(self, needs: Mapping[ArenaBlockPool, int]) -> bool:
        """Whether every pool can take ``needs[pool]`` blocks at once."""
        must, give, free = self._budget(needs)
        return sum(must.values()) <= free + sum(give.values())

    def shortfall(self, needs: Mapping[ArenaBlockPool, int]) -> tuple[str, int, int] | None:
        """None when ``needs`` fit, else (a short group, its need, what it could get)."""
        if self.fits(needs):
            return None
        must, give, free = self._budget(needs)
        # the first short group, and what it could get with the slabs the other short groups
        # take first: less than it needs (its slabs are what the supply lacks)
        p = next(iter(must))
        left = free + sum(give.values()) - sum(n for q, n in must.items() if q is not p)
        return p.name, int(needs[p]), p.own_free + max(0, left) * p.blocks_per_slab

    def fits_in_order(self, needs: Mapping[ArenaBlockPool, np.ndarray]) -> bool:
        """Whether, for every prefix of a batch, the pools can take the cumulative
        ``needs[pool][i]`` blocks (window releases already subtracted)."""
        n = len(next(iter(needs.values())))
        total = np.zeros(n, dtype=np.int64)
        free = int((self.owner == FREE).sum())
        for p in self.pools:
            c = needs.get(p)
            idle = len(self.idle_slabs(p))
            if c is None:
                total -= idle
                continue
            short = c - p.own_free
            k = p.blocks_per_slab
            total += np.where(short > 0, -(-short // k), -np.minimum(idle, -short // k))
        return bool((total <= free).all())

    # ------------------------------------------------------------------ moving slabs

    def prepare(self, needs: Mapping[ArenaBlockPool, int]) -> None:
        """Give each pool slabs enough to take ``needs[pool]`` blocks from its own free
        and evictable blocks; the takes follow.

        A short group gets free slabs first, then other groups' idle slabs (those without
        cached blocks first, then the least recently used). Then every group that would
        evict its own cached blocks (a short one too, once it has its slabs) gets free
        slabs instead, and other groups' idle slabs when that costs no newer cached block
        than its own least recently released one: one least-recently-used order across
        the groups, as far as whole slabs allow.

        Raises:
            OutOfBlocksError: the needs do not fit (nothing changed).
        """
        must, give, free = self._budget(needs)
        if sum(must.values()) > free + sum(give.values()):
            name, need, have = self.shortfall(needs) or ("", 0, 0)
            raise OutOfBlocksError("device", name, need, have, "take")
        free_slabs = list(self.free_slabs()[::-1])
        for p, count in must.items():
            self._move(p, count, free_slabs, give, lru_limit=None)
        for p in self.pools:  # optional: slabs instead of evicting own newer blocks
            need = int(needs.get(p, 0))
            short = need - (p.own_free - p.num_evictable)  # beyond its free stack
            if short <= 0:
                continue
            own_oldest = p.oldest_release()
            count = -(-short // p.blocks_per_slab)
            self._move(p, count, free_slabs, give, lru_limit=own_oldest, optional=True)

    def _move(
        self,
        p: ArenaBlockPool,
        count: int,
        free_slabs: list[int],
        give: dict[ArenaBlockPool, int],
        lru_limit: int | None,
        optional: bool = False,
    ) -> None:
        got: list[int] = []
        while free_slabs and len(got) < count:
            got.append(free_slabs.pop())
        donors: dict[ArenaBlockPool, list[int]] = {}
        if len(got) < count:
            for slab, donor in self._donor_slabs(p, give, count - len(got), lru_limit):
                donor._evict_slabs(np.array([slab]))  # the donor keeps it until handed over
                give[donor] -= 1
                donors.setdefault(donor, []).append(slab)
                got.append(slab)
        if not got:
            return
        slabs = np.array(got, dtype=np.int64)
        assert optional or len(got) == count
        # one hand-over, whole at any line: a slab off its donor's free stack is on the
        # new owner's (else its blocks would be on no stack, lost for good)
        parts = [d._give_up(np.array(s, dtype=np.int64)) for d, s in donors.items()]
        parts.append(p._grant(slabs))

        def hand_over() -> None:
            for part in parts:
                part()
            self.owner[slabs] = p.index

        run_whole(hand_over)
        self.moves += sum(map(len, donors.values()))

    def _donor_slabs(
        self,
        p: ArenaBlockPool,
        give: dict[ArenaBlockPool, int],
        count: int,
        lru_limit: int | None,
    ) -> list[tuple[int, ArenaBlockPool]]:
        """Up to ``count`` idle slabs of other groups within what each can give: empty
        ones first, then by the age of their newest cached block (older first); with
        ``lru_limit``, only slabs whose newest cached block is older than it."""
        candidates: list[tuple[int, int, ArenaBlockPool]] = []
        for d in self.pools:
            if d is p or give.get(d, 0) <= 0:
                continue
            idle = self.idle_slabs(d)
            if not len(idle):
                continue
            newest = d.newest_release(idle)
            order = np.argsort(newest, kind="stable")[: give[d]]
            candidates.extend((int(newest[i]), int(idle[i]), d) for i in order)
        candidates.sort(key=lambda c: c[0])
        chosen: list[tuple[int, ArenaBlockPool]] = []
        taken: dict[ArenaBlockPool, int] = {}
        for newest, slab, d in candidates:
            if len(chosen) == count:
                break
            if lru_limit is not None and newest > 0 and newest >= lru_limit:
                break
            if taken.get(d, 0) >= give[d]:
                continue
            taken[d] = taken.get(d, 0) + 1
            chosen.append((slab, d))
        return chosen

    def check(self) -> None:
        """Assert the invariants (tests and the soak call it)."""
        for p in self.pools:
            owned = self.owner == p.index
            assert not p.live[~owned].any() and not p.cached[~owned].any(), p
            stack = p.free_stack
            assert (self.owner[stack // p.blocks_per_slab] == p.index).all(), p
            counts = np.bincount(stack // p.blocks_per_slab, minlength=len(self.owner))
            size = np.full(len(self.owner), p.blocks_per_slab)
            if p.index == self.geometry.home:
                size[0] -= self.geometry.home_reserved
                size[-1] = self.geometry.tail_blocks
            expect = np.where(owned, size - p.live - p.cached, 0)
            assert (counts == expect).all(), p
            assert int(p.cached.sum()) == p.num_evictable, p
            assert NULL_BLOCK not in set(stack.tolist()), p
            if p.index == self.geometry.home:
                assert not (stack < self.geometry.home_reserved).any(), p

    def __repr__(self) -> str:
        owned = {p.name: p.num_owned_slabs for p in self.pools}
        return f"SlabArena({self.geometry.num_slabs} slabs, owned {owned})"


def check_arena(
    layout: CacheLayout, arena: object, num_blocks: Mapping[str, int], share_pools: bool
) -> SlabArena:
    """The scheduler side of ``arena``, refused unless it fits this layout and counts."""
    if not isinstance(arena, ArenaGeometry):
        raise TypeError(f"arena must be an ArenaGeometry or None, got {type(arena).__name__}")
    if not share_pools:
        raise ValueError("arena needs share_pools=True: its groups share one allocation")
    names = {g.name for g in layout.groups}
    for i, g in enumerate(arena.groups):
        if g not in names:
            raise ValueError(f"arena group {g!r} is not a group of the layout {sorted(names)}")
        want = arena.num_blocks(g)
        if num_blocks[g] != want:
            raise ValueError(
                f"num_blocks gives {num_blocks[g]:,} to arena group {g!r}; its arena gives "
                f"it {want:,} (num_slabs {arena.num_slabs} x {arena.blocks_per_slab[i]} per "
                f"slab{f', and {arena.tail_blocks} in the tail' if i == arena.home else ''})"
            )
    return SlabArena(arena, [layout.group(g).block_size for g in arena.groups])
