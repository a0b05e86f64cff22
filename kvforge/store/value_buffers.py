"""Reused buffers for the values ``put_async`` copies and queues (header, then payload).

A value copied into freshly allocated memory pays a page fault per 4 KiB on its first touch:
encoding 64 MiB of 2 MiB values into new ``bytes`` took 36 ms on the 2-core VM of
``docs/performance.md``, the same copy into buffers touched before 6 ms. So a store keeps the
buffers its writer is done with, by exact size (a layout has a few page sizes), and the next
``put_async`` copies into one of them.

Invariants: a buffer is handed out by :meth:`ValueBuffers.take` to one value at a time and
comes back through :meth:`ValueBuffers.give` only once no client call can still read it (the
store gives back a batch's buffers only after its write returned: a call abandoned on a
timeout may still read them, so those are left to the garbage collector). The free buffers
kept never exceed ``keep_bytes`` in all: to keep a buffer, free buffers of other sizes go
first, then the buffer itself.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import numpy as np

__all__ = ["ValueBuffers"]


class ValueBuffers:
    """Free ``uint8`` buffers by exact size, at most ``keep_bytes`` of them kept; ``on_drop``
    hears of each buffer let go.

    >>> pool = ValueBuffers(keep_bytes=1 << 20)
    >>> a = pool.take(4096)
    >>> pool.give(a)
    >>> pool.take(4096) is a, pool.free_bytes
    (True, 0)
    """

    def __init__(
        self, keep_bytes: int, on_drop: Callable[[list[np.ndarray]], None] | None = None
    ) -> None:
        self._keep_bytes = int(keep_bytes)
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._free: defaultdict[int, list[np.ndarray]] = defaultdict(list)  # guarded by _lock
        self._free_bytes = 0  # guarded by _lock

    @property
    def free_bytes(self) -> int:
        """The bytes of the buffers kept for reuse now."""
        with self._lock:
            return self._free_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """A 1-D ``uint8`` buffer of ``nbytes`` bytes (contents unspecified): one given back
        before, else a new one."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._free_bytes -= nbytes
                buf = free.pop()
                if not free:
                    del self._free[nbytes]
                return buf
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Keep ``buf`` for a later :meth:`take` of its size. Where that would pass
        ``keep_bytes``, free buffers of other sizes are let go first, the sizes kept longest
        first (a size no longer written must not hold the room for good); if it still does
        not fit, or is alone larger than ``keep_bytes``, ``buf`` itself goes. ``on_drop``
        hears of every buffer let go."""
        dropped: list[np.ndarray] = []
        with self._lock:
            for size in list(self._free):  # sizes in the order their lists were started
                if buf.nbytes > self._keep_bytes or (
                    self._free_bytes + buf.nbytes <= self._keep_bytes
                ):
                    break
                if size != buf.nbytes:
                    gone = self._free.pop(size)
                    self._free_bytes -= size * len(gone)
                    dropped += gone
            if self._free_bytes + buf.nbytes <= self._keep_bytes:
                self._free[buf.nbytes].append(buf)
                self._free_bytes += buf.nbytes
            else:
                dropped.append(buf)
        if dropped and self._on_drop is not None:  # e.g. a store forgets their registrations
            self._on_drop(dropped)

    def clear(self) -> None:
        """Let every free buffer go (the store is closing; ``on_drop`` is not called)."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
