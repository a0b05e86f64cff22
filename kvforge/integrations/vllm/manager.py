"""The scheduler side of the vLLM offloading backend: vLLM's ``OffloadingManager`` over kvforge's
host tier (:class:`~kvforge.scheduler.host_tier.HostTier`), one compact page space per group.

vLLM's offloading scheduler asks, per ``OffloadKey`` (a block hash plus a group index), whether
a chunk is held (``lookup``), pins chunks to read (``prepare_load`` .. ``complete_load``) and
reserves pages to write (``prepare_store`` .. ``complete_store``). Here every key lives in the
page space of its own group: a DeepSeek-V4 indexer chunk takes an indexer page, not a page the
size of the packed block of every group.

Invariants (tests/integrations/test_vllm_manager.py):
- a store is all or nothing: ``prepare_store`` either reserves a page for every new key of the
  call, or returns ``None`` and changes nothing;
- keys of the same call that are held already are never evicted to make room for the others;
- a page being written (store in flight) or read (load in flight) is pinned: never evicted,
  never handed to another key; ``lookup`` answers ``HIT_PENDING`` while its store runs;
- a report (``complete_store``, ``complete_load``, ``mark_failed``) counts only for the request
  that made the reservation or pin, once: a replayed, foreign or unknown report raises
  :class:`~kvforge.integrations.vllm.checks.TransferRefusedError` and changes nothing (a
  failure report for a key never held cannot block that key's later store);
- a failed store (``success=False``, or a job the worker reported failed) forgets its pages:
  a later lookup misses, it never reads what the failed copy left behind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

try:  # vLLM 0.33 names the type of config_info's rows; 0.32 has neither the name nor the hook
    from vllm.v1.kv_offload.base import ConfigInfoMapping
except ImportError:  # vLLM 0.32
    ConfigInfoMapping = Mapping[str, str | int | float | bool]  # type: ignore[misc]

from kvforge._checks import check_bool
from kvforge.integrations.vllm.checks import TransferRefusedError
from kvforge.integrations.vllm.pages import HostPagePlan, HostPages
from kvforge.scheduler.host_tier import HostTier
from kvforge.scheduler.unit_records import UnitRecordStore

__all__ = ["KVForgeHostSpec", "KVForgeOffloadingManager"]


class KVForgeHostSpec(HostPages, LoadStoreSpec):
    """Host pages of one load or store, per offloaded group in chunk order."""

    __slots__ = ()


def _group_name(group_id: int) -> str:
    return f"group{group_id}"


class KVForgeOffloadingManager(OffloadingManager):
    """vLLM's offloading manager on kvforge's host tier.

    Args:
        plan: the page spaces (:func:`~kvforge.integrations.vllm.pages.plan_host_pages`).
        enable_events: keep ``OffloadingEvent``s for ``take_events`` (vLLM's
            ``enable_kv_cache_events``).

    Stats (:meth:`get_stats`, vLLM's CPU tier gauges): the fraction of pages pinned by
    transfers, by stores, and by loads. Counters since construction: :attr:`stores_failed`
    (keys whose store failed), :attr:`allocation_failures` (``prepare_store`` calls answered
    ``None``).
    """

    def __init__(self, plan: HostPagePlan, enable_events: bool = False) -> None:
        self.plan = plan
        self.medium = Medium.CPU
        self._names = [_group_name(g) for g in plan.group_ids]
        self._tier = HostTier(
            {name: plan.num_pages + 1 for name in self._names},  # + the null page
            UnitRecordStore(),
            on_evicted=self._record_evicted,
        )
        #: key -> (request id, position, page): stores in flight
        self._storing: dict[OffloadKey, tuple[str, int, int]] = {}
        #: keys a worker reported failed while their job was still counting workers
        self._failed: set[OffloadKey] = set()
        #: keys whose load failed: their pages go once no load pins them
        self._suspect: set[OffloadKey] = set()
        #: (request id, key) -> pins that request holds for its loads
        self._pins: Counter[tuple[str, OffloadKey]] = Counter()
        self._evicted_now: list[OffloadKey] = []
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.stores_failed = 0
        self.allocation_failures = 0

    # ------------------------------------------------------------------ helpers

    def _record_evicted(self, group: str, keys: list[bytes]) -> None:
        self._evicted_now.extend(OffloadKey(k) for k in keys)

    def _position(self, key: OffloadKey) -> int | None:
        if not isinstance(key, bytes) or len(key) <= 4:
            return None
        try:
            return self.plan.position(get_offload_group_idx(key))
        except Exception:
            return None

    def _by_group(
        self, keys: Iterable[OffloadKey], strict: bool = True
    ) -> dict[int, list[OffloadKey]]:
        """``keys`` (repeats dropped) by group position, in their order. A key of no offloaded
        group is a ``KeyError`` (``strict``, nothing changed) or left out."""
        out: dict[int, list[OffloadKey]] = {}
        for key in dict.fromkeys(keys):
            pos = self._position(key)
            if pos is None:
                if strict:
                    raise KeyError(f"offload key {key!r} names no offloaded group")
                continue
            out.setdefault(pos, []).append(key)
        return out

    def _outstanding(
        self, what: str, keys: Iterable[OffloadKey], req_id: str, stores: bool, loads: bool
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """``keys`` (repeats dropped) split into ``(stores, loads)`` this request has
        outstanding: a store it reserved (``stores``) or a load it pinned (``loads``).

        Raises:
            TransferRefusedError: a key with neither (never held, already completed, or
                another request's); nothing changed.
        """
        stored: list[OffloadKey] = []
        loaded: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            entry = self._storing.get(key) if isinstance(key, bytes) else None
            if stores and entry is not None and entry[0] == req_id:
                stored.append(key)
            elif loads and isinstance(key, bytes) and self._pins[(req_id, key)] > 0:
                loaded.append(key)
            else:
                kinds = " or ".join(k for k, on in (("store", stores), ("load", loads)) if on)
                owner = f" (request {entry[0]!r} reserved its store)" if entry is not None else ""
                raise TransferRefusedError(
                    what, key, f"request {req_id!r} has no {kinds} of it outstanding{owner}"
                )
        return stored, loaded

    def _spec(self, by_pos: dict[int, list[int]]) -> KVForgeHostSpec:
        return KVForgeHostSpec(
            [np.asarray(by_pos.get(i, ()), dtype=np.int32) for i in range(len(self._names))]
        )

    @staticmethod
    def _chunk_order(keys: list[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
        """``keys`` of one group in prefix order (vLLM records each key's end token; the GPU
        side lists blocks in that order), or as given when a position is unknown."""
        ends = [req_context.get_offload_key_position(k) for k in keys]
        if any(e is None for e in ends):
            return keys
        return [k for _, k in sorted(zip(ends, keys, strict=True), key=lambda t: t[0])]

    # ------------------------------------------------------------------ lookups and loads

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        pos = self._position(key)
        if pos is None or key in self._suspect or self._tier.page_of(self._names[pos], key) is None:
            return LookupResult.MISS  # a page a load failed on is not offered again
        if key in self._storing:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the pages of ``keys`` (every one held and written, else ``KeyError`` and nothing
        pinned) until :meth:`complete_load`."""
        groups = self._by_group(keys)
        for pos, gkeys in groups.items():
            for key in gkeys:
                if key in self._storing or self._tier.page_of(self._names[pos], key) is None:
                    raise KeyError(f"offload key {key!r} is not held, or still being stored")
        pages: dict[int, list[int]] = {}
        for pos, gkeys in groups.items():
            gkeys = self._chunk_order(gkeys, req_context)
            pages[pos] = self._tier.pin(self._names[pos], gkeys).tolist()
            for key in gkeys:
                self._pins[(req_context.req_id, key)] += 1
        return self._spec(pages)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for pos, gkeys in self._by_group(keys, strict=False).items():
            self._tier.touch(self._names[pos], gkeys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin what this request pinned for ``keys``.

        Raises:
            TransferRefusedError: a key this request holds no pin on (a replayed, foreign or
                unknown completion); nothing changed.
        """
        _, mine_all = self._outstanding(
            "complete_load", keys, req_context.req_id, stores=False, loads=True
        )
        for pos, gkeys in self._by_group(mine_all).items():
            name = self._names[pos]
            mine = gkeys
            for key in mine:
                self._pins[(req_context.req_id, key)] -= 1
                if not self._pins[(req_context.req_id, key)]:
                    del self._pins[(req_context.req_id, key)]
            if mine:
                self._tier.unpin(name, np.array([self._tier.page_of(name, k) for k in mine]))
            suspect = [k for k in mine if k in self._suspect]
            if suspect:
                self._tier.forget(name, suspect)
                gone = [k for k in suspect if self._tier.page_of(name, k) is None]
                self._suspect.difference_update(gone)
                if gone and self.events is not None:  # published stored: publish the removal
                    self.events.append(OffloadingEvent(keys=gone, medium=self.medium, removed=True))

    # ------------------------------------------------------------------ stores

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve a page for every key not held yet, all or nothing.

        Keys held already (written or being written) are not stored again, and are pinned
        while the others take pages, so this call never evicts them. ``None``: some group has
        fewer free or evictable pages than new keys (nothing changed).
        """
        groups = self._by_group(keys)
        new: dict[int, list[OffloadKey]] = {}
        held: dict[int, list[OffloadKey]] = {}
        for pos, gkeys in groups.items():
            name = self._names[pos]
            for key in gkeys:
                if self._tier.page_of(name, key) is None:
                    new.setdefault(pos, []).append(key)
                elif key not in self._storing:
                    held.setdefault(pos, []).append(key)
        pinned = {pos: self._tier.pin(self._names[pos], k) for pos, k in held.items()}
        try:
            short = [
                pos for pos, k in new.items() if self._tier.pool(self._names[pos]).num_free < len(k)
            ]
            if short:
                self.allocation_failures += 1
                return None
            self._evicted_now = []
            pages: dict[int, list[int]] = {}
            for pos, gkeys in new.items():
                name = self._names[pos]
                gkeys = self._chunk_order(gkeys, req_context)
                new[pos] = gkeys
                for key in gkeys:
                    end = req_context.get_offload_key_position(key) or 1
                    page = self._tier.reserve(name, key, end, None, None)
                    assert page is not None  # free pages were counted above
                    self._storing[key] = (req_context.req_id, pos, page)
                    pages.setdefault(pos, []).append(page)
        finally:
            for pos, ids in pinned.items():
                self._tier.unpin(self._names[pos], ids)
        evicted, self._evicted_now = self._evicted_now, []
        if evicted and self.events is not None:
            self.events.append(OffloadingEvent(keys=evicted, medium=self.medium, removed=True))
        stored = [k for pos in sorted(new) for k in new[pos]]
        return PrepareStoreOutput(
            keys_to_store=stored, store_spec=self._spec(pages), evicted_keys=evicted
        )

    def mark_failed(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """A worker reported that this request's transfer of ``keys`` failed. A store's pages
        are forgotten when it completes, whatever ``complete_store`` says; a load's pages once
        no load pins them, so the request's recompute stores fresh bytes instead of failing on
        them again.

        Raises:
            TransferRefusedError: a key this request has no store or load of outstanding (a
                key never held, one already completed, another request's); nothing changed.
        """
        stored, loaded = self._outstanding(
            "mark_failed", keys, req_context.req_id, stores=True, loads=True
        )
        self._failed.update(stored)
        self._suspect.update(loaded)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """The stores this request reserved for ``keys`` are done: written pages become
        loadable (most recently used), failed ones are forgotten.

        Raises:
            TransferRefusedError: a key this request has no store of outstanding (a replayed,
                foreign or unknown completion); nothing changed.
        """
        success = check_bool("complete_store: success", success)
        mine, _ = self._outstanding(
            "complete_store", keys, req_context.req_id, stores=True, loads=False
        )
        stored: list[OffloadKey] = []
        removed: list[OffloadKey] = []
        for key in mine:
            entry = self._storing.pop(key)
            ok = success and key not in self._failed
            self._failed.discard(key)
            _, pos, page = entry
            self._tier.filled(self._names[pos], [page], [ok])
            (stored if ok else removed).append(key)
        self.stores_failed += len(removed)
        if self.events is not None:
            if removed:
                self.events.append(
                    OffloadingEvent(
                        keys=removed, medium=self.medium, removed=True, metadata_only=True
                    )
                )
            if stored:
                self.events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False))

    # ------------------------------------------------------------------ requests, reset

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        """Forget every page, in flight or not (vLLM's scheduler ignores completions of jobs
        issued before a reset)."""
        for _, pos, page in self._storing.values():
            self._tier.filled(self._names[pos], [page], [False])
        self._storing.clear()
        self._failed.clear()
        self._suspect.clear()
        for (_, key), n in self._pins.items():
            pos = self._position(key)
            assert pos is not None
            name = self._names[pos]
            page = self._tier.page_of(name, key)
            if page is not None:
                self._tier.unpin(name, np.full(n, page, dtype=np.int32))
        self._pins.clear()
        self._evicted_now = []
        self._tier.reset()
        self._evicted_now = []

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return
        events, self.events = self.events, []
        yield from events

    # ------------------------------------------------------------------ stats

    def usage(self) -> tuple[float, float]:
        """``(pinned by stores, pinned by loads)``, fractions of every group's pages."""
        total = self.plan.num_pages * len(self._names)
        loads = len({k for (_, k) in self._pins})
        return len(self._storing) / total, loads / total

    def held(self) -> dict[int, int]:
        """vLLM group index -> pages holding a key."""
        pools = [self._tier.pool(n) for n in self._names]
        return {
            g: pool.num_used + pool.num_evictable
            for g, pool in zip(self.plan.group_ids, pools, strict=True)
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        write, read = self.usage()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, write + read)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read)
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [
            {
                "cpu_num_chunks": self.plan.num_pages * len(self._names),
                "cpu_blocks_per_chunk": self.plan.blocks_per_chunk,
                "cpu_kv_cache_size_bytes": self.plan.host_bytes,
                "cpu_kv_cache_size_tokens": "None",
            }
        ]

    def __repr__(self) -> str:
        return f"KVForgeOffloadingManager({self.plan}, storing {len(self._storing)})"
