"""The index of the prefix cache and its eviction: the one place where key <-> block changes.

:class:`PrefixIndex` maps, per group, a key to its served block (``_cached``) and, per pool,
a block to what the cache knows of it (``_owner`` for served copies, ``_spare_owner`` for
newer copies waiting to take a served key over, listed per key in ``_spares``). It hears of
every eviction (:meth:`PrefixIndex.evicted`, each pool's eviction hook) and of every slab
move of an arena (:meth:`PrefixIndex.moved`), announces what it stores and removes
(:class:`~kvforge.core.values.PrefixEvent`, taken by :meth:`PrefixIndex.take_events`), and
counts evictions per family in the cache's :class:`~.records.PrefixStats`.

Invariants (``tests/scheduler/test_prefix_cache.py``, ``tests/scheduler/test_newest_copy.py``,
``tests/scheduler/test_arena.py`` and the prefix property test):

- a block is in ``_owner`` of its pool exactly when some group's ``_cached`` maps a key to it
  (it is served), in ``_spare_owner`` exactly when it waits in ``_spares`` as another copy
  of a served key, never in both; exactly then its pool retains it (evictable at ref 0),
  but for the victims of an eviction an exception cut short and a block whose
  :meth:`PrefixIndex.store` an exception cut short, retained with no key until their pool
  evicts them;
- a key names a block only while the block's entry is in place and its pool retains it:
  a key is written last (:meth:`PrefixIndex.store`, :meth:`PrefixIndex.promote`) and
  withdrawn first (:meth:`PrefixIndex.evicted`) (``tests/scheduler/test_swap_faults.py``,
  an eviction struck at every line of the pools and the index);
- the newest copy wins: when the served copy of a key goes (evicted or rewritten), its newest
  waiting copy takes the key over (:meth:`PrefixIndex.promote`), announced as stored; a
  waiting copy that goes is never announced (a key was not lost);
- a registered block holds one reference on its unit record, released when it goes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np

from kvforge.core.values import PrefixEvent
from kvforge.scheduler.block_pool import BlockPool, run_whole
from kvforge.scheduler.prefix.records import Entry, PrefixStats, Proof
from kvforge.scheduler.tables import GroupTable, RequestTables
from kvforge.scheduler.unit_records import UnitRecordStore

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Key <-> block of every group, the waiting copies, the events and the eviction hook.

    Args:
        tables: the scheduler side's tables (their groups and pools).
        records: the unit records registered blocks hold references on.
        stats: the counters evictions are added to.
    """

    def __init__(self, tables: RequestTables, records: UnitRecordStore, stats: PrefixStats) -> None:
        self._groups = tables.groups
        self._pools = tables.pools
        self._records = records
        self._stats = stats
        self._events: list[PrefixEvent] = []
        self._cached: dict[str, dict[bytes, int]] = {g.spec.name: {} for g in tables.groups}
        # per pool: block -> (key, end token, group index, the record it holds or None, the
        # tail proof (parent, payload, root preimage) of a key that ends inside a unit)
        self._owner: dict[BlockPool, dict[int, Entry]] = {pool: {} for pool, _ in tables.pools}
        # copies of a served key waiting to take it over: per pool, block -> its entry, and
        # per group, key -> the waiting blocks, oldest first
        self._spare_owner: dict[BlockPool, dict[int, Entry]] = {
            pool: {} for pool, _ in tables.pools
        }
        self._spares: dict[str, dict[bytes, list[int]]] = {g.spec.name: {} for g in tables.groups}

    # ------------------------------------------------------------------ views

    def keys_of(self, group: str) -> Mapping[bytes, int]:
        """Key -> served block of ``group`` (a live view: read it, never write it)."""
        return self._cached[group]

    def block_of(self, group: str, key: object) -> int | None:
        """The cached block of ``key`` in ``group``, or ``None``."""
        return self._cached[group].get(key)  # type: ignore[call-overload]

    def served(self, pool: BlockPool, block: int) -> Entry | None:
        """What the index knows of ``block`` while it is the served copy of a key."""
        return self._owner[pool].get(block)

    def served_blocks(self, pool: BlockPool) -> Mapping[int, Entry]:
        """Block -> entry of every served block of ``pool`` (a live view: read only)."""
        return self._owner[pool]

    def waiting_blocks(self, pool: BlockPool) -> frozenset[int]:
        """The blocks of ``pool`` waiting as newer copies of a served key."""
        return frozenset(self._spare_owner[pool])

    def registered(self, pool: BlockPool) -> dict[int, tuple[object, int, str]]:
        """Every served block of ``pool``: block -> (key, end token, group)."""
        names = [g.spec.name for g in self._groups]
        return {b: (e.key, e.end, names[e.group]) for b, e in self._owner[pool].items()}

    def take_events(self) -> list[PrefixEvent]:
        """Blocks stored in and removed from the index since the last call."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ changes

    def store(
        self,
        gi: int,
        g: GroupTable,
        key: bytes,
        block: int,
        end: int,
        ref: bytes | None,
        proof: Proof | None,
    ) -> None:
        """Register ``block`` as the served copy of ``key`` and announce it: both directions
        of the index change here, in :meth:`forget_block`, :meth:`promote` and
        :meth:`evicted` only. ``ref`` is the unit record the block holds a reference on
        (released when it goes)."""
        g.pool.retain(block)  # first: an entry is only ever on a block its pool keeps
        self._owner[g.pool][block] = Entry(key, end, gi, ref, proof)
        self._cached[g.spec.name][key] = block  # last: the key names a block kept for it
        self._events.append(PrefixEvent("stored", g.spec.name, key, end))

    def add_waiting(self, g: GroupTable, block: int, entry: Entry) -> None:
        """``block`` is a newer copy of ``entry.key`` while the served copy is in use: it
        waits (retained by its pool) and takes the key over when that copy goes."""
        g.pool.retain(block)  # first: a promotion may give it the key at once
        self._spare_owner[g.pool][block] = entry
        self._spares[g.spec.name].setdefault(entry.key, []).append(block)  # last, as a key

    def forget_block(self, g: GroupTable, block: int, promote: bool = True) -> None:
        """Forget the key of ``block`` (it will be written again): the block stays with its
        holders and goes back to the free stack when they release it. A waiting copy of the
        key, if any, takes it over (unless ``promote`` is false: a newer copy will)."""
        if self.drop_waiting(g.pool, block):
            g.pool.forget(block)
            return
        owner = self._owner[g.pool]
        entry = owner.get(block)
        if entry is None:
            return
        group = self._groups[entry.group]
        if self._cached[group.spec.name].get(entry.key) == block:
            del self._cached[group.spec.name][entry.key]  # first, as in evicted
        del owner[block]
        g.pool.forget(block)
        if entry.ref is not None:
            self._records.release(entry.ref)
        self._events.append(PrefixEvent("removed", group.spec.name, entry.key, entry.end))
        if promote:
            self.promote(group, entry.key)

    def drop_waiting(self, pool: BlockPool, block: int) -> bool:
        """Drop ``block`` if it is a waiting copy (no event: it was never announced). It
        leaves its key's list before its entry goes, so a drop cut short is finished by the
        next one, and a promotion never takes a block that has no entry."""
        spare_owner = self._spare_owner[pool]
        entry = spare_owner.get(block)
        if entry is None:
            return False
        name = self._groups[entry.group].spec.name
        waiting = self._spares[name].get(entry.key)
        if waiting is not None and block in waiting:  # (a drop cut short took it out)
            waiting.remove(block)
            if not waiting:
                del self._spares[name][entry.key]
        del spare_owner[block]
        if entry.ref is not None:
            self._records.release(entry.ref)
        return True

    def promote(self, g: GroupTable, key: bytes) -> None:
        """The served copy of ``key`` went: its newest waiting copy takes the key over."""
        waiting = self._spares[g.spec.name].get(key)
        if not waiting:
            return
        block = waiting.pop()
        if not waiting:
            del self._spares[g.spec.name][key]
        entry = self._spare_owner[g.pool].pop(block)
        self._owner[g.pool][block] = entry
        self._cached[g.spec.name][key] = block  # last, as in store
        self._events.append(PrefixEvent("stored", g.spec.name, key, entry.end))

    def evicted(self, pool: BlockPool, victims: np.ndarray) -> None:
        """The eviction hook of ``pool``: ``victims`` leave the index (and are counted).

        An eviction an exception cut short (``KeyboardInterrupt`` included) leaves its
        victims evictable in their pool, some of them with no key: the pool evicts them
        again, and this hook skips a victim it no longer knows. Each key stops naming its
        block before the block's entry goes, so no lookup finds a block the pool frees."""
        ev = self._stats.evictions
        owner = self._owner[pool]
        # waiting copies first, so that none of them is promoted; they were never announced,
        # so they are not counted as evictions (a key was not lost)
        served = [b for b in victims.tolist() if not self.drop_waiting(pool, b)]
        for b in served:
            entry = owner.get(b)
            if entry is None:
                continue  # forgotten by an eviction cut short
            g = self._groups[entry.group]
            cached = self._cached[g.spec.name]
            if cached.get(entry.key) == b:
                del cached[entry.key]  # first: from here no lookup finds the block
            del owner[b]
            family = g.spec.family.value
            ev[family] = ev.get(family, 0) + 1
            if entry.ref is not None:
                self._records.release(entry.ref)
            self._events.append(PrefixEvent("removed", g.spec.name, entry.key, entry.end))
            self.promote(g, entry.key)

    def moved(self, pool: BlockPool, src: np.ndarray, dst: np.ndarray) -> None:
        """Cached blocks ``src`` moved to ``dst`` (a slab arena packing): keys follow. A
        block this no longer knows (an eviction or a drop cut short forgot it) moves
        keyless. Each block's entry moves whole (:func:`run_whole`): in place at ``dst``
        first, then its key, then gone from ``src``; an exception leaves each block of the
        pair keyed or keyless, never one entry at two blocks (its unit record would be
        released twice). The pool frees ``src`` only once this returned."""
        served, waiting = self._owner[pool], self._spare_owner[pool]
        for a, b in zip(src.tolist(), dst.tolist(), strict=True):
            owner = served if a in served else waiting if a in waiting else None
            if owner is not None:
                run_whole(functools.partial(self._move_entry, owner, owner is waiting, a, b))

    def _move_entry(self, owner: dict[int, Entry], waits: bool, a: int, b: int) -> None:
        """Block ``a``'s entry, and the key or waiting list that names it, to block ``b``;
        every store sets a value read first, so it runs again whole."""
        entry = owner.get(a) or owner[b]  # (a second run: the entry is at b already)
        name = self._groups[entry.group].spec.name
        owner[b] = entry
        if waits:
            copies = self._spares[name].get(entry.key)
            if copies is not None and a in copies:
                copies[copies.index(a)] = b
        elif self._cached[name].get(entry.key) == a:
            self._cached[name][entry.key] = b
        owner.pop(a, None)

    def reset(self) -> int:
        """Forget every key: evictable blocks go back to the free stacks and blocks in use
        lose their keys. Returns the number of blocks evicted."""
        evicted = 0
        for pool, members in self._pools:  # waiting copies first, so that none is promoted
            for block in list(self._spare_owner[pool]):
                evicted += pool.ref_count(block) == 0  # back to the free stack, as evicted
                self.forget_block(self._groups[members[0]], block)
        for pool, _ in self._pools:
            evicted += len(pool.evict(pool.num_evictable))
        for pool, _ in self._pools:
            for block in list(self._owner[pool]):
                g = self._groups[self._owner[pool][block].group]
                self.forget_block(g, block)
        return evicted
