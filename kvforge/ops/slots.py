"""Batched slot mapping: the cache slot every scheduled token of an engine step writes.

An engine step schedules tokens of many requests at once. For one role of one group, token
``i`` of the step belongs to the request in row ``rows[i]`` of the group's block table and sits
at position ``positions[i]`` of that request. With compress ratio ``r`` and
``E = block_size // r`` entries per block:

- the token writes an entry only when ``p % r == r - 1`` (it completes a compressed token), at
  entry ``e = p // r`` of its request;
- that entry lives in block ``b = block_table[row, e // E]``, at slot ``b * E + e % E``;
- the slot is ``-1`` (write nothing) when the token completes no entry, when ``e // E`` lies
  past the table's last column, or when ``b`` is the null block ``0`` (no block: outside a
  sliding window, or not allocated).

:func:`slot_mapping` computes that for a whole step without per-token Python: vectorised numpy
on CPU (numpy arrays or CPU tensors), a Triton kernel on accelerators (same source for CUDA and
Ascend), a torch fallback where Triton is missing. :func:`token_positions` expands per-request
ranges of new tokens into the per-token ``(request index, position)`` arrays it takes.

Invariants:

- Every slot is ``-1`` or ``b * E + e % E`` with ``b >= 1`` a block of the table: never another
  negative value (a negative table entry, which a valid table never holds, also gives ``-1``).
- Every implementation gives the same slots for the same valid input; all arithmetic is int64.
- ``check=True`` (the default) validates and raises before anything is written; ``check=False``
  skips every check (for a worker that validated its inputs once): invalid input then gives
  unspecified slots or an ``IndexError``, never an out-of-bounds memory access.
- Importing this module imports neither triton nor any other ``kvforge`` package.
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import numpy as np
import torch

from kvforge._checks import check_int

__all__ = [
    "SLOT_IMPLS",
    "TokenPositions",
    "resolve_slot_impl",
    "slot_mapping",
    "token_positions",
]

#: Concrete implementations of :func:`slot_mapping` (``"auto"`` resolves to one of them).
SLOT_IMPLS: tuple[str, ...] = ("numpy", "torch", "triton")
_ACCEL = ("cuda", "npu")
_CPU = torch.device("cpu")

Array = TypeVar("Array", np.ndarray, torch.Tensor)


# ------------------------------------------------------------------------------ validation


def _dtype_name(x: np.ndarray | torch.Tensor) -> str:
    return f"numpy.{x.dtype}" if isinstance(x, np.ndarray) else str(x.dtype)


def _shape(x: np.ndarray | torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _where(x: np.ndarray | torch.Tensor) -> str:
    """What kind of array ``x`` is, for messages: ``a numpy array`` / ``a torch tensor on cpu``."""
    return "a numpy array" if isinstance(x, np.ndarray) else f"a torch tensor on {x.device}"


def _same_kind(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
    return a.device == b.device


def _check_array(x: object, name: str, what: str) -> np.ndarray | torch.Tensor:
    if not isinstance(x, (np.ndarray, torch.Tensor)):
        raise TypeError(
            f"{name} is {type(x).__name__}; expected {what} (numpy array or torch tensor)"
        )
    return x


_INT32_64 = (np.dtype(np.int32), np.dtype(np.int64), torch.int32, torch.int64)
_INT64 = (np.dtype(np.int64), torch.int64)


def _check_int_arg(value: object, name: str) -> int:
    return check_int(
        name,
        value,
        1,
        type_message="{name} is {type}; expected an int >= 1",
        range_message="{name} = {value}; expected an int >= 1",
    )


def _check_sizes(block_size: object, compress_ratio: object) -> tuple[int, int]:
    size = _check_int_arg(block_size, "block_size")
    ratio = _check_int_arg(compress_ratio, "compress_ratio")
    if size % ratio:
        raise ValueError(
            f"compress_ratio = {ratio} does not divide block_size = {size}; a block must hold "
            "a whole number of entries"
        )
    return size, ratio


def _check_inputs(
    block_table: object, rows: object, positions: object, out: object
) -> tuple[np.ndarray | torch.Tensor, ...]:
    """Types, dtypes, shapes and kinds (all numpy, or all torch on one device); not values."""
    table = _check_array(block_table, "block_table", "a 2-D int32 [max_num_seqs, max_blocks]")
    if table.dtype not in _INT32_64:
        raise TypeError(f"block_table has dtype {_dtype_name(table)}; expected int32 or int64")
    if table.ndim != 2:
        raise ValueError(
            f"block_table has shape {_shape(table)}; expected 2-D "
            "[max_num_seqs, max_blocks_per_req]"
        )
    row_arr = _check_array(rows, "rows", "a 1-D int32 or int64 [N]")
    if row_arr.dtype not in _INT32_64:
        raise TypeError(f"rows has dtype {_dtype_name(row_arr)}; expected int32 or int64")
    if row_arr.ndim != 1:
        raise ValueError(f"rows has shape {_shape(row_arr)}; expected 1-D [N]")
    n = int(row_arr.shape[0])
    pos = _check_array(positions, "positions", "a 1-D int64 [N]")
    if pos.dtype not in _INT64:
        raise TypeError(f"positions has dtype {_dtype_name(pos)}; expected int64")
    if _shape(pos) != (n,):
        raise ValueError(
            f"positions has shape {_shape(pos)}; expected ({n},) (one position per entry of rows)"
        )
    arrays = [("rows", row_arr), ("positions", pos)]
    if out is not None:
        out_arr = _check_array(out, "out", "a 1-D int64 [N]")
        if out_arr.dtype not in _INT64:
            raise TypeError(f"out has dtype {_dtype_name(out_arr)}; expected int64")
        if _shape(out_arr) != (n,):
            raise ValueError(
                f"out has shape {_shape(out_arr)}; expected ({n},) (one slot per position)"
            )
        if isinstance(out_arr, np.ndarray) and not out_arr.flags.writeable:
            raise ValueError("out is a read-only numpy array; expected a writeable one")
        arrays.append(("out", out_arr))
    for name, arr in arrays:
        if not _same_kind(arr, table):
            raise ValueError(
                f"{name} is {_where(arr)} but block_table is {_where(table)}; pass numpy arrays "
                "only, or torch tensors on one device only"
            )
    return table, row_arr, pos


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _check_values(
    table: np.ndarray | torch.Tensor,
    rows: np.ndarray | torch.Tensor,
    pos: np.ndarray | torch.Tensor,
) -> None:
    """Rows within the table, positions non-negative. One device sync for accelerator tensors
    (the three reductions come back in one transfer)."""
    if rows.shape[0] == 0:
        return
    num_seqs = int(table.shape[0])
    if isinstance(rows, np.ndarray) or rows.device.type == "cpu":
        r = rows if isinstance(rows, np.ndarray) else rows.numpy()
        p = pos if isinstance(pos, np.ndarray) else pos.numpy()
        lo, hi, low_pos = int(r.min()), int(r.max()), int(p.min())
    else:
        lo, hi, low_pos = torch.stack(
            [rows.min().to(torch.int64), rows.max().to(torch.int64), pos.min()]
        ).tolist()
        r = p = None  # copied to the host only to name a bad entry below
    if lo < 0 or hi >= num_seqs:
        r = rows.cpu().numpy() if r is None else r
        i = _first((r < 0) | (r >= num_seqs))
        raise ValueError(
            f"rows[{i}] = {int(r[i])} is out of range for block_table with {num_seqs} rows "
            "(max_num_seqs)"
        )
    if low_pos < 0:
        p = pos.cpu().numpy() if p is None else p
        i = _first(p < 0)
        raise ValueError(f"positions[{i}] = {int(p[i])} is negative; positions start at 0")


def _check_impl_name(impl: object) -> str:
    names = ", ".join(repr(x) for x in ("auto", *SLOT_IMPLS))
    if not isinstance(impl, str):
        raise TypeError(f"impl is {type(impl).__name__}; expected one of {names}")
    if impl != "auto" and impl not in SLOT_IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {names}")
    return impl


def resolve_slot_impl(impl: str, device: torch.device | str) -> str:
    """The implementation :func:`slot_mapping` runs for ``impl`` on arrays on ``device``
    (``"cpu"`` for numpy arrays).

    ``"auto"`` gives ``"numpy"`` on CPU, ``"triton"`` on cuda/npu when triton imports, else
    ``"torch"``. An explicit name is returned once it is known to work on ``device``.

    Raises:
        ValueError: unknown name; ``"numpy"`` on an accelerator; ``"triton"`` on CPU without
            ``TRITON_INTERPRET=1``.
        RuntimeError: ``"triton"`` where triton does not import.
    """
    from . import interpret_requested, triton_error  # the package's availability probes

    impl = _check_impl_name(impl)
    device = torch.device(device)
    if impl == "auto":
        if device.type == "cpu":
            return "numpy"
        if device.type in _ACCEL and triton_error() is None:
            return "triton"
        return "torch"
    if impl == "numpy" and device.type != "cpu":
        raise ValueError(
            f"impl 'numpy' runs on numpy arrays and cpu tensors; the arrays are on {device}"
        )
    if impl == "triton":
        if device.type == "cpu" and not interpret_requested():
            raise ValueError(
                "impl 'triton' on cpu arrays needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before kvforge.ops.triton_slots is first imported "
                "(or use impl='numpy')"
            )
        err = triton_error()
        if err is not None:
            raise RuntimeError(f"impl 'triton' needs triton, which does not import ({err})")
    return impl


# ---------------------------------------------------------------------------------- kernels


def _pow2_shift(v: int) -> int | None:
    """``log2(v)`` when ``v`` is a power of two, else ``None``: shifts and masks then replace
    int64 divisions, which numpy runs several times slower."""
    return v.bit_length() - 1 if v & (v - 1) == 0 else None


def _slots_numpy(
    table: np.ndarray,
    rows: np.ndarray,
    pos: np.ndarray,
    block_size: int,
    ratio: int,
    out: np.ndarray,
) -> np.ndarray:
    """The numpy path. Reads every input before it writes ``out``, so ``out`` may alias
    ``positions`` (or an int64 ``rows``)."""
    n = int(pos.shape[0])
    per_block = block_size // ratio
    max_blocks = int(table.shape[1])
    if n == 0:
        return out
    if max_blocks == 0:
        out.fill(-1)
        return out
    # entry index, and whether the token completes one (always, without compression)
    valid: np.ndarray | None = None
    if ratio == 1:
        entry = pos
    elif (k := _pow2_shift(ratio)) is not None:
        entry = pos >> k
        valid = (pos & (ratio - 1)) == ratio - 1
    else:
        entry, rem = np.divmod(pos, ratio)
        valid = rem == ratio - 1
    if (k := _pow2_shift(per_block)) is not None:
        col = entry >> k
        off = entry & (per_block - 1)
    else:
        col, off = np.divmod(entry, per_block)
    if int(col.max()) >= max_blocks:  # rare: entries past the table's last column
        inside = col < max_blocks
        valid = inside if valid is None else valid & inside
        np.minimum(col, max_blocks - 1, out=col)
    if table.flags.c_contiguous:  # one flat take is cheaper than 2-D fancy indexing
        index = np.multiply(rows, max_blocks, dtype=np.int64)
        index += col
        block = np.take(table.reshape(-1), index)
    else:
        block = table[rows, col]
    dead = block <= 0  # the null block (a negative entry, never valid, maps to -1 as well)
    if valid is not None:
        dead |= ~valid
    np.multiply(block, per_block, out=out, dtype=np.int64)
    out += off
    np.putmask(out, dead, -1)
    return out


def _slots_torch(
    table: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    ratio: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """The torch path (any device; the fallback on accelerators without triton). Same
    arithmetic as the numpy path, no host sync. Indices are clamped into the table and the
    clamped tokens masked, so unchecked bad rows or positions never index out of bounds (a
    device-side assert on an accelerator)."""
    per_block = block_size // ratio
    num_seqs, max_blocks = int(table.shape[0]), int(table.shape[1])
    if pos.shape[0] == 0:
        return out
    if max_blocks == 0 or num_seqs == 0:
        return out.fill_(-1)
    entry = torch.div(pos, ratio, rounding_mode="floor")
    col = torch.div(entry, per_block, rounding_mode="floor")
    off = entry - col * per_block
    rows = rows.long()
    valid = (col < max_blocks) & (pos >= 0) & (rows >= 0) & (rows < num_seqs)
    if ratio > 1:
        valid &= pos - entry * ratio == ratio - 1
    # one index_select over a 1-D view of the table's memory (any non-negative strides): on
    # CPU several times faster than 2-D advanced indexing
    s0, s1 = table.stride()
    span = (num_seqs - 1) * s0 + (max_blocks - 1) * s1 + 1
    flat = table.as_strided((span,), (1,), table.storage_offset())
    index = rows.clamp(0, num_seqs - 1) * s0 + col.clamp(0, max_blocks - 1) * s1
    block = flat.index_select(0, index).long()
    valid &= block > 0
    slots = block * per_block + off
    return out.copy_(torch.where(valid, slots, torch.full_like(slots, -1)))


# ------------------------------------------------------------------------------- public API


def slot_mapping(
    block_table: Array,
    rows: Array,
    positions: Array,
    block_size: int,
    compress_ratio: int = 1,
    *,
    out: Array | None = None,
    impl: str = "auto",
    check: bool = True,
) -> Array:
    """Cache slot of every scheduled token of a step, for one role of one group.

    Args:
        block_table: ``[max_num_seqs, max_blocks_per_req]`` int32 (int64 also accepted): the
            group's persistent block table; ``0`` is the null block (no block).
        rows: ``[N]`` int32 or int64: the table row of each token's request.
        positions: ``[N]`` int64: each token's position in its request.
        block_size: tokens per block of the group.
        compress_ratio: tokens per entry of the role (``r``); must divide ``block_size``.
        out: optional ``[N]`` int64 of the inputs' kind (and device) to write into; may alias
            ``positions``.
        impl: ``"auto"`` (numpy on CPU, triton on cuda/npu, torch there without triton),
            ``"numpy"``, ``"torch"`` or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``).
        check: validate arguments and values first (one device sync for accelerator tensors).
            ``False`` skips every check: for a caller that validated once (e.g. a worker
            whose tables and rows it built itself).

    Returns:
        ``[N]`` int64 slots (``out`` when given), of the inputs' kind: a numpy array for numpy
        inputs, a tensor on the inputs' device for tensors. With ``E = block_size //
        compress_ratio`` and ``e = positions[i] // compress_ratio``: ``block_table[rows[i],
        e // E] * E + e % E`` when ``positions[i] % compress_ratio == compress_ratio - 1``,
        ``e // E < max_blocks_per_req`` and that block is not ``0``; else ``-1``.

    Raises:
        TypeError / ValueError: invalid arguments (the message names the argument and value),
            before anything is written. RuntimeError: ``impl="triton"`` without triton.
    """
    if check is not True and check is not False:
        raise TypeError(f"check is {type(check).__name__}; expected a bool")
    if check:
        block_size, compress_ratio = _check_sizes(block_size, compress_ratio)
        table, rows, positions = _check_inputs(block_table, rows, positions, out)
        _check_impl_name(impl)
        _check_values(table, rows, positions)
    else:
        table = block_table
    numpy_in = isinstance(positions, np.ndarray)
    device = _CPU if numpy_in else positions.device
    # the per-step CPU case skips the resolution (a few microseconds)
    name = "numpy" if impl == "auto" and device.type == "cpu" else resolve_slot_impl(impl, device)
    if name == "numpy":
        return _run_numpy(table, rows, positions, block_size, compress_ratio, out)
    return _run_tensors(name, table, rows, positions, block_size, compress_ratio, out, device)


def _run_numpy(
    table: Array, rows: Array, positions: Array, block_size: int, r: int, out: Array | None
) -> Array:
    """The numpy kernel on numpy arrays, or on CPU tensors through their numpy views."""
    n = int(positions.shape[0])
    if isinstance(positions, np.ndarray):
        dst = np.empty(n, dtype=np.int64) if out is None else out
        return _slots_numpy(table, rows, positions, block_size, r, dst)
    dst_t = torch.empty(n, dtype=torch.int64) if out is None else out
    _slots_numpy(table.numpy(), rows.numpy(), positions.numpy(), block_size, r, dst_t.numpy())
    return dst_t


def _run_tensors(
    name: str,
    table: Array,
    rows: Array,
    positions: Array,
    block_size: int,
    r: int,
    out: Array | None,
    device: torch.device,
) -> Array:
    """The torch or triton kernel; numpy inputs are wrapped without copies and the result
    given back as numpy."""
    numpy_in = isinstance(positions, np.ndarray)
    n = int(positions.shape[0])
    tensors = [torch.from_numpy(x) if numpy_in else x for x in (table, rows, positions)]
    if out is None:
        dst_t = torch.empty(n, dtype=torch.int64, device=device)
    else:
        dst_t = torch.from_numpy(out) if numpy_in else out
    if name == "torch":
        _slots_torch(*tensors, block_size, r, dst_t)
    else:
        from . import triton_slots

        triton_slots.slot_mapping_triton(*tensors, block_size, r, dst_t)
    if not numpy_in:
        return dst_t
    return dst_t.numpy() if out is None else out


class TokenPositions(NamedTuple):
    """Per-token arrays of a step, request-major: ``request_index[t]`` is the index (into the
    per-request arrays) of token ``t``'s request and ``positions[t]`` its position."""

    request_index: np.ndarray | torch.Tensor
    positions: np.ndarray | torch.Tensor


