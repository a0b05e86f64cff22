"""A bounded put queue with one daemon writer thread: the back-pressure of ``put_async``.

Invariant: the values queued plus the values the writer holds never exceed ``bound`` values
nor ``bound_bytes`` bytes (one value alone may be larger: it is taken when nothing else is in
flight, so no value is refused for its size alone); an offer beyond that is refused at once
(the caller counts it as dropped), so the engine's step never waits for a slow store and the
memory held for puts is bounded. The writer
is a daemon thread woken by a condition, so :meth:`PutQueue.close` returns after its timeout
even while a write is stuck in a client call (the deadlock LMCache's Redis backend has on close).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["PutQueue"]

_T = TypeVar("_T")


class PutQueue(Generic[_T]):
    """Items go in through :meth:`offer`; the writer hands up to ``batch`` of them at a time
    to ``write`` (which must not raise: it is given the batch and counts its own failures).
    ``size`` gives an item's bytes for ``bound_bytes`` (default: no byte bound)."""

    def __init__(
        self,
        bound: int,
        batch: int,
        write: Callable[[list[_T]], None],
        name: str,
        bound_bytes: int | None = None,
        size: Callable[[_T], int] | None = None,
    ) -> None:
        self._bound, self._batch, self._write, self._name = bound, batch, write, name
        self._bound_bytes = bound_bytes
        self._size = size if size is not None else (lambda _item: 0)
        self._cond = threading.Condition()
        self._items: deque[tuple[_T, int]] = deque()  # (item, bytes); guarded by _cond
        self._inflight = 0  # queued + held by the writer; guarded by _cond
        self._inflight_bytes = 0  # their bytes; guarded by _cond
        self._peak = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def inflight(self) -> int:
        with self._cond:
            return self._inflight

    @property
    def inflight_bytes(self) -> int:
        with self._cond:
            return self._inflight_bytes

    @property
    def peak(self) -> int:
        with self._cond:
            return self._peak

    @property
    def writer_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def offer(self, items: Sequence[_T]) -> int:
        """Queue as many of ``items`` as the bound leaves room for, in order; returns how many."""
        with self._cond:
            if self._stopping:
                return 0
            taken = 0
            for item in items:
                nbytes = self._size(item)
                if self._inflight >= self._bound or (
                    self._bound_bytes is not None
                    and self._inflight
                    and self._inflight_bytes + nbytes > self._bound_bytes
                ):
                    break
                self._items.append((item, nbytes))
                self._inflight += 1
                self._inflight_bytes += nbytes
                taken += 1
            if not taken:
                return 0
            self._peak = max(self._peak, self._inflight)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
            return taken

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._stopping:
                    self._cond.wait()
                if not self._items:
                    return  # stopping and drained
                n = min(self._batch, len(self._items))
                held = [self._items.popleft() for _ in range(n)]
            try:
                self._write([item for item, _ in held])
            except Exception:  # write counts its own failures; the writer must live on
                pass
            finally:
                with self._cond:
                    self._inflight -= len(held)
                    self._inflight_bytes -= sum(nbytes for _, nbytes in held)
                    self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until nothing is queued or being written."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float) -> int:
        """Refuse new items, let the writer drain for up to ``timeout`` seconds, then drop
        what is still queued; returns how many were dropped. Never waits longer: a writer stuck
        in a call is left behind (it is a daemon thread and holds only its own copies)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            dropped = len(self._items)
            self._inflight_bytes -= sum(nbytes for _, nbytes in self._items)
            self._items.clear()
            self._inflight -= dropped
            self._cond.notify_all()
            return dropped
