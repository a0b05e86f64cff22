"""Exceptions kvforge raises on purpose, so engines can catch them by kind."""

from __future__ import annotations

__all__ = [
    "BlockOwnershipError",
    "BlockRangeError",
    "ControllerClosedError",
    "DeltaOrderError",
    "OutOfBlocksError",
    "PageOwnershipError",
    "PlanReplayError",
    "RequestStateError",
    "StepError",
    "StepOrderError",
    "SwapReceiptError",
    "UnissuedCopyError",
    "WorkerRefusedError",
    "add_note",
]


def add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc``'s notes, shown under its traceback: ``exc.add_note`` where
    Python has it (3.11 on), else the same ``__notes__`` list by hand (3.10, which kvforge
    supports, has the list's meaning to tools but no method), so a second failure while
    undoing never hides the first behind an ``AttributeError``.

    >>> exc = ValueError("first")
    >>> add_note(exc, "undoing failed")
    >>> exc.__notes__
    ['undoing failed']
    """
    method = getattr(exc, "add_note", None)
    if method is not None:
        method(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
    exc.__notes__ = [*notes, note]


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


class WorkerRefusedError(ValueError):
    """The worker side refused a value from the scheduler side (a table delta, a step, a block
    copy or a swap plan) before it mirrored or moved anything: the worker is unchanged.

    Subclasses name the kind; a value that is malformed (a wrong type, arrays of different
    lengths, an unknown group) raises this class itself.
    """


class DeltaOrderError(WorkerRefusedError):
    """A table delta arrived out of its sequence (``TableDelta.seq``): a gap, a repeat, a
    reordering, a delta never handed out, or one from another scheduler.

    Attributes:
        expected: the sequence number the worker mirrors next.
        got: the delta's ``seq``.
        group: the delta's group.
    """

    def __init__(self, expected: int, got: object, group: str) -> None:
        self.expected, self.got, self.group = expected, got, group
        if not isinstance(got, int) or isinstance(got, bool) or got < 0:
            why = "it was never handed out (take deltas from take_table_deltas or a step)"
        elif got == expected + 1:
            why = f"a gap: delta {expected} was never mirrored"
        elif got > expected:
            why = f"a gap: deltas {expected}..{got - 1} were never mirrored"
        else:
            why = f"a repeat or a reordering: deltas 0..{expected - 1} were already mirrored"
        super().__init__(
            f"apply_deltas: table delta of group {group!r} has seq {got!r}, expected "
            f"{expected}: {why}; nothing was mirrored"
        )


class BlockRangeError(WorkerRefusedError):
    """A block id, table row, table column or host page outside its range, or the null block
    where something would be written.

    Attributes:
        what: ``"block id"``, ``"row"``, ``"column"``, ``"host page"`` or ``"plan id"``.
        group: the group it belongs to (``""`` for a plan id).
        value: the first value out of range.
        low, high: the allowed range ``[low, high)``.
    """

    def __init__(self, action: str, what: str, group: str, value: int, low: int, high: int) -> None:
        self.what, self.group, self.value, self.low, self.high = what, group, value, low, high
        null = {"block id": " (0 is the null block)", "host page": " (0 is the null page)"}
        note = null.get(what, "") if value == 0 and low == 1 else ""
        where = f" of group {group!r}" if group else ""
        super().__init__(
            f"{action}: {what} {value}{where} is outside [{low}, {high}){note}; nothing changed"
        )


class BlockOwnershipError(WorkerRefusedError):
    """A copy or swap names a block its request does not own: a destination another table
    row holds (shared blocks are read-only), one not in the row it writes for, or swap blocks
    that the mirrored tables do not hold for the request at the plan's indices.

    Attributes:
        group: the group of the block.
        block: the block id.
        row: the row the write is for (``-1``: none, or not found).
        holder: the row that holds the block (``-1``: none).
    """

    def __init__(self, message: str, group: str, block: int, row: int, holder: int) -> None:
        self.group, self.block, self.row, self.holder = group, block, row, holder
        super().__init__(message)


class PlanReplayError(WorkerRefusedError):
    """A swap plan whose id this worker already executed (a retry, a replay, or a plan of
    another scheduler that reuses the id): executing it again could scatter pages into blocks
    that now belong to another request.

    Attributes:
        plan_id: the plan's id.
    """

    def __init__(self, plan_id: object, detail: str) -> None:
        self.plan_id = plan_id
        super().__init__(f"execute: swap plan {plan_id!r} {detail}; nothing moved")


class StepOrderError(WorkerRefusedError):
    """A step, an effects batch or a page copy arrived out of its sequence: a repeat (a retry
    of one already applied), a gap, a reordering, or one never handed out. Applying it could
    write blocks or pages that now belong to another request or prompt.

    Attributes:
        expected: the sequence number the worker applies next.
        got: the value's number.
    """

    def __init__(
        self, action: str, what: str, expected: int, got: object, sequence: str, first: int = 0
    ) -> None:
        self.expected, self.got = expected, got
        if not isinstance(got, int) or isinstance(got, bool) or got < first:
            why = "it was never handed out by the scheduler side"
        elif got > expected:
            why = f"a gap: {sequence} {expected}..{got - 1} never arrived"
        else:
            why = f"a repeat or a reordering: {sequence} {got} was already applied"
        super().__init__(
            f"{action}: {what} has {sequence} number {got!r}, expected {expected}: {why}; "
            "nothing changed"
        )


class PageOwnershipError(WorkerRefusedError):
    """A host tier page copy contradicts the worker's record of its pages: an offload into a
    page that still holds a key, or an onload from a page that holds another key or none.

    Attributes:
        group: the page's group.
        page: the page id.
    """

    def __init__(self, message: str, group: str, page: int) -> None:
        self.group, self.page = group, page
        super().__init__(message)


class UnissuedCopyError(WorkerRefusedError):
    """A block copy that no step this worker applied issued, or one that already ran: a
    forged copy, or a retry. Running it could overwrite a block that only the prefix cache
    holds, or one that belongs to another request by now.

    Attributes:
        group: the copy's group.
        block: the first destination block not issued.
    """

    def __init__(self, message: str, group: str, block: int) -> None:
        self.group, self.block = group, block
        super().__init__(message)


class SwapReceiptError(ValueError):
    """The scheduler side refused a successful :class:`~kvforge.core.values.SwapResult`
    whose receipt is not that of the plan it issued under that id: the worker never executed
    the plan, or executed another one (a flipped direction, a changed move). Nothing changed:
    the plan is still in flight; settle it with the worker's own result, or a failed one.

    Attributes:
        plan_id: the plan's id.
    """

    def __init__(self, plan_id: object, detail: str) -> None:
        self.plan_id = plan_id
        super().__init__(
            f"complete_swap: swap plan {plan_id!r} {detail}; nothing changed, the plan is "
            "still in flight"
        )
