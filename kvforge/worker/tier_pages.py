"""The host pages of the prefix tier on one worker ("tier pages"), and the copies to and from
them.

Two kinds of host pages live on a worker: *swap pages* (:mod:`kvforge.worker.swap_pages`,
what a swapped-out request's blocks go to) and *tier pages* (this module: what the device
evicted from the prefix cache, kept for later lookups). :class:`HostTierPages` holds, per
group, page-first pinned host pages in the swap pages' format (one block of every offloaded
(layer, role), packed, unpadded), but a pool of their own: the scheduler side's
:class:`~kvforge.scheduler.host_tier.HostTier` hands out their ids.

Ownership: the worker's :class:`~kvforge.worker.storage.CacheStorage` owns its tier pages
(``CacheStorage.tier_pages``; made by ``CacheController.initialize_host_tier``): its
``host_bytes`` counts them, its ``free()`` (or ``release_tier_pages()``) lets go of them, once,
and ``CacheStorage.run`` runs a step's ``offloads`` then ``onloads`` through them, after its
arena moves and before its table changes (the order :class:`~kvforge.core.values.StepEffects`
states). The tier pages reach the storage only through its declared public methods
(``lock``, ``check_ready``, ``offloaded_groups``, ``planes``, ``streams``,
``check_page_copies``, ``end_copies``, ``attach_tier_pages``).

Locking: the tier pages are part of their storage and have no lock of their own. Each public
method here holds the storage's lock (``CacheStorage.lock``, re-entrant) for its whole call:
checks, copies queued and the page ledger's record, never while waiting on anything but the
copies it queued. ``CacheStorage.run`` calls :meth:`HostTierPages.check` and
:meth:`HostTierPages.run` with that lock already held.

Pin contract: the scheduler side pins a tier page from the lookup that finds it until the step
that onloads it has been handed out, and never hands out a pinned page for an offload; the
worker does not trust that: its :class:`~kvforge.worker.page_ledger.PageLedger` records which
key each page holds, so an offload writes only a page that holds no key (after the pages the
copy releases) and an onload reads only a page that holds the key it names. A remote tier's
store registers the page tensors (``RemoteStore.register_buffer``) and reads or fills them in
place until ``host_memory.release_host_tier`` unregisters them, before the storage lets go of
the pages. Checked by ``tests/worker/test_host_tier_bytes.py``,
``tests/worker/test_step_ledger.py`` and ``tests/properties/test_step_copies_property.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvforge.core.memory_plan import check_allocatable
from kvforge.core.values import PageCopy, TableDelta
from kvforge.errors import WorkerRefusedError
from kvforge.worker.page_ledger import PageLedger
from kvforge.worker.swap_pages import HostGroupPool, HostPools
from kvforge.worker.transfer import move_pages

if TYPE_CHECKING:
    import threading

    import torch

    from kvforge.core.layout import CacheLayout
    from kvforge.ops import PlaneSet
    from kvforge.platform import Platform
    from kvforge.worker.transfer import SwapStreams

__all__ = ["HostTierPages", "PagesOwner"]


class PagesOwner(Protocol):
    """What tier pages use of the storage that owns them: its declared public methods only
    (:class:`~kvforge.worker.storage.CacheStorage` has them; this module does not import it,
    so the storage may import this one)."""

    layout: CacheLayout
    platform: Platform

    @property
    def lock(self) -> threading.RLock: ...
    @property
    def tier_pages(self) -> Any: ...
    @property
    def offloaded_groups(self) -> list[str]: ...
    @property
    def streams(self) -> SwapStreams | None: ...
    def check_ready(self) -> None: ...
    def planes(self, group: str) -> PlaneSet: ...
    def check_page_copies(
        self,
        offloads: Sequence[PageCopy],
        onloads: Sequence[PageCopy],
        num_pages: Mapping[str, int],
        deltas: Sequence[TableDelta] = (),
    ) -> None: ...
    def end_copies(self, keep_alive: list[torch.Tensor]) -> Any: ...
    def attach_tier_pages(self, pages: HostTierPages) -> None: ...


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

    def __init__(self, storage: PagesOwner, num_pages: Mapping[str, int]) -> None:
        with storage.lock:
            storage.check_ready()
            if storage.tier_pages is not None:
                raise RuntimeError("this storage has host tier pages already")
            _check_counts(num_pages, storage.offloaded_groups)
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
            storage.attach_tier_pages(self)  # the storage owns them from now on

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
        with self.storage.lock:
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
        with storage.lock:
            storage.check_ready()
            storage.check_page_copies(offloads, onloads, self.num_pages, deltas)
            self.ledger.check(offloads, onloads)
            self._checked = (offloads, onloads)

    def run(self, offloads: Sequence[PageCopy], onloads: Sequence[PageCopy]) -> Any:
        """Run the batch :meth:`check` passed last (under the storage's lock, nothing in
        between); any other batch is refused."""
        storage = self.storage
        with storage.lock:
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
            event = storage.end_copies(keep_alive)
            # after the bytes: a batch an interrupt cut short runs again whole
            self.ledger.record(offloads, onloads)
            return event

    def release(self) -> int:
        """Let go of every page (the tensors go with their last reference); the bytes
        released. Called by the owning storage (``CacheStorage.release_tier_pages``)."""
        released = self.nbytes
        self.groups = {}
        return released

    def claim(self, group: str, released: Any, pages: Any, tags: Any) -> None:
        """Pages a remote tier is about to fill in place hold ``tags`` from now on (after
        ``released`` pages are freed): see :meth:`PageLedger.claim`."""
        with self.storage.lock:
            self.ledger.claim(group, released, pages, tags)

    def __repr__(self) -> str:
        return f"HostTierPages({self.num_pages})"


def _check_counts(num_pages: Mapping[str, int], held: Sequence[str]) -> None:
    """Refuse a group the storage holds no offloaded planes of, or a count below 2."""
    unknown = sorted(set(num_pages) - set(held))
    if unknown:
        raise ValueError(
            f"num_pages names groups {unknown} that this storage holds no offloaded "
            f"planes of (groups: {sorted(held)})"
        )
    small = [
        g for g, n in num_pages.items() if isinstance(n, bool) or not isinstance(n, int) or n < 2
    ]
    if small:
        raise ValueError(
            f"num_pages[{small[0]!r}] must be an int >= 2 (one usable page plus the "
            f"null page), got {num_pages[small[0]]!r}"
        )
