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
kept never exceed ``keep_bytes`` in all; a buffer that would pass it is dropped.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import numpy as np

__all__ = ["ValueBuffers"]


class ValueBuffers:
    """Free ``uint8`` buffers by exact size, at most ``keep_bytes`` of them kept; ``on_drop``
    hears of each buffer given back but not kept.

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
                return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Keep ``buf`` for a later :meth:`take` of its size, unless that would pass
        ``keep_bytes``: then it is dropped, and ``on_drop([buf])`` called."""
        with self._lock:
            if self._free_bytes + buf.nbytes <= self._keep_bytes:
                self._free[buf.nbytes].append(buf)
                self._free_bytes += buf.nbytes
                return
        if self._on_drop is not None:  # e.g. a store forgets its registration of ``buf``
            self._on_drop([buf])
