"""Swap execution on a worker: a swap plan's hooks and copies, its failure, its events.

:class:`SwapExecutor` runs the :class:`~kvforge.core.values.SwapPlan` values a
:class:`~kvforge.worker.storage.CacheStorage` receives (``CacheStorage.execute``) and answers
each with a :class:`SwapExecution`, whose :class:`~kvforge.core.values.SwapResult` goes back to
the scheduler side. It also owns the side streams swaps and page copies run on and the
executions whose copies an accelerator may still be running (``end_copies``,
``synchronize``). The storage makes one when it installs its device buffers, bound to them,
to its mirrored tables, its guard (:class:`~kvforge.worker.guard.Verifier`) and its step
ledger, and lets go of it on ``free``; it calls it with the storage's lock held.

Invariants:

- a plan is verified (:meth:`~kvforge.worker.guard.Verifier.plan`) before any hook runs or a
  byte moves; a refused plan raises and its id is not spent
  (``tests/worker/test_verification.py``, ``tests/worker/test_swap_ledger.py``);
- swap out runs ``before_swap_out`` of every backend for every request, then the copies;
  swap in runs the copies, then ``after_swap_in`` once every request is resident;
- a hook that raises or a copy that fails is reported in the result, never raised, after every
  copy it queued finished (``Platform.synchronize``), so the scheduler side may hand the blocks
  out again (``tests/worker/test_offload.py``, ``tests/test_two_sides.py``);
- the copies go through :func:`~kvforge.worker.transfer.move_pages`, looked up in this
  module at each call (the tests inject a failing copy by patching
  ``kvforge.worker.swap_execution.move_pages``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kvforge.attn_backends.base import AttentionBackend, SwapContext
from kvforge.core.layout import CacheLayout
from kvforge.core.values import RequestMove, SwapFailure, SwapPlan, SwapResult
from kvforge.ops import PlaneSet
from kvforge.platform import Platform
from kvforge.worker.guard import Verifier
from kvforge.worker.step_ledger import StepLedger
from kvforge.worker.swap_pages import HostPools
from kvforge.worker.transfer import SwapStreams, move_pages

__all__ = ["SwapExecution", "SwapExecutor", "require_host"]


@dataclass
class SwapExecution:
    """What :meth:`CacheStorage.execute` did with one plan.

    Attributes:
        result: the plain value to hand back to the scheduler side
            (``BlockManager.complete_swap``): it pickles, the rest stays on the worker.
        event: the event the plan's copies end with (``None`` on CPU, or on failure).
        keep_alive: tensors the copies read or write until ``event`` completes.
    """

    result: SwapResult
    event: Any = None
    keep_alive: list[torch.Tensor] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result.ok


def require_host(host: HostPools | None) -> HostPools:
    """``host``, or the error of a storage asked to swap before it has swap pages."""
    if host is None:
        raise RuntimeError("call initialize_host_cache before swapping")
    return host


class SwapExecutor:
    """Runs one storage's swap plans and orders later work after its side-stream copies.

    Args:
        layout: the model's declarations.
        platform: the device's platform (events, streams, synchronize).
        streams: the side streams copies run on (``None`` on CPU, and before install).
        caches: the device buffers, in layout order.
        planes: ``group -> PlaneSet`` of the offloaded buffers.
        verify: the storage's guard, bound to its mirrored tables.
        steps: the storage's step ledger (which request each row serves).
        tables: the storage's mirrored block tables (numpy).
    """

    def __init__(
        self,
        layout: CacheLayout,
        platform: Platform,
        streams: SwapStreams | None = None,
        caches: Sequence[torch.Tensor] = (),
        planes: Mapping[str, PlaneSet] | None = None,
        verify: Verifier | None = None,
        steps: StepLedger | None = None,
        tables: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.layout = layout
        self.platform = platform
        self.streams = streams
        self.caches = list(caches)
        self.planes = dict(planes or {})
        self.verify = verify if verify is not None else Verifier({}, {}, {})
        self.steps = steps if steps is not None else StepLedger(0)
        self.tables = tables if tables is not None else {}
        #: executions whose copies an accelerator may still run (never on CPU)
        self.in_flight: list[SwapExecution] = []

    def execute(self, plan: SwapPlan, host: HostPools | None) -> SwapExecution:
        """Verify ``plan`` against the bound tables, then run it through ``host``'s swap
        pages (``CacheStorage.execute`` states the order, what is reported and what raises)."""
        if not isinstance(plan, SwapPlan):
            raise TypeError(f"plan must be a SwapPlan, got {type(plan).__name__}")
        pools = require_host(host)
        pages = {g: p.num_pages for g, p in pools.groups.items() if g in self.planes}
        self.verify.plan(plan, pages, self.steps.row_request)
        self.in_flight = [c for c in self.in_flight if not _finished(c)]
        keep_alive: list[torch.Tensor] = []
        failure = self._hooks_and_copies(plan, pools, keep_alive)
        if failure is not None:
            return failure
        result = SwapResult(plan.plan_id, receipt=self.verify.executed(plan))  # swap ledger
        if plan.direction == "in":  # the rows it filled serve its requests from now on
            self.steps.swapped_in(plan, self.tables)
        execution = SwapExecution(result, self.finish(), keep_alive)
        if execution.event is not None:  # pragma: no cover - accelerators only
            self.in_flight.append(execution)
        return execution

    def _hooks_and_copies(
        self, plan: SwapPlan, host: HostPools, keep_alive: list[torch.Tensor]
    ) -> SwapExecution | None:
        """The plan's hooks and copies in its direction's order; the failed execution when a
        hook or a copy raised (after every queued copy finished), else ``None``."""
        stage: Literal["hook", "copy"] = "hook"
        current = ""
        try:
            if plan.direction == "out":
                for move in plan.requests:
                    current = move.request_id
                    for backend, layers in self.layout.backend_layers():
                        backend.before_swap_out(self._context(backend, layers, move))
                stage, current = "copy", ""
                self._move(plan, host, keep_alive)
            else:
                stage = "copy"
                self._move(plan, host, keep_alive)
                stage = "hook"
                self.finish()
                for move in plan.requests:
                    current = move.request_id
                    for backend, layers in self.layout.backend_layers():
                        backend.after_swap_in(self._context(backend, layers, move))
        except BaseException as exc:
            # no copy of a failed plan may still touch the blocks or pages it named
            self.platform.synchronize()
            failure = SwapFailure(stage, current, type(exc).__name__, str(exc))
            return SwapExecution(SwapResult(plan.plan_id, failure, exc))
        return None

    def _context(
        self, backend: AttentionBackend, layers: tuple[int, ...], move: RequestMove
    ) -> SwapContext:
        caches = self.caches
        return SwapContext(
            request_id=move.request_id,
            num_tokens=move.num_tokens,
            purpose=move.purpose,
            layer_ids=layers,
            caches={e.key: caches[e.index] for e in self.layout.buffers_of_layers(layers)},
            device_blocks={g: ids.tolist() for g, ids in move.device_blocks.items()},
        )

    def _move(self, plan: SwapPlan, host: HostPools, keep_alive: list[torch.Tensor]) -> None:
        for group in plan.groups:
            blocks, pages = plan.group_move(group)
            if not len(blocks):
                continue
            move_pages(
                plan.direction,
                self.platform,
                self.streams,
                self.planes[group],
                blocks,
                host.groups[group].pages,
                pages,
                keep_alive,
            )

    def finish(self) -> Any:
        """Order later work on the current stream after the side-stream copies; the event
        recorded (``None`` on CPU)."""
        streams = self.streams
        event = self.platform.record_event(streams.compute if streams else None)
        if event is not None:  # pragma: no cover - accelerators only
            self.platform.current_stream_wait(event)
        return event

    def end_copies(self, keep_alive: list[torch.Tensor]) -> Any:
        """:meth:`finish`, keeping ``keep_alive`` until the event completes (on accelerators)."""
        event = self.finish()
        if event is not None:  # pragma: no cover - accelerators only
            self.in_flight.append(SwapExecution(SwapResult(-1), event, keep_alive))
        return event

    def synchronize(self) -> None:
        """Wait for every copy queued on the device; nothing is in flight after."""
        self.platform.synchronize()
        self.in_flight.clear()

    def close(self) -> None:
        """Wait for the copies still in flight (if any), then let go of the streams, buffers
        and tables."""
        if self.in_flight:  # pragma: no cover - accelerators only
            self.platform.synchronize()
        self.streams = None
        self.in_flight = []
        self.caches = []
        self.planes = {}
        self.tables = {}


def _finished(completion: SwapExecution) -> bool:
    event = completion.event
    return event is None or bool(event.query())  # pragma: no cover - accelerators only
