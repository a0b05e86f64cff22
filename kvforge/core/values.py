"""Plain values that cross from the scheduler side to the worker side and back.

Everything here is a frozen dataclass of ints, strings and numpy arrays: it pickles cheaply,
holds no torch tensor and no device memory, and imports nothing from the worker side. The
scheduler side (:class:`~kvforge.scheduler.block_manager.BlockManager`) produces
:class:`StepAllocation` and :class:`SwapPlan`; the worker side
(:class:`~kvforge.worker.CacheStorage`) applies them and answers a :class:`SwapResult`.

Array conventions: block ids and table rows are ``int32`` (the dtype attention kernels read
block tables in), token counts and positions ``int64``. ``NULL_BLOCK`` (0) in a table means
"no block here".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kvforge.core.prefix_keys import ExtraKeys, MultimodalKey, as_extra_keys
from kvforge.errors import RequestStateError
from kvforge.specs import SwapPurpose

__all__ = [
    "FEW_CELLS",
    "NO_CELLS",
    "BlockCopy",
    "PageCopy",
    "PageRelease",
    "PrefixEvent",
    "PrefixMatch",
    "PrefixQuery",
    "Refusal",
    "RequestMove",
    "StepAllocation",
    "StepEffects",
    "SwapFailure",
    "SwapPlan",
    "SwapResult",
    "TableDelta",
    "cleared_row_deltas",
    "frozen_rows",
    "page_owner",
]

_EMPTY32 = np.zeros(0, dtype=np.int32)
_EMPTY64 = np.zeros(0, dtype=np.int64)
#: the cells of a :class:`TableDelta` that writes none (it only clears rows): one frozen empty
#: ``int32`` array, shared, so a worker knows such a delta by identity at one comparison
NO_CELLS = np.zeros(0, dtype=np.int32)
NO_CELLS.flags.writeable = False
#: cells (or cleared rows) of one request's step in one group, at most: up to this many, a
#: worker checks and mirrors a delta in Python ints (numpy's per-call overhead dominates)
FEW_CELLS = 8


@dataclass(frozen=True, slots=True)
class TableDelta:
    """One change to the persistent block table of one group.

    A worker mirrors a table by applying, in order: ``table[clear_rows, :] = 0``, then
    ``table[rows, cols] = block_ids``. Within one delta every ``(row, col)`` cell appears at
    most once, so the assignment is well defined; deltas are applied in the order given.

    Attributes:
        group: the group whose table changes.
        clear_rows: ``int32 [k]`` rows emptied (a request finished, swapped out or moved).
        rows: ``int32 [n]`` row of each written cell.
        cols: ``int32 [n]`` block index of each written cell.
        block_ids: ``int32 [n]`` new content: a block id, or ``0`` where a window released one.
        seq: the delta's place in the scheduler side's one sequence of deltas (0, 1, 2, ...),
            numbered when the deltas are handed out; a worker applies them in this order,
            each once (``-1``: not handed out yet).
    """

    group: str
    clear_rows: np.ndarray = field(default_factory=lambda: NO_CELLS)
    rows: np.ndarray = field(default_factory=lambda: NO_CELLS)
    cols: np.ndarray = field(default_factory=lambda: NO_CELLS)
    block_ids: np.ndarray = field(default_factory=lambda: NO_CELLS)
    seq: int = -1

    def apply(self, table: np.ndarray) -> None:
        """Apply this delta to a numpy mirror ``int32 [max_num_seqs, max_blocks]``."""
        clear, n = self.clear_rows, len(self.rows)
        if len(clear) == 1:
            table[int(clear[0])] = 0  # one finished request: basic indexing
        elif len(clear):
            table[clear] = 0
        if (
            0 < n <= FEW_CELLS
            and type(self.rows) is type(self.cols) is type(self.block_ids) is np.ndarray
        ):
            # a step of one request: scalar stores beat a scatter
            for row, col, block in zip(
                self.rows.tolist(), self.cols.tolist(), self.block_ids.tolist(), strict=True
            ):
                table[row, col] = block
        elif n:
            table[self.rows, self.cols] = self.block_ids


# the slots of TableDelta, set as its dataclass __init__ sets them (object.__setattr__ per
# field) but without the call per field: a finish hands the workers one delta per group
_NEW_DELTA = object.__new__
_SET_GROUP = TableDelta.group.__set__  # type: ignore[attr-defined]
_SET_CLEAR = TableDelta.clear_rows.__set__  # type: ignore[attr-defined]
_SET_ROWS = TableDelta.rows.__set__  # type: ignore[attr-defined]
_SET_COLS = TableDelta.cols.__set__  # type: ignore[attr-defined]
_SET_IDS = TableDelta.block_ids.__set__  # type: ignore[attr-defined]
_SET_SEQ = TableDelta.seq.__set__  # type: ignore[attr-defined]


def frozen_rows(num_rows: int) -> list[np.ndarray]:
    """Row ``r``'s ``clear_rows`` (``int32 [1]`` holding ``r``) for every row below
    ``num_rows``: views of one array over immutable bytes, so no holder can make one
    writeable and change which row a later delta clears.

    >>> rows = frozen_rows(3)
    >>> [r.tolist() for r in rows], rows[2].flags.writeable, rows[2].base.flags.writeable
    ([[0], [1], [2]], False, False)
    """
    rows = np.frombuffer(np.arange(num_rows, dtype=np.int32).tobytes(), dtype=np.int32)
    return [rows[r : r + 1] for r in range(num_rows)]


def cleared_row_deltas(groups: Sequence[str], rows: np.ndarray) -> list[TableDelta]:
    """Per group of ``groups``, the delta that empties ``rows`` (a frozen ``int32 [k]``,
    shared by them): equal to ``TableDelta(group, rows)``, built at half its cost.

    >>> rows = np.array([3], dtype=np.int32)
    >>> [d == TableDelta(g, rows) for d, g in zip(cleared_row_deltas(["swa", "full"], rows),
    ...                                           ["swa", "full"])]
    [True, True]
    """
    out = []
    for group in groups:
        d = _NEW_DELTA(TableDelta)
        _SET_GROUP(d, group)
        _SET_CLEAR(d, rows)
        _SET_ROWS(d, NO_CELLS)
        _SET_COLS(d, NO_CELLS)
        _SET_IDS(d, NO_CELLS)
        _SET_SEQ(d, -1)
        out.append(d)
    return out


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request of a step could not be scheduled; nothing changed for it.

    Attributes:
        request_id: the refused request.
        reason: ``"out_of_blocks"`` (a pool is short), ``"max_num_seqs"`` (every table row is
            taken) or ``"max_model_len"`` (the request would grow past the tables' width).
        group: the group that ran short (``out_of_blocks`` and ``max_model_len``), else ``""``.
        needed: blocks (or rows, or tokens for ``max_model_len``) the request needed.
        available: what was available when its turn came.
    """

    request_id: str
    reason: Literal["out_of_blocks", "max_num_seqs", "max_model_len", "stale_prefix"]
    group: str
    needed: int
    available: int

    @property
    def message(self) -> str:
        if self.reason == "out_of_blocks":
            return (
                f"request {self.request_id!r}: device group {self.group!r} needs {self.needed} "
                f"free blocks but has {self.available}; nothing was allocated"
            )
        if self.reason == "stale_prefix" and not self.group:
            return (
                f"request {self.request_id!r}: its prefix match is not one this scheduler's "
                "lookup made as it stands (forged, altered, or another scheduler's); look it "
                "up again"
            )
        if self.reason == "stale_prefix":
            return (
                f"request {self.request_id!r}: its prefix match is stale (a block of group "
                f"{self.group!r} was evicted since the lookup); look it up again"
            )
        if self.reason == "max_num_seqs":
            return (
                f"request {self.request_id!r}: every one of the {self.available} table rows "
                "(max_num_seqs) is taken; nothing was allocated"
            )
        return (
            f"request {self.request_id!r}: {self.needed} tokens exceed max_model_len="
            f"{self.available}; nothing was allocated"
        )


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy whole blocks of every (layer, role) of one group on the device: ``src[i]`` to
    ``dst[i]`` (per-request state snapshots for prefix reuse).

    Attributes:
        group: the group.
        src: ``int32 [k]`` source block ids.
        dst: ``int32 [k]`` destination block ids.
        row: the table row of the request the copy writes for: ``dst`` lies in that row (a
            restored state, a copy on write), or, for ``-1``, in no row at all (a snapshot
            into fresh blocks the prefix cache holds). A worker refuses a ``dst`` that another
            row holds.
    """

    group: str
    src: np.ndarray
    dst: np.ndarray
    row: int = -1


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy whole blocks of every offloaded (layer, role) of one group between the device and
    the prefix cache's host tier pages (``kvforge.scheduler.host_tier``): an offload copies
    ``device_blocks[i]`` to ``host_pages[i]``, an onload the other way.

    The copy also carries the ownership of the pages it touches, so a worker checks it
    against its own record of the pages (:mod:`kvforge.worker.page_ledger`) and never against
    the sender's word: ``released`` pages no longer hold their key (the tier evicted them);
    an offload writes only a released page, which then holds ``owners[i]``; an onload reads
    only a page that holds ``owners[i]``. ``seq`` numbers the copies a tier hands out
    (0, 1, 2, ... over all its groups), so a worker runs each once, in order.

    Attributes:
        group: the group.
        device_blocks: ``int32 [k]`` device block ids.
        host_pages: ``int32 [k]`` host tier page ids, same order.
        owners: ``int64 [k]`` the :func:`page_owner` tag of the prefix key each page holds
            (written by an offload, expected by an onload).
        released: ``int32 [m]`` pages the tier released since its previous copy of this
            group, applied before this copy's offloads.
        seq: the copy's place in its tier's sequence (``-1``: never handed out).
    """

    group: str
    device_blocks: np.ndarray
    host_pages: np.ndarray
    owners: np.ndarray = field(default_factory=lambda: _EMPTY64)
    released: np.ndarray = field(default_factory=lambda: _EMPTY32)
    seq: int = -1


