"""The prefix cache of the scheduler side: the one owner of key <-> block, its events,
its counters, the request key chains and the snapshot pins.

:class:`PrefixCache` decides which completed blocks become reusable (:meth:`commit`), finds
the longest reusable prefix of a prompt (:meth:`lookup`), shares a match into a new request's
row (:meth:`adopt`), and hears of every eviction from the pools (:meth:`_evicted`, the pools'
eviction hook). It holds no lock of its own: :class:`~.block_manager.BlockManager` calls it
under its lock, and owns the tables it reads and writes (:class:`~.tables.RequestTables`).

Invariants (tested in ``tests/scheduler/test_prefix_cache.py`` and the prefix property test):

- a block is in ``_owner`` of its pool exactly when some group's ``_cached`` maps a key to it
  (it is served), in ``_spare_owner`` exactly when it waits in ``_spares`` as another copy
  of a served key, never in both; exactly then its pool retains it (evictable at ref 0);
- a block is registered at most once, and only after the step that completed it ran
  (:meth:`commit` is called with the step's tokens);
- the newest copy wins: a recomputed block takes over its key from an evictable cached copy
  (which goes back to the free stack); while the cached copy is in use, the new one waits
  as a spare and takes the key over when the cached copy goes (evicted or rewritten), so a
  key lives as long as its most recently used copy, as LRU means it to
  (``tests/scheduler/test_newest_copy.py``);
- a match shares the blocks registered under its keys at adoption (moved or newer copies).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import NamedTuple

import numpy as np

from kvforge.core.prefix_keys import Algorithm, PrefixHasher, unit_of
from kvforge.core.values import BlockCopy, PrefixEvent, PrefixMatch, PrefixQuery, TableDelta
from kvforge.scheduler.arena import ArenaBlockPool
from kvforge.scheduler.args import token_array
from kvforge.scheduler.block_pool import NULL_BLOCK, BlockPool
from kvforge.scheduler.retention import (
    DEFAULT_PREFIX_RETENTION,
    PREFIX_RETENTIONS,
    Retention,
    check_prefix_retention,
    checkpoints_of,
)
from kvforge.scheduler.tables import GroupTable, RequestTables
from kvforge.scheduler.unit_records import UnitRecordStore

# the retention policy lives in .retention; its names stay importable from here
__all__ = [
    "DEFAULT_PREFIX_RETENTION",
    "PREFIX_RETENTIONS",
    "PrefixCache",
    "PrefixStats",
    "Retention",
    "StepWork",
    "check_prefix_retention",
]

@dataclass
class PrefixStats:
    """Counters of the prefix cache.

    Attributes:
        queries: prompts looked up.
        query_tokens: their tokens.
        hit_tokens: tokens served from cache (``sum(L)``).
        hit_tokens_by_group: per group, the tokens its shared blocks cover.
        stored_blocks: blocks that became reusable, per group.
        evictions: blocks evicted, per family (``history``, ``window``, ``snapshot``).
        collisions: lookups whose keys named cached blocks of other content (possible only
            with an injected weak key function), cut to the tokens that are truly cached.
    """

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_group: dict[str, int] = field(default_factory=dict)
    stored_blocks: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    collisions: int = 0

    @property
    def hit_rate(self) -> float:
        """Display only: ``hit_tokens / query_tokens``."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class _Entry(NamedTuple):
    """What the prefix cache knows of one registered block."""

    key: bytes
    end: int  # the token count its key covers
    group: int  # index of its group
    ref: bytes | None  # the unit record it holds a reference on
    proof: tuple[bytes, bytes, bytes] | None  # a tail key's (parent, payload, root preimage)


class _Registration(NamedTuple):
    """A block a step completed, to register once the step has ended."""

    index: int  # its group's index
    group: GroupTable
    key: bytes
    block: int
    end: int
    ref: bytes | None
    proof: tuple[bytes, bytes, bytes] | None
    snapshot: bool  # written by the step's copies_after, not by its kernels


