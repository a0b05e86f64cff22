"""The prefix cache of the scheduler side, composed of its parts: :class:`PrefixCache`.

It decides which completed blocks become reusable (:meth:`PrefixCache.commit`, then
:meth:`PrefixCache.finish_step`: :mod:`.commit`), finds the longest reusable prefix of a prompt
(:meth:`PrefixCache.lookup`: :mod:`.lookup`), shares a match into a new request's row
(:meth:`PrefixCache.adopt`: :mod:`.adopt`, checking its seal: :mod:`.seal`), and hears of every
eviction from the pools (:mod:`.index`, the one owner of key <-> block). The requests' key
chains live in :mod:`.chains`, the retention rule in :mod:`.retention`, the plain records in
:mod:`.records`. It holds no lock of its own:
:class:`~kvforge.scheduler.block_manager.BlockManager` calls it under its lock, and owns the
tables it reads and writes (:class:`~kvforge.scheduler.tables.RequestTables`).

Invariants (tested in ``tests/scheduler/test_prefix_cache.py`` and the prefix property test):
those of its parts (each module states its own), and: every public method is entered with the
block manager's lock held; the parts share one index, one record store, one set of counters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from kvforge.core.prefix_keys import Algorithm, PrefixHasher, unit_of
from kvforge.core.values import BlockCopy, PrefixEvent, PrefixMatch, PrefixQuery
from kvforge.scheduler.arena import ArenaBlockPool
from kvforge.scheduler.block_pool import BlockPool
from kvforge.scheduler.prefix.adopt import Adoption
from kvforge.scheduler.prefix.chains import RequestChains
from kvforge.scheduler.prefix.commit import Commits
from kvforge.scheduler.prefix.index import PrefixIndex
from kvforge.scheduler.prefix.lookup import PrefixLookup, check_queries
from kvforge.scheduler.prefix.records import (
    Entry,
    PrefixSettings,
    PrefixStats,
    Proof,
    StepWork,
)
from kvforge.scheduler.prefix.retention import (
    DEFAULT_PREFIX_RETENTION,
    Retention,
    check_prefix_retention,
)
from kvforge.scheduler.prefix.seal import MatchSealer
from kvforge.scheduler.tables import GroupTable, RequestTables
from kvforge.scheduler.unit_records import UnitRecordStore

__all__ = ["PrefixCache"]


class PrefixCache:
    """Cached prefixes of every group.

    Args:
        tables: the scheduler side's tables (owned by the block manager).
        enabled: keep completed blocks reusable (off: lookups always miss).
        boundary: the LCM of the token-indexed groups' block sizes: matches end on it.
        snapshot_interval: tokens between snapshots of per-request state.
        key_algorithm: the digest of the prefix keys.
        retention: which completed window / state blocks become reusable: ``"dense"`` or
            ``"checkpoints"`` (see :func:`~.retention.check_prefix_retention`).
        retention_interval: with ``"checkpoints"``, also every multiple of this many tokens
            (a multiple of ``boundary``), or ``None``.
    """

    def __init__(
        self,
        tables: RequestTables,
        enabled: bool,
        boundary: int,
        snapshot_interval: int,
        key_algorithm: Algorithm = "sha256",
        retention: Retention = DEFAULT_PREFIX_RETENTION,
        retention_interval: int | None = None,
    ) -> None:
        retention, retention_interval = check_prefix_retention(
            retention, retention_interval, boundary
        )
        self._t = tables
        history = [g.block_size for g in tables.groups if g.history]
        snapshots = any(g.per_request for g in tables.groups)
        self._settings = PrefixSettings(
            enabled=enabled,
            boundary=boundary,
            # tokens per hashed unit of the chain: every history block end, boundary and
            # snapshot is a unit end. Window and state blocks that end inside a unit get tail
            # keys off the chain (``PrefixHasher.tail_key``), hashed only for the few blocks a
            # tail needs.
            unit=unit_of([*history, boundary], snapshot_interval if snapshots else None),
            snapshot_interval=snapshot_interval,
            key_algorithm=key_algorithm,
            retention=retention,
            retention_interval=retention_interval,
            has_history=bool(history),
        )
        self.stats = PrefixStats()
        self.records = UnitRecordStore()  # the token ids behind every cached key
        self.work = StepWork()  # what the step being scheduled holds and will register
        #: called with (pool, block) for each block a step registered (host_tier.attach)
        self.on_store: Callable[[BlockPool, int], None] | None = None
        self._index = PrefixIndex(tables, self.records, self.stats)
        self._chains = RequestChains(self.records)
        sealer = MatchSealer()
        s = self._settings
        self._lookup = PrefixLookup(s, tables.groups, self._index, self.records, self.stats, sealer)
        self._adoption = Adoption(s, tables, self._index, self._chains, self.records, sealer)
        self._commits = Commits(s, tables, self._index, self._chains, self.records, self.stats)
        if enabled:
            for pool, _ in tables.pools:
                pool.on_evict = functools.partial(self._index.evicted, pool)
                if isinstance(pool, ArenaBlockPool):
                    pool.on_move = functools.partial(self._index.moved, pool)

    # ------------------------------------------------------------------ settings

    @property
    def enabled(self) -> bool:
        """Whether completed blocks become reusable (off: lookups always miss)."""
        return self._settings.enabled

    @property
    def boundary(self) -> int:
        """The LCM of the token-indexed groups' block sizes: matches end on it."""
        return self._settings.boundary

    @property
    def unit(self) -> int:
        """Tokens per hashed unit of the key chain (every block end is a unit end or a tail)."""
        return self._settings.unit

    @property
    def snapshot_interval(self) -> int:
        """Tokens between snapshots of per-request state."""
        return self._settings.snapshot_interval

    @property
    def key_algorithm(self) -> Algorithm:
        """The digest of the prefix keys."""
        return self._settings.key_algorithm

    @property
    def retention(self) -> Retention:
        """Which completed window / state blocks become reusable."""
        return self._settings.retention

    @property
    def retention_interval(self) -> int | None:
        """With ``"checkpoints"``, the interval whose multiples are kept too, or ``None``."""
        return self._settings.retention_interval

    @property
    def groups(self) -> list[GroupTable]:
        """The group tables the cache serves, in group order (indices of :class:`Entry`)."""
        return self._t.groups

    @property
    def snapshot_groups(self) -> list[GroupTable]:
        """The per-request groups (their state is snapshotted at boundaries)."""
        return [g for g in self._t.groups if g.per_request]

    # ------------------------------------------------------------------ lookup, adoption

    def lookup(self, queries: Sequence[PrefixQuery]) -> list[PrefixMatch]:
        """The longest reusable prefix of each prompt, for many prompts at once.

        ``L`` is the largest multiple of :attr:`boundary` (the LCM of the groups' block sizes)
        below the prompt's length such that every full group holds the whole chain
        ``[0, L)``, every sliding-window and state group the blocks covering the window the
        next token reads (``[L + 1 - W, L)``), every chunked group the blocks of the current
        chunk (``[L // C * C, L)``), and every per-request group a snapshot taken at exactly
        ``L``. Nothing changes but the counters; pass the matches to :meth:`schedule`.

        Worked example, DeepSeek-V4 (``swa`` block 64 window 128; ``compressed`` block 256;
        ``c4_state`` block 4 window 8; ``c128_state`` block 8 window 128; LCM 256), a prompt
        of 1,000 tokens whose first 768 are cached: ``L = 768``; ``compressed`` shares blocks
        0..2 (tokens 0..767); ``swa`` needs tokens 641..767: blocks 10 and 11; ``c4_state``
        tokens 761..767: blocks 190 and 191; ``c128_state`` tokens 641..767: blocks 80..95.
        """
        checked = check_queries(queries)
        return [self._lookup.one(q, t) for q, t in zip(queries, checked, strict=True)]

    def hasher(self, query: PrefixQuery) -> PrefixHasher:
        """A fresh key chain for ``query``'s extra keys and multimodal items (the chain a
        lookup of it extends): read by the tiers' lookups to key a prompt's boundaries."""
        return self._settings.hasher(query)

    def adopt(
        self, request_id: str, row: int, match: PrefixMatch | None
    ) -> tuple[str | None, PrefixMatch | None]:
        """Share into ``row`` the blocks that serve a match's keys now: ``(None, the match
        adopted)``; or (a group whose keys were evicted since the lookup, or ``""`` for a match
        this cache did not make as it stands: forged, altered, another's; None): no change."""
        return self._adoption.adopt(request_id, row, match, self.work)

    def unadopt(self, row: int, match: PrefixMatch) -> None:
        """Undo :meth:`adopt` of ``match`` into ``row`` (its step refused the request)."""
        self._adoption.unadopt(row, match, self.work)

    def record_adoption(self, row: int, match: PrefixMatch) -> list[BlockCopy]:
        """Table deltas of an accepted hit, and the copies restoring per-request state."""
        return self._adoption.record(row, match)

    # ------------------------------------------------------------------ commit

    def commit(
        self, request_id: str, row: int, before: int, after: int, tokens: Sequence[int] | None
    ) -> list[BlockCopy]:
        """Make the blocks this step completed reusable; snapshot per-request state."""
        return self._commits.commit(request_id, row, before, after, tokens, self.work)

    def finish_step(self, work: StepWork, kernels_ran: bool, copies_ran: bool) -> None:
        """A step ended: register what it wrote, then drop what it held.

        ``kernels_ran`` and ``copies_ran`` say what is known to have written the step's blocks
        (an explicit ``end_step``): blocks are registered only after the kernels, snapshots
        only after the copies. A step dropped unended registers nothing."""
        self._commits.finish_step(work, kernels_ran, copies_ran, self.on_store)

    def end_chain(self, request_id: str) -> None:
        """Stop registering the blocks of ``request_id`` (finished, refused, or truncated)
        and let go of the records its chain held."""
        self._chains.end(request_id)

    @property
    def tracks_requests(self) -> bool:
        """Whether some request has a key chain or holds records."""
        return self._chains.tracking

    # ------------------------------------------------------------------ the index

    def forget_block(self, g: GroupTable, block: int, promote: bool = True) -> None:
        """Forget the key of ``block`` (it will be written again): the block stays with its
        holders and goes back to the free stack when they release it. A waiting copy of the
        key, if any, takes it over (unless ``promote`` is false: a newer copy will)."""
        self._index.forget_block(g, block, promote)

    def register(
        self,
        gi: int,
        g: GroupTable,
        key: bytes,
        block: int,
        end: int,
        ref: bytes | None,
        proof: Proof | None,
    ) -> None:
        """Register ``block`` of group ``g`` (index ``gi``) as the served copy of ``key``, a
        block ending at token ``end`` whose bytes an onload from the host tier brings back:
        it takes a reference of its own on the unit record ``ref`` (the page keeps its own),
        keeps the tail ``proof``, and a ``"stored"`` event announces it. The caller holds
        ``block`` (one reference) until its onload is handed out."""
        held = self.records.refcount(ref) if ref is not None else 0
        try:  # the record's reference is the entry's, or given back (under any exception)
            if ref is not None:
                self.records.retain(ref)
            self._index.store(gi, g, key, block, end, ref, proof)
        except BaseException:
            stored = self._index.served(g.pool, block) is not None  # its entry holds it
            if ref is not None and not stored and self.records.refcount(ref) > held:
                self.records.release(ref)  # (retained before the exception)
            raise

    def cached_keys(self, group: str) -> Mapping[bytes, int]:
        """Key -> served block of ``group`` (a live view for lookups: never write to it)."""
        return self._index.keys_of(group)

    def served(self, pool: BlockPool, block: int) -> Entry | None:
        """What the cache knows of ``block`` while it is the served copy of a key (``None``
        for a waiting copy or an unregistered block): read by the host tier's demotion."""
        return self._index.served(pool, block)

    def waiting_blocks(self, pool: BlockPool) -> frozenset[int]:
        """The blocks of ``pool`` that wait as newer copies of a served key (retained, not
        served, never announced)."""
        return self._index.waiting_blocks(pool)

    def block_of(self, group: str, key: object) -> int | None:
        """The cached block of ``key`` in ``group``, or ``None``."""
        return self._index.block_of(group, key)

    def registered(self, pool: BlockPool) -> dict[int, tuple[object, int, str]]:
        """Every block of ``pool`` the cache knows: block -> (key, end token, group)."""
        return self._index.registered(pool)

    def take_events(self) -> list[PrefixEvent]:
        """Blocks stored in and removed from the prefix cache since the last call."""
        return self._index.take_events()

    def reset(self) -> int:
        """Forget every cached prefix: evictable blocks go back to the free stacks and blocks
        in use lose their keys. Returns the number of blocks evicted."""
        if not self.enabled:
            return 0
        return self._index.reset()