def page_owner(key: bytes) -> int:
    """The tag a host page's ownership record keeps for the prefix key it holds: the key's
    first 8 bytes as a signed little-endian int64 (``0`` is never a tag: it means "released").

    >>> page_owner(bytes(range(1, 33)))
    578437695752307201
    >>> page_owner(bytes(32))  # all-zero bytes map to 1, not to "released"
    1
    """
    tag = int.from_bytes(key[:8], "little", signed=True)
    return tag or 1


@dataclass(frozen=True, slots=True)
class StepEffects:
    """Everything one numbered step makes the worker do: the effects of a scheduled step
    (:attr:`StepAllocation.effects`) or of a batch made between steps
    (``BlockManager.take_effects``, a step of no request). ``CacheStorage.run`` applies it,
    once and in its sequence (``step_id``), in this order, the only place the order is
    written down:

    1. check everything before a byte moves: the step's number and rows (the worker's step
       ledger), every block copy and page copy in range and owned (its guard, its tier pages'
       page ledger); a refused step changes nothing;
    2. ``moves``: the arena's block moves, first, since the onloads and the kernels may write
       their sources;
    3. ``offloads`` then ``onloads``: the host tier's page copies (device blocks evicted to tier
       pages, then pages a lookup brought back), so an evicted block is saved before anything
       writes it again;
    4. the step is numbered (the worker's sequence moves on: a step is never applied twice),
       then ``table_deltas`` are mirrored (finishes, swaps, truncations, then the step's
       growth) and its rows serve its requests;
    5. ``copies_before``: state restores from prefix snapshots and copies on write, before
       any kernel of the step reads their blocks.

    ``copies_after`` (snapshots taken at a boundary the step ends on) are issued by the step
    and run after its kernels (``CacheStorage.copy_blocks``), once.

    Attributes:
        step_id: the step's number in the sequence of steps (1, 2, ...).
        request_ids: the step's requests (none for a batch made between steps).
        rows: ``int32 [B]`` table row of each request.
        num_computed: ``int64 [B]`` tokens each request held before the step.
        num_new: ``int64 [B]`` tokens the step writes for it.
        table_deltas: block table changes, in their sequence (``TableDelta.seq``).
        moves, offloads, onloads, copies_before, copies_after: as :class:`StepAllocation`.
    """

    step_id: int
    request_ids: tuple[str, ...]
    rows: np.ndarray
    num_computed: np.ndarray
    num_new: np.ndarray
    table_deltas: tuple[TableDelta, ...]
    moves: tuple[BlockCopy, ...] = ()
    offloads: tuple[PageCopy, ...] = ()
    onloads: tuple[PageCopy, ...] = ()
    copies_before: tuple[BlockCopy, ...] = ()
    copies_after: tuple[BlockCopy, ...] = ()