@dataclass
class StepWork:
    """What one scheduled step holds until it ends: the blocks its copies read or write and
    the blocks it completed (``pins``, one reference each), and what it will register."""

    pins: list[tuple[GroupTable, np.ndarray]] = field(default_factory=list)
    registrations: list[_Registration] = field(default_factory=list)
    #: the requests the step grew: until it ends, they are not swapped out or truncated
    request_ids: tuple[str, ...] = ()


class PrefixCache:
    """Cached prefixes of every group.

    Args:
        tables: the scheduler side's tables (owned by the block manager).
        enabled: keep completed blocks reusable (off: lookups always miss).
        boundary: the LCM of the token-indexed groups' block sizes: matches end on it.
        snapshot_interval: tokens between snapshots of per-request state.
        key_algorithm: the digest of the prefix keys.
        retention: which completed window / state blocks become reusable: ``"dense"`` or
            ``"checkpoints"`` (see :func:`check_prefix_retention`).
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
        self.retention, self.retention_interval = check_prefix_retention(
            retention, retention_interval, boundary
        )
        # under "checkpoints": request -> the boundaries whose tails it keeps (replay boundary,
        # junction); a request without an entry (scheduled without a match) keeps them densely
        self._keep: dict[str, tuple[int, ...]] = {}
        self._t = tables
        self.key_algorithm = key_algorithm
        self._collided = False  # the current lookup met a key that names other content
        self._secret = os.urandom(32)  # seals the matches this cache makes
        self.enabled = enabled
        self.boundary = boundary
        self.snapshot_interval = snapshot_interval
        self.stats = PrefixStats()
        self._events: list[PrefixEvent] = []
        self._hashers: dict[str, PrefixHasher] = {}  # request -> key chain of its tokens
        self._cursors: dict[str, bytes] = {}  # request -> its held chain's last record
        self.records = UnitRecordStore()  # the token ids behind every cached key
        history = [g.block_size for g in tables.groups if g.history]
        self._has_history = bool(history)
        snapshots = any(g.per_request for g in tables.groups)
        #: tokens per hashed unit of the chain: every history block end, boundary and snapshot
        #: is a unit end. Window and state blocks that end inside a unit get tail keys off the
        #: chain (``PrefixHasher.tail_key``), hashed only for the few blocks a tail needs.
        self.unit = unit_of([*history, boundary], snapshot_interval if snapshots else None)
        self.work = StepWork()  # what the step being scheduled holds and will register
        #: called with (pool, block) for each block a step registered (host_tier.attach)
        self.on_store: Callable[[BlockPool, int], None] | None = None
        self._cached: dict[str, dict[object, int]] = {g.spec.name: {} for g in tables.groups}
        # per pool: block -> (key, end token, group index, the record it holds or None, the
        # tail proof (parent, payload, root preimage) of a key that ends inside a unit)
        self._owner: dict[BlockPool, dict[int, _Entry]] = {
            pool: {} for pool, _ in tables.pools
        }
        # copies of a served key waiting to take it over: per pool, block -> its entry, and
        # per group, key -> the waiting blocks, oldest first
        self._spare_owner: dict[BlockPool, dict[int, _Entry]] = {
            pool: {} for pool, _ in tables.pools
        }
        self._spares: dict[str, dict[bytes, list[int]]] = {g.spec.name: {} for g in tables.groups}
        if enabled:
            for pool, _ in tables.pools:
                pool.on_evict = functools.partial(self._evicted, pool)
                if isinstance(pool, ArenaBlockPool):
                    pool.on_move = functools.partial(self._moved, pool)

    @property
    def snapshot_groups(self) -> list[GroupTable]:
        return [g for g in self._t.groups if g.per_request]

    def _window_start(self, g: GroupTable, num_tokens: int) -> int:
        """First token the step after a prefix of ``num_tokens`` reads in group ``g``."""
        return g.rule.tail_start(g.spec, num_tokens)

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
        if isinstance(queries, PrefixQuery) or not isinstance(queries, Sequence):
            raise TypeError(
                f"queries must be a sequence of PrefixQuery, got {type(queries).__name__}"
            )
        checked = []
        for i, q in enumerate(queries):  # every query checked before any counter moves
            if not isinstance(q, PrefixQuery):
                raise TypeError(f"queries[{i}] is a {type(q).__name__}, not a PrefixQuery")
            checked.append(token_array(q.token_ids, f"queries[{i}].token_ids"))
        return [self._lookup_one(q, t) for q, t in zip(queries, checked, strict=True)]

    def _lookup_one(self, query: PrefixQuery, tokens: np.ndarray) -> PrefixMatch:
        """One query whose ``tokens`` :func:`token_array` checked (ids in ``[0, 2**32)``)."""
        n = len(tokens)
        hasher = self._hasher(query)
        stats = self.stats
        stats.queries += 1
        stats.query_tokens += n
        step = self.boundary
        top = ((n - 1) // step) * step if n else 0
        if not self.enabled or top == 0:
            return self._sealed(0, {}, {}, {}, hasher, n)
        unit = self.unit
        # the key at every unit end up to top; ids were checked, so uint32 holds them exactly
        # a cached prefix's keys come from its stored records (no digest), the rest are hashed;
        # the units found that way are exact by construction (UnitRecordStore.known_keys)
        known_units = 0

        def known(parent: bytes, payloads: Sequence[bytes], root: bytes | None) -> list[bytes]:
            nonlocal known_units
            found = self.records.known_keys(parent, payloads, root)
            known_units = len(found)
            return found

        keys = hasher.extend(tokens[:top].astype(np.uint32), known=known)
        self._collided = False

        tails: dict[int, tuple[bytes, bytes, bytes]] = {}

        def key_at(t: int) -> bytes:
            if t % unit == 0:
                return keys[t // unit - 1]
            tail = tails.get(t)
            if tail is None:
                tail = tails[t] = hasher.tail_key(t)
            return tail[0]

        upper = top
        for g in self._t.groups:
            if g.history:
                i = 0
                r = g.block_size // unit  # history blocks end on unit ends
                cached = self._cached[g.spec.name]
                for key in keys[r - 1 : upper // unit : r]:
                    if key not in cached:
                        break
                    i += 1
                upper = min(upper, i * g.block_size)
        length = (upper // step) * step
        chain = length if self._has_history else 0  # the full-attention chain's reach
        while length > 0:
            if self._tails_present(length, key_at, tails, hasher):
                break
            length -= step
        if length:
            # Exact by construction: the cached chain must equal this prompt's token ids,
            # multimodal items and extra keys for every unit up to L, byte for byte. A key
            # that names other content (a collision) shortens the hit: a counted miss.
            need = length // unit
            exact = length if known_units >= need else (
                self.records.confirm(hasher.unit_records(), need) * unit
            )
            if exact < length:
                self._collided = True
                length = (exact // step) * step
                while length > 0 and not self._tails_present(length, key_at, tails, hasher):
                    length -= step
        stats.collisions += self._collided  # one per lookup whose keys named other content
        # where the chain reaches past the tails: a prompt sharing this prefix diverged there
        junction = chain if chain > length else 0
        if length == 0:
            return self._sealed(0, {}, {}, {}, self._hasher(query), n, junction)
        first: dict[str, int] = {}
        blocks: dict[str, np.ndarray] = {}
        used: dict[str, tuple[bytes, ...]] = {}
        for g in self._t.groups:
            name = g.spec.name
            if g.per_request:
                found = (key_at(length),)
                first[name] = 0
            else:
                c0 = self._window_start(g, length) // g.block_size
                if g.block_size % unit == 0:
                    r = g.block_size // unit
                    found = tuple(keys[(c0 + 1) * r - 1 : length // unit : r])
                else:
                    found = tuple(
                        key_at((c + 1) * g.block_size) for c in range(c0, length // g.block_size)
                    )
                first[name] = c0
            used[name] = found
            cached = self._cached[name]
            blocks[name] = np.array([cached[k] for k in found], dtype=np.int32)
            covered = length if not g.windowed else len(found) * g.block_size
            stats.hit_tokens_by_group[name] = stats.hit_tokens_by_group.get(name, 0) + covered
        stats.hit_tokens += length
        return self._sealed(length, first, blocks, used, hasher.at_prefix(length), n, junction)

    def _hasher(self, query: PrefixQuery) -> PrefixHasher:
        return PrefixHasher(
            query.extra_keys, query.mm_keys, unit=self.unit, algorithm=self.key_algorithm
        )

    def _tails_present(
        self,
        length: int,
        key_at: Callable[[int], bytes],
        tails: dict[int, tuple[bytes, bytes, bytes]],
        hasher: PrefixHasher,
    ) -> bool:
        """Whether every window / state group holds the blocks the step after ``length``
        reads, and every snapshot group a snapshot at ``length``. A tail block whose key ends
        inside a unit must also hold exactly this prompt's tokens (its stored proof)."""
        for g in self._t.groups:
            cached = self._cached[g.spec.name]
            if g.per_request:
                if (
                    g.slots != 1
                    or length % self.snapshot_interval
                    or key_at(length) not in cached
                ):
                    return False
            elif g.windowed:
                c0 = self._window_start(g, length) // g.block_size
                owner = self._owner[g.pool]
                for c in range(c0, length // g.block_size):
                    end = (c + 1) * g.block_size
                    block = cached.get(key_at(end))
                    if block is None:
                        return False
                    if end % self.unit:
                        _, parent, payload = tails[end]
                        root = hasher.root_preimage if end < self.unit else b""
                        if owner[block].proof != (parent, payload, root):
                            self._collided = True
                            return False
        return True

    def _seal(
        self,
        num_tokens: int,
        first: dict[str, int],
        blocks: dict[str, np.ndarray],
        keys: dict[str, tuple[bytes, ...]],
        hasher: object,
        num_prompt_tokens: object = 0,
        junction: object = 0,
    ) -> bytes:
        """A MAC, under this cache's secret, of everything a match claims: its length, its
        columns, blocks and keys per group, the key chain it continues, and the prompt length
        and junction it reports."""
        if not isinstance(hasher, PrefixHasher):
            return b""
        if not all(
            isinstance(v, Integral) and not isinstance(v, bool) and 0 <= v < 1 << 62
            for v in (num_prompt_tokens, junction)
        ):
            return b""
        mac = hashlib.blake2b(key=self._secret, digest_size=16)
        mac.update(struct.pack("<qqq", num_tokens, hasher.num_tokens, hasher.unit))
        mac.update(struct.pack("<qq", int(num_prompt_tokens), int(junction)))  # type: ignore[call-overload]
        mac.update(hasher.key + hasher.root)
        for name in sorted(set(first) | set(blocks) | set(keys)):
            ids = np.asarray(blocks.get(name, ()), dtype=np.int64)
            mac.update(name.encode() + struct.pack("<qq", first.get(name, -1), len(ids)))
            mac.update(ids.tobytes() + b"".join(keys.get(name, ())))
        return mac.digest()

    def _sealed(
        self, num_tokens: int, first: dict[str, int], blocks: dict[str, np.ndarray],
        keys: dict[str, tuple[bytes, ...]], hasher: PrefixHasher, num_prompt_tokens: int = 0,
        junction: int = 0,
    ) -> PrefixMatch:
        seal = self._seal(num_tokens, first, blocks, keys, hasher, num_prompt_tokens, junction)
        return PrefixMatch(
            num_tokens, first, blocks, keys, hasher, seal, num_prompt_tokens, junction
        )

    def adopt(
        self, request_id: str, row: int, match: PrefixMatch | None
    ) -> tuple[str | None, PrefixMatch | None]:
        """Share into ``row`` the blocks that serve a match's keys now: ``(None, the match
        adopted)``; or (a group whose keys were evicted since the lookup, or ``""`` for a match
        this cache did not make as it stands: forged, altered, another's; None): no change."""
        if match is not None:
            m = match
            seal = self._seal(
                m.num_tokens, m.first_col, m.blocks, m.keys, m.hasher, m.num_prompt_tokens,
                m.junction,
            )
            if not self.enabled or not hmac.compare_digest(m.seal, seal):
                return "", None
        hasher = (
            match.hasher
            if match is not None
            else PrefixHasher(unit=self.unit, algorithm=self.key_algorithm)
        )
        if self.enabled:
            assert isinstance(hasher, PrefixHasher)
            self._hashers[request_id] = hasher.at_prefix(hasher.num_tokens)
            if match is not None and self.retention == "checkpoints":
                self._keep[request_id] = checkpoints_of(
                    match.num_prompt_tokens, match.junction, self.boundary
                )
        if match is None or not match.num_tokens:
            return None, match
        now: dict[str, np.ndarray] = {}
        for g in self._t.groups:
            keys = match.keys.get(g.spec.name, ())
            blocks = match.blocks.get(g.spec.name)
            if blocks is None or len(blocks) != len(keys):
                return g.spec.name, None
            served = [self._cached[g.spec.name].get(k) for k in keys]
            if None in served:
                self._hashers.pop(request_id, None)
                return g.spec.name, None
            now[g.spec.name] = np.array(served, dtype=blocks.dtype)
        if any(not np.array_equal(now[n], b) for n, b in match.blocks.items()):
            match = self._sealed(match.num_tokens, match.first_col, now, match.keys,
                                 match.hasher, match.num_prompt_tokens, match.junction)
        assert isinstance(hasher, PrefixHasher)
        held = self.records.hold(hasher.unit_records())  # verifies units 0 .. L again
        if held.cursor is None:
            self._hashers.pop(request_id, None)
            return next(iter(match.keys), ""), None
        self._cursors[request_id] = held.cursor
        for gi, g in enumerate(self._t.groups):
            blocks = match.blocks[g.spec.name]
            g.pool.share(blocks.tolist())
            if g.per_request:
                self.work.pins.append((g, blocks))  # the restore copy reads it in the step
                continue
            c0 = match.first_col[g.spec.name]
            g.table[row, c0 : c0 + len(blocks)] = blocks
            g.held_from[row] = c0
            self._t.committed[gi, row] = match.num_tokens // g.block_size
        self._t.num_tokens[row] = match.num_tokens
        return None, match

    def unadopt(self, row: int, match: PrefixMatch) -> None:
        for gi, g in enumerate(self._t.groups):
            blocks = match.blocks[g.spec.name]
            if g.per_request:
                # drop this adoption's pin only: one match may serve several requests
                pins = self.work.pins
                k = next(k for k, (_, pb) in enumerate(pins) if pb is blocks)
                del pins[k]
            else:
                c0 = match.first_col[g.spec.name]
                g.table[row, c0 : c0 + len(blocks)] = NULL_BLOCK
                g.held_from[row] = 0
                self._t.committed[gi, row] = 0
            g.pool.release(blocks)
        self._t.num_tokens[row] = 0

    def record_adoption(self, row: int, match: PrefixMatch) -> list[BlockCopy]:
        """Table deltas of an accepted hit, and the copies restoring per-request state."""
        copies = []
        for g in self._t.groups:
            blocks = match.blocks[g.spec.name]
            if g.per_request:
                copies.append(BlockCopy(g.spec.name, blocks, g.table[row, : g.slots].copy(), row))
                continue
            c0 = match.first_col[g.spec.name]
            self._t.pending.append(
                TableDelta(
                    group=g.spec.name,
                    rows=np.full(len(blocks), row, dtype=np.int32),
                    cols=np.arange(c0, c0 + len(blocks), dtype=np.int32),
                    block_ids=blocks.astype(np.int32),
                )
            )
        return copies

    def commit(
        self, request_id: str, row: int, before: int, after: int, tokens: Sequence[int] | None
    ) -> list[BlockCopy]:
        """Make the blocks this step completed reusable; snapshot per-request state."""
        hasher = self._hashers.get(request_id)
        if hasher is None or after == before:
            return []
        if tokens is None or hasher.num_tokens != before:
            self.end_chain(request_id)  # the chain is broken: stop registering
            return []
        toks = token_array(tokens, "new_token_ids")[: after - before]
        unit = self.unit
        # the blocks to register, decided before any key is hashed (a block no match can
        # read needs none): (group index, group, block, end)
        keep = self._keep.get(request_id) if self.retention == "checkpoints" else None
        chosen: list[tuple[int, GroupTable, int, int]] = []
        tail_chosen: list[tuple[int, GroupTable, int, int]] = []  # tails off the root
        for gi, g in enumerate(self._t.groups):
            if g.per_request:
                continue
            done, full = int(self._t.committed[gi, row]), after // g.block_size
            owner = self._owner[g.pool]
            for c in range(done, full):
                block = int(g.table[row, c])
                end = (c + 1) * g.block_size
                if block == NULL_BLOCK or block in owner:
                    continue  # a shared block is registered already
                # a key cached in another block is registered too: the newest copy wins
                # (finish_step)
                if g.windowed and not self._in_some_tail(g, c, keep):
                    continue  # no match can ever read it: keep the pool for blocks that can
                if end % unit and end // unit == 0:
                    # a tail off the root: its proof carries the extra keys, no record needed
                    tail_chosen.append((gi, g, block, end))
                    continue
                chosen.append((gi, g, block, end))
            self._t.committed[gi, row] = full
        wanted = {end for _, _, _, end in chosen} | {end for _, _, _, end in tail_chosen}
        snapshot = bool(self.snapshot_groups) and after % self.snapshot_interval == 0
        if snapshot:
            wanted.add(after)
        at = np.array(sorted(e for e in wanted if e % unit == 0), dtype=np.int64)
        keys = hasher.extend(toks, at=at)
        key_of = dict(zip(at.tolist(), keys, strict=True))
        proofs: dict[int, tuple[bytes, bytes, bytes]] = {}
        for end in wanted:
            if end % unit:  # a window block ending inside a unit: its tail key and proof
                key, parent, payload = hasher.tail_key(end)
                key_of[end] = key
                proofs[end] = (parent, payload, hasher.root_preimage if end < unit else b"")
        snapshots = []
        if snapshot:
            key = key_of[after]
            for gi, g in enumerate(self._t.groups):
                # one slot per request is what linear attention holds; several are not
                # snapshotted (their blocks would have to be evicted together)
                if (
                    g.per_request
                    and g.slots == 1
                    and key not in self._cached[g.spec.name]
                    and g.pool.num_free >= g.slots
                ):
                    snapshots.append((gi, g))
        # each block holds the record its key hangs off: its own end, or a tail's base
        ends = [end // unit * unit for _, _, _, end in chosen] + [after] * len(snapshots)
        held = self.records.hold(
            hasher.unit_records(), at=ends, cursor=self._cursors.pop(request_id, None)
        )
        if held.cursor is None and len(hasher.unit_records()):
            self._hashers.pop(request_id, None)  # the chain names other content: stop
        elif held.cursor is not None:
            self._cursors[request_id] = held.cursor
        work = self.work
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
                _Registration(gi, g, key_of[end], block, end, ref or None, proofs.get(end), False)
            )
        copies: list[BlockCopy] = []
        for (gi, g), ref in zip(snapshots, held.keys[len(chosen) :], strict=True):
            if ref is None:
                continue
            src = g.table[row, : g.slots].copy()
            dst = g.pool.take(g.slots)
            g.pool.share(src)  # the copy reads the request's state after the step's kernels
            work.pins += [(g, dst), (g, src)]
            work.registrations.append(
                _Registration(gi, g, ref, int(dst[0]), after, ref, None, True)
            )
            copies.append(BlockCopy(g.spec.name, src, dst))
        return copies

    def finish_step(self, work: StepWork, kernels_ran: bool, copies_ran: bool) -> None:
        """A step ended: register what it wrote, then drop what it held.

        ``kernels_ran`` and ``copies_ran`` say what is known to have written the step's blocks
        (an explicit ``end_step``): blocks are registered only after the kernels, snapshots
        only after the copies. A step dropped unended registers nothing."""
        stats, events = self.stats, self._events
        for r in work.registrations:
            owner = self._owner[r.group.pool]
            written = copies_ran if r.snapshot else kernels_ran
            old = self._cached[r.group.spec.name].get(r.key)
            if not written or r.block in owner or (old is not None and r.snapshot):
                if r.ref is not None:
                    self.records.release(r.ref)
                continue
            if old is not None:
                if r.group.pool.ref_count(old) > 0:
                    # the cached copy is in use: this one waits, and takes the key over
                    # when that copy goes
                    self._spare_owner[r.group.pool][r.block] = _Entry(
                        r.key, r.end, r.index, r.ref, r.proof
                    )
                    self._spares[r.group.spec.name].setdefault(r.key, []).append(r.block)
                    r.group.pool.retain(r.block)
                    continue
                # the cached copy is evictable: the recomputed one takes its key and place in
                # LRU order, the old one goes back to the free stack (copies still waiting
                # stay behind the new one)
                self.forget_block(r.group, old, promote=False)
            self._store(r.index, r.group, r.key, r.block, r.end, r.ref, r.proof)
            events.append(PrefixEvent("stored", r.group.spec.name, r.key, r.end))
            name = r.group.spec.name
            stats.stored_blocks[name] = stats.stored_blocks.get(name, 0) + 1
            if self.on_store is not None:  # the host tier's write-through
                self.on_store(r.group.pool, r.block)
        for g, blocks in work.pins:
            g.pool.release(blocks)
        work.registrations.clear()
        work.pins.clear()

    def _in_some_tail(
        self, g: GroupTable, col: int, keep: tuple[int, ...] | None = None
    ) -> bool:
        """Whether block ``col`` of window group ``g`` lies in the tail some retained boundary
        needs: under ``"dense"`` retention (or ``keep`` None) every boundary, under
        ``"checkpoints"`` the boundaries in ``keep`` and the multiples of the retention
        interval.

        Tails move forward with ``L``, so among evenly spaced boundaries the first at or after
        the block's end decides: a 4-token ``c4_state`` block (window 8, boundary 256) is in a
        tail only if it is one of the two blocks before a multiple of 256 (2 of every 64
        blocks).
        """
        end = (col + 1) * g.block_size
        if keep is None:
            every: int | None = self.boundary
        else:
            for b in keep:
                if b >= end and self._window_start(g, b) // g.block_size <= col:
                    return True
            every = self.retention_interval
        if every is None:
            return False
        first = -(-end // every) * every
        return self._window_start(g, first) // g.block_size <= col

    def _store(
        self,
        gi: int,
        g: GroupTable,
        key: bytes,
        block: int,
        end: int,
        ref: bytes | None,
        proof: tuple[bytes, bytes, bytes] | None,
    ) -> None:
        """Register ``block`` as the cached copy of ``key``: both directions of the index
        change here and in :meth:`forget_block` / :meth:`_evicted` only. ``ref`` is the unit record
        the block holds a reference on (released when it goes)."""
        self._cached[g.spec.name][key] = block
        self._owner[g.pool][block] = _Entry(key, end, gi, ref, proof)
        g.pool.retain(block)

    def forget_block(self, g: GroupTable, block: int, promote: bool = True) -> None:
        """Forget the key of ``block`` (it will be written again): the block stays with its
        holders and goes back to the free stack when they release it. A waiting copy of the
        key, if any, takes it over (unless ``promote`` is false: a newer copy will)."""
        if self._drop_spare(g.pool, block):
            g.pool.forget(block)
            return
        entry = self._owner[g.pool].pop(block, None)
        if entry is None:
            return
        group = self._t.groups[entry.group]
        if self._cached[group.spec.name].get(entry.key) == block:
            del self._cached[group.spec.name][entry.key]
        g.pool.forget(block)
        if entry.ref is not None:
            self.records.release(entry.ref)
        self._events.append(PrefixEvent("removed", group.spec.name, entry.key, entry.end))
        if promote:
            self._promote(group, entry.key)

    def _drop_spare(self, pool: BlockPool, block: int) -> bool:
        """Drop ``block`` if it is a waiting copy (no event: it was never announced)."""
        entry = self._spare_owner[pool].pop(block, None)
        if entry is None:
            return False
        name = self._t.groups[entry.group].spec.name
        waiting = self._spares[name][entry.key]
        waiting.remove(block)
        if not waiting:
            del self._spares[name][entry.key]
        if entry.ref is not None:
            self.records.release(entry.ref)
        return True

    def _promote(self, g: GroupTable, key: bytes) -> None:
        """The served copy of ``key`` went: its newest waiting copy takes the key over."""
        waiting = self._spares[g.spec.name].get(key)
        if not waiting:
            return
        block = waiting.pop()
        if not waiting:
            del self._spares[g.spec.name][key]
        entry = self._spare_owner[g.pool].pop(block)
        self._cached[g.spec.name][key] = block
        self._owner[g.pool][block] = entry
        self._events.append(PrefixEvent("stored", g.spec.name, key, entry.end))

    def end_chain(self, request_id: str) -> None:
        """Stop registering the blocks of ``request_id`` (finished, refused, or truncated)
        and let go of the records its chain held."""
        self._hashers.pop(request_id, None)
        self._keep.pop(request_id, None)
        cursor = self._cursors.pop(request_id, None)
        if cursor is not None:
            self.records.release(cursor)

    @property
    def tracks_requests(self) -> bool:
        """Whether some request has a key chain or holds records."""
        return bool(self._hashers or self._cursors or self._keep)

    def _evicted(self, pool: BlockPool, victims: np.ndarray) -> None:
        ev = self.stats.evictions
        owner = self._owner[pool]
        # waiting copies first, so that none of them is promoted; they were never announced,
        # so they are not counted as evictions (a key was not lost)
        served = [b for b in victims.tolist() if not self._drop_spare(pool, b)]
        for b in served:
            entry = owner.pop(b)
            g = self._t.groups[entry.group]
            family = g.spec.family.value
            ev[family] = ev.get(family, 0) + 1
            cached = self._cached[g.spec.name]
            if cached.get(entry.key) == b:
                del cached[entry.key]
            if entry.ref is not None:
                self.records.release(entry.ref)
            self._events.append(PrefixEvent("removed", g.spec.name, entry.key, entry.end))
            self._promote(g, entry.key)

    def _moved(self, pool: BlockPool, src: np.ndarray, dst: np.ndarray) -> None:
        """Cached blocks ``src`` moved to ``dst`` (a slab arena packing): keys follow."""
        served, waiting = self._owner[pool], self._spare_owner[pool]
        for a, b in zip(src.tolist(), dst.tolist(), strict=True):
            owner = served if a in served else waiting
            entry = owner[b] = owner.pop(a)
            name = self._t.groups[entry.group].spec.name
            if owner is waiting:
                copies = self._spares[name][entry.key]
                copies[copies.index(a)] = b
            elif self._cached[name].get(entry.key) == a:
                self._cached[name][entry.key] = b

    def served(self, pool: BlockPool, block: int) -> _Entry | None:
        """What the cache knows of ``block`` while it is the served copy of a key (``None``
        for a waiting copy or an unregistered block): read by the host tier's demotion."""
        return self._owner[pool].get(block)

    def block_of(self, group: str, key: object) -> int | None:
        """The cached block of ``key`` in ``group``, or ``None``."""
        return self._cached[group].get(key)

    def registered(self, pool: BlockPool) -> dict[int, tuple[object, int, str]]:
        """Every block of ``pool`` the cache knows: block -> (key, end token, group)."""
        names = [g.spec.name for g in self._t.groups]
        return {b: (e.key, e.end, names[e.group]) for b, e in self._owner[pool].items()}

    def take_events(self) -> list[PrefixEvent]:
        """Blocks stored in and removed from the prefix cache since the last call."""
        events, self._events = self._events, []
        return events

    def reset(self) -> int:
        """Forget every cached prefix: evictable blocks go back to the free stacks and blocks
        in use lose their keys. Returns the number of blocks evicted."""
        evicted = 0
        if not self.enabled:
            return 0
        for pool, members in self._t.pools:  # waiting copies first, so that none is promoted
            for block in list(self._spare_owner[pool]):
                evicted += pool.ref_count(block) == 0  # back to the free stack, as evicted
                self.forget_block(self._t.groups[members[0]], block)
        for pool, _ in self._t.pools:
            evicted += len(pool.evict(pool.num_evictable))
        for pool, _ in self._t.pools:
            for block in list(self._owner[pool]):
                g = self._t.groups[self._owner[pool][block].group]
                self.forget_block(g, block)
        return evicted
