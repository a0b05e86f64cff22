"""The worker side: device caches, host pages, mirrored block tables, swap execution.

:class:`CacheStorage` owns memory and copies, never bookkeeping. It builds the device caches
from the backends' declarations (``create_kv_cache``) or adopts tensors an engine already
allocated, mirrors the scheduler side's block tables from the :class:`TableDelta` values it
receives, computes a step's slot mappings from those mirrors, and executes
:class:`SwapPlan` values, answering each with a :class:`SwapResult`. Everything it receives
and returns is a plain value, so the scheduler side may live in another process.

Two concerns live in their own modules, as objects the storage owns and calls with explicit
state (never reading its private attributes): the device buffers are created, adopted and
checked by :class:`~kvforge.worker.device_buffers.BufferBuilder`, which hands back a checked
:class:`~kvforge.worker.device_buffers.DeviceBuffers` value the storage then keeps; swap plans
run through :class:`~kvforge.worker.swap_execution.SwapExecutor`, made at install and bound to
the buffers, tables, guard and step ledger (it owns the side streams and the copies still in
flight). The public methods here (``create``, ``adopt``, ``execute``, ``end_copies``,
``synchronize``, ``streams``, ``device_bytes``) delegate to them.

Invariants:

- nothing is stored until everything was validated: a refused ``create`` or ``adopt`` leaves
  the storage empty and retryable;
- no two (role, layer) buffers share a byte (checked on every ``create`` and ``adopt``), with
  one exception under ``share_pools=True``: buffers of *different* groups of one shared pool
  (``CacheLayout.pool_sets``) may be the same bytes when their planes coincide (same base,
  block stride and block count; one may address fewer bytes of each block than the other, a
  role padded to the stride its partner fills), since block ``b`` of one is then block ``b``
  of the other and the scheduler side never hands ``b`` to two groups of a pool;
- ``create(..., share_pools=True)`` pays a shared pool's bytes once: the ``k``-th buffer of
  every member (each member's buffers sorted by device block bytes, stably) is a view of one
  raw ``uint8 [N, device_block_bytes]`` allocation, built as the default ``create_kv_cache``
  builds a buffer (:func:`~kvforge.attn_backends.base.block_buffer_view`);
- a failed swap is reported, never raised past the worker boundary, after every copy it
  queued has finished (``synchronize``), so the scheduler side may hand the blocks out again;
- nothing it receives is trusted (:mod:`kvforge.worker.guard`): table deltas are mirrored in
  their sequence only (``TableDelta.seq``), every row, column, block id and host page is
  range-checked, a swap plan runs at most once, and a copy or swap writes only blocks its
  request's mirrored row holds and no other row does. A refused value raises a
  :class:`~kvforge.errors.WorkerRefusedError` before anything is mirrored or moved;
- a step's effects (:class:`~kvforge.core.values.StepEffects`) are applied in one place,
  :meth:`CacheStorage.run`, in the one order ``StepEffects`` states; ``apply`` and
  ``apply_effects`` are wrappers of it. What the worker remembers of steps (their number, the
  request of each row, the tokens each row's latest step wrote, the copies issued and the
  snapshots due) is its step ledger's (:mod:`kvforge.worker.step_ledger`), and the step handed
  to it that has not run whole is :attr:`CacheStorage.pending` (``tests/worker/
  test_step_ledger.py``, ``tests/scheduler/test_interrupts.py``,
  ``tests/properties/test_step_copies_property.py``);
- the storage owns its tier pages (:attr:`CacheStorage.tier_pages`,
  :mod:`kvforge.worker.tier_pages`): ``host_bytes`` counts them with the swap pages, ``free``
  lets go of them once (``tests/worker/test_host_bytes.py``).

Locking: one re-entrant lock (:attr:`CacheStorage.lock`). Every public method of the
storage holds it for its whole call (checks, mirroring, the copies it queues, ledger
records; not the completion of copies an accelerator runs on side streams, which events
order), and so does every public method of its tier pages, which are part of it. Nothing
outside the storage and its tier pages takes it; the facade serialises its own calls with its
own lock, and calls the storage with none of the scheduler side's locks held.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvforge import ops
from kvforge._checks import check_integer
from kvforge.core.arena import ArenaGeometry
from kvforge.core.layout import CacheLayout, table_widths
from kvforge.core.memory_plan import check_allocatable
from kvforge.core.naming import DEFAULT_NAME_TEMPLATE, StorageNamer
from kvforge.core.values import (
    BlockCopy,
    PageCopy,
    StepAllocation,
    StepEffects,
    SwapPlan,
    TableDelta,
)
from kvforge.errors import ControllerClosedError, UnissuedCopyError, WorkerRefusedError
from kvforge.ops import PlaneSet
from kvforge.platform import Platform, get_platform
from kvforge.worker import guard
from kvforge.worker.device_buffers import BufferBuilder, DeviceBuffers, device_bytes
from kvforge.worker.step_ledger import StepLedger
from kvforge.worker.swap_execution import SwapExecution, SwapExecutor, require_host
from kvforge.worker.swap_pages import HostPools, HostViews
from kvforge.worker.tokens import step_tokens
from kvforge.worker.transfer import SwapStreams

if TYPE_CHECKING:
    from kvforge.worker.tier_pages import HostTierPages

__all__ = ["CacheStorage", "StepInputs"]

CacheKey = tuple[str, int]


@dataclass(frozen=True)
class StepInputs:
    """What a step's attention kernels read, computed from the mirrored tables.

    Attributes:
        request_index: ``int64 [N]`` index into the step's request list of each scheduled token.
        positions: ``int64 [N]`` position of each scheduled token.
        slot_mappings: ``(group, compress_ratio) -> int64 [N]`` cache slot of each token,
            ``-1`` where it writes no entry (a compressed token not yet complete).
        block_tables: ``group -> int32 [max_num_seqs, width]`` the mirrored tables.
    """

    request_index: np.ndarray
    positions: np.ndarray
    slot_mappings: dict[tuple[str, int], Any]
    block_tables: dict[str, Any]


class CacheStorage:
    """Device caches, host pages and swap execution of one worker.

    Args:
        layout: the model's declarations.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"npu"`` or ``"auto"``.
        rank: tensor-parallel rank (used in storage names).
        device_id: device ordinal used in storage names (default: the device's index or 0).
        name_template: storage-name template (see :mod:`kvforge.core.naming`).
    """

    def __init__(
        self,
        layout: CacheLayout,
        device: str | torch.device = "cpu",
        rank: int = 0,
        device_id: int | None = None,
        name_template: str = DEFAULT_NAME_TEMPLATE,
    ) -> None:
        self.layout = layout
        self.platform: Platform = get_platform(device)
        self.rank = check_integer("rank", rank, 0)
        if device_id is None:
            device_id = self.platform.device.index or 0
        self.device_id = check_integer("device_id", device_id, 0)
        self.namer = StorageNamer(name_template, self.rank, self.device_id)
        self.names: list[str] = self.namer.check_unique(e.key for e in layout.buffers)
        # a step's slot mappings, one per (group, compress ratio): listed once per layout
        self._slot_plan = [
            (g.name, g.block_size, r) for g in layout.groups for r in layout.compress_ratios(g.name)
        ]
        self._caches: list[torch.Tensor] | None = None
        self._planes: dict[str, PlaneSet] = {}
        self._num_blocks: dict[str, int] = {}
        self._tables: dict[str, np.ndarray] = {}
        self._device_tables: dict[str, torch.Tensor] = {}
        self.share_pools = False
        self.arena: ArenaGeometry | None = None
        """Whether the installed caches may share a pool's bytes (set by create / adopt)."""
        self._host: HostPools | None = None
        self._host_caches: list[dict[CacheKey, torch.Tensor]] = []
        self._verify = guard.Verifier({}, {}, {})  # bound to the tables by _install
        self._steps = StepLedger(0)
        self._builder = BufferBuilder(layout, self.platform.device, self.names)
        self._swaps = SwapExecutor(layout, self.platform)  # bound to the buffers by _install
        self._tier_pages: HostTierPages | None = None
        #: the step the scheduler side handed this worker that has not run whole yet: whoever
        #: carries steps here in one process (``CacheController``) sets it as soon as the
        #: scheduler side hands the step out, a plain attribute write, so an interrupt at any
        #: point after that loses nothing (:meth:`catch_up` finishes it); :meth:`run` clears
        #: it once the step ran whole or was refused
        self.pending: StepAllocation | StepEffects | None = None
        self._closed = False
        self._lock = threading.RLock()

    # ================================================================== device caches

    @property
    def device(self) -> torch.device:
        return self.platform.device

    @property
    def ready(self) -> bool:
        return self._caches is not None

    @property
    def lock(self) -> threading.RLock:
        """The storage's re-entrant lock. Every public method of the storage, and of the tier
        pages it owns (:class:`~kvforge.worker.tier_pages.HostTierPages`, part of it), holds
        it for its whole call: checks, mirroring, copies queued (not their completion on an
        accelerator's side streams, ordered by events), ledger records. Nothing else takes it."""
        return self._lock

    def check_ready(self) -> None:
        """Raise unless the device caches exist: ``ControllerClosedError`` once freed,
        ``RuntimeError`` before ``create`` or ``adopt``."""
        self._ready()

    def create(
        self,
        num_blocks: Mapping[str, int],
        max_num_seqs: int,
        max_model_len: int,
        share_pools: bool = True,
        arena: ArenaGeometry | None = None,
    ) -> None:
        """Allocate every device cache through the backends' ``create_kv_cache``.

        With ``share_pools``, the groups of each set of ``layout.pool_sets`` with more than
        one group share their bytes (see the module invariants): the members' ``k``-th
        buffers (sorted by device block bytes, stably) are views of one raw allocation of
        ``N`` blocks, so a pool costs ``N * bytes_per_block`` once. The backends serving
        those groups' layers must keep the default ``create_kv_cache`` (the storage builds
        their buffers itself, exactly as it would); other backends are asked as usual.

        With ``arena`` (:func:`~kvforge.core.arena.plan_arena`), its groups' buffers are views
        of one raw allocation of ``arena.total_bytes``: group ``g`` packs its buffers page
        first (``arena.buffer_offsets``) and block ``b`` starts ``b * block_stride[g]`` bytes
        in, so every tensor keeps its pointer, shape and strides while slabs change hands.

        Every tensor is checked (keys, shape, dtype, device, plane layout, no shared bytes)
        before any is kept, so a refused call leaves the storage empty.

        Raises:
            TypeError: ``share_pools`` is not a bool.
            ValueError: (with ``share_pools``) the groups of a shared set have different
                counts, or a backend serving one overrides ``create_kv_cache``; a backend's
                tensors that do not match the declaration; more bytes than the device has.
        """
        with self._lock:
            self._check_fresh()
            buffers = self._builder.create(num_blocks, share_pools, arena)
            self._install(buffers, max_num_seqs, max_model_len)

    def adopt(
        self,
        caches: Mapping[CacheKey, torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        share_pools: bool = True,
    ) -> dict[str, int]:
        """Use device tensors an engine already allocated, one per ``(role, layer)``.

        Each tensor is block-major (``shape[0]`` = the group's blocks) with the role's dtype
        and the declared block shape. Returns the blocks per group the tensors hold (give the
        same counts to the scheduler side). With ``share_pools``, the groups of a shared set
        must hold equal counts and their buffers may be the same bytes (an engine that shares
        one pool between them hands over aliasing tensors), as the module invariants say.

        Raises:
            TypeError: ``share_pools`` is not a bool.
            ValueError: a missing or extra key, a wrong shape, dtype or device, two roles of
                one group with different block counts, (with ``share_pools``) groups of one
                shared set with different counts, or buffers that share bytes.
        """
        with self._lock:
            self._check_fresh()
            buffers = self._builder.adopt(caches, share_pools)
            self._install(buffers, max_num_seqs, max_model_len)
            return dict(buffers.num_blocks)

    def _install(self, buffers: DeviceBuffers, max_num_seqs: int, max_model_len: int) -> None:
        """Keep checked ``buffers``, with mirrored tables of ``max_num_seqs`` rows (checked
        first: a refusal keeps nothing), a guard and step ledger bound to them, side streams
        and the swap executor."""
        widths = table_widths(self.layout, max_num_seqs, max_model_len)
        # validated: now keep everything
        self._caches = buffers.caches
        self.share_pools = buffers.share_pools
        self.arena = buffers.arena
        self._planes = buffers.planes
        self._num_blocks = dict(buffers.num_blocks)
        self._tables = {
            name: np.zeros((max_num_seqs, width), dtype=np.int32) for name, width in widths.items()
        }
        mates = {
            g.name: tuple(
                m for m in self.layout.pool_of(g.name, buffers.share_pools) if m != g.name
            )
            for g in self.layout.groups
        }
        self._verify = guard.Verifier(self._tables, self._num_blocks, mates, buffers.arena)
        self._steps = StepLedger(self._verify.num_rows)
        if self.platform.is_accelerator:  # pragma: no cover - accelerators only
            self._device_tables = {
                name: torch.zeros(t.shape, dtype=torch.int32, device=self.device)
                for name, t in self._tables.items()
            }
        self._swaps = SwapExecutor(
            self.layout,
            self.platform,
            SwapStreams.create(self.platform),
            self._caches,
            self._planes,
            self._verify,
            self._steps,
            self._tables,
        )

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Every device cache, layer-major, roles in each backend's declared order."""
        return list(self._ready())

    @property
    def cache_map(self) -> dict[str, torch.Tensor]:
        """Storage name -> device cache."""
        return dict(zip(self.names, self._ready(), strict=True))

    def get(self, role: str, layer: int) -> torch.Tensor:
        return self._ready()[self.layout.entry(role, layer).index]

    def planes(self, group: str) -> PlaneSet:
        """The offloaded planes of ``group``, in host page order."""
        self._ready()
        found = self._planes.get(group)
        if found is None:
            raise ValueError(f"group {group!r} has no offloaded planes")
        return found

    @property
    def streams(self) -> SwapStreams | None:
        """The side streams swaps run on (``None`` on CPU)."""
        return self._swaps.streams

    @property
    def num_blocks(self) -> dict[str, int]:
        return dict(self._num_blocks)

    @property
    def device_bytes(self) -> int:
        """Bytes the device caches span, alignment padding included; the buffers a shared
        pool places in the same bytes count once."""
        return device_bytes(self.layout, self._caches or [], self.arena)

    # ================================================================== block tables, steps

    def apply_deltas(self, deltas: Sequence[TableDelta]) -> None:
        """Mirror table changes made by the scheduler side, in their sequence, all or nothing.

        Raises:
            DeltaOrderError: delta ``i`` does not have ``seq == next_seq + i``.
            BlockRangeError: a row, column or block id outside the table or the group's pool
                (block id ``0`` is allowed: it empties a cell).
            WorkerRefusedError: a malformed delta or an unknown group.
        """
        with self._lock:
            self._ready()
            self._verify.deltas(deltas)
            self._mirror(deltas)

    def _mirror(self, deltas: Sequence[TableDelta], rows_bound: bool = False) -> None:
        """Mirror checked ``deltas``; ``rows_bound``: the step ledger already emptied the rows
        they empty (a step's own deltas, before it bound its rows)."""
        if not deltas:
            return
        tables, device = self._tables, self._device_tables
        for delta in deltas:
            delta.apply(tables[delta.group])
            if device:  # pragma: no cover - accelerators only
                _apply_on_device(device[delta.group], delta)
        self._verify.mirrored(deltas)
        if not rows_bound:
            self._steps.mirrored(deltas)

    @property
    def next_seq(self) -> int:
        """The ``TableDelta.seq`` this worker mirrors next (how many deltas it mirrored)."""
        return self._verify.next_seq

    @property
    def next_step(self) -> int:
        """The ``StepAllocation.step_id`` this worker applies next."""
        return self._steps.next_step

    def run(self, effects: StepEffects, copies_before: bool = True) -> None:
        """Apply a step's effects, the next step in its sequence, once: the one place a
        step (or a batch made between steps, ``BlockManager.take_effects``) changes this
        worker, in the order :class:`~kvforge.core.values.StepEffects` states: every check,
        then arena moves, the tier pages' offloads and onloads, the step's number, its table
        deltas, and (unless ``copies_before=False``, for a caller that runs them itself through
        :meth:`copy_blocks`) its ``copies_before``. Its ``copies_after`` become runnable by
        :meth:`copy_blocks`. Clears :attr:`pending` once the step ran whole or was refused.

        Raises:
            StepOrderError: a repeat, a gap, or a step never handed out.
            WorkerRefusedError (and subclasses): as :meth:`apply_deltas`, :meth:`copy_blocks`
                and ``HostTierPages.move``, a row outside the tables or serving another
                request, tier copies for a worker without tier pages; nothing changed then."""
        with self._lock:
            try:
                self._effects(effects)
            except WorkerRefusedError:
                self._settle(effects)  # the worker's answer: the step never applies
                raise
            if copies_before and effects.copies_before:  # before any kernel reads them
                self.copy_blocks(effects.copies_before)
            self._settle(effects)

    def _settle(self, effects: StepEffects) -> None:
        """Clear :attr:`pending` when it holds ``effects``' step."""
        pending = self.pending
        if pending is effects or (type(pending) is StepAllocation and pending.effects is effects):
            self.pending = None

    def _effects(self, effects: StepEffects) -> None:
        """Everything of :meth:`run` but the ``copies_before``, checked before a byte moves."""
        self._ready()
        verify, steps = self._verify, self._steps
        verify.step(effects)
        steps.check(effects)  # once, in order; each request at its own row
        tier = self._tier_for(effects)
        if tier is not None:  # every copy of the step is checked before a byte moves
            tier.check(effects.offloads, effects.onloads, effects.table_deltas)
        if effects.moves:  # first: the onloads and kernels may write their sources
            verify.copies(effects.moves)
            self._copy(effects.moves)
        if tier is not None:  # the tier pages', before the step's kernels
            tier.run(effects.offloads, effects.onloads)
        # the step's number first: an interrupt past it leaves only numbered deltas to
        # mirror (:meth:`catch_up`), never a step to apply twice
        steps.record(effects)
        self._mirror(effects.table_deltas, rows_bound=True)
        verify.stepped(effects.rows)

    def _tier_for(self, effects: StepEffects) -> HostTierPages | None:
        """The tier pages a step's page copies run through (``None`` without copies)."""
        if not (effects.offloads or effects.onloads):
            return None
        if self._tier_pages is None:
            raise WorkerRefusedError(
                "apply: the step carries host tier copies but this worker has no host tier "
                "pages (kvforge.worker.tier_pages.HostTierPages); nothing changed"
            )
        return self._tier_pages

    def catch_up(self) -> StepEffects | None:
        """Finish the step in :attr:`pending`, the one an interrupt kept from running whole,
        before anything newer: the whole step, or (it was numbered already) its deltas not
        yet mirrored and its ``copies_before`` not yet run. Returns that step (``None`` when
        nothing was pending). Raises as :meth:`run`."""
        if self.pending is None:  # the common case, without the lock
            return None
        with self._lock:
            pending = self.pending
            if pending is None:
                return None
            effects = _effects_of(pending)
            if self._steps.next_step <= effects.step_id:
                self.run(effects)
                return effects
            left = [d for d in effects.table_deltas if d.seq >= self.next_seq]
            if left:
                self.apply_deltas(left)
            if effects.copies_before:
                with contextlib.suppress(UnissuedCopyError):  # they ran before the interrupt
                    self.copy_blocks(effects.copies_before)
            self.pending = None
            return effects

    def apply(self, step: StepAllocation | StepEffects) -> StepInputs:
        """:meth:`apply_effects`, then the step's slot mappings: one ``int64`` array per
        ``(group, compress_ratio)`` over every token of the step, in request order (vectorized
        numpy on CPU, no per-token Python). Raises as :meth:`run`."""
        with self._lock:
            self.apply_effects(step)
            return self.step_inputs(step)

    def apply_effects(self, step: StepAllocation | StepEffects) -> None:
        """:meth:`run` of ``step``'s effects, leaving its ``copies_before`` to the caller
        (:meth:`copy_blocks`): for an engine that runs them itself. Raises as :meth:`run`."""
        self.run(_effects_of(step), copies_before=False)

    def step_inputs(self, step: StepAllocation | StepEffects) -> StepInputs:
        """The slot mappings and tables of an applied ``step``'s tokens (see :meth:`apply`)."""
        with self._lock:
            index, positions, rows = step_tokens(step)
            slots: dict[tuple[str, int], Any] = {
                (name, r): ops.slot_mapping(self._tables[name], rows, positions, bs, r, check=False)
                for name, bs, r in self._slot_plan
            }
            tables: dict[str, Any] = self._device_tables or self._tables
            return StepInputs(index, positions, slots, dict(tables))

    def run_snapshots(self, request_ids: Sequence[str]) -> None:
        """Run the ``copies_after`` of the applied steps that named any of ``request_ids`` and
        whose snapshots have not run, before a newer step of theirs is applied: an
        asynchronous engine schedules step N + 1 before it ends step N, and N + 1's kernels
        would move a request's state past the boundary step N's snapshot is of. A copy that
        fails marks its step as one whose snapshots did not run (:meth:`end_snapshots`)."""
        with self._lock:
            due = self._steps.snapshots_due
            if not due:
                return
            ids = set(request_ids) if isinstance(request_ids, Sequence) else set()
            for step_id, (names, copies) in list(due.items()):
                if ids.isdisjoint(names):
                    continue
                del due[step_id]
                try:
                    self.copy_blocks(copies)
                except BaseException:
                    self._steps.snapshots_failed.add(step_id)
                    raise

    def end_snapshots(self, step_id: int) -> bool:
        """Run step ``step_id``'s ``copies_after`` unless :meth:`run_snapshots` ran them;
        whether its snapshots ran (``False`` when they failed there). Raises what a copy
        raises (the snapshots did not run)."""
        with self._lock:
            _, copies = self._steps.snapshots_due.pop(step_id, ((), ()))
            if copies:
                self.copy_blocks(copies)
            failed = self._steps.snapshots_failed
            if step_id in failed:
                failed.discard(step_id)
                return False
            return True

    def first_written(self, row: int, request_id: str, num_tokens: int) -> int:
        """The first token the latest step of ``request_id`` (in ``row``) wrote, when that
        step took it to ``num_tokens`` tokens; else ``num_tokens`` (see
        :meth:`StepLedger.first_written`)."""
        with self._lock:
            return self._steps.first_written(row, request_id, num_tokens)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Copy whole blocks of every (layer, role) of a group, ``src[i]`` to ``dst[i]``: the
        per-request state snapshots of prefix reuse (``StepAllocation.copies_before`` before
        a step's kernels, ``copies_after`` after them) and copies on write; all or nothing.

        Raises:
            BlockRangeError: a source or destination outside ``[1, num_blocks)`` (the null
                block and negative ids included), or a row outside the tables.
            BlockOwnershipError: a destination that a mirrored row other than
                ``BlockCopy.row`` holds (any row, for ``row == -1``) or a row of another group
                of its shared pool, or, for ``row >= 0``, one that is not in that row.
            WorkerRefusedError: a malformed copy or an unknown group.
        """
        with self._lock:
            self._ready()
            self._verify.copies(copies)
            self._steps.check_copies(copies)  # issued by an applied step, not run yet
            self._copy(copies)
            self._steps.ran(copies)

    def _copy(self, copies: Sequence[BlockCopy]) -> None:
        caches = self._ready()
        for copy in copies:
            src = torch.from_numpy(np.asarray(copy.src, dtype=np.int64)).to(self.device)
            dst = torch.from_numpy(np.asarray(copy.dst, dtype=np.int64)).to(self.device)
            for e in self.layout.buffers_of(copy.group):
                cache = caches[e.index]
                cache[dst] = cache[src]

    def slot_mapping(
        self,
        row: int,
        group: str,
        positions: np.ndarray,
        compress_ratio: int,
        checked: bool = False,
    ) -> np.ndarray:
        """Slots of ``positions`` (``int64``) of the request in table ``row``, from the mirror.

        ``checked``: the caller validated ``row`` (a row of the tables), ``positions`` (1-D
        ``int64``, non-negative) and ``compress_ratio`` (divides the group's block size), as
        the facade does; then the arguments are not checked again, and one position is
        computed in Python ints (:func:`_one_slot`, the numpy kernel's arithmetic; numpy's
        per-call overhead dominates at one token)."""
        with self._lock:
            if checked and positions.shape[0] == 1:
                few = self.few_slots(row, group, [int(positions[0])], compress_ratio)
                return np.array(few, dtype=np.int64)
            table = self.block_table(group)
            block_size = self.layout.group(group).block_size
            rows = np.full(positions.shape, row, dtype=np.int64)
            return ops.slot_mapping(
                table, rows, positions, block_size, compress_ratio, check=not checked
            )

    def few_slots(
        self, row: int, group: str, positions: list[int], compress_ratio: int
    ) -> list[int]:
        """:meth:`slot_mapping` of a few ``positions`` given as Python ints, for arguments the
        caller validated (``checked=True`` there): each by :func:`_one_slot`."""
        with self._lock:
            table = self.block_table(group)
            block_size = self.layout.group(group).block_size
            return [_one_slot(table, row, p, block_size, compress_ratio) for p in positions]

    def block_table(self, group: str) -> np.ndarray:
        """The mirrored table of ``group`` (numpy, host side)."""
        self._ready()
        table = self._tables.get(group)
        if table is None:
            raise ValueError(f"group {group!r} does not exist")
        return table

    # ================================================================== host pages

    def init_host(self, num_pages: Mapping[str, int]) -> None:
        """Allocate the pinned, page-first host pools and the backends' host views."""
        with self._lock:
            self._ready()
            if self._host is not None:
                raise RuntimeError("initialize_host_cache was already called on this storage")
            nbytes = sum(
                num_pages.get(g.name, 0) * self.layout.host_page_bytes(g.name)
                for g in self.layout.groups
            )
            check_allocatable(nbytes, "cpu", "host pages")
            host = HostPools(self.layout, num_pages, self.platform)
            views = HostViews(host)
            self._host_caches = [
                backend.create_host_kv_cache(layers, dict(num_pages), views)
                for backend, layers in self.layout.backend_layers()
            ]
            self._host = host

    @property
    def host(self) -> HostPools:
        return require_host(self._host)

    @property
    def host_ready(self) -> bool:
        return self._host is not None

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the storage holds: its swap pages and its tier pages (0
        before either is made and after :meth:`free`)."""
        swap = self._host.nbytes if self._host is not None else 0
        tier = self._tier_pages.nbytes if self._tier_pages is not None else 0
        return swap + tier

    # ================================================================== tier pages

    @property
    def tier_pages(self) -> HostTierPages | None:
        """The host pages of the prefix tier this storage owns, or ``None`` (none made, or
        released)."""
        return self._tier_pages

    def attach_tier_pages(self, pages: HostTierPages) -> None:
        """Own ``pages`` (made by ``HostTierPages(storage, num_pages)``): a step's page copies
        run through them, :attr:`host_bytes` counts them, :meth:`free` lets go of them.

        Raises:
            RuntimeError: the storage holds tier pages already, or has no device caches."""
        with self._lock:
            self._ready()
            if self._tier_pages is not None:
                raise RuntimeError("this storage has host tier pages already")
            self._tier_pages = pages

    def release_tier_pages(self) -> int:
        """Let go of the tier pages, once (a step that carries tier copies is refused from
        then on); the bytes released, 0 without tier pages. A remote tier's store must have
        forgotten them first (``host_memory.release_host_tier``)."""
        with self._lock:
            pages, self._tier_pages = self._tier_pages, None
            return pages.release() if pages is not None else 0

    @property
    def offloaded_groups(self) -> list[str]:
        """The groups with offloaded planes (those host pages can hold), sorted."""
        return sorted(self._planes)

    def check_page_copies(
        self,
        offloads: Sequence[PageCopy],
        onloads: Sequence[PageCopy],
        num_pages: Mapping[str, int],
        deltas: Sequence[TableDelta] = (),
    ) -> None:
        """The guard's checks of tier page copies against the mirrored tables
        (``guard.Verifier.page_copies``); nothing changes here."""
        with self._lock:
            self._verify.page_copies(offloads, onloads, num_pages, deltas)

    def end_copies(self, keep_alive: list[torch.Tensor]) -> Any:
        """Order later work on the compute stream after the side-stream copies queued so far,
        keeping ``keep_alive`` (what they read or write) until they finish; the event they end
        with (``None`` on CPU, where they are done already)."""
        with self._lock:
            return self._swaps.end_copies(keep_alive)

    @property
    def host_kv_caches(self) -> dict[CacheKey, torch.Tensor]:
        merged: dict[CacheKey, torch.Tensor] = {}
        for caches in self._host_caches:
            merged.update(caches)
        return merged

    # ================================================================== swaps

    def execute(self, plan: SwapPlan) -> SwapExecution:
        """Run a swap plan: hooks, then one gather (or scatter) per group for every request.

        Swap out: ``before_swap_out`` of every backend for every request, then the copies.
        Swap in: the copies, then ``after_swap_in`` once every request is resident. A hook
        that raises or a copy that fails is reported in the result (after every queued copy
        finished), never raised. Hand ``execution.result`` to the scheduler side's
        ``complete_swap``; keep ``execution.event`` / ``keep_alive`` until the copies are done.
        The plan is verified first (:func:`kvforge.worker.guard.check_plan`) against the
        mirror, so mirror ``take_table_deltas()`` after planning and before executing (a swap
        in's new rows are such deltas). A refused plan raises before any hook or byte; its id
        is not spent: give the scheduler side a failed result for it (``complete_swap``).

        Raises:
            PlanReplayError: the plan's id was executed already (a retry or a replay).
            BlockRangeError: a device block, block index or host page out of range, or the
                null block or page.
            BlockOwnershipError: a move's blocks are not what one mirrored row holds at its
                indices, or a swap in would write a running or another row's block.
            WorkerRefusedError: a malformed plan.
        """
        with self._lock:
            self._ready()
            return self._swaps.execute(plan, self._host)

    def synchronize(self) -> None:
        """Wait for every copy this storage queued."""
        self._swaps.synchronize()

    # ================================================================== teardown

    def free(self) -> None:
        """Free every device cache, host page (swap and tier pages) and host view, once.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._swaps.close()  # waits for the copies still in flight
            # taken first: a free an interrupt cut short never frees a backend's views twice
            views, self._host_caches = self._host_caches, []
            for (backend, _), caches in zip(self.layout.backend_layers(), views, strict=False):
                backend.free_host_kv_cache(caches)
            if self._host is not None:
                self._host.release()
            self._host = None
            self.release_tier_pages()
            self.pending = None
            self._caches = None
            self._planes = {}
            self._tables = {}
            self._device_tables = {}
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _ready(self) -> list[torch.Tensor]:
        if self._closed:
            raise ControllerClosedError(
                "this cache storage was freed; its caches are gone (create a new one)"
            )
        if self._caches is None:
            raise RuntimeError("call initialize_kv_cache before using the caches")
        return self._caches

    def _check_fresh(self) -> None:
        if self._closed:
            raise ControllerClosedError(
                "this cache storage was freed; its caches are gone (create a new one)"
            )
        if self._caches is not None:
            raise RuntimeError("initialize_kv_cache was already called on this controller")


# ====================================================================== helpers


def _effects_of(step: object) -> StepEffects:
    """A step's effects: a ``StepAllocation``'s, or a ``StepEffects`` itself."""
    if type(step) is StepAllocation:
        return step.effects
    if type(step) is StepEffects:
        return step
    raise WorkerRefusedError(
        f"apply: expected a StepAllocation or StepEffects, got {type(step).__name__}; "
        "nothing changed"
    )


def _apply_on_device(table: torch.Tensor, delta: TableDelta) -> None:  # pragma: no cover
    if len(delta.clear_rows):
        table[torch.from_numpy(delta.clear_rows).to(table.device, non_blocking=True).long()] = 0
    if len(delta.rows):
        rows = torch.from_numpy(delta.rows).to(table.device, non_blocking=True).long()
        cols = torch.from_numpy(delta.cols).to(table.device, non_blocking=True).long()
        vals = torch.from_numpy(delta.block_ids).to(table.device, non_blocking=True)
        table[rows, cols] = vals


def _one_slot(table: np.ndarray, row: int, position: int, block_size: int, ratio: int) -> int:
    """The slot of one ``position`` of table ``row`` (``-1`` where none is written): the
    arithmetic of :func:`kvforge.ops.slot_mapping` in Python ints, for validated arguments
    (``tests/worker/test_one_slot.py`` compares the two)."""
    if position % ratio != ratio - 1:
        return -1  # the token completes no compressed entry
    per_block = block_size // ratio
    col, off = divmod(position // ratio, per_block)
    if col >= table.shape[1]:
        return -1
    block = int(table[row, col])
    return block * per_block + off if block > 0 else -1
