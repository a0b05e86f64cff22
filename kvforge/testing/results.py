"""What the conformance kit reports: the checks it runs (:data:`CHECKS`), a failure
(:class:`ConformanceError`, an ``AssertionError`` naming its check), what each check covered
(:class:`CheckResult`) and the whole run (:class:`ConformanceReport`); plus :func:`fail` and
:func:`run_check`, which turn any failure of a backend into a failure of the check that ran
it. ``tests/backends/test_conformance.py`` checks each broken backend fails the check named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvforge.specs import SwapPurpose

CHECKS: tuple[str, ...] = (
    "declaration",
    "bytes",
    "naming_and_order",
    "no_overlap",
    "swap_round_trip",
)
"""The checks :func:`check_backend` runs, in the order it runs them."""


BLOCKER = "conformance-blocker"


_T = TypeVar("_T")


class ConformanceError(AssertionError):
    """A backend broke the contract.

    Attributes:
        check: the name of the failed check (one of :data:`CHECKS`).
        detail: what was expected and what was found.
    """

    def __init__(self, check: str, detail: str) -> None:
        self.check = check
        self.detail = detail
        super().__init__(f"conformance check {check!r} failed: {detail}")


@dataclass(frozen=True)
class CheckResult:
    """What one check covered.

    Attributes:
        name: the check (one of :data:`CHECKS`).
        buffers: ``(role, layer)`` buffers it looked at.
        entries: cache entries it covered: held by the buffers (``bytes``), compared byte for
            byte (``swap_round_trip``); 0 for checks that look at no entry.
        bytes: meaningful bytes it covered, the same way (``no_overlap``: bytes of every plane).
        note: a one-line summary.
    """

    name: str
    buffers: int
    entries: int
    bytes: int
    note: str


@dataclass(frozen=True)
class ConformanceReport:
    """The checks that ran, and what they were run with.

    Attributes:
        layers: the layer ids checked.
        num_blocks: device blocks per group (the null block included).
        tokens: tokens of the request used by the round trips.
        purposes: the swap purposes round-tripped.
        checks: one result per check, in :data:`CHECKS` order.
    """

    layers: tuple[int, ...]
    num_blocks: dict[str, int] = field(hash=False)
    tokens: int
    purposes: tuple[SwapPurpose, ...]
    checks: tuple[CheckResult, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.checks)

    def check(self, name: str) -> CheckResult:
        """The result of check ``name``."""
        for result in self.checks:
            if result.name == name:
                return result
        raise KeyError(f"no check named {name!r} ran; checks: {list(self.names)}")


def fail(check: str, detail: str, cause: BaseException | None = None) -> ConformanceError:
    error = ConformanceError(check, detail)
    error.__cause__ = cause
    return error


def run_check(check: str, what: str, call: Callable[[], _T]) -> _T:
    """``call()``, with any failure but a ConformanceError reported as a failure of ``check``."""
    try:
        return call()
    except ConformanceError:
        raise
    except Exception as exc:  # a backend's failure is the finding, whatever its type
        raise fail(check, f"{what} raised {type(exc).__name__}: {exc}", exc) from None
