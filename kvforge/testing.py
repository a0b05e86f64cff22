"""Conformance kit for backend authors: ``check_backend`` runs every check in one call.

An author of an attention backend calls :func:`check_backend` from their own test suite::

    from kvforge.testing import check_backend

    def test_my_backend():
        report = check_backend(MyBackend(...))
        assert report.check("swap_round_trip").entries > 0

It builds a :class:`~kvforge.CacheController` over the backend (or a ``layer -> backend``
mapping) and runs, in order, the checks named in :data:`CHECKS`:

- ``declaration``: ``validate()`` passes, ``cache_roles()`` / ``cache_groups()`` return the same
  lists on every call, role names are unique, every role's group is declared, and the
  controller accepts the declarations together;
- ``bytes``: every tensor ``create_kv_cache`` returns (called directly, then through the
  controller's ``initialize_kv_cache(num_blocks=...)``) belongs to a declared role, has the
  declared dtype and device, ``num_blocks`` blocks in dim 0, exactly the declared shape, and a
  block that is one run of ``role.block_bytes(group)`` bytes;
- ``naming_and_order``: the cache list is layer-major and follows ``cache_roles()`` in each
  layer, ``index_of`` and ``get`` agree with it, storage names are unique, and a controller built
  from the same mapping in another insertion order gives the same names and order;
- ``no_overlap``: no two ``(role, layer)`` buffers share a byte (decided exactly by
  :func:`kvforge.worker.overlap.find_overlap`, whatever the controller itself enforces);
- ``swap_round_trip``: per purpose, unique bytes go into every live entry of a request, it is
  swapped out, the device blocks it held are overwritten with the complement of their bytes,
  another request takes the lowest free blocks, the request is swapped back in, and every entry
  its backend's ``offload_selection`` promises to keep for that purpose is compared byte for byte.

A failed check raises :class:`ConformanceError` (an ``AssertionError``, so test runners show it
as a failure) whose ``check`` attribute names the check and whose message says what was expected
and what was found. Bad arguments to :func:`check_backend` itself raise ``TypeError`` /
``ValueError`` before anything is built.

Invariants: the kit uses only the controller's public API and the backend's public methods;
every controller it builds is freed before it returns or raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

import torch

from kvforge._checks import check_int
from kvforge.attn_backends.base import AttentionBackend
from kvforge.controller import CacheController
from kvforge.core.memory_plan import blocks_per_group
from kvforge.platform import get_platform
from kvforge.scheduler.block_pool import NULL_BLOCK
from kvforge.specs import CacheGroup, CacheRole, SwapPurpose, TokenRange
from kvforge.verify import entry_bytes_for, write_request
from kvforge.worker.overlap import PlaneExtent, find_overlap, plane_extent

__all__ = [
    "CHECKS",
    "CheckResult",
    "ConformanceError",
    "ConformanceReport",
    "check_backend",
]

CHECKS: tuple[str, ...] = (
    "declaration",
    "bytes",
    "naming_and_order",
    "no_overlap",
    "swap_round_trip",
)
"""The checks :func:`check_backend` runs, in the order it runs them."""

_BLOCKER = "conformance-blocker"
_T = TypeVar("_T")


class ConformanceError(AssertionError):
    """A backend broke the contract.

    Attributes:
        check: the name of the failed check (one of :data:`CHECKS`).
        detail: what was expected and what was found.
    """

    def __init__(self, check: str, detail: str) -> None:
        self.check = check
        self.detail = detail
        super().__init__(f"conformance check {check!r} failed: {detail}")


@dataclass(frozen=True)
class CheckResult:
    """What one check covered.

    Attributes:
        name: the check (one of :data:`CHECKS`).
        buffers: ``(role, layer)`` buffers it looked at.
        entries: cache entries it covered: held by the buffers (``bytes``), compared byte for
            byte (``swap_round_trip``); 0 for checks that look at no entry.
        bytes: meaningful bytes it covered, the same way (``no_overlap``: bytes of every plane).
        note: a one-line summary.
    """

    name: str
    buffers: int
    entries: int
    bytes: int
    note: str


@dataclass(frozen=True)
class ConformanceReport:
    """The checks that ran, and what they were run with.

    Attributes:
        layers: the layer ids checked.
        num_blocks: device blocks per group (the null block included).
        tokens: tokens of the request used by the round trips.
        purposes: the swap purposes round-tripped.
        checks: one result per check, in :data:`CHECKS` order.
    """

    layers: tuple[int, ...]
    num_blocks: dict[str, int] = field(hash=False)
    tokens: int
    purposes: tuple[SwapPurpose, ...]
    checks: tuple[CheckResult, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.checks)

    def check(self, name: str) -> CheckResult:
        """The result of check ``name``."""
        for result in self.checks:
            if result.name == name:
                return result
        raise KeyError(f"no check named {name!r} ran; checks: {list(self.names)}")


# ====================================================================== arguments


def _as_mapping(backend_or_mapping: object) -> dict[int, AttentionBackend]:
    if isinstance(backend_or_mapping, AttentionBackend):
        # One instance serving two layers: the usual wiring, and it exercises layer-major order.
        return {0: backend_or_mapping, 1: backend_or_mapping}
    if not isinstance(backend_or_mapping, Mapping):
        raise TypeError(
            "backend_or_mapping must be an AttentionBackend or a mapping of layer id -> "
            f"AttentionBackend, got {type(backend_or_mapping).__name__}"
        )
    if not backend_or_mapping:
        raise ValueError("backend_or_mapping is an empty mapping: give at least one layer")
    checked: dict[int, AttentionBackend] = {}
    for layer, backend in backend_or_mapping.items():
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"backend_or_mapping has layer id {layer!r}; layer ids are ints >= 0")
        if not isinstance(backend, AttentionBackend):
            raise TypeError(
                f"backend_or_mapping[{layer}] is a {type(backend).__name__}, not an "
                "AttentionBackend"
            )
        checked[layer] = backend
    return checked


def _purposes(purposes: object) -> tuple[SwapPurpose, ...]:
    if isinstance(purposes, (str, SwapPurpose)) or not isinstance(purposes, Iterable):
        raise TypeError(f"purposes must be a sequence of swap purposes, got {purposes!r}")
    result: list[SwapPurpose] = []
    for p in purposes:
        try:
            purpose = SwapPurpose(p)
        except ValueError:
            raise ValueError(
                f"purposes has {p!r}; each must be one of {[x.value for x in SwapPurpose]}"
            ) from None
        if purpose in result:
            raise ValueError(f"purposes lists {purpose.value!r} twice")
        result.append(purpose)
    return tuple(result)


_AT_LEAST = "{name} must be >= {minimum}, got {value}"


def _positive(name: str, value: object, minimum: int) -> int:
    wording = {"type_message": "{name} must be an int, got {value}"}
    return check_int(name, value, minimum, **wording, range_message=_AT_LEAST)


def _default_tokens(groups: Mapping[str, CacheGroup]) -> int:
    # Three blocks of every group and two blocks past every window, plus one token so the last
    # block is partial: windows slide, blocks leave them, and compressed entries complete.
    span = max(max(3 * g.block_size, (g.window or 0) + 2 * g.block_size) for g in groups.values())
    return span + 1


def _held_blocks(group: CacheGroup, tokens: int) -> int:
    """Blocks a request of ``tokens`` tokens holds in ``group`` (those its live tokens touch)."""
    live = group.live_token_range(tokens)
    return (live.end - 1) // group.block_size - live.start // group.block_size + 1


def _device_blocks(
    num_blocks: object, groups: Mapping[str, CacheGroup], tokens: int
) -> dict[str, int]:
    # A request's first step writes every one of its tokens, so allocating it may take a block
    # for each before a window lets the oldest go; then a one-token blocker takes a block while
    # the request is out, and the null block is reserved: blocks_for(tokens) + 2 always fits.
    need = {name: g.blocks_for(tokens) + 2 for name, g in groups.items()}
    if num_blocks is None:
        return need
    blocks = blocks_per_group(list(groups), num_blocks)
    for name, count in blocks.items():
        if count < need[name]:
            raise ValueError(
                f"num_blocks[{name!r}] = {count} is too small for tokens={tokens}: the round "
                f"trip may hold {need[name] - 2} blocks of the request, 1 of a second request "
                f"and the null block, so it needs at least {need[name]}"
            )
    return blocks


# ====================================================================== check helpers


def _fail(check: str, detail: str, cause: BaseException | None = None) -> ConformanceError:
    error = ConformanceError(check, detail)
    error.__cause__ = cause
    return error


def _instances(
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
            raise _fail(
                "declaration",
                f"{backend!r}.{method}() must return a list of {kind.__name__}, call {n} "
                f"returned {value!r}",
            )
    for n in (1, 2):
        if calls[n] != calls[0]:
            raise _fail(
                "declaration",
                f"{backend!r}.{method}() returned different lists on calls 1 and {n + 1}: "
                f"{_difference(calls[0], calls[n])}; it must return the same list every call "
                "(its order is the cache-list order)",
            )
    return calls[0]


def _check_declaration(
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
            raise _fail("declaration", f"{backend!r}.validate() failed: {exc}", exc) from None
        by_name: dict[str, CacheGroup] = {}
        for group in groups:
            if by_name.setdefault(group.name, group) != group:
                raise _fail(
                    "declaration",
                    f"{backend!r} declares group {group.name!r} twice, differently: "
                    f"{by_name[group.name]!r} and {group!r}",
                )
        seen: set[str] = set()
        for role in roles:
            if role.name in seen:
                raise _fail("declaration", f"{backend!r} declares role {role.name!r} twice")
            seen.add(role.name)
            if role.group not in by_name:
                raise _fail(
                    "declaration",
                    f"{backend!r}: role {role.name!r} names group {role.group!r}, which it does "
                    f"not declare (declared: {sorted(by_name)})",
                )
        if not roles:
            raise _fail("declaration", f"{backend!r} declares no cache roles")
        roles_of[id(backend)] = roles
        groups_of[id(backend)] = by_name
        buffers += len(roles) * len(layers)
    return buffers, roles_of, groups_of


def _byte_rows(tensor: torch.Tensor, extent: PlaneExtent) -> torch.Tensor:
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
        raise _fail("bytes", f"{where} is a {type(tensor).__name__}, expected a torch.Tensor")
    if tensor.dtype != role.torch_dtype:
        raise _fail(
            "bytes",
            f"{where} has dtype {tensor.dtype}, expected {role.torch_dtype} (role "
            f"{role.name!r} declares dtype {role.dtype!r})",
        )
    if tensor.device.type != device.type:
        raise _fail("bytes", f"{where} is on {tensor.device}, expected {device}")
    if tensor.dim() == 0:
        raise _fail(
            "bytes",
            f"{where} is a 0-d tensor, expected dim 0 to hold num_blocks[{group.name!r}] = "
            f"{num_blocks} blocks",
        )
    if tensor.shape[0] != num_blocks:
        raise _fail(
            "bytes",
            f"{where} has block dim ({tensor.shape[0]},), expected num_blocks[{group.name!r}] = "
            f"{num_blocks}",
        )
    try:
        extent = plane_extent(where, tensor)
    except ValueError as exc:
        raise _fail("bytes", str(exc), exc) from None
    per_block = role.entries_per_block(group)
    want = role.block_bytes(group)
    if extent.block_bytes != want:
        raise _fail(
            "bytes",
            f"{where}: one block addresses {extent.block_bytes} bytes, expected "
            f"role.block_bytes = {per_block} entries * {role.entry_bytes} B = {want} "
            f"(shape {tuple(tensor.shape)})",
        )
    shape = (num_blocks, per_block, *role.entry_shape)
    if tuple(tensor.shape) != shape:
        raise _fail("bytes", f"{where} has shape {tuple(tensor.shape)}, expected {shape}")
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
    raise _fail("no_overlap", f"{stage}: {detail}")


def _run(check: str, what: str, call: Callable[[], _T]) -> _T:
    """``call()``, with any failure but a ConformanceError reported as a failure of ``check``."""
    try:
        return call()
    except ConformanceError:
        raise
    except Exception as exc:  # a backend's failure is the finding, whatever its type
        raise _fail(check, f"{what} raised {type(exc).__name__}: {exc}", exc) from None


# ====================================================================== the kit


def check_backend(
    backend_or_mapping: AttentionBackend | Mapping[int, AttentionBackend],
    *,
    device: str | torch.device = "cpu",
    num_blocks: int | Mapping[str, int] | None = None,
    tokens: int | None = None,
    purposes: Iterable[SwapPurpose | str] = ("preempt", "prefix"),
) -> ConformanceReport:
    """Run every conformance check on a backend and report what was covered.

    Args:
        backend_or_mapping: one backend (checked serving layers 0 and 1) or ``layer id ->
            backend``, as given to :class:`~kvforge.CacheController`.
        device: where device caches live.
        num_blocks: device blocks per group, the null block included (an int for every group or
            group -> int). Default: what the round trip needs for ``tokens``.
        tokens: tokens of the round-trip request. Default: three blocks of every group and two
            blocks past every window, plus one.
        purposes: swap purposes to round-trip (``"preempt"``, ``"prefix"``).

    Returns:
        one :class:`CheckResult` per check of :data:`CHECKS`.

    Raises:
        ConformanceError: a check failed; ``.check`` names it.
        TypeError / ValueError: bad arguments (raised before any cache is allocated).
    """
    backends = _as_mapping(backend_or_mapping)
    chosen = _purposes(purposes)
    if tokens is not None:
        _positive("tokens", tokens, 1)
    platform = get_platform(device)  # an unknown device is bad input, not a finding
    instances = _instances(backends)
    results: list[CheckResult] = []

    buffers, roles_of, groups_of = _check_declaration(instances)
    ctl = _run("declaration", "CacheController(...)", lambda: CacheController(backends, device))
    try:
        layout = _Layout(backends, roles_of, groups_of, ctl)
        groups = layout.groups
        n_tokens = tokens if tokens is not None else _default_tokens(groups)
        blocks = _device_blocks(num_blocks, groups, n_tokens)
        results.append(
            CheckResult(
                "declaration",
                buffers,
                0,
                0,
                f"{len(instances)} backend(s) over {len(backends)} layer(s), "
                f"{sum(len(r) for r in roles_of.values())} role(s), {len(groups)} group(s)",
            )
        )
        results.append(_check_bytes(layout, instances, blocks, platform.device))
        results.append(_check_naming_and_order(layout, backends, device))
        results.append(_check_controller_overlap(layout))
        results.append(_check_swaps(layout, blocks, n_tokens, chosen))
    finally:
        ctl.free()
    return ConformanceReport(
        layers=tuple(sorted(backends)),
        num_blocks=blocks,
        tokens=n_tokens,
        purposes=chosen,
        checks=tuple(results),
    )


@dataclass
class _Layout:
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


def _check_bytes(
    layout: _Layout,
    instances: list[tuple[AttentionBackend, tuple[int, ...]]],
    blocks: Mapping[str, int],
    device: torch.device,
) -> CheckResult:
    # First the backend's own create_kv_cache, so its mistakes are reported by this kit whatever
    # the controller refuses; the overlap of these tensors is checked here for the same reason.
    planes: list[PlaneExtent] = []
    alive: list[Mapping] = []  # freed memory is reused: keep every tensor until the overlap check
    for backend, layers in instances:
        caches = _run(
            "bytes",
            f"{backend!r}.create_kv_cache({list(layers)}, {dict(blocks)}, {device})",
            lambda b=backend, ls=layers: b.create_kv_cache(ls, dict(blocks), device),
        )
        if not isinstance(caches, Mapping):
            raise _fail(
                "bytes",
                f"{backend!r}.create_kv_cache returned a {type(caches).__name__}, expected a "
                "dict of (role, layer) -> tensor",
            )
        expected = [(r.name, layer) for layer in layers for r in layout.roles_of[id(backend)]]
        extra = [k for k in caches if k not in set(expected)]
        if extra:
            raise _fail(
                "bytes",
                f"{backend!r}.create_kv_cache returned {sorted(extra, key=repr)}, which its "
                f"cache_roles() do not declare for layers {list(layers)} (declared: "
                f"{[r.name for r in layout.roles_of[id(backend)]]})",
            )
        missing = [k for k in expected if k not in caches]
        if missing:
            raise _fail("bytes", f"{backend!r}.create_kv_cache returned nothing for {missing}")
        for role_name, layer in expected:
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

    ctl = layout.ctl
    _run(
        "bytes",
        f"CacheController.initialize_kv_cache(num_blocks={dict(blocks)})",
        lambda: ctl.initialize_kv_cache(num_blocks=dict(blocks)),
    )
    entries = nbytes = 0
    for role_name, layer in layout.keys:
        role, group = layout.spec(role_name, layer)
        tensor = _run(
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


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )


def _check_naming_and_order(
    layout: _Layout, backends: Mapping[int, AttentionBackend], device: str | torch.device
) -> CheckResult:
    ctl = layout.ctl
    keys = layout.keys
    caches = ctl.kv_caches
    names = ctl.storage_names
    if len(caches) != len(keys) or len(names) != len(keys):
        raise _fail(
            "naming_and_order",
            f"the controller lists {len(caches)} caches and {len(names)} storage names; the "
            f"declarations give {len(keys)} (role, layer) buffers",
        )
    for position, (role, layer) in enumerate(keys):
        index = ctl.index_of(role, layer)
        if index != position:
            raise _fail(
                "naming_and_order",
                f"index_of({role!r}, {layer}) is {index}, expected {position}: the cache list "
                f"is layer-major and follows cache_roles() within a layer, so it starts "
                f"{keys[: position + 1]}",
            )
        if not _same_buffer(ctl.get(role, layer), caches[position]):
            raise _fail(
                "naming_and_order",
                f"get({role!r}, {layer}) is not kv_caches[{position}]",
            )
    seen: dict[str, tuple[str, int]] = {}
    for name, key in zip(names, keys, strict=True):
        if name in seen:
            raise _fail(
                "naming_and_order",
                f"storage name {name!r} is given to both {seen[name]} and {key}",
            )
        seen[name] = key
    # The same inputs give the same list and names, however the mapping was built.
    reordered = dict(reversed(list(backends.items())))
    again = _run(
        "naming_and_order",
        "CacheController(reordered mapping)",
        lambda: CacheController(reordered, device),
    )
    try:
        if again.storage_names != names:
            raise _fail(
                "naming_and_order",
                "a controller built from the same mapping in reverse insertion order names the "
                f"caches {again.storage_names}, expected {names}",
            )
        moved = [k for k in keys if again.index_of(*k) != ctl.index_of(*k)]
        if moved:
            raise _fail(
                "naming_and_order",
                "a controller built from the same mapping in reverse insertion order moves "
                f"{moved}",
            )
    finally:
        again.free()
    return CheckResult(
        "naming_and_order",
        len(keys),
        0,
        0,
        "layer-major order, index_of / get / kv_caches agree, unique storage names, the same "
        "names and order from a reordered mapping",
    )


def _check_controller_overlap(layout: _Layout) -> CheckResult:
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


def _promised(
    layout: _Layout, tokens: int, purpose: SwapPurpose
) -> list[tuple[str, int, CacheRole, CacheGroup, TokenRange]]:
    """Per offloaded buffer, the token range its backend promises to keep for ``purpose``."""
    promised = []
    for role_name, layer in layout.keys:
        role, group = layout.spec(role_name, layer)
        if not role.offload:
            continue  # never moves: nothing is promised
        backend = layout.backends[layer]
        kept = _run(
            "swap_round_trip",
            f"{backend!r}.offload_selection({role_name!r}, {tokens}, {purpose.value!r})",
            lambda b=backend, r=role: b.offload_selection(r, tokens, purpose),
        )
        if not isinstance(kept, TokenRange) or kept.end > tokens:
            raise _fail(
                "swap_round_trip",
                f"{backend!r}.offload_selection({role_name!r}, {tokens}, {purpose.value!r}) "
                f"returned {kept!r}; expected a TokenRange within [0, {tokens}]",
            )
        if not kept.empty:
            promised.append((role_name, layer, role, group, kept))
    return promised


def _check_swaps(
    layout: _Layout, blocks: Mapping[str, int], tokens: int, purposes: tuple[SwapPurpose, ...]
) -> CheckResult:
    ctl = layout.ctl
    roles = [layout.spec(*k)[0] for k in layout.keys]
    if not purposes or not any(r.offload for r in roles):
        why = "no purpose was asked for" if not purposes else "no role is offloaded"
        return CheckResult("swap_round_trip", 0, 0, 0, f"nothing to swap: {why}")
    # Host pages: what the request holds, plus the null page.
    pages = {g: _held_blocks(spec, tokens) + 1 for g, spec in layout.groups.items()}
    _run(
        "swap_round_trip",
        f"CacheController.initialize_host_cache(num_pages={pages})",
        lambda: ctl.initialize_host_cache(num_pages=pages),
    )
    buffers: set[tuple[str, int]] = set()
    entries = nbytes = 0
    notes = []
    for seed, purpose in enumerate(purposes, start=1):
        rid = f"conformance-{purpose.value}"
        compared, compared_bytes, touched = _round_trip(layout, rid, seed, tokens, purpose)
        buffers |= touched
        entries += compared
        nbytes += compared_bytes
        notes.append(f"{purpose.value}: {compared} entries")
    return CheckResult(
        "swap_round_trip",
        len(buffers),
        entries,
        nbytes,
        f"{tokens} tokens; " + ", ".join(notes) + " compared byte for byte after swap in",
    )


def _round_trip(
    layout: _Layout, rid: str, seed: int, tokens: int, purpose: SwapPurpose
) -> tuple[int, int, set[tuple[str, int]]]:
    ctl = layout.ctl
    check = "swap_round_trip"
    _run(check, f"allocate({rid!r}, {tokens})", lambda: ctl.allocate(rid, tokens))
    _run(
        check,
        f"kvforge.verify.write_request({rid!r})",
        lambda: write_request(ctl, rid, seed, range(tokens)),
    )
    promised = _promised(layout, tokens, purpose)
    held = {g: [b for b in ctl.block_table(rid, g) if b != NULL_BLOCK] for g in layout.groups}
    _run(
        check,
        f"swap_out({rid!r}, {purpose.value!r})",
        lambda: ctl.swap_out(rid, purpose).wait(),
    )
    # Every byte of the blocks the request held changes, so nothing stale can pass for kept.
    for role_name, layer in layout.keys:
        _, group = layout.spec(role_name, layer)
        tensor = ctl.get(role_name, layer)
        rows = _byte_rows(tensor, plane_extent("scribble", tensor))
        ids = torch.tensor(held[group.name], dtype=torch.int64, device=tensor.device)
        if len(ids):
            rows[ids] = torch.bitwise_not(rows[ids])
    _run(check, f"allocate({_BLOCKER!r}, 1)", lambda: ctl.allocate(_BLOCKER, 1))
    _run(check, f"swap_in({rid!r})", lambda: ctl.swap_in(rid).wait())

    compared = compared_bytes = mismatched = 0
    first_bad = ""
    touched: set[tuple[str, int]] = set()
    for role_name, layer, role, group, kept in promised:
        positions = torch.arange(kept.start, kept.end, dtype=torch.int64)
        slots = ctl.slot_mapping(rid, group.name, positions, role.compress_ratio).cpu()
        live = slots >= 0
        positions, slots = positions[live], slots[live]
        if not len(slots):
            continue
        tensor = ctl.get(role_name, layer)
        rows = _byte_rows(tensor, plane_extent("read", tensor))
        per_block, eb = role.entries_per_block(group), role.entry_bytes
        at = slots.to(tensor.device)
        got = rows.view(-1, per_block, eb)[at // per_block, at % per_block].cpu()
        want = entry_bytes_for(seed, layout.ctl.layout.entry(role_name, layer), positions, eb)
        bad = (got != want).any(dim=1)
        touched.add((role_name, layer))
        compared += len(slots)
        compared_bytes += len(slots) * eb
        if bool(bad.any()):
            mismatched += int(bad.sum())
            if not first_bad:
                k = int(bad.nonzero()[0, 0])
                first_bad = (
                    f"{layout.name(role_name, layer)} position {int(positions[k])} (slot "
                    f"{int(slots[k])}): expected bytes {want[k, :8].tolist()}..., found "
                    f"{got[k, :8].tolist()}..."
                )
    if mismatched:
        raise _fail(
            check,
            f"purpose {purpose.value!r}: {mismatched} of {compared} entries that "
            f"offload_selection promises to keep differ after swap out, overwrite and swap in; "
            f"first: {first_bad}",
        )
    ctl.free_request(rid)
    ctl.free_request(_BLOCKER)
    return compared, compared_bytes, touched
