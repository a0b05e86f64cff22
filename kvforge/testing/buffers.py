"""The ``bytes`` and ``no_overlap`` checks: every tensor ``create_kv_cache`` returns (directly,
then through the controller) has the declared dtype, device, block count, shape and block
bytes, and no two ``(role, layer)`` buffers share a byte (decided exactly by
:func:`kvforge.worker.overlap.find_overlap`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvforge.attn_backends.base import AttentionBackend
from kvforge.specs import CacheGroup, CacheRole
from kvforge.testing.declaration import KitLayout
from kvforge.testing.results import CheckResult, fail, run_check
from kvforge.worker.overlap import PlaneExtent, find_overlap, plane_extent


def byte_rows(tensor: torch.Tensor, extent: PlaneExtent) -> torch.Tensor:
    """``uint8 [num_blocks, block_bytes]`` view of a plane's meaningful bytes (any stride)."""
    rows = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    rows.set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * tensor.element_size(),
        (extent.num_blocks, extent.block_bytes),
        (extent.block_stride, 1),
    )
    return rows


def _check_tensor(
    where: str,
    tensor: object,
    role: CacheRole,
    group: CacheGroup,
    num_blocks: int,
    device: torch.device,
) -> PlaneExtent:
    """The ``bytes`` rules for one tensor; returns its plane."""
    if not isinstance(tensor, torch.Tensor):
        raise fail("bytes", f"{where} is a {type(tensor).__name__}, expected a torch.Tensor")
    if tensor.dtype != role.torch_dtype:
        raise fail(
            "bytes",
            f"{where} has dtype {tensor.dtype}, expected {role.torch_dtype} (role "
            f"{role.name!r} declares dtype {role.dtype!r})",
        )
    if tensor.device.type != device.type:
        raise fail("bytes", f"{where} is on {tensor.device}, expected {device}")
    if tensor.dim() == 0:
        raise fail(
            "bytes",
            f"{where} is a 0-d tensor, expected dim 0 to hold num_blocks[{group.name!r}] = "
            f"{num_blocks} blocks",
        )
    if tensor.shape[0] != num_blocks:
        raise fail(
            "bytes",
            f"{where} has block dim ({tensor.shape[0]},), expected num_blocks[{group.name!r}] = "
            f"{num_blocks}",
        )
    try:
        extent = plane_extent(where, tensor)
    except ValueError as exc:
        raise fail("bytes", str(exc), exc) from None
    per_block = role.entries_per_block(group)
    want = role.block_bytes(group)
    if extent.block_bytes != want:
        raise fail(
            "bytes",
            f"{where}: one block addresses {extent.block_bytes} bytes, expected "
            f"role.block_bytes = {per_block} entries * {role.entry_bytes} B = {want} "
            f"(shape {tuple(tensor.shape)})",
        )
    shape = (num_blocks, per_block, *role.entry_shape)
    if tuple(tensor.shape) != shape:
        raise fail("bytes", f"{where} has shape {tuple(tensor.shape)}, expected {shape}")
    return extent


def _check_no_overlap(planes: list[PlaneExtent], stage: str) -> None:
    found = find_overlap(planes)
    if found is None:
        return
    a, b, i, j = found
    (a0, a1), (b0, b1) = a.block_range(i), b.block_range(j)
    lo, hi = max(a0, b0), min(a1, b1)
    if a is b:
        detail = (
            f"{a.name} overlaps itself: blocks of {a.block_bytes} bytes at a stride of "
            f"{a.block_stride} bytes, so blocks 0 and 1 share {hi - lo} bytes"
        )
    else:
        detail = (
            f"{a.name} block {i} and {b.name} block {j} share {hi - lo} bytes (addresses "
            f"{lo:#x}..{hi:#x}); expected every (role, layer) buffer to have bytes of its own"
        )
    raise fail("no_overlap", f"{stage}: {detail}")