def token_positions(num_computed: Array, num_new: Array, *, check: bool = True) -> TokenPositions:
    """Expand per-request token ranges ``[num_computed[i], num_computed[i] + num_new[i])`` into
    concatenated per-token arrays, without Python loops.

    For ``num_computed = [5, 0, 9]`` and ``num_new = [2, 3, 1]``: ``request_index = [0, 0, 1,
    1, 1, 2]`` and ``positions = [5, 6, 0, 1, 2, 9]``. Feed ``rows = batch_rows[request_index]``
    and ``positions`` to :func:`slot_mapping`.

    Args:
        num_computed: ``[B]`` int32/int64: tokens each request already holds.
        num_new: ``[B]`` int32/int64: tokens each request adds this step (0 allowed).
        check: validate types, shapes and non-negative values first.

    Returns:
        ``TokenPositions(request_index, positions)``, both ``[sum(num_new)]`` int64, numpy
        arrays for numpy inputs, tensors on the inputs' device for tensors.
    """
    if check:
        _check_token_inputs(num_computed, num_new)
    if isinstance(num_new, np.ndarray):
        counts = num_new.astype(np.int64, copy=False)
        total = int(counts.sum())
        request = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
        # token t of request i (t counted over the whole step) sits at position
        # num_computed[i] + (t - first_token[i]), first_token the exclusive prefix sum of counts
        shift = num_computed.astype(np.int64) - (np.cumsum(counts) - counts)
        positions = np.arange(total, dtype=np.int64)
        positions += np.repeat(shift, counts)
        return TokenPositions(request, positions)
    counts_t = num_new.to(torch.int64)
    total = int(counts_t.sum())  # the output size: a host sync on accelerators
    device = counts_t.device
    arange = torch.arange(counts_t.shape[0], dtype=torch.int64, device=device)
    request_t = torch.repeat_interleave(arange, counts_t, output_size=total)
    shift_t = num_computed.to(torch.int64) - (torch.cumsum(counts_t, 0) - counts_t)
    positions_t = torch.arange(total, dtype=torch.int64, device=device)
    positions_t += shift_t[request_t]
    return TokenPositions(request_t, positions_t)


