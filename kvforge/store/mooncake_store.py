"""The Mooncake Store adapter of the remote tier: zero-copy batch puts from and gets into
registered host memory (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``),
the 80-byte header in a small registered arena of the adapter's own, the payload in place.

Invariants: every client call runs on one daemon thread of the store's own, in order, so setup
(which retries for about 90 s when no master answers) and a stuck call never block the caller
past ``op_timeout_s`` for existence checks and puts; while a call is stuck, later calls are
misses at once; no job calls the client once it is closed (a call into a closed client
crashes the process: a call queued before ``close`` fails instead). A get is never abandoned
(it writes into the caller's pages; a late write into a reused page would be wrong host
state): it waits for Mooncake's own RPC timeout instead.
``mooncake`` is imported when a store is built, so ``kvforge.store`` imports without it.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import numpy as np

from kvforge.store.base import PlaneSpan, Span, StoreBase
from kvforge.store.config import StoreConfig
from kvforge.store.servers import wait_for_port
from kvforge.store.value import (
    HEADER_SIZE,
    MissReason,
    check,
    decode,
    encode_header,
    encode_header_of_parts,
)

__all__ = ["MooncakeStore"]

_T = TypeVar("_T")

#: Mooncake's error codes this adapter tells apart (mooncake-store ``types.h``)
OK = 0
NO_AVAILABLE_HANDLE = -200  # the store is full
INVALID_PARAMS = -600  # e.g. a destination smaller than the value
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800  # e.g. buffers whose sizes do not add up to the value's
RPC_FAIL_FIRST, RPC_FAIL_LAST = -999, -900  # the master did not answer
RPC_TIMEOUT = -901  # ... because it hung (a master that is down gives -900 at once)


class _Busy(RuntimeError):
    """A call is stuck on the client thread: do not queue behind it."""


class _CallThread:
    """One daemon thread that runs the client's calls in order (the client's only caller)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._stuck: Future[Any] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        future: Future[_T] = Future()
        self._jobs.put((future, fn))
        return future

    @property
    def stuck(self) -> bool:
        return self._stuck is not None and not self._stuck.done()

    def call(self, fn: Callable[[], _T], timeout: float | None) -> _T:
        """``fn()`` on the thread; :class:`TimeoutError` after ``timeout`` seconds (the call
        goes on, and later calls raise :class:`_Busy` until it returns)."""
        if self.stuck:
            raise _Busy("a previous client call has not returned")
        future = self.submit(fn)
        try:
            return future.result(timeout)
        except FutureTimeout:
            if not future.cancel():
                self._stuck = future
            raise TimeoutError(f"the Mooncake client did not answer within {timeout}s") from None

    def stop(self, timeout: float) -> bool:
        """Ask the thread to end after its queued calls; whether it ended within ``timeout``."""
        self._jobs.put(None)
        return self.join(timeout)

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


#: client threads still closing their client after ``close()`` returned (a frozen master)
_CLOSING: set[_CallThread] = set()
#: seconds the interpreter's exit waits for them in all: a client thread still inside Mooncake
#: when the process tears down Mooncake's globals aborts the process (std::terminate)
EXIT_WAIT_S = 15.0


@atexit.register
def _wait_for_closing() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for calls in list(_CLOSING):
        calls.join(max(0.0, deadline - time.monotonic()))


