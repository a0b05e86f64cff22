"""Argument validation and the transfer plan shared by every gather/scatter implementation.

Every implementation (``torch``, ``cpu``, ``triton``) receives a :class:`TransferPlan` built by
:func:`validate` *before* any byte moves, so all of them reject exactly the same inputs with
exactly the same messages, and a rejected call never changes a byte.

Invariants:

- A plane is ``uint8 [num_blocks, block_bytes]`` with strides ``(block_stride, 1)``,
  ``block_stride >= block_bytes``: block ``b`` is the ``block_bytes`` bytes at
  ``addr + b * block_stride``. The bytes between ``block_bytes`` and ``block_stride`` (alignment
  padding, or another role packed in the same allocation) belong to someone else: no
  implementation reads or writes them.
- Rows (``out`` / ``src``, the page-first side) are packed: strides ``(row_bytes, 1)``.
- Element widths wider than a byte are used only when they divide every address, block size,
  block stride and ``row_bytes`` (:attr:`PlaneSet.alignment`).

This module imports nothing from the rest of ``kvforge`` (``kvforge.ops`` must be importable on
its own, e.g. on a device machine with only ``torch`` and ``triton``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

__all__ = [
    "ELEM_DTYPES",
    "MAX_ACCESS_BYTES",
    "PlaneSet",
    "TransferPlan",
    "as_plane_set",
    "block_stride_of",
    "elem_width",
    "pow2_alignment",
    "to_device",
    "validate",
    "widen",
]

#: Integer dtype of each element width (bytes) that kernels may move bytes as.
ELEM_DTYPES: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}

#: Up to this many ids are checked with Python lists (cheaper than numpy calls for few ids).
_SMALL_N = 256
#: Widest access, in bytes, that kernels use (16-byte vectors).
MAX_ACCESS_BYTES = 16


def pow2_alignment(values: Iterable[int], cap: int = MAX_ACCESS_BYTES) -> int:
    """Largest power of two ``<= cap`` (a power of two) that divides every value.

    The lowest set bit of ``cap | v0 | v1 | ...`` is exactly that power of two.
    """
    acc = cap
    for v in values:
        acc |= v
    return acc & -acc


class PlaneSet(Sequence[torch.Tensor]):
    """The planes of a gather/scatter, validated once, with what every call derives from them.

    Building one checks every plane: a ``torch.uint8`` tensor ``[num_blocks_p, block_bytes_p]``
    with strides ``(block_stride_p, 1)`` where ``block_stride_p >= block_bytes_p`` (a stride
    above the block size is padding, or other data sharing the allocation, that is never
    touched), at least one byte per block, all on one device. It then records block sizes,
    block strides, row offsets, the row width, block counts, base addresses and their common
    alignment. :func:`kvforge.ops.gather_blocks` and
    :func:`~kvforge.ops.scatter_blocks` accept a ``PlaneSet`` wherever they accept a list of
    planes, and then skip those per-plane checks, which are most of the host cost of a call
    that moves little (one request's window or state). A ``PlaneSet`` is a read-only sequence
    of its tensors.

    Invariant: addresses are read once, here. A plane whose storage is later replaced in place
    (``set_``, ``resize_``) needs a new ``PlaneSet``; the cache controller never does that.

    Attributes:
        device: the device of every plane.
        block_bytes: ``block_bytes[p] == planes[p].shape[1]``: the bytes moved per block.
        block_strides: ``block_strides[p] == planes[p].stride(0)`` (``>= block_bytes[p]``): the
            distance between consecutive blocks. A plane with at most one block has no
            meaningful stride (torch reports any value for a dimension of size <= 1); it is
            recorded as ``block_bytes[p]``.
        row_offsets: byte offset of plane ``p`` in a page-first row (prefix sum of
            ``block_bytes``).
        row_bytes: ``sum(block_bytes)``.
        num_blocks: ``num_blocks[p] == planes[p].shape[0]``.
        min_blocks: ``min(num_blocks)``: block ids must be below it.
        addrs: ``planes[p].data_ptr()``.
        alignment: the largest power of two up to 16 that divides every address, every block
            size, every block stride and ``row_bytes``.
        layout_table: ``numpy.int64 [4 * P]``: addresses | block bytes | row offsets | block
            strides.
    """

    __slots__ = (
        "_tensors",
        "addrs",
        "alignment",
        "block_bytes",
        "block_strides",
        "device",
        "layout_table",
        "min_blocks",
        "num_blocks",
        "row_bytes",
        "row_offsets",
    )

    def __init__(self, planes: Sequence[torch.Tensor]) -> None:
        device, block_bytes, block_strides = _check_planes(planes)
        self._tensors: tuple[torch.Tensor, ...] = tuple(planes)
        self.device: torch.device = device
        self.block_bytes: tuple[int, ...] = block_bytes
        self.block_strides: tuple[int, ...] = block_strides
        offsets = []
        acc = 0
        for nbytes in block_bytes:
            offsets.append(acc)
            acc += nbytes
        self.row_offsets: tuple[int, ...] = tuple(offsets)
        self.row_bytes: int = acc
        self.num_blocks: tuple[int, ...] = tuple(int(t.shape[0]) for t in self._tensors)
        self.min_blocks: int = min(self.num_blocks)
        self.addrs: tuple[int, ...] = tuple(t.data_ptr() for t in self._tensors)
        # a block starts at addr + b * stride: the stride bounds the alignment as much as the
        # address does
        self.alignment: int = pow2_alignment((*self.addrs, *block_bytes, *block_strides, acc))
        self.layout_table: np.ndarray = np.array(
            [*self.addrs, *block_bytes, *offsets, *block_strides], dtype=np.int64
        )

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[torch.Tensor, ...]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return self._tensors[index]

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._tensors)

    def __repr__(self) -> str:
        return (
            f"PlaneSet({len(self._tensors)} planes on {self.device}, "
            f"row_bytes={self.row_bytes:,}, min_blocks={self.min_blocks})"
        )


def as_plane_set(planes: Sequence[torch.Tensor]) -> PlaneSet:
    """``planes`` itself if it is a :class:`PlaneSet`, else a new one (which validates)."""
    return planes if isinstance(planes, PlaneSet) else PlaneSet(planes)


@dataclass(slots=True)
class TransferPlan:
    """What a validated gather/scatter call moves. Read-only by convention (not ``frozen``:
    a frozen dataclass costs a few microseconds more per call, and one is built per call).

    ``device``, ``block_bytes``, ``block_strides``, ``row_offsets`` and ``row_bytes`` are those
    of ``planes``.

    Attributes:
        planes: the validated planes.
        n: number of rows moved, ``len(block_ids)``.
        ids: ``block_ids`` as a contiguous ``numpy.int64`` array ``[n]`` in host memory.
        row_ids: ``None`` when transfer row ``i`` is row ``i`` of ``out`` / ``src``; else a
            ``numpy.int64`` array ``[n]``: transfer row ``i`` is row ``row_ids[i]``.
        ids_on_device: the caller's ``block_ids`` tensor when it already lives on the planes'
            (accelerator) device, else ``None``.
        all_valid: ``True`` when no id is ``-1``.
        num_valid: number of ids that are not ``-1``.
    """

    planes: PlaneSet
    n: int
    ids: np.ndarray
    row_ids: np.ndarray | None
    ids_on_device: torch.Tensor | None
    all_valid: bool
    num_valid: int

    @property
    def device(self) -> torch.device:
        """The device of every plane (and of ``out`` / ``src``)."""
        return self.planes.device

    @property
    def block_bytes(self) -> tuple[int, ...]:
        return self.planes.block_bytes

    @property
    def block_strides(self) -> tuple[int, ...]:
        return self.planes.block_strides

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return self.planes.row_offsets

    @property
    def row_bytes(self) -> int:
        """The width of one row of ``out`` / ``src``."""
        return self.planes.row_bytes

    @property
    def ids_cpu(self) -> torch.Tensor:
        """``ids`` as a ``torch.int64`` CPU tensor (shares memory)."""
        return torch.from_numpy(self.ids)

    def valid_rows(self) -> torch.Tensor:
        """Indices (``torch.int64``, CPU, ``[num_valid]``) of the transfer rows whose id is
        not -1."""
        return torch.from_numpy(np.flatnonzero(self.ids >= 0))

    def buffer_rows(self) -> torch.Tensor | None:
        """Rows of ``out`` / ``src`` that valid transfer rows use, in order (``torch.int64``,
        CPU, ``[num_valid]``); ``None`` when they are simply rows ``0 .. n - 1``."""
        if self.row_ids is None:
            return None if self.all_valid else self.valid_rows()
        return torch.from_numpy(self.row_ids if self.all_valid else self.row_ids[self.ids >= 0])


def elem_width(
    plan: TransferPlan, addrs: Sequence[int], widths: Sequence[int] = (8, 4, 2, 1)
) -> int:
    """Widest width ``w`` in ``widths`` (bytes, descending) that divides every block size, every
    block stride, ``row_bytes`` (hence every row offset), every plane address and every address
    in ``addrs`` (row buffer ``data_ptr()``); 1 if none does.

    Moving ``w``-byte integers instead of bytes is exact (a pure bit copy) and much faster.
    """
    limit = min(plan.planes.alignment, pow2_alignment(addrs))
    for w in widths:
        if limit % w == 0:
            return w
    return 1


def widen(
    planes: Sequence[torch.Tensor], rows: torch.Tensor, plan: TransferPlan
) -> tuple[int, list[torch.Tensor], torch.Tensor]:
    """Views of ``planes`` and ``rows`` as ``w``-byte integers, ``w`` from :func:`elem_width`.

    Returns:
        ``(w, planes_w, rows_w)``: ``planes_w[p]`` is ``[num_blocks_p, block_bytes_p // w]``
        (strides ``(block_stride_p // w, 1)``) and ``rows_w`` is ``[n, row_bytes // w]``, both of
        dtype ``ELEM_DTYPES[w]``, sharing storage with the inputs. Falls back to ``w == 1``
        (the inputs themselves) if a view is refused.
    """
    w = elem_width(plan, (rows.data_ptr(),))
    if w > 1:
        dtype = ELEM_DTYPES[w]
        try:
            return w, [t.view(dtype) for t in planes], rows.view(dtype)
        except RuntimeError:  # e.g. a storage offset torch will not reinterpret
            pass
    return 1, list(planes), rows


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _rows_contiguous(t: torch.Tensor, row_bytes: int) -> bool:
    """Whether a 2-D tensor has strides ``(row_bytes, 1)`` on every dimension that matters.

    A dimension of size <= 1 has no meaningful stride (torch gives it any value), so it is not
    checked.
    """
    rows, cols = t.shape
    if cols > 1 and t.stride(1) != 1:
        return False
    return not (rows > 1 and t.stride(0) != row_bytes)


def block_stride_of(p: int, shape: Sequence[int], stride: Sequence[int]) -> int:
    """The block stride of ``planes[p]`` (shape ``[num_blocks, block_bytes]``, ``stride`` its
    strides in bytes), or a ``ValueError`` naming the plane and its strides.

    A block's bytes must be contiguous (inner stride 1, unless a block is one byte), and blocks
    must not overlap (``block_stride >= block_bytes``; zero and negative strides are refused).
    A dimension of size <= 1 has no meaningful stride (torch gives it any value): it is not
    checked, and a plane of at most one block reports ``block_bytes`` as its stride.
    """
    num_blocks, nbytes = shape
    inner, outer = stride[1], stride[0]
    if nbytes > 1 and inner != 1:
        raise ValueError(
            f"planes[{p}] has strides {tuple(stride)}: inner stride {inner}; expected "
            f"(block_stride, 1): the {nbytes} bytes of a block must be contiguous"
        )
    if num_blocks <= 1:
        return nbytes
    if outer <= 0:
        raise ValueError(
            f"planes[{p}] has strides {tuple(stride)}: block stride {outer} is not positive "
            f"(blocks would alias); expected (block_stride, 1) with block_stride >= {nbytes}"
        )
    if outer < nbytes:
        raise ValueError(
            f"planes[{p}] has strides {tuple(stride)}: block stride {outer} is below "
            f"block_bytes {nbytes} (blocks would overlap); expected (block_stride, 1) with "
            f"block_stride >= {nbytes}"
        )
    return outer


def _check_planes(
    planes: Sequence[torch.Tensor],
) -> tuple[torch.device, tuple[int, ...], tuple[int, ...]]:
    if isinstance(planes, torch.Tensor) or not isinstance(planes, Sequence):
        raise TypeError(
            f"planes is {type(planes).__name__}; expected a sequence (list or tuple) of "
            "[num_blocks, block_bytes] torch.uint8 tensors"
        )
    if len(planes) == 0:
        raise ValueError(
            "planes is empty; expected at least one [num_blocks, block_bytes] torch.uint8 tensor"
        )
    device: torch.device | None = None
    block_bytes: list[int] = []
    block_strides: list[int] = []
    uint8 = torch.uint8
    for p, plane in enumerate(planes):  # hot path: few attribute reads per plane
        if not isinstance(plane, torch.Tensor):
            raise TypeError(f"planes[{p}] is {type(plane).__name__}; expected a torch.Tensor")
        if plane.dtype != uint8:
            raise TypeError(
                f"planes[{p}] has dtype {plane.dtype}; expected torch.uint8 "
                "(use .view(torch.uint8))"
            )
        shape = plane.shape
        if len(shape) != 2:
            raise ValueError(
                f"planes[{p}] has shape {_shape(plane)}; expected 2-D [num_blocks, block_bytes]"
            )
        nbytes = shape[1]
        if nbytes == 0:
            raise ValueError(
                f"planes[{p}] has shape {_shape(plane)}: block_bytes is 0; "
                "every plane must hold at least one byte per block"
            )
        stride = plane.stride()
        if stride[1] == 1 and stride[0] >= nbytes:  # the common case, checked cheaply
            block_strides.append(stride[0] if shape[0] > 1 else nbytes)
        else:
            block_strides.append(block_stride_of(p, shape, stride))
        dev = plane.device
        if device is None:
            device = dev
        elif dev != device:
            raise ValueError(
                f"planes[{p}] is on {dev} but planes[0] is on {device}; "
                "all planes must be on one device"
            )
        block_bytes.append(nbytes)
    assert device is not None
    return device, tuple(block_bytes), tuple(block_strides)


def _ids_array(value: object, name: str, device: torch.device) -> tuple[np.ndarray, bool]:
    """``value`` (a 1-D int64 torch tensor on CPU or on ``device``, or a 1-D numpy int64
    array) as a contiguous host numpy array, and whether it came as a tensor on ``device``.

    Host ids are copied: the kernels use exactly the ids that were checked, whatever happens
    to the caller's buffer meanwhile (another thread, or ``out`` aliasing it)."""
    if isinstance(value, np.ndarray):
        if value.dtype != np.int64:
            raise TypeError(f"{name} has dtype numpy.{value.dtype}; expected int64")
        if value.ndim != 1:
            raise ValueError(f"{name} has shape {value.shape}; expected 1-D [n]")
        return np.array(value, dtype=np.int64, copy=True), False
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} is {type(value).__name__}; expected a 1-D torch.int64 tensor "
            "(or numpy int64 array)"
        )
    if value.dtype != torch.int64:
        raise TypeError(f"{name} has dtype {value.dtype}; expected torch.int64")
    if value.dim() != 1:
        raise ValueError(f"{name} has shape {_shape(value)}; expected 1-D [n]")
    if value.device.type == "cpu":
        return np.array(value.numpy(), dtype=np.int64, copy=True), False
    if value.device != device:
        raise ValueError(
            f"{name} is on {value.device}; expected cpu or the planes' device {device}"
        )
    return value.cpu().numpy(), True


def _check_rows(
    rows: torch.Tensor, name: str, n: int | None, row_bytes: int, device: torch.device
) -> None:
    """``n is None``: any number of rows (``row_ids`` picks them). Messages are built only on
    failure: this runs on every call."""
    if not isinstance(rows, torch.Tensor):
        expected = f"[{'num_rows' if n is None else n}, {row_bytes}]"
        raise TypeError(
            f"{name} is {type(rows).__name__}; expected a {expected} torch.uint8 tensor"
        )
    if rows.dtype != torch.uint8:
        raise TypeError(
            f"{name} has dtype {rows.dtype}; expected torch.uint8 (use .view(torch.uint8))"
        )
    if rows.device != device:
        raise ValueError(f"{name} is on {rows.device}; expected {device} (the planes' device)")
    shape = rows.shape
    if n is None:
        if len(shape) != 2 or shape[1] != row_bytes:
            raise ValueError(
                f"{name} has shape {_shape(rows)}; expected (num_rows, {row_bytes}): rows of "
                f"{row_bytes} bytes (sum of plane block bytes)"
            )
    elif len(shape) != 2 or shape[0] != n or shape[1] != row_bytes:
        raise ValueError(
            f"{name} has shape {_shape(rows)}; expected ({n}, {row_bytes}): {n} rows of "
            f"{row_bytes} bytes (sum of plane block bytes)"
        )
    if not _rows_contiguous(rows, row_bytes):
        raise ValueError(
            f"{name} has strides {tuple(rows.stride())}; expected row-contiguous ({row_bytes}, 1)"
        )


def _first_duplicate(values: list[int]) -> tuple[int, int, int] | None:
    """``(value, first index, second index)`` of the repeat whose second occurrence comes
    first, ignoring negative values; ``None`` if nothing repeats."""
    seen: dict[int, int] = {}
    for i, v in enumerate(values):
        if v < 0:
            continue
        if v in seen:
            return v, seen[v], i
        seen[v] = i
    return None


def _check_row_ids(row_ids: np.ndarray, n: int, num_rows: int, rows_name: str, op: str) -> None:
    """Row ids: one per block id, each a row of ``rows_name``; a gather writes a row once.

    Python lists for a few ids (as :func:`_check_id_values`), numpy for many.
    """
    if row_ids.shape[0] != n:
        raise ValueError(f"row_ids has {row_ids.shape[0]} entries; expected {n} (one per block id)")
    if n == 0:
        return
    values, lo, hi = _values_and_bounds(row_ids)
    if lo < 0 or hi >= num_rows:
        i = int(np.argmax((row_ids < 0) | (row_ids >= num_rows)))
        raise ValueError(
            f"row_ids[{i}] = {int(row_ids[i])} is out of range for {rows_name} with {num_rows} rows"
        )
    if op != "gather_blocks" or n == 1:
        return
    if _repeats(values, row_ids, num_rows):
        v, a, b = _first_duplicate(row_ids.tolist())  # type: ignore[misc]
        raise ValueError(f"row_ids has duplicate destination row {v} (entries {a} and {b}) in {op}")


def _values_and_bounds(arr: np.ndarray) -> tuple[list[int] | None, int, int]:
    """``(values, min, max)`` of a non-empty id array; ``values`` is the array as a Python
    list when it holds at most :data:`_SMALL_N` ids (cheaper than numpy calls then), else
    ``None``."""
    if arr.shape[0] <= _SMALL_N:
        values = arr.tolist()
        return values, min(values), max(values)
    return None, int(arr.min()), int(arr.max())


def _repeats(values: list[int] | None, arr: np.ndarray, bound: int) -> bool:
    """Whether ids in ``[0, bound)`` repeat a value: a set over ``values`` when they came as a
    list (see :func:`_values_and_bounds`), else :func:`_has_duplicates` over ``arr``."""
    if values is not None:
        return len(set(values)) != len(values)
    return arr.shape[0] > 1 and _has_duplicates(arr, bound)


def _has_duplicates(valid: np.ndarray, bound: int) -> bool:
    """Whether ``valid`` (ids in ``[0, bound)``) repeats a value: a bitmap when ``bound`` is
    not much larger than the id count (O(n + bound)), else a sort (O(n log n))."""
    n = int(valid.shape[0])
    if bound <= 64 * n + 65536:
        seen = np.zeros(bound, dtype=np.bool_)
        seen[valid] = True
        return int(np.count_nonzero(seen)) != n
    ordered = np.sort(valid)
    return bool(np.any(ordered[1:] == ordered[:-1]))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor (ids, tables) to ``device`` without stalling the device stream.

    A copy from pageable memory makes the host wait for the stream; a copy from pinned memory
    (torch's caching host allocator, which keeps the buffer alive until the copy is done) is
    enqueued asynchronously. Falls back to a plain copy where pinning is unavailable.
    """
    if device.type == "cpu":
        return t
    try:
        pinned = t.pin_memory()
    except (RuntimeError, NotImplementedError):  # no pinned memory on this build/platform
        return t.to(device)
    return pinned.to(device, non_blocking=True)


def _check_id_values(arr: np.ndarray, planes: PlaneSet, scatter: bool, op: str) -> int:
    """Check id values; return how many ids are not -1.

    Python lists for a few ids, numpy for many: either costs far less than torch ops.
    """
    n = int(arr.shape[0])
    if n == 0:
        return 0
    values, lo, hi = _values_and_bounds(arr)
    if lo < -1:
        i = int(np.argmax(arr < -1))
        raise ValueError(
            f"block_ids[{i}] = {int(arr[i])} is negative; only -1 (skip this row) is allowed"
        )
    min_blocks = planes.min_blocks
    if hi >= min_blocks:
        i = int(np.argmax(arr >= min_blocks))
        value = int(arr[i])
        p = next(p for p, count in enumerate(planes.num_blocks) if value >= count)
        raise ValueError(
            f"block_ids[{i}] = {value} is out of range for planes[{p}] with "
            f"{planes.num_blocks[p]} blocks"
        )
    valid = arr[arr >= 0] if lo < 0 else arr
    num_valid = int(valid.shape[0])
    if values is not None and lo < 0:
        values = [v for v in values if v >= 0]
    if scatter and _repeats(values, valid, min_blocks):
        v, a, b = _first_duplicate(arr.tolist())  # type: ignore[misc]
        raise ValueError(f"block_ids has duplicate destination id {v} (rows {a} and {b}) in {op}")
    return num_valid


def validate(
    planes: Sequence[torch.Tensor],
    block_ids: torch.Tensor | np.ndarray,
    rows: torch.Tensor,
    rows_name: str,
    op: str,
    row_ids: torch.Tensor | np.ndarray | None = None,
) -> TransferPlan:
    """Validate a gather/scatter call and describe it; raise before anything moves.

    Args:
        planes: ``[num_blocks_p, block_bytes_p]`` ``torch.uint8`` tensors with strides
            ``(block_stride_p, 1)``, ``block_stride_p >= block_bytes_p``, all on one device; or
            a :class:`PlaneSet` of them, whose planes were checked when it was built.
        block_ids: ``[n]`` int64: a torch tensor on CPU or on the planes' device, or a numpy
            array; ``-1`` skips a row.
        rows: ``torch.uint8`` on the planes' device, strides ``(row_bytes, 1)``: ``out`` of a
            gather or ``src`` of a scatter; ``[n, sum(block_bytes_p)]``, or any number of rows
            with ``row_ids``.
        rows_name: ``"out"`` or ``"src"``, used in messages.
        op: ``"gather_blocks"`` or ``"scatter_blocks"``; scatter rejects duplicate block ids,
            gather duplicate row ids.
        row_ids: ``None``, or ``[n]`` int64 (as ``block_ids``): the row of ``rows`` each
            block id moves to or from.

    Returns:
        The :class:`TransferPlan` of the call.

    Raises:
        TypeError: a wrong type or dtype.
        ValueError: a wrong shape, stride, device, or id value (message names argument and value).
    """
    plane_set = as_plane_set(planes)
    device = plane_set.device
    ids, ids_are_on_device = _ids_array(block_ids, "block_ids", device)
    n = int(ids.shape[0])
    rows_ids: np.ndarray | None = None
    if row_ids is None:
        _check_rows(rows, rows_name, n, plane_set.row_bytes, device)
    else:
        rows_ids = _ids_array(row_ids, "row_ids", device)[0]
        _check_rows(rows, rows_name, None, plane_set.row_bytes, device)
    num_valid = _check_id_values(ids, plane_set, op == "scatter_blocks", op)
    if rows_ids is not None:
        _check_row_ids(rows_ids, n, int(rows.shape[0]), rows_name, op)
    return TransferPlan(
        planes=plane_set,
        n=n,
        ids=ids,
        row_ids=rows_ids,
        ids_on_device=block_ids if ids_are_on_device else None,  # type: ignore[arg-type]
        all_valid=num_valid == n,
        num_valid=num_valid,
    )