@dataclass(frozen=True, slots=True)
class StepAllocation:
    """What one scheduler step decided, for the whole batch.

    Attributes:
        request_ids: scheduled requests, in the order they were given (refused ones left out).
        rows: ``int32 [B]`` block-table row of each scheduled request.
        num_computed: ``int64 [B]`` tokens each request held before this step.
        num_new: ``int64 [B]`` tokens scheduled for it in this step.
        refused: requests that could not be scheduled, with the reason.
        table_deltas: every change to the block tables since the previous step, in order
            (finishes and swaps in between, then this step's growth).
        copies_before: block copies to run before the step's kernels (restoring a
            per-request state from a prefix snapshot).
        copies_after: block copies to run after them (snapshots of per-request state taken
            at a boundary the step ended on).
        step_id: the step's unique id (1, 2, ...): ``end_step`` takes it, once.
        offloads: copies of prefix blocks the device evicted to the host tier's pages
            (:class:`PageCopy`, one per group), to run before anything else of the step:
            the step may write those blocks again.
        onloads: copies of host tier pages back to device blocks that lookups brought back
            (one per group), to run after ``offloads`` and before the step's kernels.
        moves: cached blocks the step's takes moved within their group (slab arena, one
            :class:`BlockCopy` per group, ``row`` -1), to run first: a destination is a
            block no table and no offload names, a source may be written by the step.
    """

    request_ids: tuple[str, ...]
    rows: np.ndarray
    num_computed: np.ndarray
    num_new: np.ndarray
    refused: tuple[Refusal, ...]
    table_deltas: tuple[TableDelta, ...]
    copies_before: tuple[BlockCopy, ...] = ()
    copies_after: tuple[BlockCopy, ...] = ()
    step_id: int = 0
    offloads: tuple[PageCopy, ...] = ()
    onloads: tuple[PageCopy, ...] = ()
    moves: tuple[BlockCopy, ...] = ()
    # the effects, made on first read (a dataclass's own __init__ calls no kvforge code, so
    # a step handed out cannot be lost to an interrupt while it is being built)
    _effects: StepEffects | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def effects(self) -> StepEffects:
        """What this step makes the worker do (``CacheStorage.run``), in the order
        :class:`StepEffects` states: the same object on every read."""
        effects = self._effects
        if effects is None:
            effects = StepEffects(
                self.step_id, self.request_ids, self.rows, self.num_computed, self.num_new,
                self.table_deltas, self.moves, self.offloads, self.onloads, self.copies_before,
                self.copies_after,
            )  # fmt: skip
            object.__setattr__(self, "_effects", effects)
        return effects

    @property
    def num_scheduled_tokens(self) -> int:
        return int(self.num_new.sum())


