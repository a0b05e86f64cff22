"""The remote tier behind vLLM's connector: kvforge's host pages published to a store (Redis,
Mooncake Store) and loaded from it when the host pages miss, so engines in other processes or
on other machines reuse each other's prefixes.

Turned on by the ``"remote"`` entry of kvforge's options (:mod:`.remote_options`; the same
:class:`~kvforge.store.config.StoreConfig` as ``CacheController``'s remote tier).
:class:`~kvforge.integrations.vllm.connector.KVForgeConnector` then builds
:class:`RemoteOffloadingSpec`, whose manager and worker are the host tier's with a store
behind them:

- **lookup** (scheduler side, :class:`RemoteOffloadingManager`): a chunk the host pages miss
  is asked of the store off the scheduler's thread (:class:`~.remote_index.RemoteIndex`:
  ``RETRY`` until answered); a hit needs every tensor- and pipeline-parallel rank's shard.
- **load**: ``prepare_load`` reserves a host page for a chunk found in the store and hands the
  worker its store key and content proof (:class:`RemoteHostSpec`); the worker reads the value
  into the page on a thread of its own, then scatters it to the device blocks on the engine's
  thread (:class:`RemoteOffloadingWorker`). A value that does not arrive whole with this
  prompt's proof (evicted meanwhile, corrupted, truncated, the store down) fails the load:
  vLLM recomputes the request (``kv_load_failure_policy="recompute"``, required), the page is
  forgotten, the value removed from the store (:meth:`~kvforge.store.protocol.RemoteStore.
  remove`) so the next publish lands, and the answer dropped.
- **publish**: ``prepare_store`` gives each new page its store key and proof; once the worker
  has written the page it queues it for the store (``put_async``: bounded, never blocks).
  Each rank publishes its own shard under its own fingerprint.

Concurrency: a key names its content (tokens, salt, adapter, model, layout), so every correct
writer of a key writes a valid value for it: kvforge relies on neither the first writer's value
(Mooncake keeps it) nor the last's (Redis keeps it). A value found bad is removed, so the
next writer's value replaces it under both.

Lifetime: every store is opened at engine start and waits at most its ``connect_timeout_s``
for its server (a store not ready then answers misses until it is: setup retries are bounded
by the store's back-off); the worker registers its host pages with its store (Mooncake's
zero-copy registration) and ``shutdown`` unregisters them and closes every store, which
releases Mooncake's segment.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferResult,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvforge.core.model_identity import ModelIdentity
from kvforge.integrations.vllm.manager import KVForgeHostSpec, KVForgeOffloadingManager
from kvforge.integrations.vllm.remote_index import HIT, RETRY, RemoteIndex
from kvforge.integrations.vllm.remote_keys import remote_fingerprint
from kvforge.integrations.vllm.remote_options import RemoteSettings
from kvforge.integrations.vllm.spec import KVForgeOffloadingSpec
from kvforge.integrations.vllm.worker import KVForgeOffloadingWorker

__all__ = [
    "RemoteHostSpec",
    "RemoteOffloadingManager",
    "RemoteOffloadingSpec",
    "RemoteOffloadingWorker",
]

logger = logging.getLogger(__name__)

#: (group position, page, store key, content proof): one value of a transfer
RemoteValue = tuple[int, int, bytes, bytes]


class RemoteHostSpec(KVForgeHostSpec):
    """Host pages of one transfer, and the store values they come from (``fetch``: a load)
    or go to (``publish``: a store)."""

    __slots__ = ("fetch", "publish")

    def __init__(
        self,
        pages: Sequence[Any],
        fetch: Sequence[RemoteValue] = (),
        publish: Sequence[RemoteValue] = (),
    ) -> None:
        super().__init__(pages)
        self.fetch = tuple(fetch)
        self.publish = tuple(publish)


class RemoteOffloadingManager(KVForgeOffloadingManager):
    """The host tier's manager with a store behind it (module docstring).

    Counters: :attr:`remote_loads` (chunks handed to the worker to load from the store),
    :attr:`remote_load_failures` (those whose value did not arrive), :attr:`published`
    (chunks handed to the worker to publish).
    """

    def __init__(self, plan: Any, index: RemoteIndex, settings: RemoteSettings, **kw: Any):
        super().__init__(plan, **kw)
        self.index = index
        self.settings = settings
        #: key -> (request id, group position, page or 0): loads from the store in flight
        self._fetching: dict[OffloadKey, tuple[str, int, int]] = {}
        self._fetch_failed: set[OffloadKey] = set()
        self.remote_loads = 0
        self.remote_load_failures = 0
        self.published = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, req_id: str, request: Any) -> None:
        self.index.add_request(req_id, request)

    def keep_requests(self, req_ids: Collection[str]) -> None:
        """Forget the keys and answers of every request not in ``req_ids``."""
        self.index.keep_requests(req_ids)

    def _remote(self, key: OffloadKey, ctx: ReqContext) -> str:
        pos = self._position(key)
        if pos is None or not self.settings.loads or key in self._suspect:
            return "miss"
        end = ctx.get_offload_key_position(key)
        return self.index.lookup(ctx.req_id, self.plan.group_ids[pos], end)

    def _held(self, key: OffloadKey) -> bool:
        pos = self._position(key)
        return pos is not None and self._tier.page_of(self._names[pos], key) is not None

    # ------------------------------------------------------------------ lookups and loads

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._fetching:
            return LookupResult.HIT_PENDING
        result = super().lookup(key, req_context)
        if result is not LookupResult.MISS or self._held(key):
            return result
        answer = self._remote(key, req_context)
        return {HIT: LookupResult.HIT, RETRY: LookupResult.RETRY}.get(answer, LookupResult.MISS)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST if self._held(key) else CacheHitSource.EXTERNAL_UNSPECIFIED

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the held pages of ``keys``; reserve a page for each key the store holds and
        hand the worker its value to read. A key neither held nor found in the store is a
        ``KeyError`` (nothing pinned)."""
        groups = self._by_group(keys)
        remote = {k for ks in groups.values() for k in ks if not self._held(k)}
        if not remote:
            return super().prepare_load(keys, req_context)
        for key in remote:
            if self._remote(key, req_context) != HIT:
                raise KeyError(f"offload key {key!r} is neither held nor in the store")
        local = [k for k in dict.fromkeys(keys) if k not in remote]
        spec = super().prepare_load(local, req_context) if local else None
        pages: dict[int, list[int]] = {}
        fetch: list[RemoteValue] = []
        for pos, gkeys in groups.items():
            held = iter(spec.pages[pos].tolist() if spec is not None else ())
            for key in self._chunk_order(gkeys, req_context):
                if key not in remote:
                    pages.setdefault(pos, []).append(next(held))
                    continue
                page = self._reserve_fetch(key, pos, req_context)
                pages.setdefault(pos, []).append(page)
                end = req_context.get_offload_key_position(key)
                skey = self.index.key_of(req_context.req_id, self.plan.group_ids[pos], end)
                assert skey is not None  # _remote found it
                fetch.append((pos, page, skey[0], skey[1]))
        self.remote_loads += len(fetch)
        n = len(self._names)
        return RemoteHostSpec([pages.get(i, ()) for i in range(n)], fetch=fetch)

    def _reserve_fetch(self, key: OffloadKey, pos: int, ctx: ReqContext) -> int:
        """A page for ``key``'s value, pinned until the load completes; 0 when every page is
        pinned (the worker then fails the load, and vLLM recomputes)."""
        end = ctx.get_offload_key_position(key) or 1
        page = self._tier.reserve(self._names[pos], key, end, None, None) or 0
        self._fetching[key] = (ctx.req_id, pos, page)
        self._pins[(ctx.req_id, key)] += 1
        return page

    def _fetches_of(self, keys: Iterable[OffloadKey], req_id: str) -> list[OffloadKey]:
        return [k for k in dict.fromkeys(keys) if self._fetching.get(k, ("",))[0] == req_id]

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """As the host tier's; a page read from the store becomes loadable if its value
        arrived, else it is forgotten (and the store's answer with it)."""
        req_id = req_context.req_id
        self._outstanding("complete_load", keys, req_id, stores=False, loads=True)
        mine = self._fetches_of(keys, req_id)
        for key in mine:
            _, pos, page = self._fetching.pop(key)
            self._pins[(req_id, key)] -= 1
            if not self._pins[(req_id, key)]:
                del self._pins[(req_id, key)]
            ok = key not in self._fetch_failed
            self._fetch_failed.discard(key)
            if page:
                self._tier.filled(self._names[pos], [page], [ok])
            if not ok:
                self.remote_load_failures += 1
                end = req_context.get_offload_key_position(key)
                self.index.forget(req_id, self.plan.group_ids[pos], end)
        rest = [k for k in dict.fromkeys(keys) if k not in mine]
        if rest:
            super().complete_load(rest, req_context)

    def mark_failed(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        self._outstanding("mark_failed", keys, req_context.req_id, stores=True, loads=True)
        mine = self._fetches_of(keys, req_context.req_id)
        self._fetch_failed.update(mine)
        rest = [k for k in keys if k not in mine]
        if rest:
            super().mark_failed(rest, req_context)

    # ------------------------------------------------------------------ stores

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """As the host tier's; with publishing on, each new page also names the store value
        the worker publishes once the page is written."""
        out = super().prepare_store(keys, req_context)
        if out is None or not self.settings.publishes or not out.keys_to_store:
            return out
        spec = out.store_spec
        assert isinstance(spec, KVForgeHostSpec)
        by_pos: dict[int, list[OffloadKey]] = {}
        for key in out.keys_to_store:
            pos = self._position(key)
            assert pos is not None  # prepare_store checked every key
            by_pos.setdefault(pos, []).append(key)
        publish: list[RemoteValue] = []
        for pos, gkeys in by_pos.items():
            for key, page in zip(gkeys, spec.pages[pos].tolist(), strict=True):
                end = req_context.get_offload_key_position(key)
                skey = self.index.key_of(req_context.req_id, self.plan.group_ids[pos], end)
                if skey is not None:
                    publish.append((pos, page, skey[0], skey[1]))
        self.published += len(publish)
        return PrepareStoreOutput(
            keys_to_store=out.keys_to_store,
            store_spec=RemoteHostSpec(list(spec.pages), publish=publish),
            evicted_keys=out.evicted_keys,
        )

    def reset_cache(self) -> None:
        for _, pos, page in self._fetching.values():
            if page:
                self._tier.filled(self._names[pos], [page], [False])
        for key, (req_id, _, _) in self._fetching.items():
            self._pins.pop((req_id, key), None)
        self._fetching.clear()
        self._fetch_failed.clear()
        super().reset_cache()

    def shutdown(self) -> None:
        """Stop the index's thread and close every rank's store."""
        self.index.close()
        super().shutdown()

    def __repr__(self) -> str:
        return (
            f"RemoteOffloadingManager({self.plan}, role {self.settings.kv_role!r}, "
            f"fetching {len(self._fetching)})"
        )


class RemoteOffloadingWorker(KVForgeOffloadingWorker):
    """The host tier's worker with this rank's store behind it (module docstring).

    Counters: :attr:`published` (pages queued for the store), :attr:`fetched` (values read
    whole), :attr:`fetch_misses` (values that did not arrive), :attr:`removed` (bad values
    removed from the store).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, plan: Any, store: Any, **kw: Any) -> None:
        super().__init__(kv_caches, plan, **kw)
        self.store = store
        for host in self.host:
            store.register_buffer(host)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvforge-remote-load")
        #: load job id -> (the read in flight, device spec, host spec)
        self._reads: dict[int, tuple[Future[bool], Any, Any]] = {}
        self.published = 0
        self.fetched = 0
        self.fetch_misses = 0
        self.removed = 0

    def _page_rows(self, pos: int, page: int) -> Any:
        bpc = self.plan.blocks_per_chunk
        return self.host[pos][(page - 1) * bpc : page * bpc]

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._run(job_id, src_spec, dst_spec, store=True)
        publish = getattr(dst_spec, "publish", ())
        if publish and self._finished and self._finished[-1].success:
            self.published += self.store.put_async(
                [skey for _, _, skey, _ in publish],
                [self._page_rows(pos, page) for pos, page, _, _ in publish],
                [proof for _, _, _, proof in publish],
            )
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        fetch = getattr(src_spec, "fetch", ())
        if not fetch:
            return super().submit_load(job_id, src_spec, dst_spec, expedited)
        self._reads[job_id] = (self._pool.submit(self._read, fetch), dst_spec, src_spec)
        return True

    def _read(self, fetch: Sequence[RemoteValue]) -> bool:
        """Read ``fetch``'s values into their pages (off the engine's thread); whether every
        one arrived whole. Values that did not are removed from the store."""
        if any(not 1 <= page <= self.plan.num_pages for _, page, _, _ in fetch):
            return False  # no page was free for one: a failed load, recomputed
        keys = [skey for _, _, skey, _ in fetch]
        sizes = self.store.batch_get_into(
            keys,
            [self._page_rows(pos, page) for pos, page, _, _ in fetch],
            [proof for _, _, _, proof in fetch],
        )
        missed = [k for k, size in zip(keys, sizes, strict=True) if size is None]
        self.fetched += len(keys) - len(missed)
        self.fetch_misses += len(missed)
        if missed:
            self.removed += self.store.remove(missed)
        return not missed

    def _drain(self, wait_for: Collection[int] = ()) -> None:
        """Scatter the loads whose reads are done (and wait for those in ``wait_for``), on
        the calling (engine) thread; a read that failed fails its load."""
        for job_id, (read, gpu, host) in list(self._reads.items()):
            if not read.done() and job_id not in wait_for:
                continue
            del self._reads[job_id]
            try:
                ok = read.result()
            except Exception as exc:  # a bug in the read: a failed load, never the engine
                logger.warning("kvforge remote load %d failed: %s", job_id, type(exc).__name__)
                ok = False
            if ok:
                self._run(job_id, gpu, host, store=False)
            else:
                self._finished.append(TransferResult(job_id, False))
                self.failed_transfers += 1

    def get_finished(self) -> list[TransferResult]:
        self._drain()
        return super().get_finished()

    def wait(self, job_ids: set[int]) -> None:
        self._drain(job_ids)

    def shutdown(self) -> None:
        """Finish the reads in flight, unregister the host pages and close the store."""
        self._pool.shutdown(wait=True)
        self._drain(set(self._reads))
        for host in self.host:
            self.store.unregister_buffer(host)
        self.store.close()


class RemoteOffloadingSpec(KVForgeOffloadingSpec):
    """kvforge's offloading spec with a remote tier (module docstring).

    Args (beyond :class:`~kvforge.integrations.vllm.spec.KVForgeOffloadingSpec`'s):
        remote: the checked ``"remote"`` entry.
        identity: this process's shard's :class:`~kvforge.ModelIdentity`.
        rank_identities: every rank's identity (the scheduler asks each rank's store).
        unit: tokens per prefix key.
        kv_cache: the KV cache dtype and layout, in the fingerprint.
    """

    def __init__(
        self,
        config: Any,
        block_bytes: Sequence[int],
        device_type: str | None,
        *,
        remote: RemoteSettings,
        identity: ModelIdentity,
        rank_identities: Sequence[ModelIdentity],
        unit: int,
        kv_cache: str,
    ) -> None:
        super().__init__(config, block_bytes, device_type)
        self.remote = remote
        self.identity = identity
        self.rank_identities = list(rank_identities)
        self.unit = unit
        self.kv_cache = kv_cache

    def fingerprint(self, identity: ModelIdentity) -> bytes:
        return remote_fingerprint(identity, self.plan, self.unit, self.kv_cache)

    def _open(self, identity: ModelIdentity, lend: bool) -> Any:
        """An open store for ``identity``'s shard, set up within ``connect_timeout_s``
        (``lend``: lend Mooncake memory to the cluster; the scheduler's stores only ask)."""
        from kvforge.store import open_store

        config = self.remote.store
        if not lend:
            config = config.model_copy(update={"mooncake_global_segment_bytes": 0})
        store = open_store(config, self.fingerprint(identity))
        if not store.wait_ready(config.connect_timeout_s):
            logger.warning(
                "kvforge remote tier: the %s store did not answer within %.1f s; its lookups "
                "miss until it does",
                config.backend,
                config.connect_timeout_s,
            )
        return store

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            # a producer never asks the store: its scheduler opens no client
            loads = self.remote.loads
            stores = [self._open(i, lend=False) for i in self.rank_identities] if loads else []
            self._manager = RemoteOffloadingManager(
                self.plan,
                RemoteIndex(stores, self.unit),
                self.remote,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = RemoteOffloadingWorker(
                kv_caches,
                self.plan,
                self._open(self.identity, lend=True),
                impl=self.options.gather_impl,
                pin_memory=self.options.pin_memory,
            )
        return self._worker
