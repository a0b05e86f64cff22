"""Helpers shared by the commands: byte counts, sizes with units, rich tables, and the checks
and one-line messages of command-line input.

Display only: byte counts stay integers (or exact fractions) everywhere else in kvforge.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from pydantic import ValidationError

__all__ = [
    "UsageError",
    "check_output_path",
    "console",
    "format_bytes",
    "format_exact",
    "make_table",
    "one_line",
    "parse_size",
    "write_text",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit code 2."""


def console() -> Any:
    """A rich console that stays wide enough for tables when output is not a terminal."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=160)


def parse_size(text: str) -> int:
    """Parse a byte count with optional units: ``"60GiB"``, ``"512MB"``, ``"1.5GiB"``, ``"4096"``.

    Decimal fractions are parsed exactly (no floats) and rounded down to whole bytes.

    Raises:
        UsageError: unknown unit, negative or malformed value, or zero.
    """
    if text.strip().startswith("-"):
        raise UsageError(f"size {text!r} is negative; give a byte count such as 60GiB")
    match = _SIZE.match(text)
    if match is None:
        raise UsageError(f"size {text!r} is not a number with an optional unit (e.g. 60GiB)")
    number, unit = match.groups()
    if unit.lower() not in _UNITS:
        units = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise UsageError(f"size {text!r} has unknown unit {unit!r}; use one of {units}")
    value = int(Fraction(number) * _UNITS[unit.lower()])
    if value <= 0:
        raise UsageError(f"size {text!r} must be more than 0 bytes")
    return value


def make_table(title: str, columns: Sequence[str], left: Sequence[str]) -> Any:
    """A rich table with ``columns``; those named in ``left`` align left, numbers right."""
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.50 KiB"`` (display only; byte counts stay integers elsewhere)."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            whole, rest = divmod(n * 100 // scale, 100)
            return f"{whole:,}.{rest:02d} {unit}"
    return f"{n:,} B"


def format_exact(value: int | Fraction) -> str:
    """An exact byte figure: ``131072`` -> ``"131,072"``, ``15401/4`` -> ``"3,850 1/4"``."""
    value = Fraction(value)
    whole, rest = divmod(value.numerator, value.denominator)
    if not rest:
        return f"{whole:,}"
    return f"{whole:,} {rest}/{value.denominator}"


def one_line(exc: BaseException) -> str:
    """The message of an input error as one line (a pydantic error: its first problem)."""
    if isinstance(exc, ValidationError):
        from kvforge.models.base import short_repr

        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"]) or exc.title
        return f"{where}={short_repr(err.get('input'))} is invalid: {err['msg']}"
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__


def check_output_path(path: str, option: str) -> None:
    """Refuse an output path that cannot be written, before any work is done.

    The path must be a file that can be opened for writing (checked without truncating it)
    or a new file in an existing, writable directory (checked by creating and removing it).

    Raises:
        UsageError: naming the option, the path and why.
    """
    target = Path(path)
    cannot = f"cannot write {option} {path!r}"
    if target.is_dir():
        raise UsageError(f"{cannot}: it is a directory; give a file path")
    parent = target.parent
    if not parent.exists():
        raise UsageError(f"{cannot}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{cannot}: {str(parent)!r} is not a directory")
    try:
        if target.exists():
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            target.unlink()
    except OSError as exc:
        raise UsageError(f"{cannot}: {exc.strerror or exc}") from None


def write_text(path: str, text: str, option: str = "--json") -> None:
    """Write ``text`` to ``path``, which :func:`check_output_path` accepted before the work.

    Raises:
        UsageError: the file cannot be written after all (a race with the filesystem).
    """
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise UsageError(f"cannot write {option} {path!r}: {exc.strerror or exc}") from None
