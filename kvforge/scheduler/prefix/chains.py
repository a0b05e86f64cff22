"""The key chains of the requests the prefix cache registers blocks for.

Per request, :class:`RequestChains` keeps the key chain of its tokens so far (a
:class:`~kvforge.core.prefix_keys.PrefixHasher`, extended by :mod:`.commit` as steps complete
blocks), the cursor on the last unit record its chain holds (one reference, released when the
chain ends), and under ``prefix_retention="checkpoints"`` the boundaries whose tails it keeps
(:func:`~.retention.checkpoints_of`).

Invariants (``tests/scheduler/test_exact_prefix.py``, ``tests/scheduler/test_unit_records.py``
and the prefix property test): a request holds at most one cursor, and :meth:`RequestChains.end`
releases it; once a request's chain is dropped (finished, refused, truncated, or its chain named
other content) none of its later blocks is registered.
"""

from __future__ import annotations

from kvforge.core.prefix_keys import PrefixHasher
from kvforge.scheduler.unit_records import UnitRecordStore

__all__ = ["RequestChains"]


class RequestChains:
    """Request -> key chain, held record cursor and kept checkpoints.

    Args:
        records: the unit records the cursors hold references on.
    """

    def __init__(self, records: UnitRecordStore) -> None:
        self._records = records
        self._hashers: dict[str, PrefixHasher] = {}  # request -> key chain of its tokens
        self._cursors: dict[str, bytes] = {}  # request -> its held chain's last record
        # under "checkpoints": request -> the boundaries whose tails it keeps (replay boundary,
        # junction); a request without an entry (scheduled without a match) keeps them densely
        self._keep: dict[str, tuple[int, ...]] = {}

    def hasher(self, request_id: str) -> PrefixHasher | None:
        """The key chain of ``request_id``, or ``None`` (its blocks are not registered)."""
        return self._hashers.get(request_id)

    def start(self, request_id: str, hasher: PrefixHasher) -> None:
        """Register the blocks of ``request_id`` from now on, chaining keys on ``hasher``."""
        self._hashers[request_id] = hasher

    def stop(self, request_id: str) -> None:
        """Stop registering the blocks of ``request_id`` (its cursor and checkpoints stay)."""
        self._hashers.pop(request_id, None)

    def keep(self, request_id: str, boundaries: tuple[int, ...]) -> None:
        """The boundaries whose tails ``request_id`` keeps under ``"checkpoints"``."""
        self._keep[request_id] = boundaries

    def kept(self, request_id: str) -> tuple[int, ...] | None:
        """The boundaries :meth:`keep` set for ``request_id`` (``None``: every boundary)."""
        return self._keep.get(request_id)

    def hold(self, request_id: str, cursor: bytes) -> None:
        """``request_id``'s chain now holds ``cursor`` (one reference, its own)."""
        self._cursors[request_id] = cursor

    def take_cursor(self, request_id: str) -> bytes | None:
        """The cursor ``request_id`` holds, handed to the caller with its reference."""
        return self._cursors.pop(request_id, None)

    def end(self, request_id: str) -> None:
        """Stop registering the blocks of ``request_id`` (finished, refused, or truncated)
        and let go of the records its chain held."""
        self._hashers.pop(request_id, None)
        self._keep.pop(request_id, None)
        cursor = self._cursors.pop(request_id, None)
        if cursor is not None:
            self._records.release(cursor)

    @property
    def tracking(self) -> bool:
        """Whether some request has a key chain or holds records."""
        return bool(self._hashers or self._cursors or self._keep)
