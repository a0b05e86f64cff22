"""Checks of the backends' constructor arguments: every backend checks every argument before
it sets an attribute or builds a group, so a refused call leaves nothing half-built.

A wrong type and a value out of range raise :class:`~kvforge._checks.ArgumentError`, which is
both a ``TypeError`` and a ``ValueError``; the message names the backend, the argument and the
value.

>>> width("MLABackend", "kv_lora_rank", 512)
512
>>> width("MLABackend", "kv_lora_rank", -1)
Traceback (most recent call last):
...
kvforge._checks.ArgumentError: MLABackend: kv_lora_rank must be a positive int, got -1
>>> group_name("GQABackend", None, default="kv")
'kv'
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import torch

from kvforge._checks import ArgumentError
from kvforge.specs import canonical_dtype

__all__ = ["MAX_WIDTH", "choice", "dtype_name", "group_name", "optional_width", "width"]

MAX_WIDTH = 2**31 - 1
"""The largest size any backend argument may take: kernels index with 32-bit ints."""


def width(owner: str, name: str, value: Any, minimum: int = 1, unit: str = "") -> int:
    """``value`` as a Python int if it is an integer (numpy integers included; ``bool``,
    floats and strings never) in ``[minimum, MAX_WIDTH]``; else :class:`ArgumentError`."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ArgumentError(
            f"{owner}: {name} must be an int, got {value!r} ({type(value).__name__})"
        )
    number = int(value)
    if number < minimum:
        if minimum == 1:
            what = f"a positive number of {unit}" if unit else "a positive int"
        else:
            what = f">= {minimum}"
        raise ArgumentError(f"{owner}: {name} must be {what}, got {value!r}")
    if number > MAX_WIDTH:
        raise ArgumentError(f"{owner}: {name} must be at most {MAX_WIDTH:,}, got {value!r}")
    return number


def optional_width(owner: str, name: str, value: Any, unit: str = "") -> int | None:
    """``None``, or :func:`width` of ``value``."""
    return None if value is None else width(owner, name, value, unit=unit)


def choice(owner: str, name: str, value: Any, allowed: Sequence[str], message: str = "") -> str:
    """``value`` if it is one of the strings ``allowed`` (compared as a ``str`` only: no
    ``==`` on other types is trusted); else :class:`ArgumentError` with ``message`` or a
    default naming the choices."""
    if not isinstance(value, str) or value not in allowed:
        raise ArgumentError(
            f"{owner}: "
            + (message or f"{name} must be one of {list(allowed)}")
            + f", got {value!r}"
        )
    return value


def dtype_name(owner: str, name: str, value: Any) -> str:
    """The canonical name of the cache dtype ``value`` (a ``torch.dtype`` or a string)."""
    if not isinstance(value, str | torch.dtype):
        raise ArgumentError(
            f"{owner}: {name} must be a torch.dtype or a string, got {value!r} "
            f"({type(value).__name__})"
        )
    try:
        return canonical_dtype(value)
    except ValueError as exc:
        raise ArgumentError(
            f"{owner}: {exc}" if name == "dtype" else f"{owner}: {name}: {exc}"
        ) from None


def group_name(owner: str, value: Any, default: str) -> str:
    """The group name ``value``, or ``default`` for ``None``; an empty name, one with
    surrounding whitespace or one that is not a ``str`` is refused rather than replaced."""
    if value is None:
        return default
    if not isinstance(value, str) or not value or value.strip() != value:
        raise ArgumentError(
            f"{owner}: group must be a non-empty str without surrounding whitespace (or None "
            f"for the default {default!r}), got {value!r}"
        )
    return value
