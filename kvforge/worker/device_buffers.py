"""The device buffers of a worker's device storage: created, adopted, checked, then handed over.

:class:`BufferBuilder` turns one layout's declarations into the ordered device buffers a
:class:`~kvforge.worker.storage.CacheStorage` keeps, or checks the tensors an engine already
allocated, and answers both with one plain :class:`DeviceBuffers` value: the buffers in layout
order, the offloaded planes of each group, the blocks per group, whether shared pools may
share bytes and the arena the buffers live in. It keeps nothing itself: the storage installs
the value (its tables, guard and streams next to it) only once every check passed.

Invariants (the storage's, stated in :mod:`kvforge.worker.storage`):

- every buffer is checked (keys, shape, dtype, device, plane layout, no shared bytes) before a
  :class:`DeviceBuffers` exists, so a refused ``create`` or ``adopt`` leaves nothing behind
  (``tests/test_controller.py``, ``tests/test_bad_inputs.py``);
- no two (role, layer) buffers share a byte, but the coinciding planes of one shared pool and
  the buffers of an arena, one plane together (``tests/worker/test_overlap.py``,
  ``tests/scheduler/test_shared_pools.py``, ``tests/worker/test_arena_storage.py``);
- with ``share_pools``, the ``k``-th buffer of every member of a shared pool (each member's
  buffers sorted by device block bytes, stably) is a view of one raw ``uint8`` allocation,
  built as the default ``create_kv_cache`` builds a buffer, so a pool's bytes are paid once
  (:func:`device_bytes` counts them once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvforge.attn_backends.base import block_buffer_view, new_block_buffer
from kvforge.core.arena import ArenaGeometry
from kvforge.core.layout import CacheLayout, check_share_pools
from kvforge.core.memory_plan import check_allocatable
from kvforge.ops import PlaneSet
from kvforge.worker.arena_views import arena_views, check_arena
from kvforge.worker.buffer_checks import check_created_keys, overlap_of, plane_of
from kvforge.worker.overlap import PoolMember
from kvforge.worker.transfer import plane_bytes

__all__ = ["BufferBuilder", "DeviceBuffers", "device_bytes"]

CacheKey = tuple[str, int]


@dataclass(frozen=True)
class DeviceBuffers:
    """Checked device buffers, ready for a storage to keep.

    Attributes:
        caches: one tensor per (role, layer), in the layout's order.
        planes: ``group -> PlaneSet`` of the group's offloaded buffers, in host page order
            (only groups with offloaded roles).
        num_blocks: blocks per group the buffers hold.
        share_pools: whether buffers of one shared pool may be the same bytes.
        arena: the arena the arena groups' buffers are views of, or ``None``.
    """

    caches: list[torch.Tensor]
    planes: dict[str, PlaneSet]
    num_blocks: dict[str, int]
    share_pools: bool
    arena: ArenaGeometry | None


class BufferBuilder:
    """Creates or adopts, then checks, the device buffers of one layout on one device.

    Args:
        layout: the model's declarations.
        device: the device every buffer lives on.
        names: the storage name of each buffer, in the layout's order (used in errors).
    """

    def __init__(self, layout: CacheLayout, device: torch.device, names: Sequence[str]) -> None:
        self.layout = layout
        self.device = device
        self.names = list(names)

    # ================================================================== create

    def create(
        self,
        num_blocks: Mapping[str, int],
        share_pools: bool = True,
        arena: ArenaGeometry | None = None,
    ) -> DeviceBuffers:
        """Allocate every buffer (``CacheStorage.create`` states how) and check them all."""
        check_share_pools(share_pools)
        blocks = dict(num_blocks)
        shared = self.shared_sets(share_pools, blocks, "create: num_blocks gives {} to")
        in_arena = set(check_arena(arena, share_pools, blocks))
        pooled = {g for members in shared for g in members} | in_arena
        nbytes = sum(
            blocks[g.name] * self.layout.bytes_per_block(g.name)
            for g in self.layout.groups
            if g.name not in pooled
        )
        # a shared set's members have equal counts and pair up byte for byte: paid once
        nbytes += sum(blocks[m[0]] * self.layout.bytes_per_block(m[0]) for m in shared)
        nbytes += arena.total_bytes if arena is not None else 0
        check_allocatable(nbytes, self.device, "device caches")
        created: dict[CacheKey, torch.Tensor] = self._create_shared(shared, blocks)
        raw = None
        if arena is not None:
            raw = torch.zeros(arena.total_bytes, dtype=torch.uint8, device=self.device)
            created.update(arena_views(self.layout, arena, raw))
        self._create_by_backends(created, blocks, pooled)
        return self.checked(created, blocks, "create", share_pools, arena, raw)

    def _create_by_backends(
        self, created: dict[CacheKey, torch.Tensor], blocks: Mapping[str, int], pooled: set[str]
    ) -> None:
        """Add the buffers not in ``created`` yet: built here as the default
        ``create_kv_cache`` builds them for a backend serving a shared group, else asked of
        each backend (its keys checked)."""
        builds = self._default_builders(pooled)
        for backend, layers in self.layout.backend_layers():
            if id(backend) in builds:
                for e in self.layout.buffers_of_layers(layers):
                    if e.key not in created:
                        created[e.key] = new_block_buffer(
                            e.role, e.group, blocks[e.group.name], self.device
                        )
                continue
            caches = backend.create_kv_cache(layers, dict(blocks), self.device)
            check_created_keys(backend, layers, caches)
            created.update(caches)

    def shared_sets(
        self, share_pools: bool, blocks: Mapping[str, int], refusal: str
    ) -> list[tuple[str, ...]]:
        """The pools of more than one group (none without ``share_pools``), their counts
        checked (``CacheLayout.pools``; ``refusal`` opens the error)."""
        return [m for m in self.layout.pools(share_pools, blocks, refusal) if len(m) > 1]

    def _default_builders(self, pooled: set[str]) -> set[int]:
        """Ids of the backends serving a buffer of a shared group (built here, not by the
        backend). They keep the default ``create_kv_cache``: a group served by one that lays
        out its own memory is never in a shared set (``CacheLayout.pool_sets``)."""
        builds: set[int] = set()
        for backend, layers in self.layout.backend_layers():
            if any(e.group.name in pooled for e in self.layout.buffers_of_layers(layers)):
                builds.add(id(backend))
        return builds

    def _create_shared(
        self, shared: list[tuple[str, ...]], blocks: Mapping[str, int]
    ) -> dict[CacheKey, torch.Tensor]:
        """The buffers of the shared sets: position ``k`` of every member in one allocation."""
        created: dict[CacheKey, torch.Tensor] = {}
        for members in shared:
            n = blocks[members[0]]
            # sorted() is stable: equal strides pair up in layout order
            columns = [
                sorted(self.layout.buffers_of(g), key=lambda e: e.device_block_bytes)
                for g in members
            ]
            for row in zip(*columns, strict=True):
                raw = torch.zeros(
                    (n, row[0].device_block_bytes), dtype=torch.uint8, device=self.device
                )
                for e in row:
                    created[e.key] = block_buffer_view(raw, e.role, e.group)
        return created

    # ================================================================== adopt

    def adopt(
        self, caches: Mapping[CacheKey, torch.Tensor], share_pools: bool = True
    ) -> DeviceBuffers:
        """Check tensors an engine allocated (``CacheStorage.adopt`` states what is refused);
        their blocks per group are the value's ``num_blocks``."""
        check_share_pools(share_pools)
        if not isinstance(caches, Mapping):
            raise TypeError(f"caches must map (role, layer) -> tensor, got {type(caches).__name__}")
        expected = {e.key for e in self.layout.buffers}
        got = set(caches)
        if got != expected:
            raise ValueError(
                "adopt: caches must hold exactly every (role, layer) of the layout; missing "
                f"{sorted(expected - got)}, unexpected {sorted(got - expected, key=str)}"
            )
        blocks = self._adopted_blocks(caches)
        self.shared_sets(share_pools, blocks, "adopt: the caches hold {} blocks for")
        return self.checked(dict(caches), blocks, "adopt", share_pools)

    def _adopted_blocks(self, caches: Mapping[CacheKey, torch.Tensor]) -> dict[str, int]:
        """Blocks per group of adopted tensors: every role of a group must hold as many."""
        blocks: dict[str, int] = {}
        for e in self.layout.buffers:
            t = caches[e.key]
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise ValueError(f"adopt: cache {e.key} is not a block-major tensor: {t!r}")
            n = int(t.shape[0])
            known = blocks.setdefault(e.group.name, n)
            if known != n:
                raise ValueError(
                    f"adopt: cache {e.key} has {n} blocks but other caches of group "
                    f"{e.group.name!r} have {known}"
                )
        return blocks

    # ================================================================== checks

    def checked(
        self,
        created: Mapping[CacheKey, torch.Tensor],
        num_blocks: Mapping[str, int],
        action: str,
        share_pools: bool = True,
        arena: ArenaGeometry | None = None,
        arena_raw: torch.Tensor | None = None,
    ) -> DeviceBuffers:
        """``created`` in layout order once every buffer passed its checks (shape, dtype,
        device, own bytes, plane layout); ``action`` (``"create"`` or ``"adopt"``) names the
        caller in errors."""
        caches = [created[e.key] for e in self.layout.buffers]
        self._check_shapes(caches, num_blocks, action)
        self._check_own_bytes(caches, action, share_pools, arena, arena_raw)
        planes: dict[str, PlaneSet] = {}
        for g in self.layout.groups:
            entries = self.layout.offload_buffers(g.name)
            if entries:
                planes[g.name] = PlaneSet(
                    [plane_of(caches[e.index], self.names[e.index], action) for e in entries]
                )
        return DeviceBuffers(caches, planes, dict(num_blocks), share_pools, arena)

    def _check_shapes(
        self, caches: list[torch.Tensor], num_blocks: Mapping[str, int], action: str
    ) -> None:
        """Refuse a buffer whose shape, dtype or device is not its declaration's."""
        for e, t in zip(self.layout.buffers, caches, strict=True):
            backend = self.layout.backends[e.layer]
            who = f"{backend!r}.create_kv_cache gave" if action == "create" else "adopt: cache"
            shape = (num_blocks[e.group.name], *backend.block_shape(e.role))
            if tuple(t.shape) != shape or t.dtype != e.role.torch_dtype:
                raise ValueError(
                    f"{who} ({e.role.name!r}, {e.layer}) shape {tuple(t.shape)} dtype "
                    f"{t.dtype}; expected {shape} {e.role.torch_dtype}"
                )
            if t.device.type != self.device.type:
                raise ValueError(
                    f"{who} ({e.role.name!r}, {e.layer}) on {t.device}, expected {self.device}"
                )

    def _check_own_bytes(
        self,
        caches: list[torch.Tensor],
        action: str,
        share_pools: bool,
        arena: ArenaGeometry | None,
        arena_raw: torch.Tensor | None,
    ) -> None:
        """Refuse buffers that share bytes (but the coinciding planes of a shared pool, and
        an arena's buffers, one plane together)."""
        names, planes, members = self.names, caches, self._pool_members(share_pools)
        if arena is not None and arena_raw is not None:
            # the arena's buffers overlap by design (slabs change hands, never blocks in use);
            # as one plane, nothing else may touch their bytes
            inside = {e.index for g in arena.groups for e in self.layout.buffers_of(g)}
            keep = [i for i in range(len(caches)) if i not in inside]
            names = [names[i] for i in keep] + ["arena"]
            planes = [caches[i] for i in keep] + [arena_raw.view(1, -1)]
            if members is not None:
                members = [members[i] for i in keep] + [None]
        clash = overlap_of(names, planes, members)
        if clash is not None:
            a, b, i, j = clash
            raise ValueError(
                f"{action}: buffers {a.name!r} and {b.name!r} share bytes (block {i} of the "
                f"first and block {j} of the second); every (role, layer) needs its own bytes"
            )

    def _pool_members(self, share_pools: bool) -> list[PoolMember | None] | None:
        """Each buffer's shared pool and group, for the overlap check (None: share nothing)."""
        if not share_pools:
            return None
        members: list[PoolMember | None] = []
        for e in self.layout.buffers:
            pool = self.layout.pool_of(e.group.name, True)
            members.append(PoolMember(pool, e.group.name) if len(pool) > 1 else None)
        return members


def device_bytes(
    layout: CacheLayout, caches: Sequence[torch.Tensor], arena: ArenaGeometry | None
) -> int:
    """Bytes ``caches`` (in layout order) span, alignment padding included; the buffers a
    shared pool places in the same bytes count once, an arena's buffers as its allocation."""
    total = 0
    seen: set[tuple[int, int, int]] = set()
    inside: set[int] = set()
    if arena is not None:  # its groups' buffers are one allocation
        total += arena.total_bytes
        inside = {e.index for g in arena.groups for e in layout.buffers_of(g)}
    for i, t in enumerate(caches):
        if i in inside:
            continue
        block = plane_bytes(t)
        extent = (block.data_ptr(), block.shape[0], block.stride(0))
        if extent in seen:  # only coinciding planes of one shared pool (see the invariants)
            continue
        seen.add(extent)
        total += block.shape[0] * block.stride(0) if block.shape[0] else 0
    return total