@dataclass(frozen=True, slots=True)
class RequestMove:
    """The blocks of one request that a swap moves.

    Attributes:
        request_id: the request.
        num_tokens: tokens it holds.
        purpose: why it moves.
        block_indices: group -> ``int64 [k]`` block-table index of each moved block.
        device_blocks: group -> ``int32 [k]`` device block ids (the source of a swap out, the
            destination of a swap in).
        host_pages: group -> ``int32 [k]`` host page ids, same order.
    """

    request_id: str
    num_tokens: int
    purpose: SwapPurpose
    block_indices: dict[str, np.ndarray]
    device_blocks: dict[str, np.ndarray]
    host_pages: dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class PageRelease:
    """Swap pages the scheduler side gave back: they no longer hold ``request_id``'s data
    (it finished while swapped out, came back, or its swap out failed).

    Attributes:
        seq: the release's place in the scheduler side's sequence of releases (0, 1, ...).
        request_id: the request whose swapped data the pages held.
        host_pages: group -> ``int32 [k]`` the pages.
    """

    seq: int
    request_id: str
    host_pages: dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class SwapPlan:
    """A swap decided by the scheduler side, for the worker side to execute.

    Attributes:
        plan_id: identifies the plan when its :class:`SwapResult` comes back.
        direction: ``"out"`` (device to host) or ``"in"``.
        requests: the requests, in the order they were given.
        groups: the groups that move, in the layout's order.
        released: the swap pages the scheduler side released that the worker may not have
            heard of yet (:class:`PageRelease`, in ``seq`` order), applied to the worker's
            swap ledger (:mod:`kvforge.worker.swap_ledger`) before the plan is checked.
        token: a random secret of this plan: the worker's :attr:`SwapResult.receipt` is a
            keyed digest of the plan it executed (:mod:`kvforge.core.swap_receipt`).
    """

    plan_id: int
    direction: Literal["out", "in"]
    requests: tuple[RequestMove, ...]
    groups: tuple[str, ...]
    released: tuple[PageRelease, ...] = ()
    token: bytes = b""

    def group_move(self, group: str) -> tuple[np.ndarray, np.ndarray]:
        """``(device block ids, host page ids)`` of every request for ``group``, in order."""
        blocks = [m.device_blocks[group] for m in self.requests if group in m.device_blocks]
        pages = [m.host_pages[group] for m in self.requests if group in m.host_pages]
        if not blocks:
            return _EMPTY32, _EMPTY32
        return np.concatenate(blocks), np.concatenate(pages)


