"""The host tier of the prefix cache, scheduler side: host pages that keep evicted prefix
blocks, the index key -> page, LRU eviction of pages, and the page copies a worker runs.

Wiring, through declared seams only: :func:`attach` builds a tier and hands it to
:meth:`~kvforge.scheduler.block_manager.BlockManager.attach_host_tier`, which adds
:meth:`HostTier.demote_evicted` as an eviction listener of each device pool
(:meth:`~kvforge.scheduler.block_pool.BlockPool.add_eviction_listener`: it runs before the
prefix cache forgets the victims' keys), so every eviction demotes (the offloads ride in
``StepAllocation.offloads`` or ``BlockManager.take_tier_offloads``), and its lookups read the
tier (:mod:`kvforge.scheduler.prefix.host_lookup`: :meth:`HostTier.pin`,
:meth:`HostTier.queue_onloads`; the onloads ride in ``StepAllocation.onloads``).
``CacheController.initialize_host_tier`` does both sides.

Pins (who pins a page, until when, who unpins): a page is pinned (ref >= 1) by
:meth:`demote` while its offload is queued, until :meth:`take_offloads` hands the copy out;
by :meth:`pin` (a lookup) for the onload it queues, until :meth:`take_onloads` hands that
out (or :meth:`unpin`, when nothing was queued); by :meth:`reserve` (a remote fill) until
:meth:`filled` says whether its bytes arrived. Only the tier unpins, in those calls. Whoever
receives a handed-out copy (the controller) runs it on the worker before the device block
it names is written again (offloads) or read (onloads). The device blocks a lookup fills
from pages stay held by the tier (``pending_blocks``) until their onloads are handed out.

Locks: the tier has none. It is entered from inside a
:class:`~kvforge.scheduler.block_manager.BlockManager` method, with that manager's lock held
by the manager itself (a take's eviction listener, a step's write-through, a lookup, the
hand-out of copies, a reset), or by its one owner above the manager, which serialises its
calls itself (the remote tier, under the controller's lock; vLLM's offloading manager, which
owns its tier). No module takes another module's lock.

:class:`HostTier` owns, per group, a page pool of its own (a
:class:`~kvforge.scheduler.block_pool.BlockPool` of ``kind="host"``, separate from the swap
book's pages) and the index from prefix keys (the same keys the device prefix cache uses) to
the page holding that block's bytes. What the exact check needs stays alive with the page: the
unit record the device block held a reference on moves to the page with it (:meth:`demote`
takes that reference over, the page's eviction releases it), and so does a tail key's
proof. A lookup that reads the host part therefore confirms it exactly as it confirms the
device part.

Life of a page::

    demote(group, key, end, block, ref, proof)   # a device block leaves (eviction, or a
        -> page (ref 1, retained)                #  completed block under write_through):
                                                 #  an offload block -> page is queued
    take_offloads() -> (PageCopy, ...)           # handed to the worker, to run before the
        page: ref 0, evictable, LRU order        #  device block is written again
    reach(spans) -> n                            # how many boundaries the host part covers
    onload({group: (keys, device blocks)})       # all or nothing: pages pinned, touched
    take_onloads() -> (PageCopy, ...)            # to run before the step's kernels
    ... a demotion finds no free page: the least recently used evictable page goes, its
        key and record with it (a later lookup hits shorter, never reads other bytes)

Invariants (tested): a page is in the index exactly when it is retained by its pool; a page
whose offload or onload is queued is pinned (ref >= 1), so it is never evicted or reused
before the worker ran the copy; every call checks its input in full before any state moves.

Per-request (state snapshot) groups follow ``snapshot_policy``, which their backend declares
(``AttentionBackend.snapshot_policy``, resolved by :func:`declared_snapshot_policy`) and the caller
may override:

- ``"skip"`` keeps none of them: a hit that needs a snapshot the device no longer holds is
  recomputed, never guessed (``stats.skipped`` counts the demotions refused);
- ``"aligned"`` keeps the snapshots the device prefix cache registered, which it takes only at
  ``snapshot_interval``-aligned boundaries: a snapshot block is demoted, indexed, pinned,
  onloaded and evicted exactly as a window block is (one page per snapshot, the group's
  unpadded page-first bytes, the unit record at its boundary kept with the page), so a hit may
  end at an aligned boundary whose snapshot only the host (or a remote tier behind it) holds.

Window groups keep only what the device prefix cache registered: the blocks of the tails a
boundary needs, so a window group stores only its tail per chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from kvforge._checks import ArgumentError
from kvforge.core.values import PageCopy, page_owner
from kvforge.scheduler.block_pool import BlockPool, run_whole
from kvforge.scheduler.tables import GroupTable
from kvforge.scheduler.unit_records import UnitRecordStore

__all__ = [
    "HOST_TIER_POLICIES",
    "SNAPSHOT_POLICIES",
    "HostTier",
    "HostTierPolicy",
    "HostTierStats",
    "ServedBlocks",
    "SnapshotPolicy",
    "TierHost",
    "attach",
    "check_attachable",
    "check_host_tier_policy",
    "check_snapshot_policy",
    "check_tier_groups",
    "declared_snapshot_policy",
]

HostTierPolicy = Literal["eviction", "write_through"]
#: when a device block goes to the host tier: on its eviction (default) or once it completes
HOST_TIER_POLICIES: tuple[str, ...] = ("eviction", "write_through")
_NO_PAGES = np.zeros(0, dtype=np.int32)
SnapshotPolicy = Literal["skip", "aligned"]
#: what the tiers do with per-request snapshots: recompute them, or keep the aligned ones
SNAPSHOT_POLICIES: tuple[str, ...] = ("skip", "aligned")


def check_host_tier_policy(policy: object) -> HostTierPolicy:
    """``policy`` itself, refused (:class:`ArgumentError`) unless ``"eviction"`` or
    ``"write_through"``."""
    if not isinstance(policy, str) or policy not in HOST_TIER_POLICIES:
        raise ArgumentError(
            f"host_tier_policy must be 'eviction' or 'write_through', got {policy!r}"
        )
    return policy  # type: ignore[return-value]


def check_snapshot_policy(policy: object) -> SnapshotPolicy:
    """``policy`` itself, refused (:class:`ArgumentError`) unless ``"skip"`` or
    ``"aligned"``."""
    if not isinstance(policy, str) or policy not in SNAPSHOT_POLICIES:
        raise ArgumentError(f"snapshot_policy must be 'skip' or 'aligned', got {policy!r}")
    return policy  # type: ignore[return-value]


def declared_snapshot_policy(backends: Iterable[Any]) -> SnapshotPolicy:
    """The ``snapshot_policy`` the backends that declare a per-request group agree on
    (``"skip"`` when none declares one). Each backend is asked once, however many layers it
    serves.

    Raises:
        ValueError: two such backends declare different policies (pass one explicitly), a
            backend declares one that is not a snapshot policy, or declares the name this
            setting had before (``state_policy``: "state" names only the group kind now).
    """
    declared: dict[str, str] = {}
    for backend in {id(b): b for b in backends}.values():
        if not any(g.rule.per_request for g in backend.cache_groups()):
            continue
        if hasattr(backend, "state_policy"):
            raise ValueError(
                f"{backend!r} declares state_policy, which is now snapshot_policy (the same "
                "values 'skip' or 'aligned'); rename the class attribute"
            )
        policy = getattr(backend, "snapshot_policy", "skip")
        if policy not in SNAPSHOT_POLICIES:
            raise ValueError(
                f"{backend!r} declares snapshot_policy={policy!r}; a backend declares 'skip' or "
                "'aligned'"
            )
        declared.setdefault(policy, repr(backend))
    if len(declared) > 1:
        raise ValueError(
            "the backends of per-request groups declare different snapshot policies "
            f"({declared}); pass snapshot_policy explicitly"
        )
    return next(iter(declared), "skip")  # type: ignore[return-value]


@dataclass
class HostTierStats:
    """Counters of the host tier, per group.

    Attributes:
        demotions: device blocks given a host page (an offload queued).
        repeats: demotions of a key the tier already held (no copy; the page is touched).
        dropped: demotions refused because every page was pinned by a queued copy.
        skipped: demotions of per-request (state snapshot) blocks, skipped by policy
            (``snapshot_policy="skip"``).
        evictions: host pages evicted (least recently used first) for new demotions.
        hits: blocks onloaded back to the device.
        hit_tokens: prompt tokens lookups served past what the device held alone.
    """

    demotions: dict[str, int] = field(default_factory=dict)
    repeats: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    hit_tokens: int = 0


class _Page(NamedTuple):
    key: bytes
    end: int  # the token count its key covers
    ref: bytes | None  # the unit record it holds a reference on
    proof: tuple[bytes, bytes, bytes] | None  # a tail key's (parent, payload, root preimage)


def _bump(counter: dict[str, int], group: str, n: int = 1) -> None:
    counter[group] = counter.get(group, 0) + n


def _block_ids(value: object, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and (arr.dtype == bool or arr.dtype.kind not in "iu")):
        raise ArgumentError(f"{what} must be a 1-d sequence of ints, got {value!r}")
    if arr.size and int(arr.min()) < 1:
        raise ArgumentError(f"{what} must be device block ids >= 1, got {int(arr.min())}")
    return arr.astype(np.int32)


class HostTier:
    """Host pages for the prefix blocks the device lets go, per group.

    Args:
        num_pages: group -> pages of its host tier pool, the reserved null page included
            (>= 2). Groups not named keep nothing on the host.
        records: the prefix cache's unit record store: a page holds the reference its
            device block held, so the exact check of a host hit still works.
        per_request: the per-request (state snapshot) groups among them.
        policy: ``"eviction"`` (default) or ``"write_through"``: when the caller demotes
            (the tier itself only records it).
        snapshot_policy: what happens to the per-request groups' snapshots: ``"skip"``
            (default: none kept, a hit that needs one is recomputed) or ``"aligned"`` (kept
            as any block; the device prefix cache registers them only at aligned boundaries).
        on_evicted: called as ``on_evicted(group, keys)`` after pages are evicted (an owner
            that publishes removal events, as an engine's offloading manager does).

    Raises:
        ArgumentError: a bad ``num_pages`` (not a mapping of group names to ints >= 2), a
            bad ``policy`` or ``snapshot_policy``; nothing is created.

    The tier has no lock: its owner serialises its calls (a block manager holds its own lock
    around every call it makes here). Which call pins a page and which unpins it: see the
    module docstring.
    """

    def __init__(
        self,
        num_pages: Mapping[str, int],
        records: UnitRecordStore,
        per_request: Collection[str] = (),
        policy: HostTierPolicy = "eviction",
        snapshot_policy: SnapshotPolicy = "skip",
        on_evicted: Callable[[str, list[bytes]], None] | None = None,
    ) -> None:
        if not isinstance(num_pages, Mapping) or not num_pages:
            raise ArgumentError(
                f"num_pages must be a non-empty mapping group -> pages, got {num_pages!r}"
            )
        for name, n in num_pages.items():
            if not isinstance(name, str) or not name:
                raise ArgumentError(f"num_pages: group names are non-empty str, got {name!r}")
            if isinstance(n, bool) or not isinstance(n, Integral) or n < 2:
                raise ArgumentError(
                    f"num_pages[{name!r}] must be an int >= 2 (one usable page plus the null "
                    f"page), got {n!r}"
                )
        if not isinstance(records, UnitRecordStore):
            raise ArgumentError(f"records must be a UnitRecordStore, got {type(records).__name__}")
        self.policy = check_host_tier_policy(policy)
        self.snapshot_policy = check_snapshot_policy(snapshot_policy)
        self._on_evicted = on_evicted
        self.records = records
        self.per_request = frozenset(per_request) & set(num_pages)
        #: the per-request groups whose snapshots are recomputed, never kept (``"skip"``)
        self.recomputed = self.per_request if snapshot_policy == "skip" else frozenset()
        self.stats = HostTierStats()
        self._pools: dict[str, BlockPool] = {}
        self._index: dict[str, dict[bytes, int]] = {}
        self._pages: dict[str, dict[int, _Page]] = {}
        self._offloads: dict[str, list[tuple[int, int]]] = {}
        self._onloads: dict[str, list[tuple[int, int]]] = {}
        self._queued: dict[str, set[int]] = {}  # device blocks with an offload queued
        #: pages evicted since the last copy of their group was handed out: the next one
        #: carries them (``PageCopy.released``), so the worker's record frees them first
        self._released: dict[str, list[int]] = {}
        self._seq = 0  # the next PageCopy.seq
        #: device blocks a lookup filled from pages, held until their onloads are handed
        #: out (:func:`kvforge.scheduler.prefix.host_lookup.take_onloads` releases them)
        self.pending_blocks: list[tuple[BlockPool, np.ndarray]] = []
        for name, n in num_pages.items():
            self._pools[name] = BlockPool(
                int(n), name, kind="host", on_evict=functools.partial(self._evicted, name)
            )
            self._index[name], self._pages[name] = {}, {}
            self._offloads[name], self._onloads[name] = [], []
            self._queued[name], self._released[name] = set(), []

    # ------------------------------------------------------------------ views

    @property
    def groups(self) -> list[str]:
        return list(self._pools)

    def pool(self, group: str) -> BlockPool:
        """The page pool of ``group`` (ids only: the bytes are on the worker side)."""
        return self._pools[self._group(group)]

    def page_of(self, group: str, key: object) -> int | None:
        """The page holding ``key`` in ``group``, or ``None``."""
        return self._index[self._group(group)].get(key)  # type: ignore[call-overload]

    def holds(self, group: str, key: object) -> bool:
        """Whether the tier holds ``key`` in ``group`` (``False`` for a group it does not
        keep); nothing is checked or changed, so a lookup may ask it per block."""
        index = self._index.get(group)
        return index is not None and key in index

    def entry(self, group: str, key: bytes) -> tuple[int, bytes | None, object] | None:
        """``(end, record, proof)`` kept with ``key``'s page, or ``None``: what the exact check
        of a host hit reads."""
        page = self.page_of(group, key)
        if page is None:
            return None
        e = self._pages[group][page]
        return e.end, e.ref, e.proof

    def page_key(self, group: str, page: int) -> bytes | None:
        """The key ``page`` holds, or ``None`` (a free page)."""
        e = self._pages[self._group(group)].get(int(page))
        return None if e is None else e.key

    def reserve(
        self,
        group: str,
        key: bytes,
        end: int,
        ref: bytes | None,
        proof: tuple[bytes, bytes, bytes] | None,
    ) -> int | None:
        """A page for ``key``, to be filled from a remote tier: indexed at once and pinned
        until :meth:`filled` says whether its bytes arrived. The tier takes over the reference
        on ``ref`` in every case. ``None`` (reference released): the key is held already,
        every page is pinned, or ``group`` is a per-request group under ``"skip"``."""
        name = self._group(group)
        pool, index = self._pools[name], self._index[name]
        if key in index or pool.num_free == 0 or name in self.recomputed:
            self._let_go(ref)
            return None
        page = None
        try:  # (a line of its own: the page is taken inside)
            page = self._take_page(name, key, end, ref, proof)
            self._index[name][key] = page
            return page  # (struck here, the caller never learns of the page: it goes back)
        except BaseException:
            if page is not None:
                self._give_back_page(name, key, page)
            raise

    def _take_page(self, name: str, key: bytes, end: int, ref: bytes | None, proof: object) -> int:
        """Take a page (evicting the least recently used one when none is free), pinned and
        retained, with what the exact check of ``key`` reads; the caller indexes ``key`` to
        it last, once the page's bytes are due. All or nothing under an exception at any
        line, ``KeyboardInterrupt`` included."""
        pool, pages = self._pools[name], self._pages[name]
        taken: list[np.ndarray] = []
        try:
            [page] = pool.take(1, into=taken).tolist()
            pool.retain(page)
            pages[page] = _Page(key, int(end), ref, proof)  # type: ignore[arg-type]
            return page
        except BaseException:
            for ids in taken:  # the page taken, if the take got as far as naming it
                for p in ids.tolist():
                    pages.pop(p, None)
                    pool.forget(p)  # held: it only stops being retained
                pool.put_back(ids)
            raise

    def _give_back_page(self, name: str, key: bytes, page: int) -> None:
        """Undo :meth:`_take_page` of ``page`` for ``key`` (and its index entry, if made)."""
        if self._index[name].get(key) == page:
            del self._index[name][key]
        self._pages[name].pop(page, None)
        pool = self._pools[name]
        pool.forget(page)  # held: it only stops being retained
        pool.release(np.array([page], dtype=np.int32))

    def filled(self, group: str, pages: Sequence[int], arrived: Sequence[bool]) -> None:
        """Unpin pages :meth:`reserve` gave: those whose bytes arrived become the most
        recently used; the others are forgotten at once (key, record and page)."""
        name = self._group(group)
        pool, index, held = self._pools[name], self._index[name], self._pages[name]
        ids = np.asarray(pages, dtype=np.int32)
        lost = ids[~np.asarray(arrived, dtype=bool)] if len(ids) else ids
        for page in lost.tolist():  # first: no key names a page whose bytes never came
            e = held.get(page)
            if e is not None and index.get(e.key) == page:
                del index[e.key]
        pool.release(ids)
        if len(lost):
            pool.evict(block_ids=lost)

    def page_entry(self, group: str, page: int) -> tuple[int, bytes | None, object]:
        """``(end, record, proof)`` kept with ``page`` (one that holds a key)."""
        e = self._pages[self._group(group)][int(page)]
        return e.end, e.ref, e.proof

    def __len__(self) -> int:
        """Pages that hold a key, over every group."""
        return sum(len(ix) for ix in self._index.values())

    # ------------------------------------------------------------------ demotion

    def demote(
        self,
        group: str,
        key: bytes,
        end: int,
        device_block: int,
        ref: bytes | None = None,
        proof: tuple[bytes, bytes, bytes] | None = None,
    ) -> int | None:
        """Keep device block ``device_block`` (key ``key``, covering ``end`` tokens) in a
        host page: take a page (evicting the least recently used one when none is free),
        index it, and queue the offload. The tier takes over the caller's reference on
        unit record ``ref`` in every case (released here when the block is not kept).

        Returns:
            the page, or ``None``: a per-request group under ``snapshot_policy="skip"``, or every
            page pinned by a queued copy (counted in ``dropped``). A key already held keeps
            its page (touched, no copy; counted in ``repeats``).

        Raises:
            ArgumentError: an unknown group, a key that is not bytes, ``end`` or
                ``device_block`` not an int >= 1 (nothing changed).
        """
        name = self._check_demotion(group, key, end, device_block, proof)
        if name in self.recomputed:
            _bump(self.stats.skipped, name)
            self._let_go(ref)
            return None
        pool, index = self._pools[name], self._index[name]
        page = index.get(key)
        if page is not None:
            _bump(self.stats.repeats, name)
            self._let_go(ref)
            if pool.ref_count(page) == 0:  # touch: most recently used
                pool.share([page])
                pool.release([page])
            return page
        if pool.num_free == 0:
            _bump(self.stats.dropped, name)
            self._let_go(ref)
            return None
        offloads, queued, block = self._offloads[name], self._queued[name], int(device_block)
        n, page = len(offloads), None
        try:  # (a line of its own: the page is taken inside)
            page = self._take_page(name, key, end, ref, proof)
            offloads.append((block, page))
            queued.add(block)
            self._index[name][key] = page  # last: a key names a page whose bytes are due
        except BaseException:  # the offload and the page go back: all or nothing
            if page is not None:
                del offloads[n:]
                queued.discard(block)
                self._give_back_page(name, key, page)
            raise
        _bump(self.stats.demotions, name)
        return page

    def _check_demotion(
        self, group: object, key: object, end: object, device_block: object, proof: object
    ) -> str:
        """The group name of a :meth:`demote`, refused (:class:`ArgumentError`, nothing
        changed) unless every argument is well formed and no offload of ``device_block`` is
        queued."""
        name = self._group(group)
        if not isinstance(key, bytes) or not key:
            raise ArgumentError(f"key must be non-empty bytes, got {key!r}")
        for what, v in (("end", end), ("device_block", device_block)):
            if isinstance(v, bool) or not isinstance(v, Integral) or v < 1:
                raise ArgumentError(f"{what} must be an int >= 1, got {v!r}")
        if proof is not None and (
            not isinstance(proof, tuple)
            or len(proof) != 3
            or not all(isinstance(p, bytes) for p in proof)
        ):
            raise ArgumentError(f"proof must be None or three bytes, got {proof!r}")
        if int(device_block) in self._queued[name]:  # type: ignore[call-overload]
            raise ArgumentError(
                f"device block {device_block} of group {name!r} has an offload queued already; "
                "take_offloads() hands it to the worker before the block may be demoted again"
            )
        return name

    def demote_evicted(
        self,
        prefix: ServedBlocks,
        groups: Sequence[GroupTable],
        pool: BlockPool,
        victims: np.ndarray,
    ) -> None:
        """The eviction listener of a device pool (:meth:`BlockManager.attach_host_tier
        <kvforge.scheduler.block_manager.BlockManager.attach_host_tier>` adds it, bound to
        the manager's ``prefix`` cache, ``groups`` and ``pool``): demote the served blocks
        among ``victims``, which the prefix cache still knows (its own hook runs after every
        listener). Entered with the manager's lock held, from inside its take."""
        for b in victims.tolist():
            entry = prefix.served(pool, b)
            if entry is None:
                continue  # a waiting copy: its key is served by another block
            name = groups[entry.group].spec.name
            if name not in self._pools or b in self._queued[name]:
                continue  # kept nowhere, or (never expected) its previous offload is queued
            # a snapshot under "skip" goes to demote too: counted as skipped, its reference
            # let go
            if entry.ref is not None:  # the page's own reference: the prefix cache drops its own
                self.records.retain(entry.ref)
            self.demote(name, entry.key, entry.end, b, entry.ref, entry.proof)

    def write_through(
        self, prefix: ServedBlocks, groups: Sequence[GroupTable], pool: BlockPool, block: int
    ) -> None:
        """The prefix cache registered ``block`` of ``pool`` (its ``on_store`` hook under
        ``policy="write_through"``): demote a copy of it now, the device keeps it."""
        self.demote_evicted(prefix, groups, pool, np.array([block], dtype=np.int32))

    def take_offloads(self) -> tuple[PageCopy, ...]:
        """The queued offloads (device block -> host page), one :class:`PageCopy` per group,
        for the worker to run before any of those device blocks is written again; their
        pages become evictable (least recently demoted first)."""
        for queued in self._queued.values():
            queued.clear()
        # reversed: the pool queues a released run deepest first, and the first demoted page
        # must be the first evicted (the device pool demotes in its eviction order)
        return self._hand_out(self._offloads, reverse=True)

    def _hand_out(
        self, queues: dict[str, list[tuple[int, int]]], reverse: bool
    ) -> tuple[PageCopy, ...]:
        """One :class:`PageCopy` per group of ``queues`` (emptied), its pages unpinned, with
        the ownership a worker checks it against: the key tag of each page, the pages released
        since the group's last copy (offloads only: they are handed out first), and its
        number in this tier's sequence."""
        out = []
        for name, queued in queues.items():
            released = self.take_released(name) if reverse else _NO_PAGES
            if not queued and not len(released):
                continue
            if queued:
                blocks, pages = (np.array(c, dtype=np.int32) for c in zip(*queued, strict=True))
            else:
                blocks = pages = _NO_PAGES
            held = self._pages[name]
            owners = np.array([page_owner(held[p].key) for p in pages.tolist()], dtype=np.int64)
            out.append(PageCopy(name, blocks, pages, owners, released, self._seq))
            self._seq += 1
            queues[name] = []
            if queued:
                self._pools[name].release(pages[::-1] if reverse else pages)
        return tuple(out)

    def take_released(self, group: str) -> np.ndarray:
        """The pages of ``group`` evicted since the last call (or the last offloads handed
        out), for a worker's record of which key each page holds."""
        released, self._released[group] = self._released[group], []
        return np.unique(np.array(released, dtype=np.int32)) if released else _NO_PAGES

    # ------------------------------------------------------------------ lookup, onload

    def reach(self, spans: Sequence[Mapping[str, Sequence[bytes]]]) -> int:
        """How many leading ``spans`` the tier holds whole: ``spans[i]`` names, per group, the
        keys of the blocks boundary ``i`` needs beyond the previous one (a full group every
        block of the span, a window group the tail at the boundary); a span counts only when
        every key of every group is held (all or nothing), and the first one missing stops
        the count. Nothing changes.

        A per-request group holds nothing under ``snapshot_policy="skip"``: a span that needs
        one of its keys is not held.

        Raises:
            ArgumentError: a group the tier does not keep, or a span that is not a mapping.
        """
        n = 0
        for i, span in enumerate(spans):
            if not isinstance(span, Mapping):
                raise ArgumentError(f"spans[{i}] must be a mapping group -> keys")
            for name in span:
                self._group(name)
        for span in spans:
            if not all(k in self._index[g] for g, keys in span.items() for k in keys):
                break
            n += 1
        return n

    def onload(
        self, targets: Mapping[str, tuple[Sequence[bytes], Sequence[int] | np.ndarray]]
    ) -> dict[str, np.ndarray]:
        """Queue the copies of held keys back to device blocks: ``targets`` maps a group to
        ``(keys, device blocks)`` of one length. All or nothing: if a key is not held (evicted
        since :meth:`reach`), nothing is queued and ``None`` pages come back as a
        :class:`KeyError`. The pages are pinned until :meth:`take_onloads` hands them out and
        become the most recently used. The worker runs queued offloads before onloads, so a
        key whose offload is still queued may be onloaded in the same batch.

        Returns:
            group -> ``int32`` host pages, in the order of the keys.

        Raises:
            ArgumentError: an unknown group, lengths that differ, bad device block ids, a
                device block named twice in one group.
            KeyError: a key the tier does not hold (nothing changed).
        """
        plan: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, value in targets.items():
            self._group(name)
            if not isinstance(value, tuple) or len(value) != 2:
                raise ArgumentError(f"targets[{name!r}] must be (keys, device blocks)")
            keys, blocks = value
            ids = _block_ids(blocks, f"targets[{name!r}] device blocks")
            if len(ids) != len(keys):
                raise ArgumentError(
                    f"targets[{name!r}] names {len(keys)} keys and {len(ids)} device blocks"
                )
            if len(np.unique(ids)) != len(ids):
                raise ArgumentError(f"targets[{name!r}] names a device block twice")
            plan[name] = (ids, self._pages_of(name, keys))
        out = {}
        for name, (ids, pages) in plan.items():
            self._pools[name].share(pages)  # pinned until handed out
            self.queue_onloads(name, ids, pages)
            out[name] = pages
        return out

    def _pages_of(self, group: str, keys: Sequence[bytes]) -> np.ndarray:
        index = self._index[group]
        missing = next((k for k in keys if k not in index), None)
        if missing is not None:
            raise KeyError(f"group {group!r} holds no page for key {missing!r}")
        return np.array([index[k] for k in keys], dtype=np.int32)

    def pin(
        self,
        group: str,
        keys: Sequence[bytes],
        into: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> np.ndarray:
        """Pin the pages of ``keys`` (all held, else :class:`KeyError` and nothing changed),
        so no demotion evicts them; :meth:`queue_onloads` or :meth:`unpin` follows. All or
        nothing at any line of the pin itself; ``into`` gets ``group -> (pages, their counts
        before)`` before any pin, so a caller cut short as this returns, or after, can take
        it back (:meth:`restore_pins`)."""
        pages = self._pages_of(self._group(group), keys)
        pool = self._pools[group]
        before = pool.counts_of(pages)
        if into is not None:
            into[group] = (pages, before)
        try:
            pool.share(pages)
        except BaseException:
            pool.restore_counts(pages, before)
            raise
        return pages

    def restore_pins(self, group: str, pages: np.ndarray, before: np.ndarray) -> None:
        """Take back a :meth:`pin` of ``pages`` whose counts were ``before``, whole, cut
        short or never begun (a saved value: running it twice changes nothing more)."""
        self._pools[self._group(group)].restore_counts(pages, before)

    def touch(self, group: str, keys: Sequence[bytes]) -> None:
        """Make the evictable pages of ``keys`` the most recently used, the first key last
        (a chain's first block outlives its deeper ones); keys not held, or pinned, are
        left as they are."""
        name = self._group(group)
        pool, index = self._pools[name], self._index[name]
        for key in reversed(keys):
            page = index.get(key)
            if page is not None and pool.ref_count(page) == 0:
                pool.share([page])
                pool.release([page])

    def forget(self, group: str, keys: Sequence[bytes]) -> int:
        """Evict the pages of ``keys`` now (their bytes are suspect: a copy from them failed);
        pinned pages and keys not held are left. Returns how many went."""
        name = self._group(group)
        pool, index = self._pools[name], self._index[name]
        pages = [index[k] for k in dict.fromkeys(keys) if k in index]
        gone = [p for p in pages if pool.ref_count(p) == 0]
        if gone:
            pool.evict(block_ids=gone)
        return len(gone)

    def unpin(self, group: str, pages: np.ndarray) -> None:
        """Undo :meth:`pin` (nothing was queued)."""
        self._pools[self._group(group)].release(pages)

    def queue_onloads(self, group: str, device_blocks: np.ndarray, pages: np.ndarray) -> None:
        """Queue the copies of pinned ``pages`` to ``device_blocks`` (one length, checked by
        the caller); the pages stay pinned until :meth:`take_onloads` hands them out and then
        are the most recently used."""
        self._onloads[group] += zip(
            np.asarray(device_blocks).tolist(), np.asarray(pages).tolist(), strict=True
        )
        _bump(self.stats.hits, group, len(pages))

    def hold_for_onloads(
        self, group: str, pool: BlockPool, device_blocks: np.ndarray, pages: np.ndarray
    ) -> None:
        """Queue the copies of pinned ``pages`` to ``device_blocks`` of ``pool`` (taken for
        them), which the tier holds (``pending_blocks``) until :meth:`take_onloads` hands the
        onloads out: one hand-over, whole at any line (:func:`run_whole`), so a block with a
        queued onload is always held and a held block's onload always queued."""
        queue, pending = self._onloads[group], self.pending_blocks
        n, pairs = len(queue), list(zip(device_blocks.tolist(), pages.tolist(), strict=True))
        held = len(pending)

        def hand_over() -> None:
            del pending[held:]
            pending.append((pool, device_blocks))
            del queue[n:]
            queue.extend(pairs)

        run_whole(hand_over)
        _bump(self.stats.hits, group, len(pages))

    def holds_for_onloads(self, pool: BlockPool, device_blocks: np.ndarray) -> bool:
        """Whether the tier holds ``device_blocks`` of ``pool`` for queued onloads (a taken
        block is held by one owner only, so equal ids are the same hand-over)."""
        return any(
            held is pool and np.array_equal(blocks, device_blocks)
            for held, blocks in self.pending_blocks
        )

    def take_onloads(self) -> tuple[PageCopy, ...]:
        """The queued onloads (host page -> device block), one :class:`PageCopy` per group,
        for the worker to run before the step's kernels; their pages are unpinned, the first of
        a group's keys the most recently used (a chain's deepest page goes first)."""
        return self._hand_out(self._onloads, reverse=False)

    # ------------------------------------------------------------------ eviction

    def _evicted(self, group: str, victims: np.ndarray) -> None:
        """The keeper's hook of ``group``'s page pool: the victims' keys leave the index.
        An eviction cut short leaves its victims evictable, some with no key: the pool evicts
        them again, and a page this no longer knows is skipped. A key leaves the index before
        its page's entry goes, so no lookup finds a page the pool may hand out."""
        pages, index, released = self._pages[group], self._index[group], self._released[group]
        keys = []
        for page in victims.tolist():
            e = pages.get(page)
            if e is not None:  # (None: forgotten by an eviction cut short)
                named = index.get(e.key) == page
                if named:
                    del index[e.key]
                del pages[page]
                self._let_go(e.ref)
                if named:
                    keys.append(e.key)
            # once its key went: the worker's record frees it (a repeat is harmless)
            released.append(page)
        if keys:
            _bump(self.stats.evictions, group, len(keys))
        if self._on_evicted is not None and keys:
            self._on_evicted(group, keys)

    def reset(self) -> int:
        """Forget every page, queued offloads and onloads included (they will not be handed
        out); returns how many pages went."""
        # each list is emptied before what it pins is released: cut short, a page or block
        # stays pinned rather than being released twice
        for name, pool in self._pools.items():
            for copies in (self._offloads, self._onloads):
                queued, copies[name] = copies[name], []
                if queued:
                    pool.release(np.array([p for _, p in queued], dtype=np.int32))
            self._queued[name].clear()
        pending, self.pending_blocks = self.pending_blocks, []
        for pool, blocks in pending:  # their onloads will not run (the caller forgot keys)
            pool.release(blocks)
        return sum(len(pool.evict(pool.num_evictable)) for pool in self._pools.values())

    def _let_go(self, ref: bytes | None) -> None:
        if ref is not None:
            self.records.release(ref)

    def _group(self, group: object) -> str:
        if not isinstance(group, str) or group not in self._pools:
            raise ArgumentError(
                f"group {group!r} has no host tier pages; groups are {list(self._pools)}"
            )
        return group

    def __repr__(self) -> str:
        held = {g: len(ix) for g, ix in self._index.items()}
        return f"HostTier({self.policy}, {self.snapshot_policy}, pages held {held})"


# ---------------------------------------------------------------------- wiring


class ServedBlocks(Protocol):
    """What the tier reads of the device prefix cache
    (:class:`~kvforge.scheduler.prefix.PrefixCache` is one): its unit record store (a
    page holds a reference on the record its block held), and the entry of a block while it
    is the served copy of a key, with ``key``, ``end``, ``group`` (an index into the
    manager's group tables), ``ref`` and ``proof``."""

    records: UnitRecordStore

    def served(self, pool: BlockPool, block: int) -> Any: ...


class TierHost(Protocol):
    """What :func:`attach` needs of a scheduler
    (:class:`~kvforge.scheduler.block_manager.BlockManager` is one): its public tier seams."""

    @property
    def prefix_caching(self) -> bool: ...

    @property
    def groups(self) -> list[str]: ...

    @property
    def host_tier(self) -> HostTier | None: ...

    @property
    def group_tables(self) -> tuple[GroupTable, ...]: ...

    @property
    def prefix_cache(self) -> ServedBlocks: ...

    def attach_host_tier(self, tier: HostTier) -> None: ...


def check_attachable(prefix_caching: bool, current: HostTier | None) -> None:
    """Refuse a host tier to a scheduler that cannot take one.

    Raises:
        RuntimeError: prefix caching is off (the tier keeps cached prefixes), or the
            scheduler has a host tier already.
    """
    if not prefix_caching:
        raise RuntimeError("the host tier keeps cached prefixes: enable prefix caching")
    if current is not None:
        raise RuntimeError("this scheduler has a host tier already")


def check_tier_groups(named: object, groups: Sequence[str], what: str = "num_pages") -> None:
    """Refuse (:class:`ArgumentError`) a mapping or list ``named`` (``num_pages``, or a tier's
    groups) that names a group not in ``groups``; anything else is left to
    :class:`HostTier`."""
    if isinstance(named, Mapping | list | tuple):
        unknown = sorted(set(named) - set(groups), key=str)
        if unknown:
            raise ArgumentError(f"{what} names groups {unknown}; the groups are {groups}")


def attach(
    manager: TierHost,
    num_pages: Mapping[str, int],
    policy: HostTierPolicy = "eviction",
    snapshot_policy: SnapshotPolicy = "skip",
) -> HostTier:
    """Build a :class:`HostTier` of ``num_pages`` for ``manager`` and attach it
    (:meth:`BlockManager.attach_host_tier
    <kvforge.scheduler.block_manager.BlockManager.attach_host_tier>`, which checks again
    under the manager's lock and wires it). From then on every served prefix block one of its
    device pools evicts (a take that finds the free stack short, a slab move of an arena, a
    swap in's or a truncation's take) is demoted, its offload riding in the next
    ``StepAllocation.offloads`` or :meth:`BlockManager.take_tier_offloads`, and its lookups
    bring back what only the tier holds.

    With ``snapshot_policy="aligned"``, the per-request groups ``num_pages`` names keep the
    snapshots the prefix cache registered (at ``snapshot_interval``-aligned boundaries) as
    any other group keeps its blocks; under ``"skip"`` they keep none.
    With ``policy="write_through"``, every block a step registers is also demoted at once
    (its device copy stays cached): the page holds it from completion, so a remote tier behind
    the host tier can publish it while the device still serves it.

    Raises:
        RuntimeError: prefix caching is off, or the manager has a host tier already.
        ArgumentError: a group ``num_pages`` names is not the manager's, a bad count,
            ``policy`` or ``snapshot_policy``. Nothing changes in any case.
    """
    check_attachable(manager.prefix_caching, manager.host_tier)
    check_host_tier_policy(policy)
    check_snapshot_policy(snapshot_policy)
    check_tier_groups(num_pages, manager.groups)
    snapshots = {g.spec.name for g in manager.group_tables if g.per_request}
    tier = HostTier(num_pages, manager.prefix_cache.records, snapshots, policy, snapshot_policy)
    manager.attach_host_tier(tier)
    return tier
