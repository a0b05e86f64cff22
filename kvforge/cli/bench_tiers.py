"""``kvforge bench --tiers``: the host tier's and the remote tier's throughput, and the time to
restore a prefix from each tier, every figure against a baseline on the same bytes, same run.

Three kinds of record (plain dicts; ``tier``, ``direction``, ``bytes``, ``gbps``,
``client_gbps`` and ``ratio = gbps / client_gbps`` in every one):

- ``tier="host"``, ``put`` / ``get``: device blocks to host tier pages and back
  (:meth:`~kvforge.worker.tier_pages.HostTierPages.move`, one gather or scatter per group),
  against one contiguous ``torch`` copy of as many bytes (``client_gbps``).
- ``tier="redis"`` / ``"mooncake"``, ``put``: the value's checksum and header and the put
  through the kvforge adapter (:func:`kvforge.store.open_store`) from the device blocks,
  against the raw client putting the same number of values, of the same sizes, from one
  pre-packed buffer (Redis: one pipeline of ``SET``; Mooncake: ``batch_put_from`` out of a
  registered buffer). Two ways of putting are timed (on CPU) and recorded
  (``blocks_seconds``, ``gathered_seconds`` and their ratios): straight from the planes of the
  device blocks (``batch_put_blocks``) and gathered into host pages first (``batch_put``);
  the record's ``seconds`` is the one :data:`PUT_FROM` names (``put_from``). The remote
  tier's own publish path is timed too (``async_seconds`` / ``async_ratio``): the gather into
  host pages, ``put_async`` (each value copied into a reused buffer and checksummed) and the
  background writer, until ``flush`` finds the queue drained. ``get``: the adapter's
  ``batch_get_into`` (checksums checked) and the scatter into device blocks, against the raw
  client's get of the same values into one buffer (Redis: a pipeline of ``GET``, each reply
  copied into the buffer; Mooncake: ``batch_get_into``).
- ``direction="restore"``: a DeepSeek-V4-Flash-shaped prefix (16,384 tokens unless
  ``--quick``) restored into device blocks from each tier: the blocks a hit at that boundary
  reuses (every block of a full group, the tail of a window group; compressor state is
  recomputed, so not moved), against one contiguous copy of the same bytes. ``bytes`` is
  checked to be the unpadded host page sum, and the restored blocks to equal the source.

Mooncake's records carry ``segment``: who lent the memory values are stored in
(:func:`run_tiers`, ``--mooncake-segment``); by default another process, so that the raw client
and kvforge both cross TCP to it, as they would to another machine.

Timings are the best of ``repeats`` runs; CPU caches are flushed before each as in
``kvforge bench`` (:func:`kvforge.cli.timing.cache_flusher`). Servers the command starts run in
a private network namespace where ``unshare`` is allowed, else on 127.0.0.1 (with a note).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge.attn_backends.base import AttentionBackend
from kvforge.cli.formatting import console, format_bytes, make_table
from kvforge.cli.remotes import REMOTES, StoreUnavailable, missing
from kvforge.cli.timing import MIN_REPEATS, Spread, cache_flusher, ratio_spread
from kvforge.cli.timing import samples as _samples
from kvforge.controller import CacheController
from kvforge.core.values import PageCopy
from kvforge.platform import Platform, get_platform
from kvforge.store.value import CHECKSUM, encode_header
from kvforge.worker.tier_pages import HostTierPages

__all__ = ["REMOTES", "SEGMENTS", "TierCase", "default_cases", "missing", "run_tiers"]

Record = dict[str, Any]
#: what kvforge's put reads, per store (on CPU, where device blocks are host memory; on an
#: accelerator always "pages"): "blocks" puts straight from the device blocks' planes
#: (``batch_put_blocks``: no gather, the checksum fed plane by plane), "pages" gathers into
#: host pages first (``batch_put``). Both are timed and recorded; Mooncake reports "pages"
#: because each plane is a buffer of its own to its transfer engine, which over TCP to
#: another process made a put from 65 buffers per value 2.2-2.7x slower than from 2
#: (``docs/performance_history.md``, Tiers)
PUT_FROM = {"redis": "blocks", "mooncake": "pages"}
#: who lends Mooncake its segment (:func:`run_tiers`)
SEGMENTS = ("remote", "here")
MIB = 1 << 20
#: how long a store may take to answer before its records are skipped
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TierCase:
    """A model measured: ``target_bytes`` of blocks for the throughput records (as many
    blocks of every host-tier group), or the blocks a hit at ``tokens`` reuses (restore)."""

    name: str
    backends: Mapping[int, AttentionBackend]
    target_bytes: int = 0
    tokens: int = 0


# ----------------------------------------------------------------------------- servers


@contextlib.contextmanager
def servers(
    remotes: Sequence[str],
    given: Mapping[str, str],
    notes: list[str],
    segment: str = "here",
    segment_bytes: int = 0,
) -> Iterator[dict[str, str]]:
    """The address of each remote to measure: the one ``given`` for it, else a server started
    here on 127.0.0.1 (inside a private network namespace when no address was given and
    ``unshare`` works) and stopped by its pid on exit. Remotes that cannot run get a note.
    ``segment="remote"``: a Mooncake master started here gets a second process,
    ``mooncake_client``, lending it ``segment_bytes`` (the bench's client lends none)."""
    from kvforge.store.servers import (
        MooncakeMaster,
        MooncakeSegmentHost,
        RedisServer,
        free_port,
        private_net,
    )

    wanted = []
    for remote in remotes:
        why = None if remote in given else missing(remote)
        if why:
            notes.append(f"{remote}: skipped, {why}")
        else:
            wanted.append(remote)
    to_start = [r for r in wanted if r not in given]
    with contextlib.ExitStack() as stack:
        why = "an address was given" if given else ""
        if to_start and not given:
            why = stack.enter_context(private_net())
        private = to_start and not why
        if to_start and not private:
            notes.append(f"servers run on the host's 127.0.0.1, not a private namespace: {why}")
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvforge-tiers-")))
        addresses = {r: given[r] for r in wanted if r in given}
        for remote in to_start:
            if remote == "redis":
                server: Any = RedisServer(6379 if private else free_port(), log_dir / "redis.log")
            else:
                port = 50051 if private else free_port()
                server = MooncakeMaster(port, port + 1, log_dir / "master.log")
            stack.callback(server.stop)
            try:
                server.start()
                if remote == "mooncake" and segment == "remote":
                    at = 50061 if private else free_port()
                    host = MooncakeSegmentHost(
                        at, server.address, segment_bytes, log_dir / "segment.log"
                    )
                    stack.callback(host.stop)
                    host.start()
            except (OSError, RuntimeError) as exc:
                notes.append(f"{remote}: skipped, its server did not start: {exc}")
                continue
            addresses[remote] = server.address
        yield addresses


def open_remote(remote: str, address: str, segment_bytes: int) -> Any:
    """A kvforge store on ``address``, connected (``RuntimeError`` if it does not answer)."""
    from kvforge.store import StoreConfig, open_store

    host, port = address.rsplit(":", 1)
    common: dict[str, Any] = dict(
        op_timeout_s=120.0, max_value_bytes=512 * MIB, connect_timeout_s=5.0
    )
    if remote == "redis":
        config = StoreConfig(backend="redis", redis_host=host, redis_port=int(port), **common)
    else:
        config = StoreConfig(
            backend="mooncake",
            mooncake_master=address,
            mooncake_global_segment_bytes=segment_bytes,
            **common,
        )
    store = open_store(config, b"kvforge-bench-tiers")
    if not store.wait_ready(READY_TIMEOUT_S):
        store.close()
        raise RuntimeError(f"{remote} at {address} did not answer: {store.stats()}")
    if remote == "mooncake" and not _segment_mounted(store, READY_TIMEOUT_S):
        store.close()
        raise RuntimeError(f"no Mooncake segment is mounted at {address} to put into")
    return store


def _segment_mounted(store: Any, timeout: float) -> bool:
    """Whether a put succeeds within ``timeout`` s: a segment lent by another process is
    mounted a little after that process's port answers."""
    import time

    deadline = time.monotonic() + timeout
    client = store.raw_client
    while True:
        if client.put("kvforge-bench-probe", b"x") == 0:
            client.remove("kvforge-bench-probe")
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


# ---------------------------------------------------------------------------- the copies


@dataclass
class _Model:
    """A controller with its device caches and host tier pages, and the blocks measured:
    per group the source blocks, the blocks restored into and the pages between."""

    ctl: CacheController
    tier: HostTierPages
    src: dict[str, np.ndarray]
    dst: dict[str, np.ndarray]
    pages: dict[str, np.ndarray]
    page_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(b) * self.page_bytes[g] for g, b in self.src.items())

    def copies(self, blocks: dict[str, np.ndarray], offload: bool) -> list[PageCopy]:
        """One copy per group, numbered in the tier's sequence as a scheduler side numbers
        them; page ``p`` holds key tag ``p + 1``, and an offload releases its pages first (the
        bench writes the same pages again and again)."""
        seq, none = self.tier.ledger.next_seq, np.zeros(0, dtype=np.int32)
        return [
            PageCopy(g, b, self.pages[g], self.pages[g] + 1, self.pages[g] if offload else none, s)
            for s, (g, b) in enumerate(blocks.items(), seq)
        ]

    def views(self) -> list[torch.Tensor]:
        """Every page measured, one contiguous uint8 row each (the store's sources)."""
        return [self.tier.groups[g].pages[int(p)] for g, ps in self.pages.items() for p in ps]

    def allocations(self) -> list[torch.Tensor]:
        """Each device allocation the measured planes lie in, once, as a flat uint8 tensor:
        what a store registers to put straight from the planes (on CPU, host memory)."""
        found: dict[int, torch.Tensor] = {}
        for g in self.src:
            for plane in self.ctl.storage.planes(g):
                storage = plane.untyped_storage()
                if storage.data_ptr() not in found:
                    flat = torch.empty(0, dtype=torch.uint8, device=plane.device)
                    found[storage.data_ptr()] = flat.set_(storage)
        return list(found.values())

    def moved(self) -> list[torch.Tensor]:
        """The bytes the copies read and write, for the cache flush."""
        planes = [
            p[int(b)]
            for g in self.src
            for blocks in (self.src[g], self.dst[g])
            for p in self.ctl.storage.planes(g)
            for b in blocks
        ]
        return planes + self.views()

    def clear_restored(self) -> None:
        for g, blocks in self.dst.items():
            for plane in self.ctl.storage.planes(g):
                plane[torch.from_numpy(blocks).long()] = 0

    def identical(self) -> bool:
        """Whether every restored block holds its source block's bytes, plane by plane."""
        return all(
            torch.equal(
                plane[torch.from_numpy(self.src[g]).long()],
                plane[torch.from_numpy(self.dst[g]).long()],
            )
            for g in self.src
            for plane in self.ctl.storage.planes(g)
        )


