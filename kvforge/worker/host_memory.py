"""Every host byte one worker holds, counted in one place and let go of once.

A worker's host memory is of three kinds:

- the swap pages (:class:`~kvforge.worker.swap_pages.HostPools`, made by
  ``CacheController.initialize_host_cache``);
- the tier pages (:class:`~kvforge.worker.tier_pages.HostTierPages`, made by
  ``CacheController.initialize_host_tier``), a pool of their own per group;
- the values a remote tier's store has copied out of tier pages and not yet written
  (``StoreStats.inflight_put_bytes``: the staging of ``put_async``).

Device staging (the rows an accelerator's gather packs before one DMA per run) is device
memory held only until its copy's event, and on CPU there is none: rows go straight to pages.

:func:`host_bytes` is what ``CacheController.host_bytes`` reports; :func:`release_host_tier`
is what ``CacheController.free`` runs before it frees the storage (whose own ``free`` lets go
of the swap pages and of tier pages still held), so a controller's ``free`` leaves no host
byte held.
"""

from __future__ import annotations

import contextlib
from typing import Any

from kvforge._checks import ArgumentError

__all__ = ["host_bytes", "release_host_tier", "tier_pages_of"]


def tier_pages_of(storage: Any) -> Any:
    """The :class:`~kvforge.worker.tier_pages.HostTierPages` ``storage`` holds, or ``None``
    (none made, or released): ``CacheStorage.tier_pages``."""
    return storage.tier_pages


def host_bytes(storage: Any, store: Any = None) -> int:
    """Bytes of host memory held for ``storage``: swap pages and tier pages
    (``CacheStorage.host_bytes``) and, with a remote tier's ``store``, the values it is still
    writing (0 once all were released)."""
    total = int(storage.host_bytes)
    if store is not None:
        total += int(store.stats().inflight_put_bytes)
    return total


def release_host_tier(storage: Any, store: Any = None) -> int:
    """Let go of ``storage``'s tier pages, once: a remote tier's ``store`` (one the caller
    keeps open) forgets them first, so nothing still reads or pins them; ``storage`` then
    holds no tier pages (``CacheStorage.release_tier_pages``: a step that carries tier copies
    is refused). Returns the bytes released; 0 on a second call or without a tier. Call it
    while nothing else uses the storage (``CacheController.free`` holds its own lock; the
    storage's is taken by ``release_tier_pages``)."""
    tier = storage.tier_pages
    if tier is None:
        return 0
    if store is not None:
        for group in tier.groups.values():
            # ArgumentError: its owner unregistered it already, nothing to forget
            with contextlib.suppress(ArgumentError):
                store.unregister_buffer(group.pages)
    return int(storage.release_tier_pages())
