"""Exceptions kvforge raises on purpose, so engines can catch them by kind."""

from __future__ import annotations

__all__ = ["ControllerClosedError", "OutOfBlocksError", "RequestStateError", "StepError"]


class OutOfBlocksError(RuntimeError):
    """A pool (device or host) lacks the blocks an operation needs; nothing was changed.

    Attributes:
        pool: which pool (``"device"`` or ``"host"``).
        group: the group that ran short.
        needed: blocks the operation needed from it.
        free: blocks it had free.
    """

    def __init__(self, pool: str, group: str, needed: int, free: int, action: str) -> None:
        self.pool, self.group, self.needed, self.free = pool, group, needed, free
        super().__init__(
            f"{action}: {pool} group {group!r} needs {needed} free blocks but has {free}; "
            "nothing was allocated"
        )


class RequestStateError(ValueError):
    """A request id is unknown, or the request is in the wrong state for the call."""


class ControllerClosedError(RuntimeError):
    """The controller was freed; it holds no caches any more."""


class StepError(ValueError):
    """A step protocol violation: ``end_step`` of a step that is unknown, already ended or
    stale, or a request touched while a step that writes it is still in flight."""
