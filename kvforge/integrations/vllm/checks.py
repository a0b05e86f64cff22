"""Checks on what vLLM hands the offloading backend: ids must be ints, and reports and jobs must
name something that was issued and is still outstanding.

- **Ids** (block ids, job ids, counts, token counts) are ints: Python ints, numpy integers and
  integer torch scalars or arrays. Bools, floats (``4.5`` is never read as block 4), NaN,
  strings and values out of range are refused with an
  :class:`~kvforge._checks.ArgumentError` naming the field and the value, before anything
  changes.
- **Reports and jobs** (a finished or failed load or store, a job a worker is told to run) are
  accepted only for a job or key that was issued and is still outstanding, at most once. The
  manager refuses anything else with :class:`TransferRefusedError`; the connector's
  engine-facing hooks drop it with a warning and count it (docs/integrations/vllm.md,
  *Reports and ids*).

This module imports no vLLM code.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral

import numpy as np
import torch

from kvforge._checks import ArgumentError
from kvforge.errors import RequestStateError

__all__ = ["TransferRefusedError", "int_array", "int_id", "req_ids"]


class TransferRefusedError(RequestStateError):
    """A report or job of an offload transfer that was never issued, is no longer outstanding
    (a replay), or names a key another request holds: refused, nothing changed.

    Attributes:
        what: what was refused (``"mark_failed"``, ``"complete_store"``, a job, ...).
        value: the key or job id.
    """

    def __init__(self, what: str, value: object, why: str) -> None:
        self.what, self.value = what, value
        super().__init__(f"{what}: {value!r} refused: {why}; nothing changed")


def _range(low: int | None, high: int | None) -> str:
    if low is None:
        return "" if high is None else f"below {high}"
    return f">= {low}" if high is None else f"in [{low}, {high})"


def _shown(value: object) -> str:
    return repr(value.item() if isinstance(value, np.generic) else value)


def int_id(field: str, value: object, low: int = 0, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high)`` (``high=None``: no upper bound).

    Python ints, numpy integers and 0-d integer torch tensors pass; bools, floats, NaN and
    anything else are refused.

    Raises:
        ArgumentError: naming ``field`` and ``value``.
    """
    if isinstance(value, torch.Tensor):
        if (
            value.dim() != 0
            or value.dtype == torch.bool
            or value.dtype.is_floating_point
            or (value.dtype.is_complex)
        ):
            raise ArgumentError(f"{field}={_shown(value)}: must be an int {_range(low, high)}")
        value = int(value.item())
    if isinstance(value, bool | np.bool_) or not isinstance(value, Integral):
        raise ArgumentError(f"{field}={_shown(value)}: must be an int {_range(low, high)}")
    number = int(value)
    if number < low or (high is not None and number >= high):
        raise ArgumentError(f"{field}={_shown(value)}: must be an int {_range(low, high)}")
    return number


def int_array(
    field: str, values: object, low: int | None = 0, high: int | None = None
) -> np.ndarray:
    """``values`` (a sequence, a numpy array or a torch tensor) as ``int64 [n]``, every entry
    an int in ``[low, high)`` (``None``: no bound on that side).

    Raises:
        ArgumentError: an entry is not an int (a bool, a float, NaN, ...) or is out of range;
            the message names ``field[i]`` and the value.
    """
    bound = _range(low, high)
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        arr = values
        if arr.ndim != 1:
            if arr.ndim == 0 or arr.size:
                raise ArgumentError(f"{field}={values!r}: must be a flat sequence of ints")
            arr = arr.reshape(-1)
        if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
            items = arr.tolist()
            bad = next(
                (i for i, v in enumerate(items) if isinstance(v, bool) or not isinstance(v, int)),
                0,
            )
            raise ArgumentError(f"{field}[{bad}]={_shown(arr[bad])}: must be an int {bound}")
        out = arr.astype(np.int64)
    else:
        if isinstance(values, str | bytes) or not isinstance(values, Iterable):
            raise ArgumentError(f"{field}={values!r}: must be a flat sequence of ints")
        items = list(values)
        for i, v in enumerate(items):
            if (
                isinstance(v, torch.Tensor)
                and v.dim() == 0
                and not (v.dtype == torch.bool or v.dtype.is_floating_point or v.dtype.is_complex)
            ):
                items[i] = v = int(v.item())
            if isinstance(v, bool | np.bool_) or not isinstance(v, Integral):
                raise ArgumentError(f"{field}[{i}]={_shown(v)}: must be an int {bound}")
        try:
            out = np.asarray([int(v) for v in items], dtype=np.int64)
        except OverflowError:
            raise ArgumentError(f"{field}={items!r}: an id does not fit in 64 bits") from None
        arr = out
    if out.size:
        wrong = np.zeros(out.shape, dtype=bool)
        if low is not None:
            wrong |= out < low
        if high is not None:
            wrong |= out >= high
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise ArgumentError(f"{field}[{i}]={_shown(arr[i])}: must be an int {bound}")
    return out


def req_ids(field: str, values: object) -> set[str]:
    """``values`` as a set of request ids (strings).

    Raises:
        ArgumentError: ``values`` is not a collection of strings.
    """
    if values is None:
        return set()
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ArgumentError(f"{field}={values!r}: must be a set of request ids (strings)")
    out = set()
    for v in values:
        if not isinstance(v, str):
            raise ArgumentError(f"{field}: request id {v!r} is not a string")
        out.add(v)
    return out
