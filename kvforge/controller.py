"""The one-process facade over both sides of the cache.

:class:`CacheController` owns a scheduler side (:class:`BlockManager`: pools, tables, swap
bookkeeping) and a worker side (:class:`~kvforge.worker.CacheStorage`: device caches, host
pages, copies) and passes the plain values between them, so a program that runs both in one
process calls one object. Engines that schedule in one process and run workers in others use
the two sides directly (see ``docs/architecture.md``).

Lifecycle::

    controller = CacheController(backends, device="cpu")
    controller.initialize_kv_cache(memory_budget=...)      # or num_blocks=...
    controller.initialize_host_cache(memory_budget=...)    # optional, for swaps
    controller.schedule(["req-0"], [num_tokens])           # per step, the whole batch
    controller.allocate("req-0", num_tokens)               # or one request at a time
    controller.slot_mapping("req-0", "kv", positions)
    handle = controller.swap_out("req-0"); ...; controller.swap_in("req-0")
    controller.free_request("req-0")
    controller.free()                                      # once; idempotent

Invariants: the cache list is layer-major and follows each backend's role order; an
operation that fails leaves pools, tables and host pages as they were; everything allocated
is freed exactly once by :meth:`CacheController.free`. Every public method holds one lock,
so threads may share a controller (calls are serialised).

The module is over 800 lines because it is the whole public surface of both sides, one thin
locked method per verb; splitting it would split the one object a program calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvforge._checks import check_int, check_integer, locked
from kvforge.attn_backends.base import AttentionBackend
from kvforge.core.flow import plan_with_arena
from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import (
    DEFAULT_MAX_NUM_SEQS,
    MemoryPlan,
    blocks_per_group,
    plan_from_blocks,
    plan_memory,
    shared_pool_blocks,
)
from kvforge.core.naming import DEFAULT_NAME_TEMPLATE
from kvforge.core.values import (
    PageCopy,
    PrefixMatch,
    PrefixQuery,
    StepAllocation,
    SwapFailure,
    SwapPlan,
    SwapResult,
    check_request_id,
)
from kvforge.errors import (
    ControllerClosedError,
    OutOfBlocksError,
    RequestStateError,
    StepError,
    add_note,
)
from kvforge.kinds import live_start
from kvforge.options import (
    UNSET,
    CacheOptions,
    HostTierOptions,
    PlanOptions,
    Unset,
    merge_keywords,
)
from kvforge.platform import Platform
from kvforge.remote_tier import RemoteTier, check_model_identity, layout_fingerprint
from kvforge.scheduler import host_tier
from kvforge.scheduler.block_manager import BlockManager, PrefixStats, SwapStats
from kvforge.scheduler.host_tier import (
    HostTier,
    HostTierPolicy,
    SnapshotPolicy,
    declared_snapshot_policy,
)
from kvforge.scheduler.prefix import Retention
from kvforge.specs import CacheGroup, SwapPurpose
from kvforge.worker import host_memory
from kvforge.worker.storage import CacheStorage, StepInputs, SwapExecution
from kvforge.worker.tier_pages import HostTierPages
from kvforge.worker.transfer import SwapHandle

if TYPE_CHECKING:
    from kvforge.core.model_identity import ModelIdentity
    from kvforge.store import StoreConfig
    from kvforge.store.protocol import RemoteStore

__all__ = ["CacheController", "ScheduledStep", "SwapStats"]


@dataclass(frozen=True)
class ScheduledStep:
    """One step through the facade: what the scheduler side decided and what the worker
    side computed from it."""

    allocation: StepAllocation
    inputs: StepInputs


def _one_sizing(count: object, memory_budget: object, name: str = "num_blocks") -> None:
    if (count is None) == (memory_budget is None):
        raise ValueError(
            f"give exactly one of {name} or memory_budget, got "
            f"{name}={count!r}, memory_budget={memory_budget!r}"
        )


class CacheController:
    """Allocates, names, orders, pages and offloads the caches of a model, in one process.

    Args:
        backends: layer id -> backend. Layers may use different backends; an instance may
            serve many layers.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"npu"`` or ``"auto"``.
        rank: tensor-parallel rank (used in storage names).
        device_id: device ordinal used in storage names (default: the device's index or 0).
        name_template: storage-name template (see :mod:`kvforge.core.naming`).
        options: a :class:`~kvforge.options.CacheOptions`: prefix caching (on or off, the key
            algorithm, the snapshot interval, the retention of window and state blocks) and
            pool sharing, validated once. Default: ``CacheOptions()``, or the one the keywords
            below build.
        enable_prefix_caching, share_pools, prefix_retention, prefix_retention_interval: the
            :class:`~kvforge.options.CacheOptions` fields of those names, as keywords (they
            build the options object; give each either here or in ``options``, not both).

    Raises:
        ArgumentError: a bad option (named, with its value), ``options`` that is not a
            ``CacheOptions``, or a setting given both as a keyword and in ``options``.
        ValueError / TypeError: bad mapping, inconsistent declarations, two backends that
            declare one group name differently, an unknown device, a bad template, a template
            that gives two buffers one name.
    """

    def __init__(
        self,
        backends: Mapping[int, AttentionBackend],
        device: str | torch.device = "cpu",
        rank: int = 0,
        device_id: int | None = None,
        name_template: str = DEFAULT_NAME_TEMPLATE,
        enable_prefix_caching: bool | Unset = UNSET,
        share_pools: bool | Unset = UNSET,
        prefix_retention: Retention | Unset = UNSET,
        prefix_retention_interval: int | Unset | None = UNSET,
        *,
        options: CacheOptions | None = None,
    ) -> None:
        keywords = {
            "enable_prefix_caching": enable_prefix_caching,
            "share_pools": share_pools,
            "prefix_retention": prefix_retention,
            "prefix_retention_interval": prefix_retention_interval,
        }
        self._options = merge_keywords(CacheOptions, options, keywords, "CacheController")
        self.layout = CacheLayout(backends)
        self.storage = CacheStorage(self.layout, device, rank, device_id, name_template)
        self._manager: BlockManager | None = None
        self._plan: MemoryPlan | None = None
        self._closed = False
        self._remote: RemoteTier | None = None  # initialize_remote_tier
        self._owned_store: Any = None  # a store the controller opened (closed by free)
        self._lock = threading.RLock()

    # ================================================================== options

    @property
    def options(self) -> CacheOptions:
        """Every option of this controller, validated once (:class:`CacheOptions`, frozen)."""
        return self._options

    @property
    def enable_prefix_caching(self) -> bool:
        """``options.enable_prefix_caching``."""
        return self.options.enable_prefix_caching

    @property
    def share_pools(self) -> bool:
        """``options.share_pools``."""
        return self.options.share_pools

    @property
    def prefix_retention(self) -> Retention:
        """``options.prefix_retention``."""
        return self.options.prefix_retention

    @property
    def prefix_retention_interval(self) -> int | None:
        """``options.prefix_retention_interval``."""
        return self.options.prefix_retention_interval

    # ================================================================== declarations

    @property
    def platform(self) -> Platform:
        return self.storage.platform

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def groups(self) -> list[str]:
        """Group names in the controller's deterministic order."""
        return [g.name for g in self.layout.groups]

    def bytes_per_block(self, group: str) -> int:
        """Device bytes of one block of ``group`` over every layer and role."""
        return self.layout.bytes_per_block(group)

    def kv_bytes_per_token(self) -> Any:
        """Device bytes one token of full-attention history costs (see ``CacheLayout``)."""
        return self.layout.kv_bytes_per_token()

    def storage_name(self, role: str, layer: int) -> str:
        """The stable name of the buffer ``(role, layer)``."""
        return self.storage.names[self.index_of(role, layer)]

    @property
    def storage_names(self) -> list[str]:
        """Storage names in cache-list order."""
        return list(self.storage.names)

    def index_of(self, role: str, layer: int) -> int:
        """Position of ``(role, layer)`` in :attr:`kv_caches`; kernels use it, never ``2*l+1``."""
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise KeyError(f"layer must be an int, got {layer!r}")
        return self.layout.entry(role, layer).index

    def plan_memory(
        self,
        memory_budget: int,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        *,
        plan: PlanOptions | None = None,
    ) -> MemoryPlan:
        """The plan :meth:`initialize_kv_cache` would allocate for these arguments: with
        ``share_pools``, groups whose pages differ draw on one slab arena
        (:func:`~kvforge.core.flow.plan_with_arena`). ``plan``: the three sizes as one
        :class:`~kvforge.options.PlanOptions` (instead of the keywords).

        Raises:
            ArgumentError: a bad size (named), or a size given both as a keyword and in
                ``plan``.
            ValueError: a bad budget, or one too small (see
                :func:`kvforge.core.memory_plan.plan_memory`).
        """
        sizes = _plan_options(plan, max_num_seqs, max_model_len, max_num_batched_tokens)
        return self._plan_memory(memory_budget, sizes)

    def _plan_memory(self, memory_budget: int, sizes: PlanOptions) -> MemoryPlan:
        made = plan_memory(
            self.layout,
            memory_budget,
            sizes.max_num_seqs,
            sizes.max_model_len,
            sizes.max_num_batched_tokens,
        )
        return plan_with_arena(made, self.layout) if self.share_pools else made

    # ================================================================== the two sides

    @property
    @locked
    def scheduler(self) -> BlockManager:
        """The scheduler side (pools, tables, the prefix cache, the swap book): for anything
        the facade does not pass through, e.g. ``ctl.scheduler.pool("kv").num_evictable``.
        ``ctl.storage`` is the worker side and ``ctl.layout`` the declarations."""
        return self._ready_manager()

    # ================================================================== device caches

    @locked
    def initialize_kv_cache(
        self,
        num_blocks: int | Mapping[str, int] | None = None,
        memory_budget: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        *,
        plan: PlanOptions | None = None,
    ) -> MemoryPlan:
        """Allocate every device cache and the scheduler side's tables.

        Give either ``num_blocks`` (an int for every group, or group -> int; physical blocks
        including the reserved null block, so at least 2) or ``memory_budget`` in bytes
        (optionally with ``max_num_batched_tokens``; see :func:`plan_memory`).
        ``max_num_seqs`` (default 256) is the number of block-table rows; ``max_model_len``
        their width in tokens (default: what the smallest full group holds). The three sizes
        may come as one :class:`~kvforge.options.PlanOptions` in ``plan`` instead.

        With ``share_pools``, explicit ``num_blocks`` are the pools' counts, so the groups of
        a shared set need equal counts (the :class:`BlockManager` refuses others); a
        ``memory_budget`` is planned per group and each shared set's pool then gets the
        members' blocks summed, one null block among them (:func:`shared_pool_blocks`): the
        plan's bytes, the members' spare null blocks becoming usable blocks.

        Returns:
            the plan that was allocated: per group. Under ``share_pools`` its counts and
            bytes are the per-group figures (a shared set's bytes counted per member); the
            pools' counts are ``storage.num_blocks`` and their bytes ``device_bytes``.
        """
        self._check_open()
        if self.storage.ready:
            raise RuntimeError("initialize_kv_cache was already called on this controller")
        _one_sizing(num_blocks, memory_budget)
        sizes = _plan_options(plan, max_num_seqs, max_model_len, max_num_batched_tokens)
        made = self._sized_plan(num_blocks, memory_budget, sizes)
        blocks = dict(made.num_blocks)
        for g in self.layout.groups:  # groups with no bytes still need a pool for tables
            blocks.setdefault(g.name, 2)
        if self.share_pools and memory_budget is not None:
            blocks = shared_pool_blocks(self.layout, blocks)
        seqs = sizes.max_num_seqs if sizes.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS
        manager = self._new_manager(blocks, seqs, sizes.max_model_len, made.arena)
        self.storage.create(
            blocks,
            manager.max_num_seqs,
            manager.max_model_len,
            share_pools=self.share_pools,
            arena=made.arena,
        )
        self._manager = manager
        self._plan = made
        return made

    def _sized_plan(
        self, num_blocks: object, memory_budget: object, sizes: PlanOptions
    ) -> MemoryPlan:
        """The plan of explicit ``num_blocks``, or of ``memory_budget`` for ``sizes``."""
        if num_blocks is None:
            return self._plan_memory(check_integer("memory_budget", memory_budget), sizes)
        if sizes.max_num_batched_tokens is not None:
            raise ValueError("['max_num_batched_tokens'] go with memory_budget, not num_blocks")
        return plan_from_blocks(self.layout, self._blocks_per_group(num_blocks))  # type: ignore[arg-type]

    def _new_manager(
        self,
        blocks: Mapping[str, int],
        max_num_seqs: int,
        max_model_len: int | None,
        arena: Any = None,
    ) -> BlockManager:
        """The scheduler side for pools of ``blocks``, with this controller's options (valid
        already: the manager checks only what the pools' sizes decide, such as intervals
        against the groups' boundary)."""
        options = self.options
        return BlockManager(
            self.layout,
            blocks,
            max_num_seqs,
            max_model_len,
            options.enable_prefix_caching,
            snapshot_interval=options.snapshot_interval,
            share_pools=options.share_pools,
            key_algorithm=options.key_algorithm,
            prefix_retention=options.prefix_retention,
            prefix_retention_interval=options.prefix_retention_interval,
            arena=arena,
        )

    @locked
    def adopt_kv_cache(
        self,
        caches: Mapping[tuple[str, int], torch.Tensor],
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int | None = None,
    ) -> MemoryPlan:
        """Use device caches an engine already allocated, one tensor per ``(role, layer)``.

        The block counts are read from the tensors; see :meth:`CacheStorage.adopt`. With
        ``share_pools``, the groups of a shared set must hold equal counts and their tensors
        may be the same bytes.
        """
        self._check_open()
        if self.storage.ready:
            raise RuntimeError("initialize_kv_cache was already called on this controller")
        found: dict[str, int] = {}
        if isinstance(caches, Mapping):
            for e in self.layout.buffers:
                t = caches.get(e.key)
                if isinstance(t, torch.Tensor) and t.dim():
                    found[e.group.name] = int(t.shape[0])
        probe: dict[str, int] = {}
        for g in self.layout.groups:
            # a group without tensors borrows its pool's count, so the storage names what
            # is missing rather than the scheduler side a count mismatch
            pool = self.layout.pool_of(g.name, self.share_pools)
            probe[g.name] = found.get(g.name, next((found[m] for m in pool if m in found), 2))
        manager = self._new_manager(probe, max_num_seqs, max_model_len)
        blocks = self.storage.adopt(
            caches, manager.max_num_seqs, manager.max_model_len, share_pools=self.share_pools
        )
        self._manager = manager
        self._plan = plan_from_blocks(self.layout, blocks)
        return self._plan

    def _blocks_per_group(self, num_blocks: int | Mapping[str, int]) -> dict[str, int]:
        return blocks_per_group(self.groups, num_blocks)

    @property
    @locked
    def kv_caches(self) -> list[torch.Tensor]:
        """Every device cache, layer-major, roles in each backend's declared order."""
        self._check_open()
        return self.storage.kv_caches

    @property
    @locked
    def cache_map(self) -> dict[str, torch.Tensor]:
        """Storage name -> device cache."""
        self._check_open()
        return self.storage.cache_map

    @locked
    def get(self, role: str, layer: int) -> torch.Tensor:
        """The device cache of ``(role, layer)``."""
        self._check_open()
        return self.storage.get(role, layer)

    @property
    @locked
    def memory_plan(self) -> MemoryPlan:
        self._ready_manager()
        assert self._plan is not None
        return self._plan

    @property
    @locked
    def device_bytes(self) -> int:
        """Bytes of device cache held (0 before initialisation and after :meth:`free`)."""
        return self.storage.device_bytes

    def _ready_manager(self) -> BlockManager:
        self._check_open()
        if self._manager is None:
            raise RuntimeError("call initialize_kv_cache before using the caches")
        return self._manager

    def _check_open(self) -> None:
        if self._closed:
            raise ControllerClosedError(
                "this CacheController was freed; its caches are gone (create a new controller)"
            )

    def _sync_tables(self) -> None:
        """Run on the worker what changed since the last step (finishes, swaps, truncations,
        a lookup's onloads, evictions' offloads, arena moves): the scheduler side hands it out
        as one numbered step of no request (``BlockManager.take_effects``), which the worker
        runs as it runs any step (``CacheStorage.run``), once and in order."""
        self._catch_up()
        storage = self.storage
        # handed over in the statement that takes it: an interrupt at any line loses nothing
        storage.pending = step = self._ready_manager().take_effects()
        if step is None:
            return
        storage.run(step.effects)  # with its copies on write, before anything writes them
        self._publish(step.offloads)

    def _catch_up(self) -> None:
        """The worker finishes the step an interrupt kept from running whole
        (``CacheStorage.catch_up``) before anything newer; its offloads are published. A step
        the scheduler side handed out and an interrupt kept from reaching the worker (struck
        as the call returned) is its next one: ``BlockManager.last_step``."""
        storage = self.storage
        if storage.pending is None and self._manager is not None:
            lost = self._manager.last_step
            if lost is not None and lost.step_id == storage.next_step:
                storage.pending = lost
        step = storage.catch_up()
        if step is not None:
            self._publish(step.offloads)

    # ================================================================== steps

    @locked
    def schedule(
        self,
        request_ids: Sequence[str],
        num_new_tokens: Sequence[int] | np.ndarray,
        new_token_ids: Sequence[Sequence[int]] | None = None,
        prefix_matches: Sequence[PrefixMatch | None] | None = None,
    ) -> ScheduledStep:
        """One engine step for the whole batch: grow the tables (scheduler side), mirror them,
        compute the slot mappings and restore per-request state from prefix snapshots (worker
        side). See :meth:`BlockManager.schedule`. After the step's kernels ran, call
        :meth:`end_step` (it takes the per-request state snapshots the step is due)."""
        self._catch_up()
        storage = self.storage
        # handed over in the statement that makes it (see CacheStorage.pending)
        storage.pending = allocation = self._ready_manager().schedule(
            request_ids, num_new_tokens, new_token_ids, prefix_matches
        )
        # the snapshots of the open steps of these requests, before this step's kernels move
        # their states on (an asynchronous engine ends step N after it schedules N + 1)
        storage.run_snapshots(request_ids)
        storage.run(allocation.effects)  # its copies_after wait for end_step (or the next)
        inputs = storage.step_inputs(allocation)
        self._publish(allocation.offloads)
        return ScheduledStep(allocation, inputs)

    @locked
    def end_step(self, step: ScheduledStep) -> None:
        """End a step whose kernels ran: run its ``copies_after`` (per-request state
        snapshots) unless a later :meth:`schedule` ran them already (it runs those of every
        open step first, so the next step's kernels never move a state before its snapshot),
        then let the scheduler side share the blocks it wrote.

        See :meth:`BlockManager.end_step` for the order an asynchronous engine may use.

        Raises:
            StepError: the step is unknown, already ended, or stale (nothing runs then).
        """
        if not isinstance(step, ScheduledStep):
            raise StepError(f"end_step takes a ScheduledStep, got {type(step).__name__}")
        manager = self._ready_manager()
        step_id = step.allocation.step_id
        if step_id not in manager.open_steps:
            manager.end_step(step.allocation)  # raises the StepError that says why
        try:  # unless a later schedule ran them (CacheStorage.run_snapshots)
            ran = self.storage.end_snapshots(step_id)
        except BaseException:
            manager.end_step(step.allocation, copies_ran=False)  # no snapshot of it
            raise
        manager.end_step(step.allocation, copies_ran=ran)

    @locked
    def lookup(self, queries: Sequence[PrefixQuery]) -> list[PrefixMatch]:
        """The longest reusable cached prefix of each prompt (see :meth:`BlockManager.lookup`);
        pass the matches to :meth:`schedule`. With a remote tier, what the device and host
        lack is fetched from the store into host pages first."""
        manager = self._ready_manager()
        self._catch_up()  # a remote fill claims pages only once the worker has every step
        if self._remote is not None:
            self._remote.fetch(queries)
        return manager.lookup(queries)

    def _publish(self, offloads: Sequence[PageCopy]) -> None:
        if self._remote is not None and offloads:
            self.storage.synchronize()  # the pages hold the bytes before they are read
            self._remote.publish(offloads)

    @property
    @locked
    def prefix_stats(self) -> PrefixStats:
        return self._ready_manager().prefix_stats

    @locked
    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Grow ``request_id``'s block tables in every group to cover ``num_tokens`` tokens.

        All-or-nothing: if any group lacks blocks, :class:`OutOfBlocksError` names it (blocks
        needed and free) and no pool changes. This is one step of one request, the tokens
        from :meth:`num_tokens` up to ``num_tokens``: window blocks that slid out during an
        earlier step go back to their pool now, and the blocks this step writes stay held
        until the request's next step, as in :meth:`schedule`. :meth:`slot_mapping` of the
        step's positions gives the slots its kernels write (every one of a 512-token chunk
        through a 128-token window).
        """
        manager = self._ready_manager()
        check_request_id(request_id)
        current = manager.num_tokens_of(request_id)  # 0: new, finished or swapped out
        if not current and manager.is_swapped(request_id):
            raise RequestStateError(f"request {request_id!r} is swapped out; swap_in it first")
        num_tokens = check_int("num_tokens", num_tokens, 1)
        if num_tokens < current:
            raise ValueError(
                f"num_tokens={num_tokens} is less than the {current} tokens request "
                f"{request_id!r} already holds; tables only grow (use truncate to roll back)"
            )
        self._catch_up()
        # handed over in the statement that makes it (see CacheStorage.pending)
        self.storage.pending = step = manager.schedule([request_id], [num_tokens - current])
        # no token ids: the step registers nothing and holds nothing, so it ends at once
        manager.end_step(step)
        # moves, evicted blocks out, brought-back blocks in, table changes: checked and run
        # by the worker as any step (slot_mapping computes this step's slots on demand)
        self.storage.run(step.effects)
        self._publish(step.offloads)
        if step.refused:
            refusal = step.refused[0]
            if refusal.reason == "out_of_blocks":
                raise OutOfBlocksError(
                    "device", refusal.group, refusal.needed, refusal.available, "allocate"
                )
            if refusal.reason == "max_num_seqs":
                raise OutOfBlocksError("device", "table rows (max_num_seqs)", 1, 0, "allocate")
            raise ValueError(refusal.message)

    @locked
    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll a request back to ``num_tokens`` tokens (rejected speculative tokens)."""
        manager = self._ready_manager()
        manager.truncate(request_id, num_tokens)
        self._sync_tables()  # with the copies on write of a block shared with another request

    @locked
    def free_request(self, request_id: str) -> None:
        """Return every device block and host page of ``request_id``."""
        self._ready_manager().finish([check_request_id(request_id)])
        self._sync_tables()

    @locked
    def free_requests(self, request_ids: Sequence[str]) -> None:
        """:meth:`free_request` for several requests, all or nothing."""
        self._ready_manager().finish(request_ids)
        self._sync_tables()

    @locked
    def num_tokens(self, request_id: str) -> int:
        """Tokens ``request_id`` holds (on the device or swapped out)."""
        return self._ready_manager().num_tokens(request_id)

    @property
    @locked
    def requests(self) -> list[str]:
        """Ids of requests that hold device blocks, sorted."""
        return self._ready_manager().requests

    @property
    @locked
    def swapped_requests(self) -> list[str]:
        """Ids of requests whose caches are in host memory, sorted."""
        return self._ready_manager().swapped_requests

    @locked
    def is_swapped(self, request_id: str) -> bool:
        return self._ready_manager().is_swapped(request_id)

    @locked
    def block_table(self, request_id: str, group: str) -> list[int]:
        """``request_id``'s block table in ``group`` (null id 0 where it holds no block)."""
        return self._ready_manager().block_table(request_id, group)

    @locked
    def slot_mapping(
        self,
        request_id: str,
        group: str,
        positions: Sequence[int] | torch.Tensor,
        compress_ratio: int = 1,
    ) -> torch.Tensor:
        """Cache slots of ``positions`` of one request (int64 tensor, -1 where none is written).

        Position ``p`` of a role with compress ratio ``r`` writes an entry only when a
        compressed token completes (``p % r == r - 1``), entry ``p // r``, which lives in
        block ``table[(p // r) // (block_size // r)]``.

        One step has one answer: the positions the request's latest step wrote (from the
        tokens it held before that :meth:`allocate` or :meth:`schedule` to
        :meth:`num_tokens`) map to the very slots ``schedule`` gave that step in
        ``inputs.slot_mappings``, window groups included: a 512-token chunk through a
        128-token window writes all 512 tokens, and their blocks stay held until the
        request's next step. Any other position outside the group's live window at rest
        (the last ``window`` tokens, see :func:`live_start`) maps to ``-1``, as does one
        whose block the request no longer holds. Engines use :meth:`schedule`, which
        computes the slots of a whole step at once.

        Raises:
            ValueError: an unknown group, a ratio that does not divide the block size, or a
                position that is not an int in ``[0, num_tokens)``.
        """
        manager = self._ready_manager()
        row, n = manager.residence(request_id)
        spec = self.layout.group(group)
        if type(compress_ratio) is int and compress_ratio == 1:
            ratio = 1  # every token's own slot: nothing to check
        else:
            ratio = check_int("compress_ratio", compress_ratio, 1)
            if spec.block_size % ratio:
                raise ValueError(
                    f"compress_ratio={ratio} does not divide block_size={spec.block_size} of "
                    f"group {group!r}"
                )
        few = _few_positions(positions)
        if few is not None:  # a decode step's token or a few: Python ints throughout
            return self._few_slots(request_id, row, n, spec, few, ratio)
        pos = _positions(positions)
        if pos.size:
            low, high = (int(pos[0]),) * 2 if pos.size == 1 else (int(pos.min()), int(pos.max()))
            if low < 0 or high >= n:
                raise ValueError(
                    f"position {low if low < 0 else high} is outside request {request_id!r}, "
                    f"which holds tokens 0..{n - 1}"
                )
        self._sync_tables()
        # row, positions and ratio validated above: the worker does not check them again
        slots = self.storage.slot_mapping(row, group, pos, ratio, checked=True)
        first = live_start(spec, n)  # between steps only the window is readable ...
        if first:
            # ... but the tokens the latest step wrote keep their slots, as schedule gave them
            first = min(first, self.storage.first_written(row, request_id, n))
        if first:
            slots[pos < first] = -1
        return torch.from_numpy(slots)

    def _few_slots(
        self, request_id: str, row: int, n: int, spec: CacheGroup, few: list[int], ratio: int
    ) -> torch.Tensor:
        """:meth:`slot_mapping` of a few positions given as Python ints: the same checks,
        slots and window, without an array per step (``tests/test_controller_slots.py``
        compares the two)."""
        if few:
            low, high = min(few), max(few)
            if low < 0 or high >= n:
                raise ValueError(
                    f"position {low if low < 0 else high} is outside request {request_id!r}, "
                    f"which holds tokens 0..{n - 1}"
                )
        self._sync_tables()
        slots = self.storage.few_slots(row, spec.name, few, ratio)
        first = live_start(spec, n)  # as slot_mapping: the window, or the latest step's
        if first and few and min(few) < first:
            first = min(first, self.storage.first_written(row, request_id, n))
            slots = [-1 if p < first else slot for p, slot in zip(few, slots, strict=True)]
        return torch.from_numpy(np.array(slots, dtype=np.int64))

    @locked
    def num_free_blocks(self, group: str) -> int:
        return self._ready_manager().num_free_blocks(group)

    @locked
    def num_used_blocks(self, group: str) -> int:
        return self._ready_manager().num_used_blocks(group)

    @property
    @locked
    def stats(self) -> SwapStats:
        if self._manager is None:
            return SwapStats()
        return self._manager.stats

    # ================================================================== host cache

    @locked
    def initialize_host_cache(
        self,
        num_pages: int | Mapping[str, int] | None = None,
        memory_budget: int | None = None,
    ) -> MemoryPlan:
        """Allocate the pinned host pools (page-first, one per group with offloaded roles).

        Give ``num_pages`` (pages per group, the reserved null page included) or
        ``memory_budget`` in bytes (split like the device budget).

        Raises:
            ValueError: no role of any group is offloaded (there is nothing to size), or a
                bad count or budget.
        """
        manager = self._ready_manager()
        if self.storage.host_ready:
            raise RuntimeError("initialize_host_cache was already called on this controller")
        _one_sizing(num_pages, memory_budget, "num_pages")
        if not any(self.layout.host_page_bytes(g) for g in self.groups):
            raise ValueError(
                "no role of any group is offloaded (every role has offload=False): there is "
                "no host cache to allocate"
            )
        if num_pages is not None:
            plan = plan_from_blocks(self.layout, self._blocks_per_group(num_pages), host=True)
        else:
            budget = check_integer("memory_budget", memory_budget)
            plan = plan_memory(self.layout, budget, host=True)
        pages = plan.num_blocks
        # the worker's pages, then the scheduler side's ids: both or neither
        manager.init_host(pages, then=lambda: self.storage.init_host(pages))
        return plan

    @locked
    def initialize_host_tier(
        self,
        num_pages: int | Mapping[str, int],
        policy: HostTierPolicy | Unset = UNSET,
        snapshot_policy: SnapshotPolicy | Unset | None = UNSET,
        *,
        options: HostTierOptions | None = None,
    ) -> dict[str, int]:
        """Keep the prefix blocks the device evicts in host tier pages: pinned, page-first,
        a pool of their own per group (apart from :meth:`initialize_host_cache`'s swap
        pages). ``num_pages``: pages per group (one count for all, or a mapping), the null
        page included. ``snapshot_policy``: what per-request (state snapshot) groups keep,
        ``"skip"`` (no pages: a hit needing a snapshot the device lost is recomputed) or
        ``"aligned"`` (pages for the snapshots taken at aligned boundaries); ``None``
        (default) follows the backends' declared ``snapshot_policy``. ``policy`` and
        ``snapshot_policy`` may come as one :class:`~kvforge.options.HostTierOptions` in
        ``options`` instead. Returns the pages per group.

        Every evicted cached block is offloaded before its device block is written again
        (slab moves of an arena included), and :meth:`lookup` brings back what only the tier
        holds, onloaded before the next step's kernels (``docs/tiered_store.md``, "Host
        tier").

        Raises:
            RuntimeError: prefix caching is off, or the tier exists already.
            ArgumentError: a bad count, ``policy`` or ``snapshot_policy``, or a policy given both
                as a keyword and in ``options``.
            ValueError: no group can keep anything there, or backends of per-request groups
                declare different snapshot policies and none was given.
        """
        manager = self._ready_manager()
        if not manager.prefix_caching:
            raise RuntimeError("the host tier keeps cached prefixes: enable_prefix_caching=True")
        keywords = {"policy": policy, "snapshot_policy": snapshot_policy}
        chosen = merge_keywords(HostTierOptions, options, keywords, "initialize_host_tier")
        policy, snapshot_policy = chosen.policy, chosen.snapshot_policy
        if snapshot_policy is None:
            snapshot_policy = declared_snapshot_policy(self.layout.backends.values())
        pages = {
            g: n
            for g, n in self._blocks_per_group(num_pages).items()
            if self.layout.host_page_bytes(g)
            and (snapshot_policy == "aligned" or not self.layout.group(g).rule.per_request)
        }
        if not pages:
            raise ValueError(
                "no group keeps anything in a host tier: every group is per-request or has no "
                "offloaded role"
            )
        had_pages, had_tier = self.storage.tier_pages is not None, manager.host_tier
        try:  # both sides or neither, under an exception at any line
            HostTierPages(self.storage, pages)  # the storage keeps it; raises if it has one
            host_tier.attach(manager, pages, policy, snapshot_policy)
        except BaseException:
            if manager.host_tier is had_tier and not had_pages:  # the scheduler side took none
                self.storage.release_tier_pages()
            raise
        return pages

    @locked
    def initialize_remote_tier(
        self, store: StoreConfig | RemoteStore, model: ModelIdentity | None = None
    ) -> RemoteTier:
        """Put a remote store (Redis, Mooncake Store) behind the host tier: pages the host
        tier fills are published to it, and lookups fetch from it what the device and host
        lack (:mod:`kvforge.remote_tier`). ``store``: a :class:`~kvforge.store.StoreConfig`
        (opened here with the fingerprint of this layout and ``model``, closed by
        :meth:`free`) or an open store whose fingerprint is
        :func:`~kvforge.remote_tier.layout_fingerprint` of this layout and ``model``.
        ``model`` (required): the :class:`~kvforge.ModelIdentity` of the engine (its
        tensor-parallel rank included), in every key and value header.

        Raises:
            RuntimeError: no host tier yet (:meth:`initialize_host_tier` first), or a remote
                tier exists already.
            ArgumentError: ``model`` missing or not a ModelIdentity (there is no default).
            ValueError: a store of another layout's or model's fingerprint, or a config whose
                backend is ``"none"``.
        """
        from kvforge.store import StoreConfig, open_store

        manager = self._ready_manager()
        if manager.host_tier is None:
            raise RuntimeError(
                "a remote tier sits behind the host tier: call initialize_host_tier first"
            )
        if self._remote is not None:
            raise RuntimeError("this controller has a remote tier already")
        model = check_model_identity(model, "initialize_remote_tier")
        fingerprint = layout_fingerprint(self.layout, model)
        owned = None
        if isinstance(store, StoreConfig):
            if store.backend == "none":
                raise ValueError("initialize_remote_tier: the StoreConfig's backend is 'none'")
            owned = store = open_store(store, fingerprint)
        elif getattr(store, "fingerprint", None) != fingerprint:
            raise ValueError(
                "initialize_remote_tier: the store was opened with another layout fingerprint "
                f"than this layout's for model {model} (open it with "
                "kvforge.remote_tier.layout_fingerprint(layout, model))"
            )
        self._remote = RemoteTier(manager, self.storage.tier_pages, store, model)
        self._owned_store = owned
        return self._remote

    @property
    @locked
    def remote_tier(self) -> RemoteTier | None:
        """The remote tier (its ``store`` and ``stats``), or ``None``."""
        return self._remote

    @property
    @locked
    def host_tier(self) -> HostTier | None:
        """The scheduler side's host tier (its index and ``stats``), or ``None``."""
        return self._ready_manager().host_tier

    @property
    @locked
    def host_bytes(self) -> int:
        """Bytes of host memory held: swap pages, host tier pages, and the values a remote
        tier is still writing (``kvforge.worker.host_memory``; 0 before initialisation and
        after :meth:`free`)."""
        store = self._remote.store if self._remote is not None else None
        return host_memory.host_bytes(self.storage, store)

    @property
    @locked
    def host_kv_caches(self) -> dict[tuple[str, int], torch.Tensor]:
        """``(role, layer)`` -> host view made by the backends' ``create_host_kv_cache``."""
        return self.storage.host_kv_caches

    @locked
    def host_pool_usage(self) -> dict[str, tuple[int, int]]:
        """Group -> (used pages, usable pages) of the host pools."""
        manager = self._ready_manager()
        self.storage.host  # noqa: B018 - raises before initialize_host_cache
        return {
            g: (manager.host_pool(g).num_used, manager.host_pool(g).num_usable)
            for g in manager.host_groups
        }

    # ================================================================== swaps

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

    @locked
    def swap_out_many(
        self, request_ids: Sequence[str], purpose: SwapPurpose | str = "preempt"
    ) -> list[SwapHandle]:
        """:meth:`swap_out` for several requests at once, all or nothing.

        Each group's blocks of every request move in one data-path call. Hooks:
        ``before_swap_out`` runs for every request before any byte moves; if one raises,
        nothing is swapped, the host pages are given back and the exception propagates.

        Returns:
            One handle per request, in order. They share one event.

        Raises:
            OutOfBlocksError: the host pools lack pages for the whole batch (nothing changed).
            RequestStateError: an unknown request, or one already swapped out (nothing changed).
            ValueError: a request id appears twice, or an unknown purpose.
        """
        self.storage.host  # noqa: B018 - raises before initialize_host_cache
        manager = self._ready_manager()
        return self._run(lambda: manager.plan_swap_out(request_ids, purpose))

    def swap_in(self, request_id: str) -> SwapHandle:
        """Bring a swapped-out request back: new device blocks, scatter, free host pages.

        Raises:
            OutOfBlocksError: the device pools lack blocks (nothing changed).
            RequestStateError: the request is not swapped out.
        """
        return self.swap_in_many([request_id])[0]

    @locked
    def swap_in_many(self, request_ids: Sequence[str]) -> list[SwapHandle]:
        """:meth:`swap_in` for several requests at once, all or nothing.

        ``after_swap_in`` runs once every request of the batch is resident; if it raises, the
        new device blocks are given back, the requests stay swapped out, and the exception
        propagates.
        """
        self.storage.host  # noqa: B018 - raises before initialize_host_cache
        manager = self._ready_manager()
        return self._run(lambda: manager.plan_swap_in(request_ids))

    def _run(self, make_plan: Callable[[], SwapPlan]) -> list[SwapHandle]:
        """Plan a swap, execute it on the worker side and complete it on the scheduler side
        with the worker's own result (its receipt), all or nothing: if any of it raises, an
        interrupt included, a plan made is settled as failed (what it reserved is given
        back, every request is where it was before the call) and the exception propagates."""
        manager = self._ready_manager()
        plan: SwapPlan | None = None
        execution: SwapExecution | None = None
        earlier = {p.plan_id for p in manager.plans_in_flight()}
        try:
            plan = make_plan()
            self._sync_tables()  # a swap in's new rows, mirrored before the worker checks it
            execution = self.storage.execute(plan)
            manager.complete_swap(execution.result)
        except BaseException as exc:
            if plan is None:  # struck after the plan was made, before it came back here
                plan = next(
                    (p for p in manager.plans_in_flight() if p.plan_id not in earlier), None
                )
            if plan is not None:
                try:
                    if execution is not None:  # no copy may still touch what goes back
                        self.storage.synchronize()
                finally:
                    _roll_back(manager, plan, exc)
                try:
                    self._sync_tables()
                except BaseException as failure:
                    add_note(exc, f"kvforge: mirroring the rollback failed: {failure!r}")
            raise
        assert execution is not None
        self._sync_tables()
        if not execution.ok:
            assert execution.result.error is not None
            raise execution.result.error
        handles = []
        for move in plan.requests:
            handle = SwapHandle(move.request_id, plan.direction, move.purpose, move.num_tokens)
            for group, pages in move.host_pages.items():
                handle.blocks_moved[group] = len(pages)
                handle.bytes_moved += len(pages) * manager.page_bytes(group)
            handle.event, handle.keep_alive = execution.event, execution.keep_alive
            handles.append(handle)
        return handles

    # ================================================================== teardown

    @locked
    def free(self) -> None:
        """Free every device cache, host page (swap and host tier) and host view, once; a
        remote tier's store forgets the tier's pages (and is closed if this controller opened
        it). Idempotent."""
        if self._closed:
            return
        store = self._remote.store if self._remote is not None else None
        owned = self._owned_store
        self._remote = self._owned_store = None
        try:
            host_memory.release_host_tier(self.storage, store)  # the store forgets them first
            if self._manager is not None:
                self._manager.reset_host_tier()  # its pages' keys and unit record references
        finally:  # whatever raised above, every page still goes (a second release is a no-op)
            host_memory.release_host_tier(self.storage)
            if owned is not None:
                owned.close()  # bounded by its close_timeout_s; never hangs
            self.storage.free()
            self._manager = None
            self._closed = True

    @property
    @locked
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._closed else ("ready" if self.storage.ready else "declared")
        return (
            f"CacheController({len(self.layout.layers)} layers, groups={self.groups}, "
            f"device={self.device}, {state})"
        )


