"""Checks of the buffers a backend creates or an engine hands over, before a
:class:`~kvforge.worker.storage.CacheStorage` keeps them: the keys a backend's
``create_kv_cache`` returns, the byte ranges its buffers cover, and each buffer seen as the
raw bytes of its blocks (a plane)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvforge.attn_backends.base import AttentionBackend
from kvforge.worker.overlap import PoolMember, find_overlap, plane_extent
from kvforge.worker.transfer import plane_bytes

__all__ = ["check_created_keys", "overlap_of", "plane_of"]

CacheKey = tuple[str, int]


def check_created_keys(
    backend: AttentionBackend, layers: tuple[int, ...], caches: Mapping[CacheKey, Any]
) -> None:
    if not isinstance(caches, Mapping):
        raise ValueError(
            f"{backend!r}.create_kv_cache returned a {type(caches).__name__}, expected a "
            "dict of (role, layer) -> tensor"
        )
    expected = {(r.name, layer) for layer in layers for r in backend.cache_roles()}
    if set(caches) != expected:
        raise ValueError(
            f"{backend!r}.create_kv_cache returned keys {sorted(caches, key=str)}, expected "
            f"{sorted(expected)}"
        )
    for key, t in caches.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{backend!r}.create_kv_cache returned a {type(t).__name__} for {key}, "
                "expected a torch.Tensor"
            )


def overlap_of(
    names: list[str], caches: list[torch.Tensor], members: list[PoolMember | None] | None
) -> Any:
    planes = [plane_extent(n, t) for n, t in zip(names, caches, strict=True)]
    return find_overlap(planes, members)


def plane_of(cache: torch.Tensor, name: str, action: str) -> torch.Tensor:
    try:
        return plane_bytes(cache)
    except ValueError as exc:
        raise ValueError(f"{action}: buffer {name!r}: {exc}") from None