@dataclass(frozen=True, slots=True)
class SwapFailure:
    """Why the worker side could not execute a swap plan.

    Attributes:
        stage: ``"hook"`` (a backend's ``before_swap_out`` / ``after_swap_in`` raised) or
            ``"copy"`` (the data path failed).
        request_id: the request whose hook raised, ``""`` for a copy failure.
        error_type: the exception's class name.
        message: the exception's message.
    """

    stage: Literal["hook", "copy"]
    request_id: str
    error_type: str
    message: str


@dataclass(frozen=True, slots=True)
class SwapResult:
    """The worker side's answer to a :class:`SwapPlan`.

    ``failure`` is ``None`` when every byte moved. A failed swap out left the device blocks
    as they were; a failed swap in may have written some new device blocks, which the
    scheduler side gives back. ``error`` is the original exception when it could be carried
    (it is dropped if it cannot be pickled). ``receipt``: the worker's proof that it
    executed the plan (:func:`kvforge.core.swap_receipt.plan_receipt`); the scheduler side
    accepts an ``ok`` result only with the receipt of the plan it issued.
    """

    plan_id: int
    failure: SwapFailure | None = None
    error: BaseException | None = field(default=None, compare=False)
    receipt: bytes = b""

    @property
    def ok(self) -> bool:
        return self.failure is None

    def __reduce__(self) -> tuple[object, ...]:
        import pickle

        error = self.error
        try:
            pickle.dumps(error)
        except Exception:
            error = None
        return (SwapResult, (self.plan_id, self.failure, error, self.receipt))


