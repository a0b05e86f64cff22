"""The remote tier's store protocol: what kvforge asks of a distributed KV store (Mooncake Store,
Redis), and the counters every adapter keeps.

Invariants every adapter keeps: a call never raises for anything the server or the network
does (down, slow, restarting, full, corrupted values): that is a miss or a failed put, counted
in :class:`StoreStats`; only a malformed argument raises (``kvforge._checks.ArgumentError``).
A hit's bytes are exactly the bytes put under that key and layout with that content proof
(``kvforge.store.value``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["RemoteStore", "StoreStats"]


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of one store's counters (:meth:`RemoteStore.stats`)."""

    backend: str
    #: values written (sync puts and queued puts alike)
    puts_ok: int = 0
    #: values the server or client refused or lost (down, slow, full, restarting)
    puts_failed: int = 0
    #: ``put_async`` values not queued: the queue held ``max_inflight_puts`` values or would
    #: pass ``max_inflight_put_bytes`` with this one, or the store was closed or backing off;
    #: or queued values ``close()`` had no time to write
    puts_dropped: int = 0
    #: values over ``max_value_bytes``, never sent
    puts_too_large: int = 0
    gets_hit: int = 0
    #: values :meth:`RemoteStore.remove` deleted (found bad by a reader)
    removed: int = 0
    #: misses by :class:`kvforge.store.value.MissReason` value
    misses: dict[str, int] = field(default_factory=dict)
    #: client errors (each also counted as a miss or a failed put)
    errors: int = 0
    last_error: str | None = None
    #: values queued or being written by ``put_async`` now, and at most so far
    inflight_puts: int = 0
    peak_inflight_puts: int = 0
    #: bytes of the values queued or being written now
    inflight_put_bytes: int = 0
    #: whether the client is set up and not backing off after an error
    available: bool = False
    closed: bool = False

    @property
    def gets_missed(self) -> int:
        return sum(self.misses.values())


@runtime_checkable
class RemoteStore(Protocol):
    """A remote tier for prefix blocks, keyed by prefix keys, values in kvforge's format.

    Sources and destinations are contiguous byte ranges (``memoryview`` slices, numpy uint8
    arrays or CPU ``torch.uint8`` tensors) inside buffers given to :meth:`register_buffer`,
    so a store that reads host memory directly (Mooncake) needs no copy. A destination's
    length is the payload length expected: a value of another length is a miss.

    ``proofs`` (every put and get): one content proof per key, :data:`~kvforge.store.value.
    PROOF_SIZE` bytes (the remote tier's SHA-256 chain over the block's tokens and extra keys,
    ``docs/tiered_store.md``). A value is read only by a get whose proof equals the one it
    was put with (else :attr:`~kvforge.store.value.MissReason.OTHER_CONTENT`); ``None``
    writes and expects :data:`~kvforge.store.value.NO_PROOF`.
    """

    def register_buffer(self, buf: Any) -> None:
        """Make ``buf`` (host memory the caller keeps alive) usable as a source or a
        destination; a buffer overlapping one already registered is refused."""

    def unregister_buffer(self, buf: Any) -> None:
        """Forget a buffer given to :meth:`register_buffer` (the same object or an equal
        span); an unknown one is refused."""

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the store holds (0 on any error). A hint: a value that
        exists may still be a miss when read (corrupted, evicted meanwhile)."""

    def batch_put(
        self, keys: Sequence[bytes], sources: Sequence[Any], proofs: Sequence[bytes] | None = None
    ) -> list[bool]:
        """Write ``sources[i]`` under ``keys[i]`` now; ``True`` where the store took it."""

    def batch_put_blocks(
        self,
        keys: Sequence[bytes],
        planes: Sequence[Any],
        block_ids: Any,
        proofs: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Write block ``block_ids[i]`` of every plane, in plane order, under ``keys[i]`` now,
        straight from the planes: no packed page first. A plane is a 2-D ``uint8`` CPU tensor
        or numpy array ``[num_blocks, block_bytes]`` with strides ``(block_stride, 1)``
        (padding past ``block_bytes`` is never read), lying inside a registered buffer. The
        value is byte for byte the one :meth:`batch_put` writes from the host page that packs
        the same blocks, so :meth:`batch_get_into` reads it into a page. ``True`` where the
        store took it."""

    def put_async(
        self, keys: Sequence[bytes], sources: Sequence[Any], proofs: Sequence[bytes] | None = None
    ) -> int:
        """Copy the values and queue them for a background writer; returns how many were
        queued (the rest are dropped and counted: the queue is bounded). The sources may be
        reused as soon as this returns."""

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        destinations: Sequence[Any],
        proofs: Sequence[bytes] | None = None,
    ) -> list[int | None]:
        """Read ``keys[i]``'s payload into ``destinations[i]``: its byte count on a hit,
        ``None`` on a miss. After a miss the destination's bytes are unspecified."""

    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete the values of ``keys`` (one a reader found bad: the next put then lands,
        whether the server keeps the first writer's value or the last's); how many existed
        (0 on any error)."""

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for queued puts; ``True`` if none is left."""

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the client to reach its server."""

    def stats(self) -> StoreStats: ...

    def close(self) -> None:
        """Stop the writer and the client. Returns within about ``close_timeout_s`` plus
        ``op_timeout_s`` whatever the server does; queued puts left then are dropped."""