def _check_token_inputs(num_computed: object, num_new: object) -> None:
    computed = _check_array(num_computed, "num_computed", "a 1-D int64 [B]")
    new = _check_array(num_new, "num_new", "a 1-D int64 [B]")
    for name, arr in (("num_computed", computed), ("num_new", new)):
        if arr.dtype not in _INT32_64:
            raise TypeError(f"{name} has dtype {_dtype_name(arr)}; expected int64 (or int32)")
        if arr.ndim != 1:
            raise ValueError(f"{name} has shape {_shape(arr)}; expected 1-D [B]")
    if _shape(new) != _shape(computed):
        raise ValueError(
            f"num_new has shape {_shape(new)}; expected {_shape(computed)} (one count per "
            "entry of num_computed)"
        )
    if not _same_kind(new, computed):
        raise ValueError(
            f"num_new is {_where(new)} but num_computed is {_where(computed)}; pass numpy "
            "arrays only, or torch tensors on one device only"
        )
    for name, arr in (("num_computed", computed), ("num_new", new)):
        host = arr if isinstance(arr, np.ndarray) else arr.cpu().numpy()
        if host.shape[0] and int(host.min()) < 0:
            i = _first(host < 0)
            raise ValueError(f"{name}[{i}] = {int(host[i])} is negative")
