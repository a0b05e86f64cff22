"""The ``naming_and_order`` check: the cache list is layer-major and follows ``cache_roles()``,
``index_of`` / ``get`` / ``kv_caches`` agree, storage names are unique, and a controller built
from the same mapping in another insertion order gives the same names and order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvforge.attn_backends.base import AttentionBackend
from kvforge.controller import CacheController
from kvforge.testing.declaration import KitLayout
from kvforge.testing.results import CheckResult, fail, run_check


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )


def check_naming_and_order(
    layout: KitLayout, backends: Mapping[int, AttentionBackend], device: str | torch.device
) -> CheckResult:
    ctl = layout.ctl
    keys = layout.keys
    caches = ctl.kv_caches
    names = ctl.storage_names
    if len(caches) != len(keys) or len(names) != len(keys):
        raise fail(
            "naming_and_order",
            f"the controller lists {len(caches)} caches and {len(names)} storage names; the "
            f"declarations give {len(keys)} (role, layer) buffers",
        )
    for position, (role, layer) in enumerate(keys):
        index = ctl.index_of(role, layer)
        if index != position:
            raise fail(
                "naming_and_order",
                f"index_of({role!r}, {layer}) is {index}, expected {position}: the cache list "
                f"is layer-major and follows cache_roles() within a layer, so it starts "
                f"{keys[: position + 1]}",
            )
        if not _same_buffer(ctl.get(role, layer), caches[position]):
            raise fail(
                "naming_and_order",
                f"get({role!r}, {layer}) is not kv_caches[{position}]",
            )
    seen: dict[str, tuple[str, int]] = {}
    for name, key in zip(names, keys, strict=True):
        if name in seen:
            raise fail(
                "naming_and_order",
                f"storage name {name!r} is given to both {seen[name]} and {key}",
            )
        seen[name] = key
    _check_reordered(layout, backends, device)
    return CheckResult(
        "naming_and_order",
        len(keys),
        0,
        0,
        "layer-major order, index_of / get / kv_caches agree, unique storage names, the same "
        "names and order from a reordered mapping",
    )


def _check_reordered(
    layout: KitLayout, backends: Mapping[int, AttentionBackend], device: str | torch.device
) -> None:
    """The same inputs give the same list and names, however the mapping was built."""
    ctl = layout.ctl
    keys = layout.keys
    names = ctl.storage_names
    reordered = dict(reversed(list(backends.items())))
    again = run_check(
        "naming_and_order",
        "CacheController(reordered mapping)",
        lambda: CacheController(reordered, device),
    )
    try:
        if again.storage_names != names:
            raise fail(
                "naming_and_order",
                "a controller built from the same mapping in reverse insertion order names the "
                f"caches {again.storage_names}, expected {names}",
            )
        moved = [k for k in keys if again.index_of(*k) != ctl.index_of(*k)]
        if moved:
            raise fail(
                "naming_and_order",
                "a controller built from the same mapping in reverse insertion order moves "
                f"{moved}",
            )
    finally:
        again.free()
