"""The backend contract: an attention variant declares its caches, the controller does the rest.

A subclass only has to implement :meth:`AttentionBackend.cache_roles` and
:meth:`AttentionBackend.cache_groups`; allocation, host views and swap selection are derived
from the declaration. Overrides exist for special layouts (several roles carved from one
allocation, roles that must move differently on a swap).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch

from kvforge.specs import (
    CacheGroup,
    CacheRole,
    SwapPurpose,
    TokenRange,
    check_role_in_group,
)

__all__ = [
    "AttentionBackend",
    "DeclaredBackend",
    "HostViewSource",
    "SwapContext",
    "block_buffer_view",
    "new_block_buffer",
    "padded_block_view",
]

CacheDict = dict[tuple[str, int], torch.Tensor]


def padded_block_view(
    raw: torch.Tensor, role: CacheRole, group: CacheGroup, offset: int = 0
) -> torch.Tensor:
    """Role ``role``'s typed blocks inside a byte buffer ``raw`` ``uint8 [num_blocks, stride]``.

    Block ``b`` of the result is the ``role.block_bytes(group)`` bytes starting at byte
    ``offset`` of row ``b``, seen as ``role.block_shape(group)`` of the role's dtype; the rest
    of the row (alignment padding, or other roles packed in the same allocation) is never
    addressed. This is how the default :meth:`AttentionBackend.create_kv_cache` builds an
    aligned role, and how an engine can carve several roles out of one allocation.

    Raises:
        ValueError: ``raw`` is not a 2-d ``uint8`` tensor with unit column stride, the role's
            bytes do not fit in a row from ``offset``, or the row stride or ``offset`` is not
            a whole number of the role's elements (a typed view would be misaligned).
    """
    if raw.dtype != torch.uint8 or raw.dim() != 2 or (raw.shape[1] > 1 and raw.stride(1) != 1):
        raise ValueError(
            f"raw must be a uint8 [num_blocks, row_bytes] tensor with unit column stride, got "
            f"{raw.dtype} shape {tuple(raw.shape)} strides {raw.stride()}"
        )
    nbytes, itemsize = role.block_bytes(group), role.itemsize
    row_stride = raw.stride(0) if raw.shape[0] > 1 else raw.shape[1]
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    if offset + nbytes > raw.shape[1]:
        raise ValueError(
            f"role {role.name!r} needs {nbytes} bytes per block from offset {offset}, but a row "
            f"of raw holds {raw.shape[1]}"
        )
    if row_stride % itemsize or offset % itemsize or raw.storage_offset() % itemsize:
        raise ValueError(
            f"role {role.name!r} ({role.dtype}, {itemsize} bytes per element) cannot be viewed "
            f"at row stride {row_stride} and offset {offset}: not whole elements"
        )
    shape = role.block_shape(group)
    # strides of a contiguous block of `shape`, in elements, behind a per-block stride
    inner: list[int] = []
    step = 1
    for size in reversed(shape):
        inner.append(step)
        step *= size
    strides = (row_stride // itemsize, *reversed(inner))
    typed = torch.empty(0, dtype=role.torch_dtype, device=raw.device)
    typed.set_(
        raw.untyped_storage(),
        (raw.storage_offset() + offset) // itemsize,
        (raw.shape[0], *shape),
        strides,
    )
    return typed


def new_block_buffer(
    role: CacheRole, group: CacheGroup, num_blocks: int, device: torch.device | str
) -> torch.Tensor:
    """A zeroed device cache of ``num_blocks`` blocks for ``role``: a fresh
    ``uint8 [num_blocks, device_block_bytes]`` allocation seen through
    :func:`block_buffer_view`."""
    raw = torch.zeros(
        (num_blocks, role.device_block_bytes(group)), dtype=torch.uint8, device=device
    )
    return block_buffer_view(raw, role, group)


def block_buffer_view(raw: torch.Tensor, role: CacheRole, group: CacheGroup) -> torch.Tensor:
    """The device cache of ``role`` inside ``raw`` ``uint8 [num_blocks, device_block_bytes]``.

    This is the one place a declared role's device buffer gets its typed shape, so the default
    :meth:`AttentionBackend.create_kv_cache` and the shared pools of the worker side (which
    give several groups' buffers the same raw allocation) build identical views: a contiguous
    ``[num_blocks, *role.block_shape(group)]`` of the role's dtype when the role has no
    alignment padding, else :func:`padded_block_view` (block ``b`` starts ``b *
    device_block_bytes`` bytes in, the padding after it is never addressed).

    Raises:
        ValueError: ``raw`` is not a contiguous ``uint8 [num_blocks, device_block_bytes]``
            tensor for this role (naming the role, the shape expected and the shape given).
    """
    stride = role.device_block_bytes(group)
    if (
        not isinstance(raw, torch.Tensor)
        or raw.dtype != torch.uint8
        or raw.dim() != 2
        or raw.shape[1] != stride
        or not raw.is_contiguous()
    ):
        got = (
            f"{raw.dtype} shape {tuple(raw.shape)} contiguous={raw.is_contiguous()}"
            if isinstance(raw, torch.Tensor)
            else type(raw).__name__
        )
        raise ValueError(
            f"role {role.name!r} needs a contiguous uint8 [num_blocks, {stride}] buffer "
            f"(its device_block_bytes), got {got}"
        )
    if stride != role.block_bytes(group):
        return padded_block_view(raw, role, group)
    shape = role.block_shape(group)
    return raw.view(role.torch_dtype).view(raw.shape[0], *shape)


@runtime_checkable
class HostViewSource(Protocol):
    """Where :meth:`AttentionBackend.create_host_kv_cache` gets its host views from.

    The worker side passes its host pools (``kvforge.worker.HostViews``); the contract
    names only this protocol so that backends import nothing from the host package.
    """

    def view(self, role: CacheRole, layer: int) -> torch.Tensor:
        """Role ``role`` of ``layer`` across every host page of its group."""
        ...


@dataclass
class SwapContext:
    """What a swap hook is told about the move in progress.

    Attributes:
        request_id: the request being moved.
        num_tokens: tokens the request holds.
        purpose: why it moves.
        layer_ids: the layers of this backend.
        caches: ``(role, layer) -> device tensor`` for this backend's layers.
        device_blocks: ``group -> device block ids`` being moved (source on swap out,
            destination on swap in).
    """

    request_id: str
    num_tokens: int
    purpose: SwapPurpose
    layer_ids: tuple[int, ...]
    caches: Mapping[tuple[str, int], torch.Tensor]
    device_blocks: Mapping[str, list[int]] = field(default_factory=dict)


class AttentionBackend(ABC):
    """Base class of every attention variant.

    Invariants a subclass must keep (checked by :meth:`validate`):

    - role names are unique within the backend, and every role's group is declared;
    - every role's ``compress_ratio`` divides its group's ``block_size``;
    - :meth:`cache_roles` returns the same list every call: its order is the per-layer order
      of the controller's cache list.

    Attributes:
        snapshot_policy: what the host and remote tiers do with the snapshots of this backend's
            per-request groups (ignored by a backend that declares none): ``"skip"``
            (default: none kept; a hit whose snapshot the device lost is recomputed) or
            ``"aligned"`` (the snapshots the prefix cache takes at aligned boundaries are
            kept and brought back as any block). ``CacheController.initialize_host_tier``
            follows it unless given one.
    """

    snapshot_policy: ClassVar[Literal["skip", "aligned"]] = "skip"

    @abstractmethod
    def cache_groups(self) -> list[CacheGroup]:
        """The block tables this backend needs."""

    @abstractmethod
    def cache_roles(self) -> list[CacheRole]:
        """The buffers of one layer, in per-layer order."""

    # ------------------------------------------------------------------ derived declarations

    def validate(self) -> None:
        """Check the declaration is self-consistent.

        Raises:
            ValueError: naming the backend and the offending role or group.
        """
        groups = self.groups_by_name()
        seen: set[str] = set()
        for role in self.cache_roles():
            if role.name in seen:
                raise ValueError(f"{self!r} declares role {role.name!r} twice")
            seen.add(role.name)
            if role.group not in groups:
                raise ValueError(
                    f"{self!r}: role {role.name!r} names group {role.group!r}, which is not "
                    f"declared (declared: {sorted(groups)})"
                )
            check_role_in_group(role, groups[role.group])
        if not seen:
            raise ValueError(f"{self!r} declares no cache roles")

    def groups_by_name(self) -> dict[str, CacheGroup]:
        groups: dict[str, CacheGroup] = {}
        for group in self.cache_groups():
            if group.name in groups and groups[group.name] != group:
                raise ValueError(f"{self!r} declares group {group.name!r} twice, differently")
            groups[group.name] = group
        return groups

    def role(self, name: str) -> CacheRole:
        for role in self.cache_roles():
            if role.name == name:
                return role
        raise KeyError(f"{self!r} has no role {name!r}")

    def block_shape(self, role: CacheRole) -> tuple[int, ...]:
        """Shape of one block of ``role``, per its declared ``block_layout``.

        ``(entries_per_block, *entry_shape)`` for ``token_major``;
        ``(entry_shape[0], entries_per_block, *entry_shape[1:])`` for ``head_major``.
        """
        return role.block_shape(self.groups_by_name()[role.group])

    # ------------------------------------------------------------------ allocation

    def create_kv_cache(
        self,
        layer_ids: Iterable[int],
        num_blocks: Mapping[str, int],
        device: torch.device | str,
    ) -> CacheDict:
        """Allocate device caches for ``layer_ids``.

        Args:
            layer_ids: the layers this backend serves.
            num_blocks: blocks per group name (at least every group this backend declares).
            device: where to allocate.

        Returns:
            ``{(role, layer): tensor}`` with block-major tensors of shape
            ``[num_blocks[group], *block_shape(role)]`` and the role's dtype. A role whose
            ``device_block_bytes`` exceeds its ``block_bytes`` (``block_alignment``) is one
            buffer ``[num_blocks, device_block_bytes]`` seen through a strided typed view
            (see :func:`padded_block_view`): block ``b`` starts ``b * device_block_bytes``
            bytes in, and the padding after it is never addressed. Contents are zero, padding
            included. Each buffer is built by :func:`block_buffer_view`; a backend that keeps
            this default can have its buffers placed in a shared pool by the worker side
            (``CacheStorage.create(..., share_pools=True)``), one that overrides it cannot.
        """
        groups = self.groups_by_name()
        caches: CacheDict = {}
        for layer in layer_ids:
            for role in self.cache_roles():
                group = groups[role.group]
                caches[(role.name, layer)] = new_block_buffer(
                    role, group, num_blocks[role.group], device
                )
        return caches

    def create_host_kv_cache(
        self,
        layer_ids: Iterable[int],
        num_blocks: Mapping[str, int],
        allocator: HostViewSource,
    ) -> CacheDict:
        """Host-side views of the offloaded roles of ``layer_ids``.

        The default asks ``allocator`` for this role's slice of the page-first host pool of its
        group: a strided view ``[num_blocks[group], entries_per_block, *entry_shape]`` in which
        block ``b`` is the role's part of host page ``b``. Roles with ``offload=False`` get none.
        """
        caches: CacheDict = {}
        for layer in layer_ids:
            for role in self.cache_roles():
                if role.offload:
                    caches[(role.name, layer)] = allocator.view(role, layer)
        return caches

    def free_host_kv_cache(self, host_caches: CacheDict) -> None:
        """Release what :meth:`create_host_kv_cache` returned (the default holds views only)."""
        host_caches.clear()

    # ------------------------------------------------------------------ swap hooks

    def offload_selection(
        self, role: CacheRole, num_tokens: int, purpose: SwapPurpose
    ) -> TokenRange:
        """Token positions of ``role`` that must move for ``purpose``.

        Default, by group kind: full keeps ``[0, num_tokens)``; sliding_window and state keep
        the last ``window`` tokens; ``prefix`` skips state roles (they are recomputed). Roles
        declared with ``offload=False`` never move.
        """
        group = self.groups_by_name()[role.group]
        if not role.offload:
            return TokenRange(start=num_tokens, end=num_tokens)
        if purpose is SwapPurpose.PREFIX and group.rule.recomputed_for_prefix:
            return TokenRange(start=num_tokens, end=num_tokens)
        return group.live_token_range(num_tokens)

    def before_swap_out(self, ctx: SwapContext) -> None:  # noqa: B027 - optional hook
        """Called before the gather of a swap out. Default: nothing."""

    def after_swap_in(self, ctx: SwapContext) -> None:  # noqa: B027 - optional hook
        """Called after the scatter of a swap in has completed. Default: nothing."""

    # ------------------------------------------------------------------ identity

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class DeclaredBackend(AttentionBackend):
    """A backend whose groups and roles are fixed when it is constructed.

    Subclasses build their declaration in ``__init__`` and hand it to :meth:`declare`,
    which validates it once; the lists are then returned as copies on every call.
    """

    _groups: tuple[CacheGroup, ...] = ()
    _roles: tuple[CacheRole, ...] = ()

    def declare(self, groups: Iterable[CacheGroup], roles: Iterable[CacheRole]) -> None:
        """Set this backend's groups and roles (the per-layer order) and validate them.

        Raises:
            ValueError: naming the backend and the offending role or group.
        """
        self._groups = tuple(groups)
        self._roles = tuple(roles)
        self.validate()

    def cache_groups(self) -> list[CacheGroup]:
        return list(self._groups)

    def cache_roles(self) -> list[CacheRole]:
        return list(self._roles)
