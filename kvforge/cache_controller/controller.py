"""The variant-agnostic cache controller.

It knows no attention variant: everything it does is derived from what each layer's backend
declares (groups, roles) and decides (allocation overrides, swap selections, swap hooks).

Lifecycle::

    controller = CacheController(backends, device="cpu")
    controller.initialize_kv_cache(memory_budget=...)      # or num_blocks=...
    controller.initialize_host_cache(memory_budget=...)    # optional, for swaps
    controller.allocate("req-0", num_tokens)               # per step
    controller.slot_mapping("req-0", "kv", positions)
    handle = controller.swap_out("req-0"); ...; controller.swap_in("req-0")
    controller.free_request("req-0")
    controller.free()                                      # once; idempotent

Invariants: the cache list is layer-major and follows each backend's role order; an
operation that fails leaves pools, tables and host pages as they were; everything allocated
is freed exactly once by :meth:`CacheController.free`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvforge.attn_backends.base import AttentionBackend, SwapContext
from kvforge.cache_controller.block_pool import NULL_BLOCK
from kvforge.cache_controller.block_tables import BlockTables, check_request_id
from kvforge.cache_controller.layout import CacheLayout
from kvforge.cache_controller.memory_plan import MemoryPlan, plan_from_blocks, plan_memory
from kvforge.cache_controller.naming import DEFAULT_NAME_TEMPLATE, StorageNamer
from kvforge.errors import ControllerClosedError, RequestStateError
from kvforge.host_cache.host_pool import HostCacheAllocator, HostPools
from kvforge.host_cache.swap import SwapHandle, SwapStreams, move_pages, plane_bytes
from kvforge.ops import PlaneSet
from kvforge.platform import Platform, get_platform
from kvforge.specs import SwapPurpose, TokenRange

__all__ = ["CacheController", "SwapStats"]


@dataclass
class _SwappedRequest:
    """A request whose blocks live in host pages."""

    num_tokens: int
    purpose: SwapPurpose
    pages: dict[str, list[int]]
    """Host page ids per group."""
    indices: dict[str, list[int]]
    """Block-table index each page belongs to, per group (same order as ``pages``)."""


@dataclass
class SwapStats:
    """Counters of the swaps a controller has run."""

    swaps_out: int = 0
    swaps_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    blocks_out: dict[str, int] = field(default_factory=dict)
    blocks_in: dict[str, int] = field(default_factory=dict)


def _one_sizing(num_blocks: object, memory_budget: object) -> None:
    if (num_blocks is None) == (memory_budget is None):
        raise ValueError(
            "give exactly one of num_blocks or memory_budget, got "
            f"num_blocks={num_blocks!r}, memory_budget={memory_budget!r}"
        )


def _count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


class CacheController:
    """Allocates, names, orders, pages and offloads the caches of a model.

    Args:
        backends: layer id -> backend. Layers may use different backends; an instance may
            serve many layers.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"npu"`` or ``"auto"``.
        rank: tensor-parallel rank (used in storage names).
        device_id: device ordinal used in storage names (default: the device's index or 0).
        name_template: storage-name template (see :mod:`kvforge.cache_controller.naming`).

    Raises:
        ValueError / TypeError: bad mapping, inconsistent declarations, two backends that
            declare one group name differently, an unknown device, a bad template.
    """

    def __init__(
        self,
        backends: Mapping[int, AttentionBackend],
        device: str | torch.device = "cpu",
        rank: int = 0,
        device_id: int | None = None,
        name_template: str = DEFAULT_NAME_TEMPLATE,
    ) -> None:
        self.layout = CacheLayout(backends)
        self.platform: Platform = get_platform(device)
        self.rank = _count("rank", rank)
        if device_id is None:
            device_id = self.platform.device.index or 0
        self.device_id = _count("device_id", device_id)
        self.namer = StorageNamer(name_template, self.rank, self.device_id)
        self._caches: list[torch.Tensor] | None = None
        # group -> its offloadable planes, validated once (groups with none never move)
        self._planes: dict[str, PlaneSet] = {}
        self._names: list[str] = [
            self.namer.name(e.role.name, e.layer) for e in self.layout.entries
        ]
        self._tables: BlockTables | None = None
        self._plan: MemoryPlan | None = None
        self._host: HostPools | None = None
        self._host_caches: list[dict[tuple[str, int], torch.Tensor]] = []
        self._swapped: dict[str, _SwappedRequest] = {}
        self._streams: SwapStreams | None = None
        self._closed = False
        self.stats = SwapStats()

    # ================================================================== declarations

    @property
    def device(self) -> torch.device:
        return self.platform.device

    @property
    def groups(self) -> list[str]:
        """Group names in the controller's deterministic order."""
        return [g.name for g in self.layout.groups]

    def bytes_per_block(self, group: str) -> int:
        """Device bytes of one block of ``group`` over every layer and role."""
        return self.layout.bytes_per_block(group)

    def kv_bytes_per_token(self) -> int:
        """Device bytes one token of full-attention history costs (see ``CacheLayout``)."""
        return self.layout.kv_bytes_per_token()

    def storage_name(self, role: str, layer: int) -> str:
        """The stable name of the buffer ``(role, layer)``."""
        return self._names[self.layout.entry(role, layer).index]

    @property
    def storage_names(self) -> list[str]:
        """Storage names in cache-list order."""
        return list(self._names)

    def index_of(self, role: str, layer: int) -> int:
        """Position of ``(role, layer)`` in :attr:`kv_caches`; kernels use it, never ``2*l+1``."""
        return self.layout.entry(role, layer).index

    def plan_memory(
        self,
        memory_budget: int,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
    ) -> MemoryPlan:
        """The plan :meth:`initialize_kv_cache` would allocate for these arguments."""
        return plan_memory(self.layout, memory_budget, max_num_seqs, max_model_len)

    # ================================================================== device caches

    def initialize_kv_cache(
        self,
        num_blocks: int | Mapping[str, int] | None = None,
        memory_budget: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
    ) -> MemoryPlan:
        """Allocate every device cache.

        Give either ``num_blocks`` (an int for every group, or group -> int; physical blocks
        including the reserved null block, so at least 2) or ``memory_budget`` in bytes
        (optionally with ``max_num_seqs`` and ``max_model_len``; see :func:`plan_memory`).

        Returns:
            the plan that was allocated.
        """
        self._check_open()
        if self._caches is not None:
            raise RuntimeError("initialize_kv_cache was already called on this controller")
        _one_sizing(num_blocks, memory_budget)
        if num_blocks is not None:
            if max_num_seqs is not None or max_model_len is not None:
                raise ValueError(
                    "max_num_seqs / max_model_len go with memory_budget, not num_blocks"
                )
            plan = plan_from_blocks(self.layout, self._blocks_per_group(num_blocks))
        else:
            plan = self.plan_memory(
                _count("memory_budget", memory_budget), max_num_seqs, max_model_len
            )
        blocks = plan.num_blocks
        tables = BlockTables(self.layout.groups, blocks)
        created: dict[tuple[str, int], torch.Tensor] = {}
        for backend, layers in self.layout.backend_layers():
            caches = backend.create_kv_cache(layers, dict(blocks), self.device)
            self._check_created(backend, layers, blocks, caches)
            created.update(caches)
        self._caches = [created[e.key] for e in self.layout.entries]
        self._planes = {
            g.name: PlaneSet(
                [plane_bytes(self._caches[e.index]) for e in self.layout.offload_entries(g.name)]
            )
            for g in self.layout.groups
            if self.layout.offload_entries(g.name)
        }
        self._tables = tables
        self._plan = plan
        self._streams = SwapStreams.create(self.platform)
        return plan

    def _blocks_per_group(self, num_blocks: int | Mapping[str, int]) -> dict[str, int]:
        names = self.groups
        if isinstance(num_blocks, Mapping):
            unknown = sorted(set(num_blocks) - set(names))
            missing = [n for n in names if n not in num_blocks]
            if unknown or missing:
                raise ValueError(
                    f"num_blocks must name every group exactly: unknown {unknown}, missing "
                    f"{missing} (groups are {names})"
                )
            blocks = {n: num_blocks[n] for n in names}
        else:
            blocks = dict.fromkeys(names, num_blocks)
        for name, count in blocks.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 2:
                raise ValueError(
                    f"num_blocks[{name!r}] must be an int >= 2 (one usable block plus the "
                    f"reserved null block), got {count!r}"
                )
        return blocks

    def _check_created(
        self,
        backend: AttentionBackend,
        layers: tuple[int, ...],
        blocks: Mapping[str, int],
        caches: Mapping[tuple[str, int], torch.Tensor],
    ) -> None:
        expected = {(r.name, layer) for layer in layers for r in backend.cache_roles()}
        if set(caches) != expected:
            raise ValueError(
                f"{backend!r}.create_kv_cache returned keys {sorted(caches)}, expected "
                f"{sorted(expected)}"
            )
        for layer in layers:
            for role in backend.cache_roles():
                t = caches[(role.name, layer)]
                shape = (blocks[role.group], *backend.block_shape(role))
                if tuple(t.shape) != shape or t.dtype != role.torch_dtype:
                    raise ValueError(
                        f"{backend!r}.create_kv_cache gave ({role.name!r}, {layer}) shape "
                        f"{tuple(t.shape)} dtype {t.dtype}; expected {shape} {role.torch_dtype}"
                    )
                if t.device.type != self.device.type:
                    raise ValueError(
                        f"{backend!r}.create_kv_cache put ({role.name!r}, {layer}) on {t.device}, "
                        f"expected {self.device}"
                    )

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Every device cache, layer-major, roles in each backend's declared order."""
        return list(self._ready_caches())

    @property
    def cache_map(self) -> dict[str, torch.Tensor]:
        """Storage name -> device cache."""
        return dict(zip(self._names, self._ready_caches(), strict=True))

    def get(self, role: str, layer: int) -> torch.Tensor:
        """The device cache of ``(role, layer)``."""
        return self._ready_caches()[self.index_of(role, layer)]

    @property
    def memory_plan(self) -> MemoryPlan:
        self._ready_caches()
        assert self._plan is not None
        return self._plan

    @property
    def device_bytes(self) -> int:
        """Bytes of device cache held (0 before initialisation and after :meth:`free`)."""
        return sum(t.numel() * t.element_size() for t in self._caches or [])

    def _ready_caches(self) -> list[torch.Tensor]:
        self._check_open()
        if self._caches is None:
            raise RuntimeError("call initialize_kv_cache before using the caches")
        return self._caches

    def _ready_tables(self) -> BlockTables:
        self._ready_caches()
        assert self._tables is not None
        return self._tables

    def _check_open(self) -> None:
        if self._closed:
            raise ControllerClosedError(
                "this CacheController was freed; its caches are gone (create a new controller)"
            )

    # ================================================================== requests

    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Grow ``request_id``'s block tables in every group to cover ``num_tokens`` tokens.

        All-or-nothing: if any group lacks blocks, :class:`OutOfBlocksError` names it (blocks
        needed and free) and no pool changes. Blocks that fall wholly outside a window go back
        to their pool.
        """
        tables = self._ready_tables()
        if check_request_id(request_id) in self._swapped:
            raise RequestStateError(f"request {request_id!r} is swapped out; swap_in it first")
        tables.allocate(request_id, num_tokens)

    def free_request(self, request_id: str) -> None:
        """Return every device block and host page of ``request_id``."""
        tables = self._ready_tables()
        swapped = self._swapped.pop(check_request_id(request_id), None)
        if swapped is not None:
            assert self._host is not None
            self._host.free(swapped.pages)
            return
        tables.release(request_id)

    def num_tokens(self, request_id: str) -> int:
        """Tokens ``request_id`` holds (on the device or swapped out)."""
        swapped = self._swapped.get(check_request_id(request_id))
        if swapped is not None:
            return swapped.num_tokens
        return self._ready_tables().get(request_id).num_tokens

    @property
    def requests(self) -> list[str]:
        """Ids of requests that hold device blocks, sorted."""
        return sorted(self._ready_tables().requests)

    @property
    def swapped_requests(self) -> list[str]:
        """Ids of requests whose caches are in host memory, sorted."""
        return sorted(self._swapped)

    def is_swapped(self, request_id: str) -> bool:
        return check_request_id(request_id) in self._swapped

    def block_table(self, request_id: str, group: str) -> list[int]:
        """``request_id``'s block table in ``group`` (null id 0 where it holds no block)."""
        return self._ready_tables().table(request_id, group)

    def slot_mapping(
        self,
        request_id: str,
        group: str,
        positions: Sequence[int] | torch.Tensor,
        compress_ratio: int = 1,
    ) -> torch.Tensor:
        """Cache slots of ``positions`` (int64, -1 where none is written); see BlockTables."""
        return self._ready_tables().slot_mapping(request_id, group, positions, compress_ratio)

    def num_free_blocks(self, group: str) -> int:
        return self._ready_tables().pools[self.layout.group(group).name].num_free

    def num_used_blocks(self, group: str) -> int:
        return self._ready_tables().pools[self.layout.group(group).name].num_used

    def num_usable_blocks(self, group: str) -> int:
        return self._ready_tables().pools[self.layout.group(group).name].num_usable

    # ================================================================== host cache

    def initialize_host_cache(
        self,
        num_blocks: int | Mapping[str, int] | None = None,
        memory_budget: int | None = None,
    ) -> MemoryPlan:
        """Allocate the pinned host pools (page-first, one per group with offloaded roles).

        Give ``num_blocks`` (pages per group, the reserved null page included) or
        ``memory_budget`` in bytes (split like the device budget).
        """
        self._ready_caches()
        if self._host is not None:
            raise RuntimeError("initialize_host_cache was already called on this controller")
        _one_sizing(num_blocks, memory_budget)
        if num_blocks is not None:
            plan = plan_from_blocks(self.layout, self._blocks_per_group(num_blocks), host=True)
        else:
            plan = plan_memory(self.layout, _count("memory_budget", memory_budget), host=True)
        pages = plan.num_blocks
        self._host = HostPools(self.layout, pages, self.platform)
        allocator = HostCacheAllocator(self._host)
        self._host_caches = [
            backend.create_host_kv_cache(layers, pages, allocator)
            for backend, layers in self.layout.backend_layers()
        ]
        return plan

    @property
    def host_bytes(self) -> int:
        """Bytes of host pages held (0 before initialisation and after :meth:`free`)."""
        return self._host.nbytes if self._host is not None else 0

    @property
    def host_kv_caches(self) -> dict[tuple[str, int], torch.Tensor]:
        """``(role, layer)`` -> host view made by the backends' ``create_host_kv_cache``."""
        merged: dict[tuple[str, int], torch.Tensor] = {}
        for caches in self._host_caches:
            merged.update(caches)
        return merged

    def host_pool_usage(self) -> dict[str, tuple[int, int]]:
        """Group -> (used pages, usable pages) of the host pools."""
        self._ready_host()
        assert self._host is not None
        return {n: (p.pool.num_used, p.pool.num_usable) for n, p in self._host.groups.items()}

    def _ready_host(self) -> HostPools:
        self._ready_caches()
        if self._host is None:
            raise RuntimeError("call initialize_host_cache before swapping")
        return self._host

    # ================================================================== swaps

    def _selection(self, request_id: str, purpose: SwapPurpose) -> dict[str, list[int]]:
        """Block-table indices to move per group, asked of each role's backend."""
        state = self._ready_tables().get(request_id)
        n = state.num_tokens
        selected: dict[str, list[int]] = {}
        for group in self.layout.groups:
            start, end = n, 0
            for backend, role in self.layout.offload_roles(group.name):
                r = backend.offload_selection(role, n, purpose)
                if not isinstance(r, TokenRange) or r.end > n:
                    raise ValueError(
                        f"{backend!r}.offload_selection({role.name!r}, {n}, {purpose.value!r}) "
                        f"returned {r!r}; expected a TokenRange within [0, {n})"
                    )
                if not r.empty:
                    start, end = min(start, r.start), max(end, r.end)
            table = state.tables[group.name]
            if start >= end:
                selected[group.name] = []
                continue
            first, last = start // group.block_size, (end - 1) // group.block_size
            selected[group.name] = [i for i in range(first, last + 1) if table[i] != NULL_BLOCK]
        return selected

    def _swap_context(
        self,
        backend: AttentionBackend,
        layers: tuple[int, ...],
        request_id: str,
        num_tokens: int,
        purpose: SwapPurpose,
        device_blocks: dict[str, list[int]],
    ) -> SwapContext:
        caches = self._ready_caches()
        return SwapContext(
            request_id=request_id,
            num_tokens=num_tokens,
            purpose=purpose,
            layer_ids=layers,
            caches={e.key: caches[e.index] for e in self.layout.entries_of_layers(layers)},
            device_blocks=device_blocks,
        )

    def swap_out(self, request_id: str, purpose: SwapPurpose | str = "preempt") -> SwapHandle:
        """Move ``request_id``'s live blocks to host pages and free its device blocks.

        What moves is asked of each backend (``offload_selection``): by default every block of
        full groups, the blocks covering the last ``window`` tokens of sliding-window groups,
        and the newest state blocks of state groups (skipped for purpose ``"prefix"``).

        Raises:
            OutOfBlocksError: the host pools lack pages (nothing changed).
            RequestStateError: unknown request, or already swapped out.
        """
        return self.swap_out_many([request_id], purpose)[0]

    def swap_out_many(
        self, request_ids: Sequence[str], purpose: SwapPurpose | str = "preempt"
    ) -> list[SwapHandle]:
        """:meth:`swap_out` for several requests at once, all or nothing.

        Each group's blocks of every request move in one data-path call (one gather launch
        per pipeline chunk on accelerators, one kernel call on CPU), where a loop of
        :meth:`swap_out` pays the fixed cost of a call once per request and group. That is
        what an engine preempting several requests in one step wants.

        Returns:
            One handle per request, in order. They share one event: waiting on any of them
            waits for the whole batch.

        Hooks: ``before_swap_out`` runs for every request before any byte moves. If it raises
        for one of them, nothing is swapped and the host pages are given back, but the hooks
        of the requests before it have run (there is no abort hook).

        Raises:
            OutOfBlocksError: the host pools lack pages for the whole batch (nothing changed).
            RequestStateError: an unknown request, or one already swapped out (nothing changed).
            ValueError: a request id appears twice, or an unknown purpose.
        """
        host = self._ready_host()
        tables = self._ready_tables()
        try:
            purpose = SwapPurpose(purpose)
        except ValueError:
            raise ValueError(
                f"purpose must be one of {[p.value for p in SwapPurpose]}, got {purpose!r}"
            ) from None
        ids = self._batch_ids(request_ids)
        for request_id in ids:
            if request_id in self._swapped:
                raise RequestStateError(f"request {request_id!r} is already swapped out")
            tables.get(request_id)  # unknown ids raise before anything changes
        moving: dict[str, dict[str, list[int]]] = {}
        totals: dict[str, int] = {}
        for request_id in ids:
            selected = self._selection(request_id, purpose)
            moving[request_id] = {g: idx for g, idx in selected.items() if idx}
            for g, idx in moving[request_id].items():
                totals[g] = totals.get(g, 0) + len(idx)
        allocated = host.allocate(totals)

        try:  # a hook that raises leaves the host pools as they were
            pages: dict[str, dict[str, list[int]]] = {}
            handles: list[SwapHandle] = []
            device_blocks: dict[str, dict[str, list[int]]] = {}
            taken = dict.fromkeys(allocated, 0)
            for request_id in ids:
                state = tables.get(request_id)
                pages[request_id] = {}
                for g, idx in moving[request_id].items():
                    pages[request_id][g] = allocated[g][taken[g] : taken[g] + len(idx)]
                    taken[g] += len(idx)
                device_blocks[request_id] = {
                    g: [state.tables[g][i] for i in idx] for g, idx in moving[request_id].items()
                }
                handles.append(
                    self._handle(request_id, "out", purpose, state.num_tokens, moving[request_id])
                )
                for backend, layers in self.layout.backend_layers():
                    backend.before_swap_out(
                        self._swap_context(
                            backend,
                            layers,
                            request_id,
                            state.num_tokens,
                            purpose,
                            device_blocks[request_id],
                        )
                    )
            keep_alive = self._move_batch("out", ids, device_blocks, pages)
        except BaseException:
            self.platform.synchronize()  # no copy of a failed batch may still target the pages
            host.free(allocated)
            raise
        event = self._finish_copies()
        for request_id, handle in zip(ids, handles, strict=True):
            handle.event, handle.keep_alive = event, keep_alive
            num_tokens = tables.release(request_id).num_tokens
            self._swapped[request_id] = _SwappedRequest(
                num_tokens, purpose, pages[request_id], moving[request_id]
            )
            self._record_stats("out", handle)
        return handles

    def swap_in(self, request_id: str) -> SwapHandle:
        """Bring a swapped-out request back: new device blocks, scatter, free host pages.

        Device blocks are allocated all-or-nothing for the request's live window in every
        group; they generally differ from the blocks it had before, and the block tables are
        rebuilt to match. Roles that were not moved (state roles of a ``"prefix"`` swap) get
        blocks with undefined contents.

        Raises:
            OutOfBlocksError: the device pools lack blocks (nothing changed).
            RequestStateError: the request is not swapped out.
        """
        return self.swap_in_many([request_id])[0]

    def swap_in_many(self, request_ids: Sequence[str]) -> list[SwapHandle]:
        """:meth:`swap_in` for several requests at once, all or nothing (see
        :meth:`swap_out_many`).

        Returns:
            One handle per request, in order, sharing one event. ``after_swap_in`` runs once
            every request of the batch is resident.

        Raises:
            OutOfBlocksError: the device pools lack blocks for the whole batch (nothing
                changed).
            RequestStateError: a request that is not swapped out (nothing changed).
            ValueError: a request id appears twice.
        """
        host = self._ready_host()
        tables = self._ready_tables()
        ids = self._batch_ids(request_ids)
        swapped: dict[str, _SwappedRequest] = {}
        for request_id in ids:
            entry = self._swapped.get(request_id)
            if entry is None:
                raise RequestStateError(
                    f"request {request_id!r} is not swapped out "
                    f"(swapped out: {self.swapped_requests})"
                )
            swapped[request_id] = entry
        states = tables.adopt_many([(r, swapped[r].num_tokens) for r in ids])
        device_blocks = {
            r: {g: [state.tables[g][i] for i in idx] for g, idx in swapped[r].indices.items()}
            for r, state in zip(ids, states, strict=True)
        }
        handles = [
            self._handle(r, "in", swapped[r].purpose, swapped[r].num_tokens, swapped[r].indices)
            for r in ids
        ]
        try:
            pages = {r: swapped[r].pages for r in ids}
            keep_alive = self._move_batch("in", ids, device_blocks, pages)
        except BaseException:
            # A group may already have scattered (or queued its scatter) into the new blocks:
            # let it finish before they can be handed out again, then give them back.
            self.platform.synchronize()
            for r in ids:
                tables.release(r)
            raise
        event = self._finish_copies()
        # Bookkeeping for the whole batch first, so a hook that raises finds every request
        # resident and none half swapped in.
        for request_id, handle in zip(ids, handles, strict=True):
            handle.event, handle.keep_alive = event, keep_alive
            host.free(swapped[request_id].pages)
            del self._swapped[request_id]
            self._record_stats("in", handle)
        for request_id in ids:
            entry = swapped[request_id]
            for backend, layers in self.layout.backend_layers():
                backend.after_swap_in(
                    self._swap_context(
                        backend,
                        layers,
                        request_id,
                        entry.num_tokens,
                        entry.purpose,
                        device_blocks[request_id],
                    )
                )
        return handles

    @staticmethod
    def _batch_ids(request_ids: Sequence[str]) -> list[str]:
        if isinstance(request_ids, str) or not isinstance(request_ids, Sequence):
            raise TypeError(
                f"request_ids must be a sequence of request ids, got {type(request_ids).__name__}"
            )
        ids = [check_request_id(r) for r in request_ids]
        seen: set[str] = set()
        for r in ids:
            if r in seen:
                raise ValueError(f"request_ids lists {r!r} twice")
            seen.add(r)
        return ids

    def _handle(
        self,
        request_id: str,
        direction: Literal["out", "in"],
        purpose: SwapPurpose,
        num_tokens: int,
        indices: dict[str, list[int]],
    ) -> SwapHandle:
        """A handle for one request of a batch, with the blocks and bytes it moves."""
        host = self._host
        assert host is not None
        handle = SwapHandle(request_id, direction, purpose, num_tokens)
        for group, idx in indices.items():
            handle.blocks_moved[group] = len(idx)
            handle.bytes_moved += len(idx) * host.groups[group].page_bytes
        return handle

    def _move_batch(
        self,
        direction: Literal["out", "in"],
        ids: list[str],
        device_blocks: dict[str, dict[str, list[int]]],
        pages: dict[str, dict[str, list[int]]],
    ) -> list[torch.Tensor]:
        """One ``move_pages`` per group for the blocks of every request in ``ids``."""
        host = self._host
        assert host is not None
        keep_alive: list[torch.Tensor] = []
        for group in (g.name for g in self.layout.groups):
            blocks = [b for r in ids for b in device_blocks[r].get(group, ())]
            if not blocks:
                continue
            move_pages(
                direction,
                self.platform,
                self._streams,
                self._planes[group],
                blocks,
                host.groups[group].pages,
                [p for r in ids for p in pages[r].get(group, ())],
                keep_alive,
            )
        return keep_alive

    def _record_stats(self, direction: Literal["out", "in"], handle: SwapHandle) -> None:
        stats = self.stats
        if direction == "out":
            stats.swaps_out += 1
            stats.bytes_out += handle.bytes_moved
            per_group = stats.blocks_out
        else:
            stats.swaps_in += 1
            stats.bytes_in += handle.bytes_moved
            per_group = stats.blocks_in
        for group, count in handle.blocks_moved.items():
            per_group[group] = per_group.get(group, 0) + count

    def _finish_copies(self) -> object:
        """Order later work on the current stream after the side-stream copies."""
        streams = self._streams
        event = self.platform.record_event(streams.compute if streams else None)
        if event is not None:  # pragma: no cover - accelerators only
            self.platform.current_stream_wait(event)
        return event

    # ================================================================== teardown

    def free(self) -> None:
        """Free every device cache, host page and host view, once. Idempotent."""
        if self._closed:
            return
        for (backend, _), caches in zip(
            self.layout.backend_layers(), self._host_caches, strict=False
        ):
            backend.free_host_kv_cache(caches)
        self._host_caches = []
        if self._host is not None:
            self._host.release()
        self._host = None
        self._swapped.clear()
        self._caches = None
        self._planes = {}
        self._tables = None
        self._streams = None
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._closed else ("ready" if self._caches is not None else "declared")
        return (
            f"CacheController({len(self.layout.layers)} layers, groups={self.groups}, "
            f"device={self.device}, {state})"
        )