def _plan_options(
    plan: PlanOptions | None,
    max_num_seqs: object,
    max_model_len: object,
    max_num_batched_tokens: object,
) -> PlanOptions:
    """``plan``, or the :class:`PlanOptions` the size keywords given (not ``None``) build."""
    keywords = {
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_num_batched_tokens,
    }
    return merge_keywords(PlanOptions, plan, keywords, "plan options", unset=None)


def _roll_back(manager: BlockManager, plan: SwapPlan, exc: BaseException) -> None:
    """Settle ``plan`` as failed after ``exc`` struck while it was made, executed or
    completed: a swap out keeps its requests resident and gives back its pages, a swap in
    keeps them swapped out and gives back its rows and blocks. A plan that completed before
    ``exc`` is left complete."""
    failure = SwapFailure("copy", "", type(exc).__name__, f"rolled back: {exc}")
    try:
        manager.complete_swap(SwapResult(plan.plan_id, failure))
    except ValueError:  # not in flight: it completed before the fault
        return
    except BaseException as again:
        add_note(
            exc,
            f"kvforge: settling swap plan {plan.plan_id} as failed raised {again!r}; it is "
            "still in flight (BlockManager.complete_swap with a failed result settles it)",
        )


_FEW_POSITIONS = 8  # a decode step's positions (speculative tokens included)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _few_positions(positions: object) -> list[int] | None:
    """A few positions as Python ints, from a 1-d CPU ``int64`` tensor or a list or tuple of
    ints; ``None`` for anything else (:func:`_positions` decides and refuses)."""
    if type(positions) is torch.Tensor:
        if (
            positions.dtype is torch.int64
            and positions.is_cpu
            and positions.dim() == 1
            and positions.numel() <= _FEW_POSITIONS
        ):
            return positions.tolist()
        return None
    if (
        type(positions) in (list, tuple)
        and len(positions) <= _FEW_POSITIONS
        and all(type(p) is int and _INT64_MIN <= p <= _INT64_MAX for p in positions)
    ):
        return list(positions)  # (beyond int64, _positions words it as it always did)
    return None


def _positions(positions: object) -> np.ndarray:
    """Token positions as ``int64``; floats and bools are refused, never truncated."""
    if type(positions) is torch.Tensor:
        if positions.dtype is torch.int64 and positions.is_cpu and positions.dim() == 1:
            return positions.detach().numpy()  # an engine's positions: read, never copied
        positions = positions.detach().cpu().numpy()
    elif isinstance(positions, torch.Tensor):
        positions = positions.detach().cpu().numpy()
    if isinstance(positions, range):
        return np.arange(positions.start, positions.stop, positions.step, dtype=np.int64)
    if isinstance(positions, Sequence) and not isinstance(positions, str):
        for p in positions:
            if not isinstance(p, int | np.integer) or isinstance(p, bool):
                raise ValueError(f"positions must be ints, got {p!r}")
    arr = np.asarray(positions)
    if arr.size and (arr.dtype == bool or arr.dtype.kind not in "iu"):
        raise ValueError(f"positions must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64).reshape(-1) if arr.ndim != 1 else arr.astype(np.int64, copy=False)