@dataclass(frozen=True, slots=True)
class PrefixQuery:
    """A prompt to look up in the prefix cache.

    Attributes:
        token_ids: the prompt's token ids.
        extra_keys: request-level keys that must match for blocks to be shared, tagged by
            source: :class:`~kvforge.core.prefix_keys.ExtraKeys` (``cache_salt``, ``adapter``,
            custom fields). ``None``: none. A plain tuple is refused (``TypeError``).
        mm_keys: :class:`~kvforge.core.prefix_keys.MultimodalKey` ``(start, end, digest)``:
            token ranges whose content is not told by their ids (multimodal placeholders) and
            a digest of at least 32 bytes of that content, hashed by position.

    Raises:
        TypeError / ValueError: a field of the wrong type or value, named.
    """

    token_ids: Sequence[int] | np.ndarray
    extra_keys: ExtraKeys | None = None
    mm_keys: tuple[MultimodalKey, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_keys", as_extra_keys(self.extra_keys, "extra_keys"))
        if isinstance(self.mm_keys, MultimodalKey) or not isinstance(self.mm_keys, Sequence):
            raise TypeError(
                f"mm_keys must be a sequence of MultimodalKey, got {type(self.mm_keys).__name__}"
            )
        for i, key in enumerate(self.mm_keys):
            if not isinstance(key, MultimodalKey):
                raise TypeError(
                    f"mm_keys[{i}] must be a MultimodalKey(start, end, digest), got "
                    f"{type(key).__name__}"
                )
        object.__setattr__(self, "mm_keys", tuple(self.mm_keys))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix of one prompt, to hand to ``BlockManager.schedule``.

    Attributes:
        num_tokens: ``L``, the tokens served from cache (0 on a miss): aligned to every
            group's block, below the prompt's length.
        first_col: group -> first block index the request shares (0 for full groups; the
            start of the trailing window or chunk for window groups).
        blocks: group -> ``int32`` block ids for block indices ``first_col ..``; for a
            per-request group, the snapshot block to restore from.
        keys: group -> the keys of those blocks (to check the match is still valid).
        hasher: the request's key chain at ``L`` (continues hashing its suffix).
        seal: a MAC, under a secret of the scheduler that made the match, of everything
            above and below: a match that was forged, altered, or made by another scheduler
            is refused (``Refusal.reason == "stale_prefix"``).
        num_prompt_tokens: the length of the prompt looked up: where it ends tells
            ``prefix_retention="checkpoints"`` which window and state blocks the request keeps
            reusable (its replay boundary).
        junction: a boundary beyond ``num_tokens`` up to which the full-attention chain is
            cached but some window or state tail is not (where this prompt left a cached one),
            or 0: under ``prefix_retention="checkpoints"`` the request keeps the tail there.
    """

    num_tokens: int
    first_col: dict[str, int]
    blocks: dict[str, np.ndarray]
    keys: dict[str, tuple[bytes, ...]]
    hasher: object
    seal: bytes = b""
    num_prompt_tokens: int = 0
    junction: int = 0


@dataclass(frozen=True, slots=True)
class PrefixEvent:
    """A change of the prefix cache an engine or a router may mirror.

    Attributes:
        kind: ``"stored"`` (a block became reusable) or ``"removed"`` (it was evicted).
        group: the group of the block.
        key: the block's prefix key (32 bytes; the same in every process and engine that
            follows ``docs/prefix_keys.md``).
        num_tokens: the prefix length the key covers.
    """

    kind: Literal["stored", "removed"]
    group: str
    key: bytes
    num_tokens: int


def check_request_id(request_id: object) -> str:
    """``request_id`` itself, refused unless it is a non-empty str (both sides check alike)."""
    if not isinstance(request_id, str) or not request_id:
        raise RequestStateError(f"request_id must be a non-empty str, got {request_id!r}")
    return request_id
