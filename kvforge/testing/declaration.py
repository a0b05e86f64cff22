"""The ``declaration`` check, and the expected buffers every later check compares with:
``validate()`` passes, ``cache_roles()`` / ``cache_groups()`` are stable across calls, role
names are unique and every role's group is declared. :class:`KitLayout` derives the expected
``(role, layer)`` order, groups and names from the declarations alone, never from controller
internals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from kvforge.attn_backends.base import AttentionBackend
from kvforge.controller import CacheController
from kvforge.specs import CacheGroup, CacheRole
from kvforge.testing.results import fail


def backend_instances(
    backends: Mapping[int, AttentionBackend],
) -> list[tuple[AttentionBackend, tuple[int, ...]]]:
    """Distinct backend instances with their layers, ordered by their first layer."""
    layers: dict[int, list[int]] = {}
    first: dict[int, AttentionBackend] = {}
    for layer in sorted(backends):
        backend = backends[layer]
        layers.setdefault(id(backend), []).append(layer)
        first.setdefault(id(backend), backend)
    return [(first[key], tuple(ls)) for key, ls in sorted(layers.items(), key=lambda kv: kv[1])]


def _difference(first: list, other: list) -> str:
    names = [getattr(x, "name", repr(x)) for x in first]
    other_names = [getattr(x, "name", repr(x)) for x in other]
    if names != other_names:
        return f"{names} then {other_names}"
    k = next(k for k, (a, b) in enumerate(zip(first, other, strict=True)) if a != b)
    return f"item {k} {first[k]!r} then {other[k]!r}"


def _stable(backend: AttentionBackend, method: str, kind: type) -> list:
    calls = [getattr(backend, method)() for _ in range(3)]
    for n, value in enumerate(calls, 1):
        if not isinstance(value, list) or not all(isinstance(x, kind) for x in value):
            raise fail(
                "declaration",
                f"{backend!r}.{method}() must return a list of {kind.__name__}, call {n} "
                f"returned {value!r}",
            )
    for n in (1, 2):
        if calls[n] != calls[0]:
            raise fail(
                "declaration",
                f"{backend!r}.{method}() returned different lists on calls 1 and {n + 1}: "
                f"{_difference(calls[0], calls[n])}; it must return the same list every call "
                "(its order is the cache-list order)",
            )
    return calls[0]


def check_declaration(
    instances: list[tuple[AttentionBackend, tuple[int, ...]]],
) -> tuple[int, dict[int, list[CacheRole]], dict[int, dict[str, CacheGroup]]]:
    roles_of: dict[int, list[CacheRole]] = {}
    groups_of: dict[int, dict[str, CacheGroup]] = {}
    buffers = 0
    for backend, layers in instances:
        roles = _stable(backend, "cache_roles", CacheRole)
        groups = _stable(backend, "cache_groups", CacheGroup)
        try:
            backend.validate()
        except Exception as exc:  # whatever a broken declaration raises is the finding
            raise fail("declaration", f"{backend!r}.validate() failed: {exc}", exc) from None
        by_name: dict[str, CacheGroup] = {}
        for group in groups:
            if by_name.setdefault(group.name, group) != group:
                raise fail(
                    "declaration",
                    f"{backend!r} declares group {group.name!r} twice, differently: "
                    f"{by_name[group.name]!r} and {group!r}",
                )
        seen: set[str] = set()
        for role in roles:
            if role.name in seen:
                raise fail("declaration", f"{backend!r} declares role {role.name!r} twice")
            seen.add(role.name)
            if role.group not in by_name:
                raise fail(
                    "declaration",
                    f"{backend!r}: role {role.name!r} names group {role.group!r}, which it does "
                    f"not declare (declared: {sorted(by_name)})",
                )
        if not roles:
            raise fail("declaration", f"{backend!r} declares no cache roles")
        roles_of[id(backend)] = roles
        groups_of[id(backend)] = by_name
        buffers += len(roles) * len(layers)
    return buffers, roles_of, groups_of


@dataclass
class KitLayout:
    """The expected buffers, from the declarations alone (never from controller internals)."""

    backends: Mapping[int, AttentionBackend]
    roles_of: dict[int, list[CacheRole]]
    groups_of: dict[int, dict[str, CacheGroup]]
    ctl: CacheController

    @cached_property
    def keys(self) -> list[tuple[str, int]]:
        """``(role, layer)`` in the contract's order: layer-major, then ``cache_roles()``."""
        return [
            (role.name, layer)
            for layer in sorted(self.backends)
            for role in self.roles_of[id(self.backends[layer])]
        ]

    @cached_property
    def groups(self) -> dict[str, CacheGroup]:
        """Every group, by first use in :attr:`keys` (the controller checked that backends
        declaring one name agree on its spec)."""
        groups: dict[str, CacheGroup] = {}
        for role, layer in self.keys:
            group = self.spec(role, layer)[1]
            groups.setdefault(group.name, group)
        return groups

    @cached_property
    def storage_names(self) -> list[str]:
        return self.ctl.storage_names

    def spec(self, role: str, layer: int) -> tuple[CacheRole, CacheGroup]:
        backend = self.backends[layer]
        spec = next(r for r in self.roles_of[id(backend)] if r.name == role)
        return spec, self.groups_of[id(backend)][spec.group]

    def name(self, role: str, layer: int) -> str:
        return f"{self.storage_names[self.ctl.index_of(role, layer)]} ({role!r}, {layer})"
