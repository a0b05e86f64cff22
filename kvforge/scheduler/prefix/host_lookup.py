"""Lookups that read the host tier: before the device prefix cache answers a prompt, the
blocks its longest prefix needs that only the host tier holds are brought back to device
blocks (one onload per group), registered under their keys, and the device lookup then
serves them as it serves any cached block.

:func:`lookup` is :meth:`BlockManager.lookup
<kvforge.scheduler.block_manager.BlockManager.lookup>` (with no host tier it is the device
lookup alone). For each prompt it finds the longest boundary ``L`` whose blocks are all held
on the device *or* the host (a full group every block of ``[0, L)``, a window or state group
the tail the step after ``L`` reads, a per-request group a snapshot taken at exactly ``L``: on
the device, or under the host tier's ``snapshot_policy="aligned"`` on the host too; under
``"skip"`` the host keeps none, so a snapshot the device lost is recomputed). The blocks only
the host holds get device blocks (taken as any block is: free first, then the least recently
used cached block, which is demoted in turn), their pages are pinned and their onloads
queued, and the blocks are registered in the device prefix cache
(:meth:`PrefixCache.register <.cache.PrefixCache.register>`) with the unit record and tail
proof their page kept, so the device lookup confirms them exactly (a snapshot's record is the
one at ``L``: the chain's unit records up to ``L`` confirm it as they confirm a full block
ending there). When the device cannot give every block at ``L``, shorter boundaries are
tried, each only when every group holds what it needs there (its window tail and snapshot
differ from ``L``'s: a page can leave the tier on its own); the device part is never evicted
to make room for the host part. Under any pressure the answer is a shorter hit or a miss,
never an exception.

Everything here reads the prefix cache, the group tables and the tier through their public
methods, passed explicitly; the caller holds the block manager's lock.

Invariants (``tests/scheduler/test_tier_lookup.py``):

- a device block with a queued onload is held (ref >= 1) until :func:`take_onloads` hands
  the onload out, so nothing evicts, demotes or reuses it before its bytes arrive; the worker
  runs a batch's offloads before its onloads, so a block evicted and refilled in one batch is
  offloaded first;
- the pages an onload reads are pinned before any device block is taken, so the demotions
  those takes cause cannot evict them;
- a host hit is all or nothing per prompt: either every block at ``L`` is queued, or none;
  under an exception part way (``KeyboardInterrupt`` included, at any line) each group's
  onloads are queued whole with their blocks held, or its blocks and pages are given back
  (``tests/scheduler/test_tier_lookup.py``, a line sweep);
- a lookup never raises for lack of room or of a page, and pins nothing it does not queue
  (``tests/scheduler/test_tier_lookup_pressure.py``, a property test under random pressure).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kvforge.core.values import PageCopy, PrefixMatch, PrefixQuery
from kvforge.scheduler.arena import ArenaBlockPool
from kvforge.scheduler.args import token_array
from kvforge.scheduler.block_pool import BlockPool
from kvforge.scheduler.host_tier import HostTier
from kvforge.scheduler.prefix.cache import PrefixCache
from kvforge.scheduler.prefix.records import Proof
from kvforge.scheduler.tables import GroupTable

__all__ = ["PromptPlan", "lookup", "take_onloads"]

#: per group of a hit: (group index, group, [(key, end token) of each block it reads])
Need = list[tuple[int, GroupTable, list[tuple[bytes, int]]]]


def lookup(
    prefix: PrefixCache, tier: HostTier | None, queries: Sequence[PrefixQuery]
) -> list[PrefixMatch]:
    """The device lookup of ``queries``, after bringing back from the host ``tier`` (if
    any) what each prompt's longest prefix needs (the caller holds the manager's lock)."""
    batch = isinstance(queries, Sequence) and not isinstance(queries, PrefixQuery)
    if tier is not None and prefix.enabled and batch:
        for i, q in enumerate(queries):
            if isinstance(q, PrefixQuery):
                _bring_back(prefix, tier, q, i)
    return prefix.lookup(queries)  # checks every query, as without a host tier


def take_onloads(tier: HostTier | None) -> tuple[PageCopy, ...]:
    """The queued onloads of ``tier`` (host page -> device block), for the worker to run
    after the batch's offloads and before anything reads those blocks; their device blocks
    become ordinary cached blocks (evictable once no request holds them)."""
    if tier is None:
        return ()
    copies = tier.take_onloads()
    pending, tier.pending_blocks = tier.pending_blocks, []  # emptied first: released once
    for pool, blocks in pending:
        pool.release(blocks)
    return copies


def forget_pending(prefix: PrefixCache, groups: Sequence[GroupTable], tier: HostTier) -> None:
    """The device forgets the keys of the blocks ``tier`` brought back whose onloads were not
    handed out yet (before a reset drops those onloads: their bytes will never arrive)."""
    for pool, blocks in tier.pending_blocks:
        group = next(g for g in groups if g.pool is pool)
        for block in blocks.tolist():
            prefix.forget_block(group, block)


class PromptPlan:
    """The keys of one prompt's boundaries, and what a hit at each boundary reads: shared by
    the host tier's lookup and the remote tier's fetch (:mod:`kvforge.remote_tier`).

    Args:
        prefix: the device prefix cache (its settings, key chains and served keys).
        groups: the scheduler side's group tables, in group order.
        tier: the host tier (its kept snapshot groups), or ``None``.
        tokens: the prompt's token ids, checked (:func:`~kvforge.scheduler.args.token_array`).
        query: the prompt's query (its extra keys and multimodal items).
    """

    def __init__(
        self,
        prefix: PrefixCache,
        groups: Sequence[GroupTable],
        tier: HostTier | None,
        tokens: np.ndarray,
        query: PrefixQuery,
    ) -> None:
        self.prefix = prefix
        self.step, self.unit = prefix.boundary, prefix.unit
        self.top = ((len(tokens) - 1) // self.step) * self.step if len(tokens) else 0
        self.hasher = prefix.hasher(query)
        self.keys = self.hasher.extend(tokens[: self.top])
        self._tails: dict[int, tuple[bytes, bytes, bytes]] = {}
        self.groups: Sequence[GroupTable] = groups
        self.device: dict[str, Mapping[bytes, int]] = {
            g.spec.name: prefix.cached_keys(g.spec.name) for g in self.groups
        }
        #: the per-request groups whose snapshots the tiers keep (``snapshot_policy="aligned"``)
        self.kept_snapshots = frozenset() if tier is None else tier.per_request - tier.recomputed

    def key_at(self, t: int) -> bytes:
        """The key of the block that ends at token ``t``."""
        if t % self.unit == 0:
            return self.keys[t // self.unit - 1]
        return self.tail(t)[0]

    def tail(self, t: int) -> tuple[bytes, bytes, bytes]:
        """``(key, parent, payload)`` of the tail key ending at ``t`` (inside a unit)."""
        if t not in self._tails:
            self._tails[t] = self.hasher.tail_key(t)
        return self._tails[t]

    def proof(self, end: int) -> Proof | None:
        """The proof a block ending at ``end`` keeps (a tail key's; ``None`` on a unit end)."""
        if end % self.unit == 0:
            return None
        _, parent, payload = self.tail(end)
        return parent, payload, self.hasher.root_preimage if end < self.unit else b""

    def on_device(self, g: GroupTable, key: bytes) -> bool:
        """Whether the device prefix cache serves ``key`` in group ``g``."""
        return key in self.device[g.spec.name]

    def needed(self, length: int) -> Need | None:
        """Per group, ``(key, end)`` of the blocks a hit of ``length`` reads, a per-request
        group's snapshot at ``length`` included (None: no snapshot can be there: ``length``
        is not aligned, or the group's snapshots are recomputed and the device has none)."""
        out = []
        for gi, g in enumerate(self.groups):
            if g.per_request:
                if g.slots != 1 or length % self.prefix.snapshot_interval:
                    return None
                key = self.key_at(length)
                if g.spec.name not in self.kept_snapshots and not self.on_device(g, key):
                    return None
                out.append((gi, g, [(key, length)]))  # pinned with the device part
                continue
            c0 = 0 if g.history else g.rule.tail_start(g.spec, length) // g.block_size
            ends = [(c + 1) * g.block_size for c in range(c0, length // g.block_size)]
            out.append((gi, g, [(self.key_at(e), e) for e in ends]))
        return out

    def reach(self, held: Callable[[GroupTable, bytes], bool]) -> int:
        """The longest boundary whose every needed block ``held`` says is held."""
        upper, unit = self.top, self.unit
        for g in self.groups:
            if g.history:
                r, i = g.block_size // unit, 0
                for key in self.keys[r - 1 : upper // unit : r]:
                    if not held(g, key):
                        break
                    i += 1
                upper = min(upper, i * g.block_size)
        length = upper // self.step * self.step
        while length > 0:
            need = self.needed(length)
            if need is not None and all(held(g, k) for _, g, ks in need for k, _ in ks):
                return length
            length -= self.step
        return 0


def _bring_back(prefix: PrefixCache, tier: HostTier, query: PrefixQuery, index: int) -> None:
    """Bring back from ``tier`` the host-only blocks of the longest prefix of ``query`` (the
    ``index``-th query) that the device can give blocks to, or nothing."""
    tokens = token_array(query.token_ids, f"queries[{index}].token_ids")
    plan = PromptPlan(prefix, prefix.groups, tier, tokens, query)
    if plan.top == 0:
        return

    def anywhere(g: GroupTable, key: bytes) -> bool:
        return plan.on_device(g, key) or tier.holds(g.spec.name, key)

    on_device_only = plan.reach(plan.on_device)
    length = plan.reach(anywhere)
    while length > on_device_only:
        # a shorter boundary needs other window tails and snapshots than the longest one:
        # offered only when every group holds what it needs there, on the device or the host
        need = plan.needed(length)
        held = need is not None and all(anywhere(g, k) for _, g, ks in need for k, _ in ks)
        if held and _restore(prefix, tier, need, plan.on_device):  # type: ignore[arg-type]
            tier.stats.hit_tokens += length - on_device_only
            return
        length -= plan.step  # the device cannot give every block: a shorter host hit


def _restore(
    prefix: PrefixCache,
    tier: HostTier,
    need: Need,
    on_device: Callable[[GroupTable, bytes], bool],
) -> bool:
    """Bring back every host-only block of ``need``, or nothing (False): also when a block
    is neither on the device nor in the tier (never an exception, nothing pinned). An
    exception part way gives back what the groups not yet queued hold (:func:`_give_back`)
    and propagates."""
    missing = [(gi, g, [k for k, _ in ks if not on_device(g, k)]) for gi, g, ks in need]
    missing = [(gi, g, ks) for gi, g, ks in missing if ks]
    kept_groups = set(tier.groups)
    if any(
        g.spec.name not in kept_groups or tier.page_of(g.spec.name, k) is None
        for _, g, ks in missing
        for k in ks
    ):
        return False
    # the device part stays: pinned while the takes evict, touched as a hit touches it
    kept = [
        (
            g.pool,
            np.array(
                [prefix.cached_keys(g.spec.name)[k] for k, _ in ks if on_device(g, k)],
                dtype=np.int32,
            ),
        )
        for _, g, ks in need
    ]
    before = [pool.counts_of(blocks) for pool, blocks in kept]
    # every pin and take is recorded here before it is made: whatever line an exception
    # strikes, the except below gives back exactly what is held
    pins: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    takes: dict[BlockPool, list[np.ndarray]] = {}
    taken = None
    try:
        for pool, blocks in kept:
            pool.share(blocks)
        taken = _pin_and_take(tier, missing, pins, takes)
        for pool, blocks in kept:
            pool.release(blocks)
        if taken is None:
            return False
        _queue(prefix, tier, missing, taken, {name: p for name, (p, _) in pins.items()})
    except BaseException:
        for (pool, blocks), counts in zip(kept, before, strict=True):
            pool.restore_counts(blocks, counts)
        _give_back(tier, missing, taken, pins, takes)
        raise
    return True


def _pin_and_take(
    tier: HostTier,
    missing: list[tuple[int, GroupTable, list[bytes]]],
    pins: dict[str, tuple[np.ndarray, np.ndarray]],
    takes: dict[BlockPool, list[np.ndarray]],
) -> dict[BlockPool, np.ndarray] | None:
    """Pin the pages of the ``missing`` keys (every one held: checked by the caller) and take
    a device block for each (``pool -> blocks taken``), or ``None`` with nothing pinned or
    taken when the device pools cannot give them all. Each pin goes to ``pins`` and each
    take to ``takes`` before it is made, for the caller's undo."""
    per_pool: dict[BlockPool, int] = {}
    for _, g, ks in missing:
        per_pool[g.pool] = per_pool.get(g.pool, 0) + len(ks)
    if not _fits(per_pool):
        return None
    for _, g, ks in missing:  # all held (checked above)
        tier.pin(g.spec.name, ks, into=pins)
    arenas = {p.arena for p in per_pool if isinstance(p, ArenaBlockPool)}
    for arena in arenas:
        arena.prepare({p: n for p, n in per_pool.items() if p in arena.pools})
    taken = {}
    for pool, n in per_pool.items():
        takes[pool] = into = []
        taken[pool] = pool.take(n, into=into)
    return taken


def _per_group(
    missing: list[tuple[int, GroupTable, list[bytes]]], taken: dict[BlockPool, np.ndarray]
) -> Iterator[tuple[int, GroupTable, list[bytes], np.ndarray]]:
    """Each group of ``missing`` with its share of the blocks ``taken`` from its pool."""
    at = dict.fromkeys(taken, 0)
    for gi, g, ks in missing:
        yield gi, g, ks, taken[g.pool][at[g.pool] : at[g.pool] + len(ks)]
        at[g.pool] += len(ks)


def _queue(
    prefix: PrefixCache,
    tier: HostTier,
    missing: list[tuple[int, GroupTable, list[bytes]]],
    taken: dict[BlockPool, np.ndarray],
    pages: dict[str, np.ndarray],
) -> None:
    """Queue the onloads of the pinned ``pages`` into the ``taken`` device blocks, held
    until :func:`take_onloads` (one hand-over per group, whole at any line), and register
    each block under its key with its page's record and proof."""
    for gi, g, ks, blocks in _per_group(missing, taken):
        name = g.spec.name
        tier.hold_for_onloads(name, g.pool, blocks, pages[name])
        for key, block, page in zip(ks, blocks.tolist(), pages[name].tolist(), strict=True):
            end, ref, proof = tier.page_entry(name, page)
            prefix.register(gi, g, key, block, end, ref, proof)  # type: ignore[arg-type]


def _give_back(
    tier: HostTier,
    missing: list[tuple[int, GroupTable, list[bytes]]],
    taken: dict[BlockPool, np.ndarray] | None,
    pins: dict[str, tuple[np.ndarray, np.ndarray]],
    takes: dict[BlockPool, list[np.ndarray]],
) -> None:
    """Undo the pins and takes of a lookup cut short, but for the groups whose onloads were
    queued (their blocks are held until the onloads are handed out, their pages pinned):
    the other blocks go back to the free stack, the other pages are unpinned."""
    handed: dict[BlockPool, list[np.ndarray]] = {}
    names = set()
    if taken is not None:  # (else no onload was queued)
        for _, g, _, blocks in _per_group(missing, taken):
            if tier.holds_for_onloads(g.pool, blocks):
                handed.setdefault(g.pool, []).append(blocks)
                names.add(g.spec.name)
    for pool, parts in takes.items():
        for ids in parts:
            kept = handed.get(pool)
            pool.put_back(ids[~np.isin(ids, np.concatenate(kept))] if kept else ids)
    for name, (pages, before) in pins.items():
        if name not in names:
            tier.restore_pins(name, pages, before)


def _fits(per_pool: dict[BlockPool, int]) -> bool:
    """Whether every pool (an arena's pools together) can give its count of blocks."""
    arenas: dict[Any, dict[ArenaBlockPool, int]] = {}
    for pool, n in per_pool.items():
        if isinstance(pool, ArenaBlockPool):
            arenas.setdefault(pool.arena, {})[pool] = n
        elif pool.num_free < n:
            return False
    return all(arena.fits(needs) for arena, needs in arenas.items())
