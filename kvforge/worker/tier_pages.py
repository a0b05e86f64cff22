"""The prefix cache's host tier pages of one worker, and the copies to and from them.

``CacheController.initialize_host_tier`` creates one; ``CacheStorage.apply`` runs a step's
``offloads`` and ``onloads`` through it (found by :func:`kvforge.worker.guard.tier_of`):
offloads first, then the onloads of blocks a lookup brought back, before the step's kernels.

:class:`HostTierPages` holds, per group, page-first pinned host pages in the swap pages'
format (:class:`~kvforge.worker.host_pool.HostPools`: one block of every offloaded (layer,
role), packed, unpadded), but a pool of their own: the scheduler side's
:class:`~kvforge.scheduler.host_tier.HostTier` hands out their ids. :meth:`HostTierPages.move`
runs the scheduler side's :class:`~kvforge.core.values.PageCopy` values with the transfer code
of swaps (:func:`~kvforge.worker.transfer.move_pages`, one gather or scatter per copy), after
the storage's guard checked the whole batch (:func:`kvforge.worker.guard.check_page_copies`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvforge.core.memory_plan import check_allocatable
from kvforge.core.values import PageCopy, SwapResult, TableDelta
from kvforge.errors import WorkerRefusedError
from kvforge.worker.host_pool import HostGroupPool, HostPools
from kvforge.worker.page_ledger import PageLedger
from kvforge.worker.transfer import move_pages

if TYPE_CHECKING:
    from kvforge.worker.storage import CacheStorage

__all__ = ["HostTierPages"]


class HostTierPages:
    """Host tier pages for the groups of ``storage`` named in ``num_pages``.

    Args:
        storage: the worker's :class:`~kvforge.worker.storage.CacheStorage`, with its device
            caches created (the copies run under its lock, checked by its guard).
        num_pages: group -> pages, the null page 0 included (>= 2).

    Raises:
        ValueError: a group the storage holds no offloaded planes of, a count below 2, or
            more bytes than the host has (nothing is allocated).
        RuntimeError: the storage has no device caches yet, or host tier pages already.
    """

    def __init__(self, storage: CacheStorage, num_pages: Mapping[str, int]) -> None:
        with storage._lock:
            storage._ready()
            if getattr(storage, "host_tier_pages", None) is not None:
                raise RuntimeError("this storage has host tier pages already")
            held = sorted(storage._planes)
            unknown = sorted(set(num_pages) - set(held))
            if unknown:
                raise ValueError(
                    f"num_pages names groups {unknown} that this storage holds no offloaded "
                    f"planes of (groups: {held})"
                )
            small = [
                g
                for g, n in num_pages.items()
                if isinstance(n, bool) or not isinstance(n, int) or n < 2
            ]
            if small:
                raise ValueError(
                    f"num_pages[{small[0]!r}] must be an int >= 2 (one usable page plus the "
                    f"null page), got {num_pages[small[0]]!r}"
                )
            layout = storage.layout
            nbytes = sum(n * layout.host_page_bytes(g) for g, n in num_pages.items())
            check_allocatable(nbytes, "cpu", "host tier pages")
            every = {g.name: int(num_pages.get(g.name, 0)) for g in layout.groups}
            pools = HostPools(layout, every, storage.platform)
            self.groups: dict[str, HostGroupPool] = {
                g: p for g, p in pools.groups.items() if every[g]
            }
            self.storage = storage
            #: which key each page holds, and the next page copy's number: what every copy
            #: is checked against (the scheduler side's index is not visible here)
            self.ledger = PageLedger(self.num_pages)
            self._checked: tuple[Sequence[PageCopy], Sequence[PageCopy]] | None = None
            # how the storage finds the pages that a step's offloads go to (guard.tier_of)
            storage.host_tier_pages = self  # type: ignore[attr-defined]

    @property
    def num_pages(self) -> dict[str, int]:
        return {g: p.num_pages for g, p in self.groups.items()}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.groups.values())

    def move(self, offloads: Sequence[PageCopy] = (), onloads: Sequence[PageCopy] = ()) -> Any:
        """Run every offload (device blocks to pages, one gather per copy), then every onload
        (pages back to device blocks, one scatter per copy), so a page offloaded and onloaded
        in one batch carries the offloaded bytes. The whole batch is checked before a byte
        moves (:meth:`check`). Returns the event after which the copies are done (``None`` on
        CPU, where they are done on return).

        Raises:
            BlockRangeError: a device block or page out of range, or the null one.
            BlockOwnershipError: an onload into a block a mirrored row holds, or (arena) into
                a slab another group's row holds.
            PageOwnershipError: an offload into a page that holds a key, an onload from a page
                that does not hold the key it names.
            StepOrderError: a copy out of its tier's sequence (a repeat, a gap, never handed
                out).
            WorkerRefusedError: a value that is not a ``PageCopy``, a group without host tier
                pages, lengths that differ, an onload writing a device block twice.
            ControllerClosedError: the storage was freed (its caches are gone).
        """
        with self.storage._lock:
            self.check(offloads, onloads)
            return self.run(offloads, onloads)

    def check(
        self,
        offloads: Sequence[PageCopy],
        onloads: Sequence[PageCopy],
        deltas: Sequence[TableDelta] = (),
    ) -> None:
        """Refuse the batch unless every copy is in range, in its sequence and owned: an
        offload writes only released pages, an onload reads only pages that hold the key it
        names and writes only device blocks no mirrored row holds once ``deltas`` (the step's
        own, mirrored right after the copies) are applied. Nothing changes here."""
        storage = self.storage
        with storage._lock:
            storage._ready()
            storage._verify.page_copies(offloads, onloads, self.num_pages, deltas)
            self.ledger.check(offloads, onloads)
            self._checked = (offloads, onloads)

    def run(self, offloads: Sequence[PageCopy], onloads: Sequence[PageCopy]) -> Any:
        """Run the batch :meth:`check` passed last (under the storage's lock, nothing in
        between); any other batch is refused."""
        storage = self.storage
        with storage._lock:
            checked, self._checked = self._checked, None
            if checked is None or checked[0] is not offloads or checked[1] is not onloads:
                raise WorkerRefusedError(
                    "HostTierPages.run: only the batch check() passed last runs; nothing moved"
                )
            keep_alive: list[Any] = []
            for direction, copies in (("out", offloads), ("in", onloads)):
                for copy in copies:
                    if not len(copy.device_blocks):
                        continue
                    move_pages(
                        direction,  # type: ignore[arg-type]
                        storage.platform,
                        storage.streams,
                        storage.planes(copy.group),
                        copy.device_blocks,
                        self.groups[copy.group].pages,
                        copy.host_pages,
                        keep_alive,
                    )
            event = storage._finish()
            if event is not None:  # pragma: no cover - accelerators only
                from kvforge.worker.storage import SwapExecution

                storage._copies.append(SwapExecution(SwapResult(-1), event, keep_alive))
            # after the bytes: a batch an interrupt cut short runs again whole
            self.ledger.record(offloads, onloads)
            return event

    def claim(self, group: str, released: Any, pages: Any, tags: Any) -> None:
        """Pages a remote tier is about to fill in place hold ``tags`` from now on (after
        ``released`` pages are freed): see :meth:`PageLedger.claim`."""
        with self.storage._lock:
            self.ledger.claim(group, released, pages, tags)

    def __repr__(self) -> str:
        return f"HostTierPages({self.num_pages})"
