"""The worker side: device storage, host pages, mirrored block tables, step and swap execution.

:class:`CacheStorage` executes what the scheduler side
(:class:`kvforge.scheduler.block_manager.BlockManager`) decided, from plain values only. One
line per piece:

- ``storage``: :class:`CacheStorage`, the device storage of one worker (install, views, tables,
  swaps) and ``CacheStorage.run``, the one place a step's effects
  (:class:`~kvforge.core.values.StepEffects`) are applied;
- ``device_buffers``: the device buffers created from the declarations or adopted from an
  engine, checked before the storage keeps them (``BufferBuilder``, ``DeviceBuffers``);
- ``swap_execution``: a swap plan's hooks and copies, its failure reported, its events
  (``SwapExecutor``, ``SwapExecution``);
- ``swap_pages``: host pages of swapped-out requests (page-first pools) and the host views
  backends get;
- ``tier_pages``: host pages of the prefix tier (``HostTierPages``), owned by the storage;
- ``host_memory``: every host byte a worker holds, counted and let go of in one place;
- ``guard``: what the worker checks before it mirrors a delta or moves a byte;
- ``step_ledger``, ``page_ledger``, ``swap_ledger``: what it remembers of the steps, tier page
  copies and swaps it ran (each applied once, in order, only as issued);
- ``transfer``: gathers and scatters between device blocks and host pages, on side streams;
- ``overlap``, ``buffer_checks``, ``arena_views``: checks and views of the device buffers;
- ``tokens``: the per-token arrays of a step.
"""

from kvforge.worker.storage import CacheStorage, StepInputs

__all__ = ["CacheStorage", "StepInputs"]
