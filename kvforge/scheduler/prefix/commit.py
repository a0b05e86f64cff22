"""Making completed blocks reusable: what a step completed is chosen, keyed and pinned when
the step is scheduled (:meth:`Commits.commit`), and registered in the index only when the step
has ended (:meth:`Commits.finish_step`).

:meth:`Commits.commit` runs per request of a step: it chooses the blocks the step completes
that some match can read (history blocks always, window blocks under the retention rule,
:func:`~.retention.in_some_tail`), hashes their keys on the request's chain (tail keys and
their proofs for window blocks that end inside a unit), takes the unit records they hang off
(:meth:`~kvforge.scheduler.unit_records.UnitRecordStore.hold`), pins them for the step, and
queues a snapshot copy of per-request state at every ``snapshot_interval``.
:meth:`Commits.finish_step` registers them once the kernels (snapshots: the copies) ran.

Invariants (``tests/test_isolation.py``, ``tests/scheduler/test_newest_copy.py``,
``tests/scheduler/test_retention.py`` and the prefix property test):

- a block is registered at most once, and only after the step that completed it ran
  (sharing starts when the writing step ends; a step dropped unended registers nothing);
- the newest copy wins: a recomputed block takes over its key from an evictable cached copy
  (which goes back to the free stack); while the cached copy is in use, the new one waits
  and takes the key over when the cached copy goes;
- a chain that names other content (its records disagree) stops registering at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvforge.core.prefix_keys import PrefixHasher
from kvforge.core.values import BlockCopy
from kvforge.scheduler.args import token_array
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.scheduler.prefix.chains import RequestChains
from kvforge.scheduler.prefix.index import PrefixIndex
from kvforge.scheduler.prefix.records import (
    Entry,
    PrefixSettings,
    PrefixStats,
    Proof,
    Registration,
    StepWork,
)
from kvforge.scheduler.prefix.retention import in_some_tail
from kvforge.scheduler.tables import GroupTable, RequestTables
from kvforge.scheduler.undo import all_or_nothing
from kvforge.scheduler.unit_records import Held, UnitRecordStore

__all__ = ["Commits"]

#: a block chosen for registration: (group index, group, block, end token)
_Chosen = tuple[int, GroupTable, int, int]


class Commits:
    """Chooses, keys and registers the blocks the steps complete.

    Args:
        settings: the cache's settings.
        tables: the scheduler side's tables (rows, committed counts).
        index: the key <-> block index.
        chains: the requests' key chains.
        records: the unit records the registered blocks hold.
        stats: the counters of stored blocks.
    """

    def __init__(
        self,
        settings: PrefixSettings,
        tables: RequestTables,
        index: PrefixIndex,
        chains: RequestChains,
        records: UnitRecordStore,
        stats: PrefixStats,
    ) -> None:
        self._s = settings
        self._t = tables
        self._index = index
        self._chains = chains
        self._records = records
        self._stats = stats

    def commit(
        self,
        request_id: str,
        row: int,
        before: int,
        after: int,
        tokens: Sequence[int] | None,
        work: StepWork,
    ) -> list[BlockCopy]:
        """Make the blocks this step completed reusable (once ``work``'s step ends);
        snapshot per-request state. Returns the snapshot copies to run after the step."""
        hasher = self._chains.hasher(request_id)
        if hasher is None or after == before:
            return []
        if tokens is None or hasher.num_tokens != before:
            self._chains.end(request_id)  # the chain is broken: stop registering
            return []
        toks = token_array(tokens, "new_token_ids")[: after - before]
        # the blocks to register, decided before any key is hashed (a block no match can
        # read needs none)
        chosen, tail_chosen = self._choose(request_id, row, after)
        snapshot = bool(self._snapshot_groups()) and after % self._s.snapshot_interval == 0
        key_of, proofs = self._keys(hasher, toks, after, [*chosen, *tail_chosen], snapshot)
        snapshots = self._snapshot_targets(key_of[after]) if snapshot else []
        held = self._hold(request_id, hasher, chosen, after, len(snapshots))
        registered = [
            (gi, g, block, end, ref)
            for (gi, g, block, end), ref in zip(chosen, held.keys, strict=False)
        ]
        if held.cursor is not None or not len(hasher.unit_records()):
            registered += [(gi, g, block, end, b"") for gi, g, block, end in tail_chosen]
        for gi, g, block, end, ref in registered:
            if ref is None:
                continue
            # shareable when the step that writes it ends: held by the step until then
            g.pool.share([block])
            work.pins.append((g, np.array([block], dtype=np.int32)))
            work.registrations.append(
                Registration(gi, g, key_of[end], block, end, ref or None, proofs.get(end), False)
            )
        return self._snapshot_copies(row, after, snapshots, held.keys[len(chosen) :], work)

    def _snapshot_groups(self) -> list[GroupTable]:
        return [g for g in self._t.groups if g.per_request]

    def _choose(self, request_id: str, row: int, after: int) -> tuple[list[_Chosen], list[_Chosen]]:
        """``(chosen, tails off the root)``: the blocks of ``row`` completed up to ``after``
        that are not registered yet and that some match can read; the row's committed counts
        move to ``after``."""
        unit = self._s.unit
        keep = self._chains.kept(request_id) if self._s.retention == "checkpoints" else None
        chosen: list[_Chosen] = []
        tail_chosen: list[_Chosen] = []  # tails off the root
        for gi, g in enumerate(self._t.groups):
            if g.per_request:
                continue
            done, full = int(self._t.committed[gi, row]), after // g.block_size
            owner = self._index.served_blocks(g.pool)
            for c in range(done, full):
                block = int(g.table[row, c])
                end = (c + 1) * g.block_size
                if block == NULL_BLOCK or block in owner:
                    continue  # a shared block is registered already
                # a key cached in another block is registered too: the newest copy wins
                # (finish_step)
                if g.windowed and not in_some_tail(
                    g, c, self._s.boundary, self._s.retention_interval, keep
                ):
                    continue  # no match can ever read it: keep the pool for blocks that can
                if end % unit and end // unit == 0:
                    # a tail off the root: its proof carries the extra keys, no record needed
                    tail_chosen.append((gi, g, block, end))
                    continue
                chosen.append((gi, g, block, end))
            self._t.committed[gi, row] = full
        return chosen, tail_chosen

    def _keys(
        self,
        hasher: PrefixHasher,
        toks: np.ndarray,
        after: int,
        chosen: list[_Chosen],
        snapshot: bool,
    ) -> tuple[dict[int, bytes], dict[int, Proof]]:
        """``(end -> key, end -> proof)`` of every chosen end (and of ``after`` for a
        snapshot): unit ends from the chain, the others as tail keys with their proofs."""
        unit = self._s.unit
        wanted = {end for _, _, _, end in chosen}
        if snapshot:
            wanted.add(after)
        at = np.array(sorted(e for e in wanted if e % unit == 0), dtype=np.int64)
        keys = hasher.extend(toks, at=at)
        key_of = dict(zip(at.tolist(), keys, strict=True))
        proofs: dict[int, Proof] = {}
        for end in wanted:
            if end % unit:  # a window block ending inside a unit: its tail key and proof
                key, parent, payload = hasher.tail_key(end)
                key_of[end] = key
                proofs[end] = (parent, payload, hasher.root_preimage if end < unit else b"")
        return key_of, proofs

    def _snapshot_targets(self, key: bytes) -> list[tuple[int, GroupTable]]:
        """The per-request groups that take a snapshot under ``key``: one slot per request is
        what linear attention holds; several are not snapshotted (their blocks would have to
        be evicted together), nor a key cached already, nor without a free block."""
        return [
            (gi, g)
            for gi, g in enumerate(self._t.groups)
            if g.per_request
            and g.slots == 1
            and self._index.block_of(g.spec.name, key) is None
            and g.pool.num_free >= g.slots
        ]

    def _hold(
        self, request_id: str, hasher: PrefixHasher, chosen: list[_Chosen], after: int, snaps: int
    ) -> Held:
        """Take the unit records the chosen blocks (and the snapshots) hang off: each holds
        the record of its own end, or of a tail's base. A chain whose records name other
        content stops registering."""
        unit = self._s.unit
        ends = [end // unit * unit for _, _, _, end in chosen] + [after] * snaps
        held = self._records.hold(
            hasher.unit_records(), at=ends, cursor=self._chains.take_cursor(request_id)
        )
        if held.cursor is None and len(hasher.unit_records()):
            self._chains.stop(request_id)  # the chain names other content: stop
        elif held.cursor is not None:
            self._chains.hold(request_id, held.cursor)
        return held

    def _snapshot_copies(
        self,
        row: int,
        after: int,
        snapshots: list[tuple[int, GroupTable]],
        refs: Sequence[bytes | None],
        work: StepWork,
    ) -> list[BlockCopy]:
        """The copies of ``row``'s per-request state into fresh blocks, pinned by ``work``."""
        copies: list[BlockCopy] = []
        for (gi, g), ref in zip(snapshots, refs, strict=True):
            if ref is None:
                continue
            src = g.table[row, : g.slots].copy()
            dst = g.pool.take(g.slots)
            g.pool.share(src)  # the copy reads the request's state after the step's kernels
            work.pins += [(g, dst), (g, src)]
            work.registrations.append(Registration(gi, g, ref, int(dst[0]), after, ref, None, True))
            copies.append(BlockCopy(g.spec.name, src, dst))
        return copies

    def finish_step(
        self,
        work: StepWork,
        kernels_ran: bool,
        copies_ran: bool,
        on_store: Callable[[BlockPool, int], None] | None,
    ) -> None:
        """A step ended: register what it wrote, then drop what it held.

        ``kernels_ran`` and ``copies_ran`` say what is known to have written the step's blocks
        (an explicit ``end_step``): blocks are registered only after the kernels, snapshots
        only after the copies. A step dropped unended registers nothing. ``on_store`` hears
        of every block registered (the host tier's write-through)."""
        try:
            self._register(work, kernels_ran, copies_ran, on_store)
        finally:  # whatever a registration met, the rest are dropped and the pins go
            work.registrations.clear()
            if work.pins:
                _release_pins(work)

    def _register(
        self,
        work: StepWork,
        kernels_ran: bool,
        copies_ran: bool,
        on_store: Callable[[BlockPool, int], None] | None,
    ) -> None:
        """The registrations of :meth:`finish_step`."""
        stats = self._stats
        registrations = work.registrations
        registrations.reverse()  # each taken off before it is registered: never twice
        while registrations:
            r = registrations.pop()
            written = copies_ran if r.snapshot else kernels_ran
            old = self._index.block_of(r.group.spec.name, r.key)
            if (
                not written
                or self._index.served(r.group.pool, r.block) is not None
                or (old is not None and r.snapshot)
            ):
                if r.ref is not None:
                    self._records.release(r.ref)
                continue
            if old is not None:
                if r.group.pool.ref_count(old) > 0:
                    # the cached copy is in use: this one waits, and takes the key over
                    # when that copy goes
                    entry = Entry(r.key, r.end, r.index, r.ref, r.proof)
                    self._index.add_waiting(r.group, r.block, entry)
                    continue
                # the cached copy is evictable: the recomputed one takes its key and place in
                # LRU order, the old one goes back to the free stack (copies still waiting
                # stay behind the new one)
                self._index.forget_block(r.group, old, promote=False)
            self._index.store(r.index, r.group, r.key, r.block, r.end, r.ref, r.proof)
            name = r.group.spec.name
            stats.stored_blocks[name] = stats.stored_blocks.get(name, 0) + 1
            if on_store is not None:  # the host tier's write-through
                on_store(r.group.pool, r.block)


def _release_pins(work: StepWork) -> None:
    """Release every pin of ``work`` (blocks it held for its copies and registrations) and
    empty the list, all or nothing: cut short at any line, the pins are held and listed as
    before, for an ``end_step`` tried again."""
    with all_or_nothing() as undo:
        pins = work.pins
        for g, blocks in pins:
            undo.release(g.pool, blocks)
        undo.add(lambda: setattr(work, "pins", pins))  # (struck as the block closes, too)
        work.pins = []
