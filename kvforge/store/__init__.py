"""The remote tier of the tiered prefix store: a small store protocol (:class:`RemoteStore`),
the value format that makes a bad value a miss (:mod:`kvforge.store.value`), and adapters on
Redis (:class:`RedisStore`) and Mooncake Store (:class:`MooncakeStore`); ``docs/tiered_store.md``.

Names load on first use: ``kvforge.store.value`` needs ``xxhash`` (its XXH3-128 checksum),
:class:`StoreConfig` needs ``pydantic-settings``, and each adapter imports its client library
only when a store is built (``pip install 'kvforge[redis]'`` / ``'kvforge[mooncake]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvforge._lazy import lazy_exports

if TYPE_CHECKING:
    from kvforge.store.config import StoreConfig
    from kvforge.store.protocol import RemoteStore

_EXPORTS = {
    "RemoteStore": "kvforge.store.protocol",
    "StoreStats": "kvforge.store.protocol",
    "StoreConfig": "kvforge.store.config",
    "MissReason": "kvforge.store.value",
    "RedisStore": "kvforge.store.redis_store",
    "MooncakeStore": "kvforge.store.mooncake_store",
}

__all__ = [*_EXPORTS, "open_store"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


def open_store(config: StoreConfig, fingerprint: bytes) -> RemoteStore | None:
    """The adapter ``config.backend`` names, for values of layout ``fingerprint`` (for a remote
    tier, :func:`kvforge.remote_tier.layout_fingerprint` of the layout and the model's
    identity); ``None`` for ``backend="none"`` (the embedded default: no remote tier).
    Connecting happens in the background: calls before the server answers are misses."""
    if config.backend == "redis":
        from kvforge.store.redis_store import RedisStore

        return RedisStore(config, fingerprint)
    if config.backend == "mooncake":
        from kvforge.store.mooncake_store import MooncakeStore

        return MooncakeStore(config, fingerprint)
    return None
