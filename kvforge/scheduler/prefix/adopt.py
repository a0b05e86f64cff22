"""Adopting a match: sharing the blocks a lookup found into a new request's row.

:class:`Adoption` checks a match's seal (:class:`~.seal.MatchSealer`), shares into the row the
blocks that serve the match's keys *now* (a served key may have moved to a newer copy since
the lookup), verifies the unit records up to ``L`` again as the request's chain takes them
over, and starts the request's key chain (:class:`~.chains.RequestChains`). It undoes an
adoption the step then refuses (:meth:`Adoption.unadopt`) and records the table deltas and
restore copies of an accepted one (:meth:`Adoption.record`).

Invariants (``tests/test_isolation.py``, ``tests/scheduler/test_prefix_cache.py``): a match
this cache did not make as it stands (forged, altered, another cache's) is refused with
nothing changed; a match whose keys were evicted since the lookup is refused naming the group;
per-request blocks are pinned by the step until its restore copy has read them.
"""

from __future__ import annotations

import numpy as np

from kvforge.core.prefix_keys import PrefixHasher
from kvforge.core.values import BlockCopy, PrefixMatch
from kvforge.scheduler.block_pool import NULL_BLOCK
from kvforge.scheduler.prefix.chains import RequestChains
from kvforge.scheduler.prefix.index import PrefixIndex
from kvforge.scheduler.prefix.records import PrefixSettings, StepWork
from kvforge.scheduler.prefix.retention import checkpoints_of
from kvforge.scheduler.prefix.seal import MatchSealer
from kvforge.scheduler.tables import RequestTables
from kvforge.scheduler.unit_records import UnitRecordStore

__all__ = ["Adoption"]


class Adoption:
    """Adopts, unadopts and records matches into the scheduler side's tables.

    Args:
        settings: the cache's settings.
        tables: the scheduler side's tables (rows, committed counts, pending deltas).
        index: the key <-> block index.
        chains: the requests' key chains.
        records: the unit records behind the keys.
        sealer: verifies the matches' seals.
    """

    def __init__(
        self,
        settings: PrefixSettings,
        tables: RequestTables,
        index: PrefixIndex,
        chains: RequestChains,
        records: UnitRecordStore,
        sealer: MatchSealer,
    ) -> None:
        self._s = settings
        self._t = tables
        self._index = index
        self._chains = chains
        self._records = records
        self._sealer = sealer

    def adopt(
        self, request_id: str, row: int, match: PrefixMatch | None, work: StepWork
    ) -> tuple[str | None, PrefixMatch | None]:
        """Share into ``row`` the blocks that serve a match's keys now: ``(None, the match
        adopted)``; or (a group whose keys were evicted since the lookup, or ``""`` for a match
        this cache did not make as it stands: forged, altered, another's; None): no change."""
        if match is not None:
            valid = self._sealer.verify(match)
            if not self._s.enabled or not valid:
                return "", None
        hasher = match.hasher if match is not None else self._s.hasher()
        if self._s.enabled:
            assert isinstance(hasher, PrefixHasher)
            self._chains.start(request_id, hasher.at_prefix(hasher.num_tokens))
            if match is not None and self._s.retention == "checkpoints":
                self._chains.keep(
                    request_id,
                    checkpoints_of(match.num_prompt_tokens, match.junction, self._s.boundary),
                )
        if match is None or not match.num_tokens:
            return None, match
        stale, match = self._served_now(request_id, match)
        if match is None:
            return stale, None
        assert isinstance(hasher, PrefixHasher)
        held = self._records.hold(hasher.unit_records())  # verifies units 0 .. L again
        if held.cursor is None:
            self._chains.stop(request_id)
            return next(iter(match.keys), ""), None
        self._chains.hold(request_id, held.cursor)
        self._share(row, match, work)
        return None, match

    def _served_now(
        self, request_id: str, match: PrefixMatch
    ) -> tuple[str | None, PrefixMatch | None]:
        """``(None, match)`` over the blocks that serve its keys now (resealed when some
        moved), or ``(a group whose keys are gone, None)``."""
        now: dict[str, np.ndarray] = {}
        for g in self._t.groups:
            keys = match.keys.get(g.spec.name, ())
            blocks = match.blocks.get(g.spec.name)
            if blocks is None or len(blocks) != len(keys):
                return g.spec.name, None
            cached = self._index.keys_of(g.spec.name)
            served = [cached.get(k) for k in keys]
            if None in served:
                self._chains.stop(request_id)
                return g.spec.name, None
            now[g.spec.name] = np.array(served, dtype=blocks.dtype)
        if any(not np.array_equal(now[n], b) for n, b in match.blocks.items()):
            m = match
            match = self._sealer.sealed(
                m.num_tokens, m.first_col, now, m.keys, m.hasher, m.num_prompt_tokens, m.junction
            )
        return None, match

    def _share(self, row: int, match: PrefixMatch, work: StepWork) -> None:
        """Share the match's blocks into ``row`` (per-request ones pinned by the step)."""
        for gi, g in enumerate(self._t.groups):
            blocks = match.blocks[g.spec.name]
            g.pool.share(blocks.tolist())
            if g.per_request:
                work.pins.append((g, blocks))  # the restore copy reads it in the step
                continue
            c0 = match.first_col[g.spec.name]
            g.table[row, c0 : c0 + len(blocks)] = blocks
            g.held_from[row] = c0
            self._t.committed[gi, row] = match.num_tokens // g.block_size
        self._t.num_tokens[row] = match.num_tokens

    def unadopt(self, row: int, match: PrefixMatch, work: StepWork) -> None:
        """Undo :meth:`adopt` of ``match`` into ``row`` (the step refused the request)."""
        for gi, g in enumerate(self._t.groups):
            blocks = match.blocks[g.spec.name]
            if g.per_request:
                # drop this adoption's pin only: one match may serve several requests
                pins = work.pins
                k = next(k for k, (_, pb) in enumerate(pins) if pb is blocks)
                del pins[k]
            else:
                c0 = match.first_col[g.spec.name]
                g.table[row, c0 : c0 + len(blocks)] = NULL_BLOCK
                g.held_from[row] = 0
                self._t.committed[gi, row] = 0
            g.pool.release(blocks)
        self._t.num_tokens[row] = 0

    def record(self, row: int, match: PrefixMatch) -> list[BlockCopy]:
        """Table deltas of an accepted hit, and the copies restoring per-request state."""
        copies = []
        for g in self._t.groups:
            blocks = match.blocks[g.spec.name]
            if g.per_request:
                copies.append(BlockCopy(g.spec.name, blocks, g.table[row, : g.slots].copy(), row))
                continue
            c0 = match.first_col[g.spec.name]
            self._t.record(
                g,
                np.full(len(blocks), row, dtype=np.int32),
                np.arange(c0, c0 + len(blocks), dtype=np.int32),
                blocks,
            )
        return copies