def _blocks(case: TierCase, ctl: CacheController) -> dict[str, int]:
    """Blocks per host-tier group: the restore's (the blocks a hit at ``case.tokens`` reuses)
    or the throughput's (as many in every group, ``target_bytes`` in all)."""
    layout = ctl.layout
    groups = [g for g in layout.groups if layout.host_page_bytes(g.name) and not g.rule.per_request]
    if case.tokens:
        return {
            g.name: g.rule.blocks_for(g, case.tokens)
            - g.rule.tail_start(g, case.tokens) // g.block_size
            for g in groups
            if not g.rule.recomputed_for_prefix
        }
    per_row = sum(layout.host_page_bytes(g.name) for g in groups)
    return {g.name: max(1, case.target_bytes // per_row) for g in groups}


def _build(case: TierCase, platform: Platform, seed: int = 0) -> _Model:
    probe = CacheController(case.backends, device=platform.device, share_pools=False)
    counts = _blocks(case, probe)
    ctl = CacheController(case.backends, device=platform.device, share_pools=False)
    ctl.initialize_kv_cache(
        num_blocks={g.name: 2 * counts.get(g.name, 0) + 2 for g in ctl.layout.groups}
    )
    tier = HostTierPages(ctl.storage, {g: n + 1 for g, n in counts.items()})
    gen = torch.Generator().manual_seed(seed)
    src, dst, pages = {}, {}, {}
    for g, n in counts.items():
        src[g] = np.arange(1, n + 1, dtype=np.int32)
        dst[g] = np.arange(n + 1, 2 * n + 1, dtype=np.int32)
        pages[g] = np.arange(1, n + 1, dtype=np.int32)
        for plane in ctl.storage.planes(g):
            rows = torch.randint(0, 256, (n, plane.shape[1]), dtype=torch.uint8, generator=gen)
            plane[torch.from_numpy(src[g]).long()] = rows.to(plane.device)
    page_bytes = {g: ctl.layout.host_page_bytes(g) for g in counts}
    return _Model(ctl, tier, src, dst, pages, page_bytes)


def _keys(case: str, tag: str, n: int) -> list[bytes]:
    return [
        hashlib.blake2b(f"{case}/{tag}/{i}".encode(), digest_size=32).digest() for i in range(n)
    ]


class _Raw:
    """The raw client of a kvforge store: put and get ``n`` values of ``sizes`` bytes out of
    and into one pre-packed buffer, without a header, a checksum or a gather."""

    def __init__(self, store: Any, sizes: list[int]) -> None:
        self.store, self.sizes = store, sizes
        self.buf = np.random.default_rng(1).integers(0, 256, sum(sizes), dtype=np.uint8)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        if store.config.backend == "mooncake":
            store.register_buffer(self.buf)  # registers it with the client's transfer engine

    def names(self, tag: str) -> list[str]:
        return [f"bench-raw/{tag}/{i}" for i in range(len(self.sizes))]

    def put(self, tag: str) -> None:
        names, client, view = self.names(tag), self.store.raw_client, memoryview(self.buf)
        if self.store.config.backend == "redis":
            pipe = client.pipeline(transaction=False)
            for name, at, size in zip(names, self.offsets, self.sizes, strict=True):
                pipe.set(name, view[at : at + size])
            ok = all(r is True for r in pipe.execute())
        else:
            ptrs = [self.buf.ctypes.data + at for at in self.offsets]
            ok = all(c == 0 for c in client.batch_put_from(names, ptrs, self.sizes))
        if not ok:
            raise RuntimeError(f"{self.store.config.backend}: a raw put was refused")

    def get(self, tag: str) -> None:
        names, client = self.names(tag), self.store.raw_client
        if self.store.config.backend == "redis":
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            for reply, at, size in zip(pipe.execute(), self.offsets, self.sizes, strict=True):
                self.buf[at : at + size] = np.frombuffer(reply, dtype=np.uint8)
        else:
            ptrs = [self.buf.ctypes.data + at for at in self.offsets]
            codes = client.batch_get_into(names, ptrs, self.sizes)
            if list(codes) != self.sizes:
                raise RuntimeError(f"mooncake: a raw get returned {list(codes)[:4]}")


_FIELDS = ("tier", "direction", "model", "blocks", "bytes", "seconds", "client_seconds", "cache")


def _record(
    tier: str,
    direction: str,
    case: TierCase,
    m: _Model,
    t: Sequence[float],
    t_client: Sequence[float],
    cache: str,
    **extra: Any,
) -> Record:
    """One record: seconds and GB/s from the best run of each side, ``ratio`` the median of
    the per-run ratios with their spread (``ratio_spread``: min, median, max)."""
    gbps, client = m.nbytes / min(t) / 1e9, m.nbytes / min(t_client) / 1e9
    blocks = sum(len(b) for b in m.src.values())
    fields = (tier, direction, case.name, blocks, m.nbytes, min(t), min(t_client), cache)
    record = dict(zip(_FIELDS, fields, strict=True))
    record |= {"gbps": round(gbps, 3), "client_gbps": round(client, 3)}
    spread = ratio_spread(t, t_client)
    record |= {"ratio": spread.median, "ratio_spread": spread.as_list()}
    return record | {"seconds_spread": Spread.of(t, 6).as_list(), **extra}


def _measure(
    case: TierCase,
    platform: Platform,
    stores: Mapping[str, Any],
    repeats: int,
    notes: list[str],
    segment: str = "remote",
) -> list[Record]:
    """Every record of one case: host put and get (or restore), then each store's."""
    m = _build(case, platform)
    src = platform.empty((m.nbytes,), torch.uint8).fill_(0x5A)
    dst = platform.empty_host((m.nbytes,), torch.uint8).fill_(0xA5)
    flush, cache = cache_flusher(platform, [*m.moved(), src, dst])
    offload = lambda: m.tier.move(offloads=m.copies(m.src, True))  # noqa: E731
    onload = lambda: m.tier.move(onloads=m.copies(m.dst, False))  # noqa: E731
    offload(), onload()  # warm-up; the pages now hold the source blocks
    timed = functools.partial(_samples, platform, repeats=repeats, flush=flush)
    t_down, t_up = timed(lambda: dst.copy_(src)), timed(lambda: src.copy_(dst))
    extra: dict[str, Any] = {}
    if case.tokens:
        planes = {g: sum(p.shape[1] for p in m.ctl.storage.planes(g)) for g in m.src}
        per_token = {  # what the copies move (plane widths), the host pages, the device blocks
            "bytes_per_token": sum(planes[g] * len(b) for g, b in m.src.items()),
            "page_bytes_per_token": m.nbytes,
            "device_bytes_per_token": sum(
                m.ctl.layout.bytes_per_block(g) * len(b) for g, b in m.src.items()
            ),
        }
        extra = {"tokens": case.tokens, "groups": {g: len(b) for g, b in m.src.items()}}
        extra |= {k: v / case.tokens for k, v in per_token.items()}
        m.clear_restored()
        t = timed(onload)
        records = [
            _record("host", "restore", case, m, t, t_up, cache, identical=m.identical(), **extra)
        ]
    else:
        t_put, t_get = timed(offload), timed(onload)
        records = [
            _record("host", "put", case, m, t_put, t_down, cache),
            _record("host", "get", case, m, t_get, t_up, cache),
        ]
    for remote, store in stores.items():
        try:
            where = {"segment": segment} if remote == "mooncake" else {}
            records += _measure_remote(
                remote, store, case, m, timed, flush, t_up, cache, extra | where
            )
        except RuntimeError as exc:  # a refused put or a miss: say so, measure the rest
            notes.append(f"{remote}: {case.name} not measured: {exc}")
    m.ctl.free()
    return records


# ------------------------------------------------------------------------------ the run


def default_cases(quick: bool) -> list[TierCase]:
    """Throughput: Llama-3-8B and DeepSeek-V4-Flash, 64 MiB each (16 MiB, Llama only, with
    ``quick``); restore: DeepSeek-V4-Flash at 16,384 tokens (4,096 with ``quick``)."""
    from kvforge.models import from_hf_config

    llama, flash = from_hf_config("llama-3-8b"), from_hf_config("deepseek-v4-flash")
    target = (16 if quick else 64) * MIB
    cases = [TierCase("llama-3-8b", llama, target_bytes=target)]
    if not quick:
        cases.append(TierCase("deepseek-v4-flash", flash, target_bytes=target))
    return [*cases, TierCase("deepseek-v4-flash", flash, tokens=4096 if quick else 16384)]


def _check_run(
    repeats: object, remotes: Sequence[str], mooncake_segment: str, required: Sequence[str]
) -> None:
    """``ValueError`` naming the first bad argument of :func:`run_tiers`."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < MIN_REPEATS:
        raise ValueError(
            f"repeats must be an int >= {MIN_REPEATS} (each ratio is reported with its spread "
            f"over the repeats), got {repeats!r}"
        )
    if mooncake_segment not in SEGMENTS:
        raise ValueError(f"mooncake_segment must be one of {SEGMENTS}, got {mooncake_segment!r}")
    if any(r not in remotes for r in required):
        raise ValueError(f"required must name remotes of {list(remotes)}, got {list(required)}")


def run_tiers(
    cases: Sequence[TierCase],
    remotes: Sequence[str] = REMOTES,
    addresses: Mapping[str, str] | None = None,
    repeats: int = 3,
    device: str | None = None,
    progress: bool = True,
    notes: list[str] | None = None,
    mooncake_segment: str = "remote",
    required: Sequence[str] = (),
) -> list[Record]:
    """Every record of every case, host tier first, then each of ``remotes`` that can run
    (at ``addresses`` where given, else on a server started here); what was skipped, and why,
    is appended to ``notes``.

    ``mooncake_segment``: who lends Mooncake the memory values are stored in. ``"remote"``
    (default): another process (``mooncake_client``, started here with the master; with a
    master given, the cluster's own clients), the bench's client lends none, so every put and
    get crosses TCP to another process as it would to another machine. ``"here"``: the bench's
    client lends it, and Mooncake's raw put and get are a ``memcpy`` inside this process.

    ``required``: remotes that must run: one that cannot (its server did not start or does
    not answer) raises :class:`~kvforge.cli.remotes.StoreUnavailable` before anything is
    measured, its servers stopped, instead of a note."""
    _check_run(repeats, remotes, mooncake_segment, required)
    platform = get_platform(device)
    notes = notes if notes is not None else []
    most = max((_case_bytes(c, platform) for c in cases), default=0)
    records: list[Record] = []
    segment = 2 * most + 64 * MIB  # one put at a time: the store is emptied before each
    lent = servers(remotes, addresses or {}, notes, mooncake_segment, segment)
    with lent as found, contextlib.ExitStack() as stack:
        stores: dict[str, Any] = {}
        for remote, address in found.items():
            ours = 0 if remote == "mooncake" and mooncake_segment == "remote" else segment
            try:
                stores[remote] = stack.enter_context(
                    contextlib.closing(open_remote(remote, address, ours))
                )
            except (ImportError, OSError, RuntimeError) as exc:
                notes.append(f"{remote}: skipped, {exc}")
        for remote in required:
            if remote not in stores:
                said = [n.replace(f"{remote}: skipped, ", f"{remote}: ") for n in notes]
                said = [n for n in said if n.startswith(f"{remote}: ")]
                why = "; ".join(said) or f"{remote}: its server did not start"
                raise StoreUnavailable(why, remote)
        chosen: Any = cases
        if progress:
            from rich.progress import track

            chosen = track(cases, description="benchmarking tiers", transient=True)
        for case in chosen:
            records += _measure(case, platform, stores, repeats, notes, mooncake_segment)
    return records


def _case_bytes(case: TierCase, platform: Platform) -> int:
    ctl = CacheController(case.backends, device=platform.device, share_pools=False)
    return sum(n * ctl.layout.host_page_bytes(g) for g, n in _blocks(case, ctl).items())


def print_records(records: Sequence[Record], notes: Sequence[str]) -> None:
    table = make_table(
        "kvforge tiers: throughput and restore vs the same bytes in the same run (client: "
        "contiguous copy for host and restore, the raw client for a remote put/get)",
        ("tier", "dir", "model", "tokens", "blocks", "bytes", "GB/s", "client GB/s", "ratio", "ms"),
        left=("tier", "dir", "model"),
    )
    for r in records:
        tokens = f"{r['tokens']:,}" if "tokens" in r else ""
        numbers = (r["gbps"], r["client_gbps"], r["ratio"], r["seconds"] * 1e3)
        cells = [r["tier"], r["direction"], r["model"], tokens, f"{r['blocks']:,}"]
        table.add_row(*cells, format_bytes(r["bytes"]), *(f"{x:.2f}" for x in numbers))
    out = console()
    out.print(table)
    for r in records:
        if "tokens" in r:
            out.print(
                f"restore from {r['tier']}: {r['bytes_per_token']:,.1f} bytes/token moved "
                f"(unpadded host pages: {r['page_bytes_per_token']:,.1f}), blocks "
                f"{r['groups']}, restored bytes identical: {r['identical']}"
            )
        elif r.get("async_seconds") is not None:
            out.print(
                f"{r['tier']} publish (put_async, the remote tier's path) of {r['model']}: "
                f"{r['async_seconds'] * 1e3:.2f} ms, ratio {r['async_ratio']:.2f}"
            )
    for note in notes:
        out.print(f"note: {note}")


class _RemoteBench:
    """One store's runs of one case: kvforge's ways of putting and its get, the raw client's
    put and get of the same values, and the checksum alone. Registers the buffers it reads and
    writes with the store; :meth:`close` unregisters them and empties the store."""

    def __init__(self, remote: str, store: Any, case: TierCase, m: _Model) -> None:
        self.remote, self.store, self.m = remote, store, m
        self.views, self.pools = m.views(), [m.tier.groups[g].pages for g in m.pages]
        self.on_cpu = m.ctl.storage.platform.device.type == "cpu"
        # device memory cannot be sent from in place
        self.planes = m.allocations() if self.on_cpu else []
        for buf in (*self.pools, *self.planes):
            store.register_buffer(buf)
        self.raw = _Raw(store, [v.numel() for v in self.views])
        self.payloads = [v.numpy() for v in self.views]  # what the checksum reads
        self.label = f"{case.name}/{case.tokens or case.target_bytes}/{remote}"
        self.keys = _keys(self.label, "kvforge", len(self.views))
        # the keys of each group's blocks, in the order of its pages (views are page-ordered)
        cut = np.cumsum([0, *(len(m.src[g]) for g in m.pages)]).tolist()
        pairs = zip(m.pages, cut, cut[1:], strict=False)
        self.group_keys = {g: self.keys[a:b] for g, a, b in pairs}
        # Mooncake keeps a key's first value: every timed put starts with the store emptied,
        # which also keeps both sides on segment memory already touched (Redis overwrites)
        mooncake = store.config.backend == "mooncake"
        self.empty = functools.partial(store.raw_client.remove_all, True) if mooncake else int
        blocks = self.on_cpu and PUT_FROM[remote] == "blocks"
        self.put, self.other_put = (
            (self.put_blocks, self.put_gathered) if blocks else (self.put_gathered, self.put_blocks)
        )

    def refused(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.remote}: {what}: {self.store.stats()}")

    def put_gathered(self) -> None:
        """Gather into host pages, then put the pages."""
        self.m.tier.move(offloads=self.m.copies(self.m.src, True))
        if not all(self.store.batch_put(self.keys, self.views)):
            raise self.refused("a put was refused")

    def put_blocks(self) -> None:
        """Put straight from the device blocks' planes."""
        for g, ks in self.group_keys.items():
            planes = self.m.ctl.storage.planes(g)
            if not all(self.store.batch_put_blocks(ks, planes, self.m.src[g])):
                raise self.refused("a put was refused")

    def publish(self) -> None:
        """The remote tier's path: gather, then ``put_async`` and its writer, drained."""
        failed = self.store.stats().puts_failed
        self.m.tier.move(offloads=self.m.copies(self.m.src, True))
        if self.store.put_async(self.keys, self.views) != len(self.keys) or not self.store.flush(
            120.0
        ):
            raise self.refused("put_async dropped or did not drain")
        if self.store.stats().puts_failed != failed:
            raise self.refused("a queued put failed")

    def get(self) -> None:
        if None in self.store.batch_get_into(self.keys, self.views):
            raise self.refused("a get missed")
        self.m.tier.move(onloads=self.m.copies(self.m.dst, False))

    def checksums(self) -> None:
        """The value's checksum alone (value.CHECKSUM, XXH3-128, over every payload): what a
        put and a get pay beyond the raw client's bytes."""
        fp = self.store.fingerprint
        for k, v in zip(self.keys, self.payloads, strict=True):
            encode_header(k, fp, v)

    def close(self) -> None:
        for buf in (*self.pools, *self.planes, self.raw.buf):
            with contextlib.suppress(Exception):
                self.store.unregister_buffer(buf)
        self.empty()


def _put_facts(
    bench: _RemoteBench,
    timed: Callable[..., list[float]],
    before_put: Callable[[], None],
    t_put: list[float],
) -> tuple[list[float], dict[str, Any]]:
    """The raw client's put (its values stay in the store for its get), with the record's facts
    on both ways of putting (:data:`PUT_FROM` says why ``t_put``'s is reported), the publish
    path and the checksum."""
    t_other = timed(bench.other_put, flush=before_put) if bench.on_cpu else t_put
    blocks = bench.put == bench.put_blocks
    t_blocks, t_gathered = (t_put, t_other) if blocks else (t_other, t_put)
    t_async = timed(bench.publish, flush=before_put)
    t_raw_put = timed(lambda: bench.raw.put(bench.label), flush=before_put)
    t_sum = timed(bench.checksums)
    blocks_ratio = ratio_spread(t_blocks, t_raw_put) if bench.on_cpu else None
    gathered, publish = ratio_spread(t_gathered, t_raw_put), ratio_spread(t_async, t_raw_put)
    facts = {
        "checksum": CHECKSUM,
        "checksum_seconds": min(t_sum),
        "checksum_gbps": round(bench.m.nbytes / min(t_sum) / 1e9, 3),
        "put_from": "blocks" if blocks else "pages",
        "blocks_seconds": min(t_blocks) if bench.on_cpu else None,
        "blocks_ratio": blocks_ratio.median if blocks_ratio else None,
        "blocks_ratio_spread": blocks_ratio.as_list() if blocks_ratio else None,
        "gathered_seconds": min(t_gathered),
        "gathered_ratio": gathered.median,
        "gathered_ratio_spread": gathered.as_list(),
        "async_seconds": min(t_async),
        "async_ratio": publish.median,
        "async_ratio_spread": publish.as_list(),
    }
    return t_raw_put, facts


def _measure_remote(
    remote: str,
    store: Any,
    case: TierCase,
    m: _Model,
    timed: Callable[..., list[float]],
    flush: Callable[[], None] | None,
    t_up: list[float],
    cache: str,
    extra: dict[str, Any],
) -> list[Record]:
    """One store's records of ``case``: put and get against the raw client, or restore.
    ``extra`` goes into every record (a restore's facts, Mooncake's ``segment``)."""
    where = {k: v for k, v in extra.items() if k == "segment"}
    bench = _RemoteBench(remote, store, case, m)

    def before_put() -> None:
        bench.empty()
        if flush is not None:
            flush()

    try:
        if case.tokens:
            before_put()
            bench.put()
            m.clear_restored()  # so that ``identical`` says what the remote tier brought back
            t_get = timed(bench.get)
            facts = {"identical": m.identical(), **extra}
            return [_record(remote, "restore", case, m, t_get, t_up, cache, **facts)]
        t_put = timed(bench.put, flush=before_put)
        t_get = timed(bench.get)  # the values the last put left
        t_raw_put, facts = _put_facts(bench, timed, before_put, t_put)
        t_raw_get = timed(lambda: bench.raw.get(bench.label))
        why = {k: facts[k] for k in ("checksum", "checksum_seconds", "checksum_gbps")}
        return [
            _record(remote, "put", case, m, t_put, t_raw_put, cache, **facts, **where),
            _record(remote, "get", case, m, t_get, t_raw_get, cache, **why, **where),
        ]
    finally:
        bench.close()
