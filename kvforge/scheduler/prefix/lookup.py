"""Finding the longest reusable prefix of a prompt on the device (what
:meth:`PrefixCache.lookup <.cache.PrefixCache.lookup>` answers).

``L`` is the largest multiple of the boundary below the prompt's length such that every full
group holds the whole chain ``[0, L)``, every window and state group the blocks covering the
window the next token reads, and every per-request group a snapshot taken at exactly ``L``.
:class:`PrefixLookup` finds it in three passes: how far the full-attention chains reach
(:meth:`PrefixLookup._reach`), the exact check of the tokens, multimodal items and extra keys
behind every unit up to ``L`` (:meth:`PrefixLookup._exact`), and the blocks each group shares
(:meth:`PrefixLookup._match`), sealed by :class:`~.seal.MatchSealer`.

Invariants (``tests/scheduler/test_prefix_cache.py``, ``tests/scheduler/test_exact_prefix.py``
and the prefix property test): a lookup changes nothing but the counters; every query is
checked before any counter moves; a hit is exact (a key that names other content shortens it
to what is truly cached and counts one collision, never serves another prompt's KV); the
match holds, per group, exactly the blocks the step after ``L`` reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvforge.core.prefix_keys import PrefixHasher
from kvforge.core.values import PrefixMatch, PrefixQuery
from kvforge.scheduler.args import token_array
from kvforge.scheduler.prefix.index import PrefixIndex
from kvforge.scheduler.prefix.records import PrefixSettings, PrefixStats, Proof
from kvforge.scheduler.prefix.retention import window_start
from kvforge.scheduler.prefix.seal import MatchSealer
from kvforge.scheduler.tables import GroupTable
from kvforge.scheduler.unit_records import UnitRecordStore

__all__ = ["PrefixLookup", "check_queries"]


def check_queries(queries: object) -> list[np.ndarray]:
    """The token ids of every query, checked (:func:`token_array`) before any is looked up.

    Raises:
        TypeError: ``queries`` is not a sequence of :class:`PrefixQuery`, named.
        ArgumentError: a bad ``queries[i].token_ids``, named.
    """
    if isinstance(queries, PrefixQuery) or not isinstance(queries, Sequence):
        raise TypeError(f"queries must be a sequence of PrefixQuery, got {type(queries).__name__}")
    checked = []
    for i, q in enumerate(queries):  # every query checked before any counter moves
        if not isinstance(q, PrefixQuery):
            raise TypeError(f"queries[{i}] is a {type(q).__name__}, not a PrefixQuery")
        checked.append(token_array(q.token_ids, f"queries[{i}].token_ids"))
    return checked


class _Probe:
    """One prompt's keys as a lookup reads them: the chain's key at every unit end up to the
    top boundary, tail keys hashed on demand, and what the lookup learnt on the way."""

    def __init__(self, hasher: PrefixHasher, unit: int) -> None:
        self.hasher = hasher
        self.unit = unit
        self.keys: list[bytes] = []
        self.tails: dict[int, tuple[bytes, bytes, bytes]] = {}
        self.known_units = 0  # leading units whose keys came from stored records (exact)
        self.collided = False  # a key named other content

    def key_at(self, t: int) -> bytes:
        """The key of the block that ends at token ``t``."""
        if t % self.unit == 0:
            return self.keys[t // self.unit - 1]
        tail = self.tails.get(t)
        if tail is None:
            tail = self.tails[t] = self.hasher.tail_key(t)
        return tail[0]

    def proof(self, end: int) -> Proof:
        """The proof a tail block ending at ``end`` must hold (after :meth:`key_at`)."""
        _, parent, payload = self.tails[end]
        return parent, payload, self.hasher.root_preimage if end < self.unit else b""


class PrefixLookup:
    """The device lookup of a prefix cache, over the parts it reads.

    Args:
        settings: the cache's settings.
        groups: the scheduler side's group tables.
        index: the key <-> block index.
        records: the unit records behind every cached key (the exact check).
        stats: the counters a lookup moves.
        sealer: seals the matches.
    """

    def __init__(
        self,
        settings: PrefixSettings,
        groups: Sequence[GroupTable],
        index: PrefixIndex,
        records: UnitRecordStore,
        stats: PrefixStats,
        sealer: MatchSealer,
    ) -> None:
        self._s = settings
        self._groups = groups
        self._index = index
        self._records = records
        self._stats = stats
        self._sealer = sealer

    def one(self, query: PrefixQuery, tokens: np.ndarray) -> PrefixMatch:
        """One query whose ``tokens`` :func:`token_array` checked (ids in ``[0, 2**32)``)."""
        n = len(tokens)
        hasher = self._s.hasher(query)
        stats = self._stats
        stats.queries += 1
        stats.query_tokens += n
        step = self._s.boundary
        top = ((n - 1) // step) * step if n else 0
        if not self._s.enabled or top == 0:
            return self._sealer.sealed(0, {}, {}, {}, hasher, n)
        probe = self._probe(hasher, tokens, top)
        chain, length = self._reach(probe, top)
        length = self._exact(probe, length)
        stats.collisions += probe.collided  # one per lookup whose keys named other content
        # where the chain reaches past the tails: a prompt sharing this prefix diverged there
        junction = chain if chain > length else 0
        if length == 0:
            return self._sealer.sealed(0, {}, {}, {}, self._s.hasher(query), n, junction)
        return self._match(probe, length, n, junction)

    def _probe(self, hasher: PrefixHasher, tokens: np.ndarray, top: int) -> _Probe:
        """The keys at every unit end up to ``top``: a cached prefix's come from its stored
        records (no digest), the rest are hashed; the units found that way are exact by
        construction (``UnitRecordStore.known_keys``). Ids were checked: uint32 holds them."""
        probe = _Probe(hasher, self._s.unit)
        records = self._records

        def known(parent: bytes, payloads: Sequence[bytes], root: bytes | None) -> list[bytes]:
            found = records.known_keys(parent, payloads, root)
            probe.known_units = len(found)
            return found

        probe.keys = hasher.extend(tokens[:top].astype(np.uint32), known=known)
        return probe

    def _reach(self, probe: _Probe, top: int) -> tuple[int, int]:
        """``(chain, L)``: how far every full group's chain reaches (0 without one), and the
        longest boundary within it whose window tails and snapshots are present."""
        unit, step, keys = self._s.unit, self._s.boundary, probe.keys
        upper = top
        for g in self._groups:
            if g.history:
                i = 0
                r = g.block_size // unit  # history blocks end on unit ends
                cached = self._index.keys_of(g.spec.name)
                for key in keys[r - 1 : upper // unit : r]:
                    if key not in cached:
                        break
                    i += 1
                upper = min(upper, i * g.block_size)
        length = (upper // step) * step
        chain = length if self._s.has_history else 0  # the full-attention chain's reach
        while length > 0:
            if self._tails_present(length, probe):
                break
            length -= step
        return chain, length

    def _exact(self, probe: _Probe, length: int) -> int:
        """``length`` cut to what is exactly cached: the cached chain must equal this prompt's
        token ids, multimodal items and extra keys for every unit up to it, byte for byte. A
        key that names other content (a collision) shortens the hit: a counted miss."""
        if not length:
            return length
        unit, step = self._s.unit, self._s.boundary
        need = length // unit
        exact = (
            length
            if probe.known_units >= need
            else self._records.confirm(probe.hasher.unit_records(), need) * unit
        )
        if exact < length:
            probe.collided = True
            length = (exact // step) * step
            while length > 0 and not self._tails_present(length, probe):
                length -= step
        return length

    def _tails_present(self, length: int, probe: _Probe) -> bool:
        """Whether every window / state group holds the blocks the step after ``length``
        reads, and every snapshot group a snapshot at ``length``. A tail block whose key ends
        inside a unit must also hold exactly this prompt's tokens (its stored proof)."""
        for g in self._groups:
            cached = self._index.keys_of(g.spec.name)
            if g.per_request:
                if (
                    g.slots != 1
                    or length % self._s.snapshot_interval
                    or probe.key_at(length) not in cached
                ):
                    return False
            elif g.windowed and not self._tail_present(g, cached, length, probe):
                return False
        return True

    def _tail_present(
        self, g: GroupTable, cached: Mapping[bytes, int], length: int, probe: _Probe
    ) -> bool:
        """Whether window group ``g`` holds, with the right proofs, its tail at ``length``."""
        owner = self._index.served_blocks(g.pool)
        for c in range(window_start(g, length) // g.block_size, length // g.block_size):
            end = (c + 1) * g.block_size
            block = cached.get(probe.key_at(end))
            if block is None:
                return False
            if end % self._s.unit and owner[block].proof != probe.proof(end):
                probe.collided = True
                return False
        return True

    def _match(self, probe: _Probe, length: int, n: int, junction: int) -> PrefixMatch:
        """The sealed match of ``length`` tokens: per group its first column, blocks, keys."""
        stats = self._stats
        first: dict[str, int] = {}
        blocks: dict[str, np.ndarray] = {}
        used: dict[str, tuple[bytes, ...]] = {}
        for g in self._groups:
            name = g.spec.name
            first[name], used[name] = self._keys_read(g, probe, length)
            cached = self._index.keys_of(name)
            blocks[name] = np.array([cached[k] for k in used[name]], dtype=np.int32)
            covered = length if not g.windowed else len(used[name]) * g.block_size
            stats.hit_tokens_by_group[name] = stats.hit_tokens_by_group.get(name, 0) + covered
        stats.hit_tokens += length
        hasher = probe.hasher.at_prefix(length)
        return self._sealer.sealed(length, first, blocks, used, hasher, n, junction)

    def _keys_read(
        self, g: GroupTable, probe: _Probe, length: int
    ) -> tuple[int, tuple[bytes, ...]]:
        """``(first column, keys)`` of the blocks of ``g`` a hit of ``length`` shares."""
        unit = self._s.unit
        if g.per_request:
            return 0, (probe.key_at(length),)
        c0 = window_start(g, length) // g.block_size
        if g.block_size % unit == 0:
            r = g.block_size // unit
            return c0, tuple(probe.keys[(c0 + 1) * r - 1 : length // unit : r])
        key_at: Callable[[int], bytes] = probe.key_at
        return c0, tuple(key_at((c + 1) * g.block_size) for c in range(c0, length // g.block_size))
