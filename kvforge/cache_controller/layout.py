"""The merged, ordered view of every layer's declared caches.

:class:`CacheLayout` is built once from ``layer id -> backend`` and answers every question
that depends only on the declarations: which groups exist, the ordered list of (role, layer)
buffers, per-group byte counts. It allocates nothing.

Ordering invariant: buffers are layer-major (ascending layer id) and, within a layer, follow
the backend's ``cache_roles()`` order. Groups are ordered by the first buffer that uses them.
Neither depends on the order in which the mapping was built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from kvforge.attn_backends.base import AttentionBackend
from kvforge.specs import CacheGroup, CacheRole, GroupKind

__all__ = ["CacheEntry", "CacheLayout"]


@dataclass(frozen=True)
class CacheEntry:
    """One (role, layer) buffer.

    Attributes:
        index: its position in the ordered cache list.
        layer: the layer id.
        role: the role spec.
        group: the role's group spec.
    """

    index: int
    layer: int
    role: CacheRole
    group: CacheGroup

    @property
    def key(self) -> tuple[str, int]:
        return (self.role.name, self.layer)

    @property
    def block_bytes(self) -> int:
        return self.role.block_bytes(self.group)


def _check_backends(backends: Mapping[int, AttentionBackend]) -> dict[int, AttentionBackend]:
    if not isinstance(backends, Mapping):
        raise TypeError(
            f"backends must be a mapping of layer id -> AttentionBackend, got "
            f"{type(backends).__name__}"
        )
    if not backends:
        raise ValueError("backends is empty: give at least one layer id -> AttentionBackend")
    checked: dict[int, AttentionBackend] = {}
    for layer in sorted(backends, key=lambda k: (not isinstance(k, int), str(k))):
        backend = backends[layer]
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"backends has layer id {layer!r}; layer ids must be ints >= 0")
        if not isinstance(backend, AttentionBackend):
            raise TypeError(
                f"backends[{layer}] is a {type(backend).__name__}, not an AttentionBackend"
            )
        checked[layer] = backend
    return checked


class CacheLayout:
    """Groups, ordered buffers and byte counts of a model.

    Args:
        backends: layer id -> backend (layers may use different backends, an instance may
            serve several layers).

    Raises:
        ValueError: empty mapping, bad layer ids, a backend whose declaration is inconsistent,
            or two backends that declare the same group name with different specs.
        TypeError: a value is not an :class:`AttentionBackend`.
    """

    def __init__(self, backends: Mapping[int, AttentionBackend]) -> None:
        checked = _check_backends(backends)
        self.layers: tuple[int, ...] = tuple(sorted(checked))
        self.backends: dict[int, AttentionBackend] = {
            layer: checked[layer] for layer in self.layers
        }

        groups: dict[str, CacheGroup] = {}
        declared_by: dict[str, int] = {}
        entries: list[CacheEntry] = []
        for layer in self.layers:
            backend = self.backends[layer]
            backend.validate()
            own = backend.groups_by_name()
            for role in backend.cache_roles():
                group = own[role.group]
                known = groups.get(group.name)
                if known is None:
                    groups[group.name] = group
                    declared_by[group.name] = layer
                elif known != group:
                    first = declared_by[group.name]
                    raise ValueError(
                        f"group {group.name!r} is declared differently by layer {first} "
                        f"({self.backends[first]!r}: {known!r}) and layer {layer} "
                        f"({backend!r}: {group!r})"
                    )
                entries.append(CacheEntry(len(entries), layer, role, group))
        self.entries: tuple[CacheEntry, ...] = tuple(entries)
        # Ordered by first use in the layer-major list, a deterministic order.
        ordered: list[CacheGroup] = []
        for e in self.entries:
            if e.group not in ordered:
                ordered.append(e.group)
        self.groups: tuple[CacheGroup, ...] = tuple(ordered)
        self._index = {e.key: e for e in self.entries}
        self._entries_by_layers: dict[tuple[int, ...], tuple[CacheEntry, ...]] = {}

    # ------------------------------------------------------------------ lookups

    @cached_property
    def group_map(self) -> dict[str, CacheGroup]:
        return {g.name: g for g in self.groups}

    def group(self, name: str) -> CacheGroup:
        try:
            return self.group_map[name]
        except KeyError:
            raise ValueError(
                f"group {name!r} does not exist; groups are {[g.name for g in self.groups]}"
            ) from None

    def entry(self, role: str, layer: int) -> CacheEntry:
        try:
            return self._index[(role, layer)]
        except KeyError:
            if layer not in self.backends:
                raise KeyError(
                    f"layer {layer!r} has no caches; layers are {list(self.layers)}"
                ) from None
            roles = [r.name for r in self.backends[layer].cache_roles()]
            raise KeyError(f"layer {layer} has no role {role!r}; its roles are {roles}") from None

    def entries_of(self, group: str) -> tuple[CacheEntry, ...]:
        """Buffers of ``group`` in list order."""
        return tuple(e for e in self.entries if e.group.name == group)

    def entries_of_layers(self, layers: tuple[int, ...]) -> tuple[CacheEntry, ...]:
        """Buffers of ``layers`` in list order (a backend's layers, asked on every swap)."""
        found = self._entries_by_layers.get(layers)
        if found is None:
            members = set(layers)
            found = tuple(e for e in self.entries if e.layer in members)
            self._entries_by_layers[layers] = found
        return found

    @cached_property
    def _offload_entries(self) -> dict[str, tuple[CacheEntry, ...]]:
        # the layout never changes after construction; swaps ask for this on every call
        return {
            g.name: tuple(e for e in self.entries_of(g.name) if e.role.offload) for g in self.groups
        }

    def offload_entries(self, group: str) -> tuple[CacheEntry, ...]:
        """Buffers of ``group`` that swaps move, in list order: the planes of a host page."""
        found = self._offload_entries.get(group)
        return found if found is not None else ()

    @cached_property
    def _offload_roles(self) -> dict[str, tuple[tuple[AttentionBackend, CacheRole], ...]]:
        found: dict[str, dict[tuple[int, str], tuple[AttentionBackend, CacheRole]]] = {}
        for e in self.entries:
            if e.role.offload:
                backend = self.backends[e.layer]
                found.setdefault(e.group.name, {}).setdefault(
                    (id(backend), e.role.name), (backend, e.role)
                )
        return {g: tuple(pairs.values()) for g, pairs in found.items()}

    def offload_roles(self, group: str) -> tuple[tuple[AttentionBackend, CacheRole], ...]:
        """Distinct (backend instance, role) pairs that swaps of ``group`` move, in list order.

        ``offload_selection`` sees a role, not a layer, so a swap asks each pair once: 43
        layers of DeepSeek-V4-Flash share three backends.
        """
        found = self._offload_roles.get(group)
        return found if found is not None else ()

    @cached_property
    def _backend_layers(self) -> tuple[tuple[AttentionBackend, tuple[int, ...]], ...]:
        by_id: dict[int, tuple[AttentionBackend, list[int]]] = {}
        for layer in self.layers:
            backend = self.backends[layer]
            by_id.setdefault(id(backend), (backend, []))[1].append(layer)
        return tuple((b, tuple(ls)) for b, ls in by_id.values())

    def backend_layers(self) -> list[tuple[AttentionBackend, tuple[int, ...]]]:
        """Each distinct backend instance with its layers, ordered by its first layer."""
        return list(self._backend_layers)

    # ------------------------------------------------------------------ bytes

    def bytes_per_block(self, group: str) -> int:
        """Device bytes of one block of ``group`` across every layer and role."""
        return sum(e.block_bytes for e in self.entries_of(self.group(group).name))

    def host_page_bytes(self, group: str) -> int:
        """Bytes of one host page of ``group``: its offloaded roles, packed, no padding."""
        return sum(e.block_bytes for e in self.offload_entries(self.group(group).name))

    def kv_bytes_per_token(self) -> int:
        """Device bytes one more token of history costs, block-amortised, over full groups.

        ``sum(bytes_per_block(g) // block_size(g))`` over ``full`` groups: exact for
        uncompressed roles (e.g. 2 * layers * kv_heads * head_dim * itemsize for GQA), rounded
        down where a compressed role makes the per-token share fractional. Window and state
        groups cost a bounded amount per sequence instead; see ``cache_bytes_per_sequence``.
        """
        return sum(
            self.bytes_per_block(g.name) // g.block_size
            for g in self.groups
            if g.kind is GroupKind.FULL
        )
