"""What both adapters share: argument checks, the registry of host buffers, server keys, the
counters, the back-off after a client error, the bounded put queue and a close that returns.

Batches: ``exists_prefix``, ``batch_put`` and ``batch_put_blocks`` send up to
``max_batch_keys`` keys per round trip (an adapter may cut ``batch_put_blocks`` finer:
:attr:`StoreBase.max_put_parts`); ``batch_get_into`` also cuts at ``max_get_batch_bytes`` of
payload (:meth:`StoreBase._get_batches`), so the client reads its replies a few MiB at a time.

Invariants: the store object owns every piece of state here (one lock, ``_lock``, guards the
registry, the counters and the back-off; the put queue guards itself). A client call is made
only through the adapter's ``_exists`` / ``_put`` / ``_put_blocks`` / ``_write_encoded`` /
``_get``, and any exception out of one becomes misses or failed puts plus an error count:
nothing the server does reaches the caller. Only a malformed argument raises
(:class:`ArgumentError`).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvforge._checks import ArgumentError
from kvforge.store.config import StoreConfig
from kvforge.store.protocol import StoreStats
from kvforge.store.put_queue import PutQueue
from kvforge.store.value import (
    HEADER_SIZE,
    NO_PROOF,
    PROOF_SIZE,
    MissReason,
    encode_into,
    layout_digest,
)
from kvforge.store.value_buffers import ValueBuffers

__all__ = ["PlaneSpan", "Span", "StoreBase", "server_key"]


def server_key(namespace: str, fingerprint: bytes, key: bytes) -> str:
    """The name a value of ``key`` under layout ``fingerprint`` has on the server:
    ``namespace/<16 hex of the layout digest>/<key in hex>``, so two layouts never share a
    name (the header checks both again on every read)."""
    return f"{namespace}/{layout_digest(fingerprint)[:8].hex()}/{key.hex()}"


@dataclass(frozen=True)
class Span:
    """A contiguous byte range of host memory: its address, length and a byte view of it."""

    addr: int
    nbytes: int
    view: memoryview


def span_of(obj: Any, name: str, *, writable: bool = False) -> Span:
    """``obj`` (a buffer-protocol object or a CPU ``torch.uint8`` tensor) as a :class:`Span`;
    :class:`ArgumentError` naming ``name`` if it is not contiguous host bytes."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # a torch tensor
        device = str(getattr(obj, "device", "cpu"))
        dtype = str(getattr(obj, "dtype", ""))
        if device != "cpu" or dtype != "torch.uint8" or not obj.is_contiguous():
            raise ArgumentError(
                f"{name} must be a contiguous CPU torch.uint8 tensor, got "
                f"dtype={dtype} device={device} contiguous={obj.is_contiguous()}"
            )
        obj = obj.numpy()
    try:
        view = memoryview(obj)
    except TypeError:
        raise ArgumentError(
            f"{name} must be a memoryview, a numpy uint8 array or a torch.uint8 tensor, "
            f"got {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ArgumentError(f"{name} must be contiguous, got a strided view of shape {view.shape}")
    if writable and view.readonly:
        raise ArgumentError(f"{name} must be writable, got a read-only {type(obj).__name__}")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
    return Span(addr, view.nbytes, view)


@dataclass(frozen=True)
class PlaneSpan:
    """One plane of a :meth:`StoreBase.batch_put_blocks`, inside a registered buffer: block
    ``b`` is the ``block_bytes`` bytes at ``addr + b * block_stride``."""

    addr: int
    block_bytes: int
    block_stride: int
    num_blocks: int
    #: the registered buffer the plane lies in
    within: Span

    def view(self, block: int) -> memoryview:
        """Block ``block``'s bytes, a view of the registered buffer (no copy)."""
        at = self.addr - self.within.addr + block * self.block_stride
        return self.within.view[at : at + self.block_bytes]


def plane_layout(obj: Any, name: str) -> tuple[int, int, int, int]:
    """``(addr, block_bytes, block_stride, num_blocks)`` of a plane: a 2-D ``uint8`` CPU
    ``torch`` tensor or numpy array ``[num_blocks, block_bytes]`` whose bytes within a block
    are contiguous (strides ``(block_stride, 1)``, ``block_stride >= block_bytes``);
    :class:`ArgumentError` naming ``name`` otherwise."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "stride"):  # a torch tensor
        device, dtype = str(getattr(obj, "device", "cpu")), str(getattr(obj, "dtype", ""))
        if device != "cpu" or dtype != "torch.uint8":
            raise ArgumentError(
                f"{name} must be a CPU torch.uint8 tensor, got dtype={dtype} device={device}"
            )
        shape, strides, addr = tuple(obj.shape), tuple(obj.stride()), int(obj.data_ptr())
    elif isinstance(obj, np.ndarray):
        if obj.dtype != np.uint8:
            raise ArgumentError(f"{name} must be a uint8 array, got dtype={obj.dtype}")
        shape, strides, addr = obj.shape, obj.strides, int(obj.ctypes.data)
    else:
        raise ArgumentError(
            f"{name} must be a 2-D torch.uint8 tensor or numpy uint8 array, "
            f"got {type(obj).__name__}"
        )
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ArgumentError(
            f"{name} must be 2-D [num_blocks, block_bytes] with at least one block of one "
            f"byte, got shape {shape}"
        )
    num_blocks, block_bytes = int(shape[0]), int(shape[1])
    stride = int(strides[0]) if num_blocks > 1 else block_bytes  # a lone block has no stride
    if (block_bytes > 1 and strides[1] != 1) or stride < block_bytes:
        raise ArgumentError(
            f"{name} must hold each block's bytes contiguously (strides (block_stride >= "
            f"{block_bytes}, 1)), got strides {strides}"
        )
    return addr, block_bytes, stride, num_blocks


def _check_block_ids(block_ids: Any, n: int, limit: int, call: str) -> np.ndarray:
    if isinstance(block_ids, bytes | str):
        raise ArgumentError(f"{call}: block_ids must be integers, got {type(block_ids).__name__}")
    try:
        ids = np.asarray(block_ids)
    except Exception:
        raise ArgumentError(
            f"{call}: block_ids must be a sequence of integers, got {type(block_ids).__name__}"
        ) from None
    if ids.ndim != 1 or (ids.size and (ids.dtype == np.bool_ or ids.dtype.kind not in "iu")):
        raise ArgumentError(
            f"{call}: block_ids must be a 1-D sequence of integers, got shape {ids.shape} "
            f"dtype {ids.dtype}"
        )
    if len(ids) != n:
        raise ArgumentError(f"{call}: {n} keys but {len(ids)} block_ids")
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    if bad.size:
        i = int(bad[0])
        raise ArgumentError(
            f"{call}: block_ids[{i}] = {int(ids[i])} is out of range [0, {limit}) (the "
            "fewest blocks of any plane)"
        )
    return ids.astype(np.int64, copy=False)


def _check_proofs(proofs: Any, n: int, call: str) -> list[bytes]:
    """``proofs`` (one content proof of :data:`PROOF_SIZE` bytes per key), or
    :data:`NO_PROOF` for every key when ``None``."""
    if proofs is None:
        return [NO_PROOF] * n
    if isinstance(proofs, bytes | str) or not isinstance(proofs, Sequence):
        raise ArgumentError(
            f"{call}: proofs must be a sequence of bytes or None, got {type(proofs).__name__}"
        )
    if len(proofs) != n:
        raise ArgumentError(f"{call}: {n} keys but {len(proofs)} proofs")
    for i, proof in enumerate(proofs):
        if not isinstance(proof, bytes) or len(proof) != PROOF_SIZE:
            raise ArgumentError(
                f"{call}: proofs[{i}] must be {PROOF_SIZE} bytes (a content proof), got "
                f"{proof!r:.60}"
            )
    return list(proofs)


def _check_keys(keys: Any, call: str) -> list[bytes]:
    if isinstance(keys, bytes | str) or not isinstance(keys, Sequence):
        raise ArgumentError(f"{call}: keys must be a sequence of bytes, got {type(keys).__name__}")
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not key:
            raise ArgumentError(f"{call}: keys[{i}] must be non-empty bytes, got {key!r:.60}")
    return list(keys)


class StoreBase:
    """The shared half of an adapter; subclasses implement the four client calls."""

    backend: ClassVar[str] = "base"
    #: payload bytes per ``batch_get_into`` round trip when the config's
    #: ``max_get_batch_bytes`` is None (None: only ``max_batch_keys`` limits a round trip)
    default_get_batch_bytes: ClassVar[int | None] = None
    #: buffers (a header, then one per plane, per value) per ``_put_blocks`` call at most;
    #: None: only ``max_batch_keys`` limits a call
    max_put_parts: ClassVar[int | None] = None

    def __init__(self, config: StoreConfig, fingerprint: bytes) -> None:
        if not isinstance(config, StoreConfig):
            raise ArgumentError(f"config must be a StoreConfig, got {type(config).__name__}")
        if config.backend != self.backend:
            raise ArgumentError(
                f"config.backend must be {self.backend!r} for {type(self).__name__}, "
                f"got {config.backend!r}"
            )
        if not isinstance(fingerprint, bytes) or not fingerprint:
            raise ArgumentError(f"fingerprint must be non-empty bytes, got {fingerprint!r:.60}")
        self._config = config
        self._fingerprint = fingerprint
        self._lock = threading.Lock()
        self._buffers: dict[int, tuple[Span, Any]] = {}  # addr -> (span, the object kept alive)
        self._starts: list[int] = []  # the keys of _buffers, sorted (they never overlap)
        self._counts: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()
        self._last_error: str | None = None
        self._down_until = 0.0
        self._closed = False
        # the values put_async copies go into reused buffers (value_buffers: no page faults)
        self._values = ValueBuffers(config.max_inflight_put_bytes, self._values_dropped)
        self._queue: PutQueue[tuple[str, np.ndarray]] = PutQueue(
            config.max_inflight_puts,
            config.max_batch_keys,
            self._write_queued,
            name=f"kvforge-store-{self.backend}-put",
            bound_bytes=config.max_inflight_put_bytes,
            size=lambda item: item[1].nbytes,
        )

    # -- what an adapter implements ----------------------------------------------------------

    def _ready(self) -> bool:
        """Whether the client may be called now (set up); may start a new setup attempt."""
        return True

    def _exists(self, names: list[str]) -> list[bool]:
        raise NotImplementedError

    def _put(self, items: list[tuple[str, bytes, bytes, Span]]) -> list[bool]:
        """Write (name, key, proof, source) items: each value is the header, then the source."""
        raise NotImplementedError

    def _put_blocks(
        self, items: list[tuple[str, bytes, bytes, int]], planes: list[PlaneSpan]
    ) -> list[bool]:
        """Write (name, key, proof, block) items: each value is the header, then block ``block`` of
        every plane in order (:meth:`batch_put_blocks`)."""
        raise NotImplementedError

    def _write_encoded(self, items: list[tuple[str, np.ndarray]]) -> list[bool]:
        """Write (name, value) items, each value a whole encoded value (``uint8`` array)."""
        raise NotImplementedError

    def _get(self, items: list[tuple[str, bytes, bytes, Span]]) -> list[MissReason | None]:
        """Read (name, key, proof, destination) items; ``None`` where the value is a hit."""
        raise NotImplementedError

    def _remove(self, names: list[str]) -> int:
        """Delete the values ``names``; how many were there."""
        raise NotImplementedError

    def _values_dropped(self, values: list[np.ndarray]) -> None:
        """``put_async`` buffers that will not be reused (over the bound, or their write
        raised): an adapter that registered them with its client forgets them."""

    def _register_client(self, span: Span) -> None:
        """Tell the client about a host buffer (Mooncake registers it for zero-copy)."""

    def _unregister_client(self, span: Span) -> None:
        """Undo :meth:`_register_client`."""

    def _interrupt(self) -> None:
        """Break a client call stuck in another thread (close: the writer is stuck)."""

    def _close_client(self, writer_stuck: bool) -> None:
        raise NotImplementedError

    # -- shared state ------------------------------------------------------------------------

    def _note_error(self, message: str, *, trip: bool) -> None:
        """Count a client error; ``trip``: the server looks unreachable, back off."""
        with self._lock:
            self._counts["errors"] += 1
            self._last_error = message[:300]
            if trip:
                self._down_until = time.monotonic() + self._config.retry_after_s

    def _recovered(self) -> None:
        """The server answered a probe: end the back-off."""
        with self._lock:
            self._down_until = 0.0

    def _available(self) -> bool:
        with self._lock:
            if self._closed or time.monotonic() < self._down_until:
                return False
        return self._ready()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def _miss(self, reasons: Sequence[MissReason]) -> None:
        with self._lock:
            self._misses.update(r.value for r in reasons)

    def _within(self, addr: int, nbytes: int) -> Span | None:
        """The registered buffer holding ``nbytes`` at ``addr``, if one does (caller locks):
        buffers never overlap, so only the one starting last at or before ``addr`` can."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        base = self._buffers[self._starts[i]][0]
        return base if addr + nbytes <= base.addr + base.nbytes else None

    def _located(self, obj: Any, name: str, *, writable: bool) -> Span:
        span = span_of(obj, name, writable=writable)
        if span.nbytes == 0:
            raise ArgumentError(f"{name} must hold at least one byte, got an empty buffer")
        with self._lock:
            if self._within(span.addr, span.nbytes) is not None:
                return span
        raise ArgumentError(
            f"{name} ({span.nbytes} bytes at {span.addr:#x}) lies outside every registered "
            "buffer: register_buffer the host memory it is in first"
        )

    def _batches(self, n: int) -> list[range]:
        step = self._config.max_batch_keys
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    def _get_batches(self, spans: Sequence[Span]) -> list[range]:
        """The round trips of ``batch_get_into``: consecutive runs of ``spans`` of at most
        ``max_batch_keys`` values and at most ``max_get_batch_bytes`` of payload (a value
        larger than that is a round trip alone)."""
        most = self._config.max_batch_keys
        limit = self._config.max_get_batch_bytes or self.default_get_batch_bytes
        batches, start, size = [], 0, 0
        for i, span in enumerate(spans):
            full = i - start >= most or (limit is not None and size + span.nbytes > limit)
            if i > start and full:
                batches.append(range(start, i))
                start, size = i, 0
            size += span.nbytes
        if start < len(spans):
            batches.append(range(start, len(spans)))
        return batches

    def _name(self, key: bytes) -> str:
        return server_key(self._config.namespace, self._fingerprint, key)

    # -- the protocol ------------------------------------------------------------------------

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def fingerprint(self) -> bytes:
        return self._fingerprint

    def register_buffer(self, buf: Any) -> None:
        span = span_of(buf, "buf", writable=False)
        if span.nbytes == 0:
            raise ArgumentError("buf must hold at least one byte, got an empty buffer")
        with self._lock:
            if self._closed:
                raise ArgumentError("register_buffer: the store is closed")
            for other, _ in self._buffers.values():
                if span.addr < other.addr + other.nbytes and other.addr < span.addr + span.nbytes:
                    raise ArgumentError(
                        f"buf ({span.nbytes} bytes at {span.addr:#x}) overlaps a registered "
                        f"buffer ({other.nbytes} bytes at {other.addr:#x})"
                    )
            self._buffers[span.addr] = (span, buf)
            bisect.insort(self._starts, span.addr)
        self._register_client(span)

    def unregister_buffer(self, buf: Any) -> None:
        span = span_of(buf, "buf", writable=False)
        with self._lock:
            known = self._buffers.get(span.addr)
            if known is None or known[0].nbytes != span.nbytes:
                raise ArgumentError(
                    f"unregister_buffer: buf ({span.nbytes} bytes at {span.addr:#x}) was "
                    "never registered"
                )
            del self._buffers[span.addr]
            self._starts.remove(span.addr)
        self._unregister_client(known[0])

    def _registered(self) -> list[Span]:
        with self._lock:
            return [span for span, _ in self._buffers.values()]

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        keys = _check_keys(keys, "exists_prefix")
        if not keys or not self._available():
            return 0
        found = 0
        for part in self._batches(len(keys)):
            try:
                flags = self._exists([self._name(keys[i]) for i in part])
            except Exception as exc:
                self._note_error(f"exists: {type(exc).__name__}: {exc}", trip=True)
                return found
            for flag in flags:
                if not flag:
                    return found
                found += 1
        return found

    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete the values of ``keys`` (a value a reader found bad, so the next writer's put
        lands: Mooncake's put never overwrites); how many existed (0 on any error)."""
        keys = _check_keys(keys, "remove")
        if not keys or not self._available():
            return 0
        gone = 0
        for part in self._batches(len(keys)):
            try:
                gone += self._remove([self._name(keys[i]) for i in part])
            except Exception as exc:
                self._note_error(f"remove: {type(exc).__name__}: {exc}", trip=True)
                break
        self._count(removed=gone)
        return gone

    def _fits(self, span: Span) -> bool:
        return HEADER_SIZE + span.nbytes <= self._config.max_value_bytes

    def batch_put(
        self, keys: Sequence[bytes], sources: Sequence[Any], proofs: Sequence[bytes] | None = None
    ) -> list[bool]:
        keys = _check_keys(keys, "batch_put")
        spans = self._spans(keys, sources, "batch_put", "sources", writable=False)
        proved = _check_proofs(proofs, len(keys), "batch_put")
        done = [False] * len(keys)
        for part in self._batches(len(keys)):
            todo = [i for i in part if self._fits(spans[i])]
            self._count(puts_too_large=len(part) - len(todo))
            if not todo:
                continue
            items = [(self._name(keys[i]), keys[i], proved[i], spans[i]) for i in todo]
            self._put_part(todo, done, self._put, items)
        return done

    def _put_part(
        self,
        todo: Sequence[int],
        done: list[bool],
        put: Callable[[list[Any]], list[bool]],
        items: list[Any],
    ) -> None:
        """Run one round trip of puts (``put(items)`` writes the values ``todo``), record each
        in ``done`` and count them; a store that is down or backing off fails them unasked,
        and a client error fails them all and starts the back-off."""
        if not self._available():
            self._count(puts_failed=len(todo))
            return
        try:
            ok = put(items)
        except Exception as exc:
            self._note_error(f"put: {type(exc).__name__}: {exc}", trip=True)
            ok = [False] * len(todo)
        for i, flag in zip(todo, ok, strict=True):
            done[i] = bool(flag)
        wrote = sum(map(bool, ok))
        self._count(puts_ok=wrote, puts_failed=len(todo) - wrote)

    def batch_put_blocks(
        self,
        keys: Sequence[bytes],
        planes: Sequence[Any],
        block_ids: Any,
        proofs: Sequence[bytes] | None = None,
    ) -> list[bool]:
        keys = _check_keys(keys, "batch_put_blocks")
        spans = self._planes(planes, "batch_put_blocks")
        fewest = min(p.num_blocks for p in spans)
        ids = _check_block_ids(block_ids, len(keys), fewest, "batch_put_blocks")
        proved = _check_proofs(proofs, len(keys), "batch_put_blocks")
        done = [False] * len(keys)
        if HEADER_SIZE + sum(p.block_bytes for p in spans) > self._config.max_value_bytes:
            self._count(puts_too_large=len(keys))
            return done
        step = self._config.max_batch_keys
        if self.max_put_parts is not None:
            step = max(1, min(step, self.max_put_parts // (len(spans) + 1)))
        for start in range(0, len(keys), step):
            part = range(start, min(len(keys), start + step))
            items = [(self._name(keys[i]), keys[i], proved[i], int(ids[i])) for i in part]
            self._put_part(part, done, lambda batch: self._put_blocks(batch, spans), items)
        return done

    def _planes(self, planes: Any, call: str) -> list[PlaneSpan]:
        if isinstance(planes, bytes | str) or not isinstance(planes, Sequence):
            raise ArgumentError(
                f"{call}: planes must be a sequence of planes, got {type(planes).__name__}"
            )
        if len(planes) == 0:
            raise ArgumentError(f"{call}: planes must name at least one plane, got none")
        spans = []
        for i, plane in enumerate(planes):
            addr, block_bytes, stride, num_blocks = plane_layout(plane, f"planes[{i}]")
            extent = (num_blocks - 1) * stride + block_bytes
            with self._lock:
                within = self._within(addr, extent)
            if within is None:
                raise ArgumentError(
                    f"planes[{i}] ({extent} bytes at {addr:#x}) lies outside every registered "
                    "buffer: register_buffer the host memory it is in first"
                )
            spans.append(PlaneSpan(addr, block_bytes, stride, num_blocks, within))
        return spans

    def put_async(
        self, keys: Sequence[bytes], sources: Sequence[Any], proofs: Sequence[bytes] | None = None
    ) -> int:
        keys = _check_keys(keys, "put_async")
        spans = self._spans(keys, sources, "put_async", "sources", writable=False)
        proved = _check_proofs(proofs, len(keys), "put_async")
        if not self._available():
            self._count(puts_dropped=len(keys))
            return 0
        fitting = [i for i in range(len(keys)) if self._fits(spans[i])]
        self._count(puts_too_large=len(keys) - len(fitting))
        # encode one value at a time and stop at the bound, so a full queue costs one copy
        queued = 0
        for i in fitting:
            value = self._values.take(HEADER_SIZE + spans[i].nbytes)
            encode_into(value, keys[i], self._fingerprint, spans[i].view, proved[i])
            if self._queue.offer([(self._name(keys[i]), value)]) == 0:
                self._values.give(value)
                break
            queued += 1
        self._count(puts_dropped=len(fitting) - queued)
        return queued

    def _write_queued(self, items: list[tuple[str, np.ndarray]]) -> None:
        if not self._available():
            self._count(puts_failed=len(items))
            self._give_back(items)
            return
        try:
            ok = self._write_encoded(items)
        except Exception as exc:
            # not given back: a call abandoned on a timeout may still read them
            self._note_error(f"put: {type(exc).__name__}: {exc}", trip=True)
            self._values_dropped([value for _, value in items])
            ok = [False] * len(items)
        else:
            self._give_back(items)
        self._count(puts_ok=sum(map(bool, ok)), puts_failed=len(items) - sum(map(bool, ok)))

    def _give_back(self, items: list[tuple[str, np.ndarray]]) -> None:
        for _, value in items:
            self._values.give(value)

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        destinations: Sequence[Any],
        proofs: Sequence[bytes] | None = None,
    ) -> list[int | None]:
        keys = _check_keys(keys, "batch_get_into")
        spans = self._spans(keys, destinations, "batch_get_into", "destinations", writable=True)
        proved = _check_proofs(proofs, len(keys), "batch_get_into")
        reasons: list[MissReason | None] = [MissReason.UNAVAILABLE] * len(keys)
        for part in self._get_batches(spans):
            if not self._available():
                break
            try:
                got = self._get([(self._name(keys[i]), keys[i], proved[i], spans[i]) for i in part])
            except Exception as exc:
                self._note_error(f"get: {type(exc).__name__}: {exc}", trip=True)
                got = [MissReason.STORE_ERROR] * len(part)
            for i, reason in zip(part, got, strict=True):
                reasons[i] = reason
        self._miss([r for r in reasons if r is not None])
        self._count(gets_hit=sum(r is None for r in reasons))
        return [spans[i].nbytes if r is None else None for i, r in enumerate(reasons)]

    def _spans(
        self, keys: list[bytes], objs: Any, call: str, name: str, *, writable: bool
    ) -> list[Span]:
        if isinstance(objs, bytes | str) or not isinstance(objs, Sequence):
            raise ArgumentError(f"{call}: {name} must be a sequence, got {type(objs).__name__}")
        if len(objs) != len(keys):
            raise ArgumentError(f"{call}: {len(keys)} keys but {len(objs)} {name}")
        return [self._located(o, f"{name}[{i}]", writable=writable) for i, o in enumerate(objs)]

    def flush(self, timeout: float) -> bool:
        return self._queue.wait_idle(timeout)

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._available():
            if time.monotonic() >= deadline or self._closed:
                return False
            time.sleep(0.02)
        return True

    def stats(self) -> StoreStats:
        available = self._available()
        with self._lock:
            c = self._counts
            return StoreStats(
                backend=self.backend,
                puts_ok=c["puts_ok"],
                puts_failed=c["puts_failed"],
                puts_dropped=c["puts_dropped"],
                puts_too_large=c["puts_too_large"],
                gets_hit=c["gets_hit"],
                removed=c["removed"],
                misses=dict(self._misses),
                errors=c["errors"],
                last_error=self._last_error,
                inflight_puts=self._queue.inflight,
                peak_inflight_puts=self._queue.peak,
                inflight_put_bytes=self._queue.inflight_bytes,
                available=available,
                closed=self._closed,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        dropped = self._queue.close(self._config.close_timeout_s)
        if self._queue.writer_alive:
            self._interrupt()  # a write stuck on a dead socket: break it, then wait a little
            dropped += self._queue.close(min(1.0, self._config.close_timeout_s))
        self._count(puts_dropped=dropped)
        self._values.clear()  # no put_async after this: the buffers kept for reuse can go
        try:
            self._close_client(self._queue.writer_alive)
        except Exception as exc:
            self._note_error(f"close: {type(exc).__name__}: {exc}", trip=False)

    def __enter__(self) -> StoreBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(namespace={self._config.namespace!r}, "
            f"layout={layout_digest(self._fingerprint)[:8].hex()}, closed={self._closed})"
        )
