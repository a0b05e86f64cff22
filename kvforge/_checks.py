"""Argument checks every public call shares: one validator for integers, one for booleans,
and one lock decorator, so each refusal reads the same wherever it is raised.

A wrong type and a value out of range raise :class:`ArgumentError`, which is both a
``TypeError`` and a ``ValueError``: callers that catch either, as kvforge documented for
different calls before, keep working. The message names the argument and the value.

>>> check_int("max_num_seqs", 16, minimum=1)
16
>>> check_int("max_num_seqs", True, minimum=1)
Traceback (most recent call last):
...
kvforge._checks.ArgumentError: max_num_seqs must be an int >= 1, got True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from numbers import Integral
from typing import Any, TypeVar

__all__ = ["ArgumentError", "check_bool", "check_int", "check_integer", "locked"]

_T = TypeVar("_T")


class ArgumentError(TypeError, ValueError):
    """A bad argument: the wrong type, or a value out of range."""


def check_int(
    name: str,
    value: object,
    minimum: int = 0,
    maximum: int | None = None,
    *,
    type_message: str | None = None,
    range_message: str | None = None,
) -> int:
    """``value`` as a Python int if it is an integer (numpy integers included, ``bool``
    never) within ``[minimum, maximum]``; else :class:`ArgumentError` naming ``name``.

    ``type_message`` / ``range_message`` word the refusal where a module keeps its own
    established wording; they are formatted with ``name``, ``value`` (its repr),
    ``type`` (its type's name) and ``minimum``."""
    if type(value) is int and value >= minimum and maximum is None:
        return value  # the common case, on every per-request call: no dict, no ABC check
    fields = {"name": name, "minimum": minimum}
    if isinstance(value, bool) or not isinstance(value, Integral):
        template = type_message or "{name} must be an int >= {minimum}, got {value}"
        raise ArgumentError(template.format(value=repr(value), type=type(value).__name__, **fields))
    number = int(value)
    if number < minimum or (maximum is not None and number > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        template = range_message or "{name} must be an int " + bound + ", got {value}"
        raise ArgumentError(template.format(value=repr(value), type=type(value).__name__, **fields))
    return number


def check_integer(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as a Python int if it is an integer (numpy integers included, ``bool``
    never), refused as ``"{name} must be an int, got {value}"``; with ``minimum``, a smaller
    value is refused as ``"{name} must be >= {minimum}, got {value}"``. For arguments whose
    range a later check words (a budget's), or whose only rule is a floor (a rank)."""
    if minimum is None:
        return check_int(name, value, -(1 << 63), type_message=_INT_TYPE)
    return check_int(name, value, minimum, type_message=_INT_TYPE, range_message=_INT_FLOOR)


_INT_TYPE = "{name} must be an int, got {value}"
_INT_FLOOR = "{name} must be >= {minimum}, got {value}"


def check_bool(name: str, value: object) -> bool:
    """``value`` itself if it is a ``bool`` (not 0, 1 or a string); else
    :class:`ArgumentError` naming ``name``."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be a bool, got {value!r}")
    return value


def locked(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` holding ``self._lock``: the one way a public method of a side or of the
    facade takes its object's lock (``tests/test_threads.py`` checks every public method)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    wrapper.__locked__ = True  # type: ignore[attr-defined]
    return wrapper
