"""The worker side: device caches, host pages, mirrored block tables and swap execution.

:class:`CacheStorage` executes what the scheduler side
(:class:`kvforge.cache_controller.BlockManager`) decided, from plain values only.
"""

from kvforge.worker.storage import CacheStorage, StepInputs

__all__ = ["CacheStorage", "StepInputs"]