def check_bytes(
    layout: KitLayout,
    instances: list[tuple[AttentionBackend, tuple[int, ...]]],
    blocks: Mapping[str, int],
    device: torch.device,
) -> CheckResult:
    # First the backend's own create_kv_cache, so its mistakes are reported by this kit whatever
    # the controller refuses; the overlap of these tensors is checked here for the same reason.
    planes: list[PlaneExtent] = []
    alive: list[Mapping] = []  # freed memory is reused: keep every tensor until the overlap check
    for backend, layers in instances:
        caches = _backend_caches(layout, backend, layers, blocks, device)
        for role_name, layer in _expected_keys(layout, backend, layers):
            role, group = layout.spec(role_name, layer)
            where = f"{layout.name(role_name, layer)} from {backend!r}.create_kv_cache"
            planes.append(
                _check_tensor(
                    where, caches[(role_name, layer)], role, group, blocks[group.name], device
                )
            )
        alive.append(caches)
    _check_no_overlap(planes, "create_kv_cache")
    del planes, alive
    return _check_controller_bytes(layout, blocks, device)


def _expected_keys(
    layout: KitLayout, backend: AttentionBackend, layers: tuple[int, ...]
) -> list[tuple[str, int]]:
    """``(role, layer)`` of every buffer ``backend`` declares for ``layers``."""
    return [(r.name, layer) for layer in layers for r in layout.roles_of[id(backend)]]


def _backend_caches(
    layout: KitLayout,
    backend: AttentionBackend,
    layers: tuple[int, ...],
    blocks: Mapping[str, int],
    device: torch.device,
) -> Mapping:
    """``backend.create_kv_cache`` for ``layers``: a mapping of exactly its declared buffers."""
    caches = run_check(
        "bytes",
        f"{backend!r}.create_kv_cache({list(layers)}, {dict(blocks)}, {device})",
        lambda: backend.create_kv_cache(layers, dict(blocks), device),
    )
    if not isinstance(caches, Mapping):
        raise fail(
            "bytes",
            f"{backend!r}.create_kv_cache returned a {type(caches).__name__}, expected a "
            "dict of (role, layer) -> tensor",
        )
    expected = _expected_keys(layout, backend, layers)
    extra = [k for k in caches if k not in set(expected)]
    if extra:
        raise fail(
            "bytes",
            f"{backend!r}.create_kv_cache returned {sorted(extra, key=repr)}, which its "
            f"cache_roles() do not declare for layers {list(layers)} (declared: "
            f"{[r.name for r in layout.roles_of[id(backend)]]})",
        )
    missing = [k for k in expected if k not in caches]
    if missing:
        raise fail("bytes", f"{backend!r}.create_kv_cache returned nothing for {missing}")
    return caches


def _check_controller_bytes(
    layout: KitLayout, blocks: Mapping[str, int], device: torch.device
) -> CheckResult:
    """The same checks on every buffer the controller allocates from the declarations."""
    ctl = layout.ctl
    run_check(
        "bytes",
        f"CacheController.initialize_kv_cache(num_blocks={dict(blocks)})",
        lambda: ctl.initialize_kv_cache(num_blocks=dict(blocks)),
    )
    entries = nbytes = 0
    for role_name, layer in layout.keys:
        role, group = layout.spec(role_name, layer)
        tensor = run_check(
            "bytes", f"get({role_name!r}, {layer})", lambda r=role_name, la=layer: ctl.get(r, la)
        )
        _check_tensor(
            f"controller: {layout.name(role_name, layer)}",
            tensor,
            role,
            group,
            blocks[group.name],
            device,
        )
        entries += blocks[group.name] * role.entries_per_block(group)
        nbytes += blocks[group.name] * role.block_bytes(group)
    return CheckResult(
        "bytes",
        len(layout.keys),
        entries,
        nbytes,
        "dtype, device, block dim, block bytes and shape of every buffer, from create_kv_cache "
        "and from the controller",
    )


def check_controller_overlap(layout: KitLayout) -> CheckResult:
    ctl = layout.ctl
    planes = [
        plane_extent(layout.name(role, layer), ctl.get(role, layer)) for role, layer in layout.keys
    ]
    _check_no_overlap(planes, "controller caches")
    return CheckResult(
        "no_overlap",
        len(planes),
        0,
        sum(p.num_blocks * p.block_bytes for p in planes),
        "no two (role, layer) buffers share a byte",
    )
