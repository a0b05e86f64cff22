"""Gather / scatter of KV cache blocks between block-major planes and page-first rows.

A *plane* is one (layer, role) cache buffer seen as raw bytes, ``[num_blocks, block_bytes]``
``torch.uint8`` with strides ``(block_stride, 1)``, ``block_stride >= block_bytes``: the stride
may exceed the meaningful bytes (alignment padding, an engine-owned allocation, several roles
packed in one buffer as strided views); only ``block_bytes`` bytes per block are ever read or
written. A *page-first row* packs one block of every plane of a group, in plane order, with no
padding: row ``i`` is ``cat([planes[p][block_ids[i]] for p in range(P)])``.

- :func:`gather_blocks` packs selected blocks into rows (device -> host direction: on an
  accelerator into a device staging buffer that the caller then DMAs to pinned host memory; on
  CPU directly into the host rows).
- :func:`scatter_blocks` is the mirror image (host -> device).
- :func:`resolve_impl` says which implementation ``impl="auto"`` picks for a device.
- :class:`PlaneSet` holds planes validated once; callers that move the same planes many times
  (the cache controller, one per group) pass it instead of a list and skip the per-plane checks.
- :func:`slot_mapping` computes the cache slot of every scheduled token of a step from a
  group's block table (numpy on CPU, a Triton kernel on accelerators), and
  :func:`token_positions` expands per-request token ranges into the per-token arrays it takes
  (module :mod:`kvforge.ops.slots`).

Implementations (``impl=``):

``"torch"``
    Reference: one ``index_select`` / ``index_copy_`` per plane. Always available.
``"cpu"``
    numba kernels, one ``memcpy`` per (row, plane) over numba threads; CPU tensors only; needs
    the optional ``numba`` package (extra ``fast-cpu``).
``"triton"``
    One Triton launch for all planes (CUDA via triton, Ascend via triton-ascend). On CPU
    tensors only under the Triton interpreter (``TRITON_INTERPRET=1``, used by tests).

``"auto"`` picks ``"triton"`` on cuda/npu when ``import triton`` works (else ``"torch"``), and
``"cpu"`` on CPU when numba imports (else ``"torch"``).

Neither triton nor numba is imported when this package is imported; this package imports no
other ``kvforge`` module.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from ._common import PlaneSet, TransferPlan, validate
from .slots import (
    SLOT_IMPLS,
    TokenPositions,
    resolve_slot_impl,
    slot_mapping,
    token_positions,
)
from .torch_ref import gather_blocks_torch, scatter_blocks_torch

__all__ = [
    "IMPLS",
    "SLOT_IMPLS",
    "PlaneSet",
    "TokenPositions",
    "TransferPlan",
    "available_impls",
    "gather_blocks",
    "resolve_impl",
    "resolve_slot_impl",
    "scatter_blocks",
    "slot_mapping",
    "token_positions",
]

#: Concrete implementation names (``"auto"`` resolves to one of them).
IMPLS: tuple[str, ...] = ("torch", "cpu", "triton")
_ACCEL = ("cuda", "npu")


@functools.cache
def _import_error(module: str) -> str | None:
    """``None`` when ``kvforge.ops.<module>`` imports, else the reason it does not."""
    try:
        importlib.import_module(f"{__name__}.{module}")
    except Exception as exc:  # any failure (ImportError, a broken install) = unavailable
        return f"{type(exc).__name__}: {exc}"
    return None


def _cpu_error() -> str | None:
    return _import_error("cpu_fast")


def triton_error() -> str | None:
    """``None`` when the Triton kernels import, else why not (the availability probe
    :func:`resolve_impl` and :mod:`kvforge.ops.slots` share)."""
    return _import_error("triton_kernels")


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET=1`` asks for the Triton interpreter on CPU."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_impl_name(impl: object) -> str:
    if not isinstance(impl, str):
        raise TypeError(
            f"impl is {type(impl).__name__}; expected one of 'auto', 'torch', 'cpu', 'triton'"
        )
    if impl != "auto" and impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of 'auto', 'torch', 'cpu', 'triton'")
    return impl


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """Return the concrete implementation that ``impl`` means for tensors on ``device``.

    Args:
        impl: ``"auto"``, ``"torch"``, ``"cpu"`` or ``"triton"``.
        device: the planes' device (``torch.device`` or a string such as ``"cuda:0"``).

    Returns:
        ``"torch"``, ``"cpu"`` or ``"triton"``. ``"auto"`` gives ``"triton"`` on cuda/npu when
        triton imports, ``"cpu"`` on CPU when numba imports, ``"torch"`` otherwise. An explicit
        name is returned unchanged once it is known to work on ``device``.

    Raises:
        ValueError: unknown name, or a name that cannot run on ``device`` (``"cpu"`` on an
            accelerator; ``"triton"`` on CPU without ``TRITON_INTERPRET=1``).
        RuntimeError: an explicit name whose optional dependency (numba / triton) is missing.
    """
    impl = _check_impl_name(impl)
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if impl == "auto":
        if device.type in _ACCEL:
            return "triton" if triton_error() is None else "torch"
        if device.type == "cpu":
            return "cpu" if _cpu_error() is None else "torch"
        return "torch"
    if impl == "cpu":
        if device.type != "cpu":
            raise ValueError(f"impl 'cpu' runs on cpu tensors only; the planes are on {device}")
        err = _cpu_error()
        if err is not None:
            raise RuntimeError(
                f"impl 'cpu' needs numba, which does not import ({err}); install the "
                "'fast-cpu' extra or use impl='torch'"
            )
    elif impl == "triton":
        if device.type == "cpu" and not interpret_requested():
            raise ValueError(
                "impl 'triton' on cpu tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before kvforge.ops.triton_kernels is first imported "
                "(or use impl='cpu' / 'torch')"
            )
        err = triton_error()
        if err is not None:
            raise RuntimeError(f"impl 'triton' needs triton, which does not import ({err})")
    return impl


def available_impls(device: torch.device | str) -> list[str]:
    """Concrete implementations that can run on ``device`` now, reference first."""
    out = []
    for name in IMPLS:
        try:
            resolve_impl(name, device)
        except (ValueError, RuntimeError):
            continue
        out.append(name)
    return out


_AUTO_CPU_BROKEN: list[str] = []


def _run(
    op: str,
    planes: Sequence[torch.Tensor],
    block_ids: torch.Tensor | np.ndarray,
    rows: torch.Tensor,
    impl: str,
    row_ids: torch.Tensor | np.ndarray | None,
) -> None:
    _check_impl_name(impl)
    rows_name = "src" if op == "scatter_blocks" else "out"
    plan = validate(planes, block_ids, rows, rows_name, op, row_ids)
    name = resolve_impl(impl, plan.device)
    if plan.n == 0 or plan.num_valid == 0:
        return
    planes = plan.planes
    scatter = op == "scatter_blocks"
    if name == "cpu" and impl == "auto" and _AUTO_CPU_BROKEN:
        name = "torch"
    if name == "torch":
        (scatter_blocks_torch if scatter else gather_blocks_torch)(planes, plan, rows)
    elif name == "cpu":
        from . import cpu_fast

        fn = cpu_fast.scatter_blocks_cpu if scatter else cpu_fast.gather_blocks_cpu
        if impl != "auto":
            fn(planes, plan, rows)
            return
        try:
            fn(planes, plan, rows)
        except Exception as exc:  # numba failed to compile: nothing moved yet
            if not _is_numba_error(exc):
                raise
            _AUTO_CPU_BROKEN.append(repr(exc))
            warnings.warn(
                f"kvforge.ops: the numba CPU path failed ({exc!r}); using the torch reference",
                RuntimeWarning,
                stacklevel=3,
            )
            (scatter_blocks_torch if scatter else gather_blocks_torch)(planes, plan, rows)
    else:
        from . import triton_kernels

        if scatter:
            triton_kernels.scatter_blocks_triton(planes, plan, rows)
        else:
            triton_kernels.gather_blocks_triton(planes, plan, rows)


def _is_numba_error(exc: Exception) -> bool:
    return type(exc).__module__.startswith(("numba", "llvmlite"))


def gather_blocks(
    planes: Sequence[torch.Tensor],
    block_ids: torch.Tensor | np.ndarray,
    out: torch.Tensor,
    impl: str = "auto",
    *,
    row_ids: torch.Tensor | np.ndarray | None = None,
) -> torch.Tensor:
    """Pack blocks of every plane into page-first rows: ``out[r_i] = cat_p(planes[p][ids[i]])``
    with ``r_i = i``, or ``r_i = row_ids[i]`` when ``row_ids`` is given.

    Args:
        planes: ``P`` tensors ``[num_blocks_p, block_bytes_p]``, ``torch.uint8``, strides
            ``(block_stride_p, 1)`` with ``block_stride_p >= block_bytes_p`` (the bytes past
            ``block_bytes_p`` in each block stride are never touched), all on one device.
            ``block_bytes_p``, ``block_stride_p`` and ``num_blocks_p`` may differ per plane. A
            :class:`PlaneSet` of them skips the per-plane checks (done when it was built): build
            one per group and reuse it.
        block_ids: ``[n]`` ``torch.int64`` on CPU or on the planes' device, or a numpy
            ``int64`` array. ``-1`` skips the row (``out[r_i]`` is left untouched); other ids
            must satisfy ``0 <= id < min_p num_blocks_p``. Repeated ids are allowed.
        out: ``[n, row_bytes]`` ``torch.uint8`` (any number of rows with ``row_ids``) with
            ``row_bytes = sum_p block_bytes_p`` and strides ``(row_bytes, 1)``, on the planes'
            device. Plane ``p`` occupies bytes ``[off_p, off_p + block_bytes_p)`` of a row,
            ``off_p = sum_{q<p} block_bytes_q``.
        impl: ``"auto"`` (see :func:`resolve_impl`), ``"torch"``, ``"cpu"`` or ``"triton"``.
        row_ids: ``None``, or ``[n]`` int64 (same forms as ``block_ids``): the row of ``out``
            each block goes to, all distinct and in ``[0, out.shape[0])``. Lets a CPU gather
            write straight into scattered host pages in one call.

    Returns:
        ``out``. On accelerators the copy is enqueued on the current stream (asynchronous).

    Raises:
        TypeError / ValueError: invalid arguments (the message names the argument and value);
            raised before any byte moves.
        RuntimeError: an explicitly requested implementation is not installed.
    """
    _run("gather_blocks", planes, block_ids, out, impl, row_ids)
    return out


def scatter_blocks(
    planes: Sequence[torch.Tensor],
    block_ids: torch.Tensor | np.ndarray,
    src: torch.Tensor,
    impl: str = "auto",
    *,
    row_ids: torch.Tensor | np.ndarray | None = None,
) -> None:
    """Unpack page-first rows into blocks: ``planes[p][ids[i]] = src[r_i, off_p : off_p +
    bytes_p]`` with ``r_i = i``, or ``r_i = row_ids[i]`` when ``row_ids`` is given.

    Args:
        planes: as in :func:`gather_blocks`; written in place.
        block_ids: ``[n]`` int64 as in :func:`gather_blocks`. ``-1`` skips the row; a
            non-negative id may appear only once (two rows writing one block is an error).
        src: ``[n, row_bytes]`` ``torch.uint8`` (any number of rows with ``row_ids``), strides
            ``(row_bytes, 1)``, on the planes' device (on accelerators: a device staging
            buffer the caller filled from host rows).
        impl: ``"auto"``, ``"torch"``, ``"cpu"`` or ``"triton"``.
        row_ids: ``None``, or ``[n]`` int64: the row of ``src`` each block is read from, in
            ``[0, src.shape[0])`` (a row may be read more than once).

    Raises:
        TypeError / ValueError: invalid arguments, raised before any byte moves.
        RuntimeError: an explicitly requested implementation is not installed.
    """
    _run("scatter_blocks", planes, block_ids, src, impl, row_ids)