class MooncakeStore(StoreBase):
    """A :class:`kvforge.store.protocol.RemoteStore` on a Mooncake Store cluster.

    The client lends ``mooncake_global_segment_bytes`` of its memory to the cluster (0: lend
    nothing, only use others') and reaches the master at ``mooncake_master``. Setup runs in the
    background; :meth:`wait_ready` waits for it. Puts of a key that exists keep the existing
    value (Mooncake's ``put`` does not overwrite).
    """

    backend = "mooncake"
    #: Mooncake's TCP transport queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``
    #: (default 1024) buffers per peer and fails the rest of a call (``TRANSFER_FAIL``): a
    #: ``batch_put_blocks`` of 32 values of 65 buffers did, so its calls stay under that
    max_put_parts = 1024

    def __init__(self, config: StoreConfig, fingerprint: bytes) -> None:
        super().__init__(config, fingerprint)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ModuleNotFoundError as exc:  # pragma: no cover - the extra is installed in CI
            raise ModuleNotFoundError(
                "the Mooncake tier needs Mooncake Store's client: pip install 'kvforge[mooncake]' "
                "(and apt-get install libibverbs1 ibverbs-providers)"
            ) from exc
        # the TCP transport binds where this says (else it picks an interface of its own)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.mooncake_local_hostname)
        self._client = MooncakeDistributedStore()
        self._calls = _CallThread(f"kvforge-store-mooncake-{id(self):x}")
        # headers of one batch: slots [0, max_batch) for puts, [max_batch, 2 max_batch) for gets
        self._arena = np.zeros(2 * config.max_batch_keys * HEADER_SIZE, dtype=np.uint8)
        self._arena_addr = int(self._arena.ctypes.data)
        self._setup_lock = threading.Lock()  # guards _setup and _setup_ok
        self._setup: Future[int] | None = None
        self._setup_ok = False
        # put_async's value buffers registered with the client, by address (kept alive here
        # until unregistered), and whether the client is closed: both touched only on the
        # client's thread (a call into a closed client crashes the process)
        self._value_regs: dict[int, np.ndarray] = {}
        self._client_closed = False
        self._start_setup()

    # -- setup --------------------------------------------------------------------------------

    def _start_setup(self) -> None:
        with self._setup_lock:
            self._setup = self._calls.submit(self._do_setup)

    def _do_setup(self) -> int:
        c = self._config
        host, port = c.mooncake_master.rsplit(":", 1)
        # Mooncake's setup holds the GIL while it retries an absent master (about 90 s here):
        # the whole process would stop, so it is called only once the master's port answers
        if not wait_for_port(host, int(port), c.connect_timeout_s):
            self._note_error(f"setup: no master answers at {c.mooncake_master}", trip=True)
            return -1
        rc = self._client.setup(
            c.mooncake_local_hostname,
            c.mooncake_metadata_server,
            c.mooncake_global_segment_bytes,
            c.mooncake_local_buffer_bytes,
            c.mooncake_protocol,
            c.mooncake_rdma_devices,
            c.mooncake_master,
        )
        if rc != OK:
            self._note_error(f"setup returned {rc} (master {c.mooncake_master})", trip=True)
            return int(rc)
        for addr, size in [(self._arena_addr, self._arena.nbytes)] + [
            (s.addr, s.nbytes) for s in self._registered()
        ]:
            reg = self._client.register_buffer(addr, size)
            if reg != OK:
                self._note_error(f"register_buffer({size} bytes) returned {reg}", trip=False)
        with self._setup_lock:
            self._setup_ok = True
        return OK

    def _ready(self) -> bool:
        with self._setup_lock:
            if self._setup_ok:
                return True
            pending = self._setup is not None and not self._setup.done()
        if pending or self._closed:
            return False
        # the last setup failed and the back-off is over (``_available`` checked it): try again
        self._start_setup()
        return False

    # -- client calls -------------------------------------------------------------------------

    def _call(self, fn: Callable[[], _T], *, abandon: bool = True) -> _T:
        def guarded() -> _T:
            if self._client_closed:  # a call queued before close() reached the thread after it
                raise RuntimeError("the Mooncake client is closed")
            return fn()

        return self._calls.call(guarded, self._config.op_timeout_s if abandon else None)

    def _trip_on(self, codes: list[int], what: str) -> None:
        bad = [c for c in codes if RPC_FAIL_FIRST <= c <= RPC_FAIL_LAST or c == -1]
        if bad:
            self._note_error(f"{what}: the master did not answer (code {bad[0]})", trip=True)

    @property
    def raw_client(self) -> Any:
        """The ``MooncakeDistributedStore`` client this store talks through, for a benchmark's
        baseline (``kvforge bench --tiers`` times it on the same values). A call on it bypasses
        the store: no header, checksum, counter, call thread or back-off, and its errors and
        return codes reach the caller."""
        return self._client

    def _register_client(self, span: Span) -> None:
        if not self._ready():
            return  # setup registers every buffer it finds
        try:
            rc = self._call(lambda: self._client.register_buffer(span.addr, span.nbytes))
        except Exception as exc:
            rc = f"{type(exc).__name__}: {exc}"
        if rc != OK:
            self._note_error(f"register_buffer({span.nbytes} bytes) returned {rc}", trip=False)

    def _unregister_client(self, span: Span) -> None:
        if not self._ready():
            return
        try:
            self._call(lambda: self._client.unregister_buffer(span.addr))
        except Exception as exc:
            self._note_error(f"unregister_buffer: {type(exc).__name__}: {exc}", trip=False)

    def _exists(self, names: list[str]) -> list[bool]:
        codes = list(self._call(lambda: self._client.batch_is_exist(names)))
        self._trip_on(codes, "exists")
        return [code == 1 for code in codes]

    def _remove(self, names: list[str]) -> int:
        # force: a reader's get leases the value for ``default_kv_lease_ttl``, and a value
        # found bad is removed right after that read (else remove answers -706, leased)
        codes = list(self._call(lambda: [self._client.remove(n, True) for n in names]))
        self._trip_on(codes, "remove")
        return sum(code == OK for code in codes)

    def _put(self, items: list[tuple[str, bytes, bytes, Span]]) -> list[bool]:
        def job() -> list[int]:
            ptrs, sizes = [], []
            for slot, (_, key, proof, span) in enumerate(items):
                at = slot * HEADER_SIZE
                self._arena[at : at + HEADER_SIZE] = np.frombuffer(
                    encode_header(key, self._fingerprint, span.view, proof), dtype=np.uint8
                )
                ptrs.append([self._arena_addr + at, span.addr])
                sizes.append([HEADER_SIZE, span.nbytes])
            names = [name for name, _, _, _ in items]
            return list(self._client.batch_put_from_multi_buffers(names, ptrs, sizes))

        return self._put_codes(self._call(job))

    def _put_blocks(
        self, items: list[tuple[str, bytes, bytes, int]], planes: list[PlaneSpan]
    ) -> list[bool]:
        addrs = np.array([p.addr for p in planes], dtype=np.int64)
        strides = np.array([p.block_stride for p in planes], dtype=np.int64)
        sizes = [HEADER_SIZE, *(p.block_bytes for p in planes)]

        def job() -> list[int]:
            blocks = np.array([block for _, _, _, block in items], dtype=np.int64)
            starts = (addrs[None, :] + blocks[:, None] * strides[None, :]).tolist()
            ptrs = []
            for slot, (_, key, proof, block) in enumerate(items):
                at = slot * HEADER_SIZE
                parts = [plane.view(block) for plane in planes]
                self._arena[at : at + HEADER_SIZE] = np.frombuffer(
                    encode_header_of_parts(key, self._fingerprint, parts, proof), dtype=np.uint8
                )
                ptrs.append([self._arena_addr + at, *starts[slot]])
            names = [name for name, _, _, _ in items]
            return list(
                self._client.batch_put_from_multi_buffers(names, ptrs, [sizes] * len(items))
            )

        return self._put_codes(self._call(job))

    def _put_codes(self, codes: list[int]) -> list[bool]:
        self._trip_on(codes, "put")
        refused = [c for c in codes if c != OK]
        if refused and not any(RPC_FAIL_FIRST <= c <= RPC_FAIL_LAST for c in refused):
            full = " (the store is full)" if NO_AVAILABLE_HANDLE in refused else ""
            self._note_error(f"put refused: code {refused[0]}{full}", trip=False)
        return [c == OK for c in codes]

    def _write_encoded(self, items: list[tuple[str, np.ndarray]]) -> list[bool]:
        """One ``batch_put_from`` straight out of the value buffers (each registered with the
        client once, on first use): ``put`` per value cost a call each, 56 against 44 ms for
        64 values of DeepSeek-V4-Flash here. A buffer the client refuses to register is put
        with ``put`` (a copy)."""

        def job() -> list[int]:
            registered = [self._value_registered(value) for _, value in items]
            direct = [i for i, ok in enumerate(registered) if ok]
            codes = [OK] * len(items)
            if direct:
                names = [items[i][0] for i in direct]
                addrs = [int(items[i][1].ctypes.data) for i in direct]
                sizes = [items[i][1].nbytes for i in direct]
                got = list(self._client.batch_put_from(names, addrs, sizes))
                for i, code in zip(direct, got, strict=True):
                    codes[i] = int(code)
            for i, ((name, value), ok) in enumerate(zip(items, registered, strict=True)):
                if not ok:
                    codes[i] = int(self._client.put(name, memoryview(value)))
            return codes

        return self._put_codes(self._call(job))

    def _value_registered(self, value: np.ndarray) -> bool:
        """Whether ``value`` is registered with the client, registering it now if not (on the
        client's thread)."""
        addr = int(value.ctypes.data)
        if addr in self._value_regs:
            return True
        rc = self._client.register_buffer(addr, value.nbytes)
        if rc != OK:
            self._note_error(f"register_buffer({value.nbytes} bytes) returned {rc}", trip=False)
            return False
        self._value_regs[addr] = value
        return True

    def _values_dropped(self, values: list[np.ndarray]) -> None:
        if self._closed:  # the client is closing, and closing forgets every registration
            return

        def job() -> None:  # after any call still reading them: the client runs calls in order
            for value in values:
                addr = int(value.ctypes.data)
                if self._value_regs.get(addr) is value and not self._client_closed:
                    del self._value_regs[addr]
                    self._client.unregister_buffer(addr)

        self._calls.submit(job)

    def _close_on_thread(self) -> None:
        """Close the client (on its thread); later jobs see it closed and call nothing."""
        self._client.close()
        self._client_closed = True
        self._value_regs.clear()

    def _get(self, items: list[tuple[str, bytes, bytes, Span]]) -> list[MissReason | None]:
        base = self._config.max_batch_keys

        def job() -> list[MissReason | None]:
            ptrs, sizes = [], []
            for slot, (_, _, _, span) in enumerate(items):
                ptrs.append([self._arena_addr + (base + slot) * HEADER_SIZE, span.addr])
                sizes.append([HEADER_SIZE, span.nbytes])
            names = [name for name, _, _, _ in items]
            codes = list(self._client.batch_get_into_multi_buffers(names, ptrs, sizes))
            self._trip_on(codes, "get")
            reasons: list[MissReason | None] = []
            for slot, (item, code) in enumerate(zip(items, codes, strict=True)):
                _, key, proof, span = item
                at = (base + slot) * HEADER_SIZE
                if code == HEADER_SIZE + span.nbytes:
                    header = self._arena[at : at + HEADER_SIZE]
                    reasons.append(check(header, span.view, key, self._fingerprint, proof))
                elif code == OBJECT_NOT_FOUND:
                    reasons.append(MissReason.ABSENT)
                elif code in (INVALID_PARAMS, TRANSFER_FAIL):
                    reasons.append(self._why_other_size(item))
                else:
                    reasons.append(MissReason.STORE_ERROR)
            return reasons

        # never abandoned: it writes into the caller's pages (module docstring)
        return self._call(job, abandon=False)

    def _why_other_size(self, item: tuple[str, bytes, bytes, Span]) -> MissReason:
        """A value whose size is not the header plus the destination: read whole (a value of
        at most ``max_value_bytes``) and decoded, so an old-format value is counted as one;
        else shorter is truncated."""
        name, key, proof, span = item
        wanted = HEADER_SIZE + span.nbytes
        size = int(self._client.get_size(name))
        if size < 0:
            return MissReason.ABSENT if size == OBJECT_NOT_FOUND else MissReason.STORE_ERROR
        if size <= self._config.max_value_bytes:
            blob = self._client.get(name)
            if isinstance(blob, bytes | bytearray | memoryview) and len(blob) == size:
                reason = decode(
                    blob, key, self._fingerprint, expected_length=span.nbytes, proof=proof
                )
                if isinstance(reason, MissReason):
                    return reason
        return MissReason.TRUNCATED if size < wanted else MissReason.OTHER_LENGTH

    # -- close --------------------------------------------------------------------------------

    def _closes_quickly(self, timeout: float | None) -> bool:
        """Whether ``close`` would be quick now: the master's port refuses connections (it is
        down), or a probe came back within ``timeout`` without an RPC timeout (it answers).
        A frozen master accepts connections but lets the probe time out."""
        host, port = self._config.mooncake_master.rsplit(":", 1)
        if not wait_for_port(host, int(port), 0.0):
            return True
        codes = self._calls.call(lambda: self._client.batch_is_exist(["-"]), timeout)
        return RPC_TIMEOUT not in codes

    def _close_client(self, writer_stuck: bool) -> None:
        """Close the client now if its master answers or is down; else close it later.

        Mooncake's ``close`` holds the GIL while it waits for the master (65 s with a frozen
        master here, a few seconds with a master that is down), stopping every thread of the
        process meanwhile. So it is called now only when it is quick (:meth:`_closes_quickly`
        within ``close_timeout_s``); else the client's own thread closes it once it would be,
        and this returns at once (:meth:`wait_closed` waits for that)."""
        limit = max(self._config.close_timeout_s, 0.1)
        with self._setup_lock:
            set_up = self._setup_ok
        if set_up:
            quick = False
            if not self._calls.stuck:
                try:
                    quick = self._closes_quickly(limit)
                except Exception as exc:
                    self._note_error(f"close: {type(exc).__name__}: {exc}", trip=False)
            if quick:
                self._calls.call(self._close_on_thread, None)
            else:
                self._note_error("close: the master did not answer; closing later", trip=False)
                self._calls.submit(self._close_when_quick)
                _CLOSING.add(self._calls)
        # the thread ends after its queued calls; one still inside a call is a daemon
        self._calls.stop(0.1 if self._calls.stuck or not set_up else limit)

    def wait_closed(self, timeout: float) -> bool:
        """After :meth:`close`: wait up to ``timeout`` seconds for the client to be closed
        (it may close later than ``close()`` returns, see there); whether it is."""
        if not self._closed:
            return False
        done = self._calls.join(timeout)
        if done:
            _CLOSING.discard(self._calls)
        return done

    def _close_when_quick(self) -> None:
        """On the client's thread, after ``close()`` returned: wait until closing is quick
        (each probe waits up to Mooncake's RPC timeout), then close the client."""
        host, port = self._config.mooncake_master.rsplit(":", 1)
        while wait_for_port(host, int(port), 0.0):
            if RPC_TIMEOUT not in self._client.batch_is_exist(["-"]):
                break
        self._close_on_thread()

    def _available(self) -> bool:
        return super()._available() and not self._calls.stuck
