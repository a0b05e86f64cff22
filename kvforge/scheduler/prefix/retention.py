"""Which completed window and state blocks the prefix cache keeps reusable: the retention
policy (``prefix_retention``) and its checks, shared by :class:`~.cache.PrefixCache`,
:class:`~kvforge.scheduler.block_manager.BlockManager` and the controller, and the rule
itself (:func:`in_some_tail`), which :mod:`.commit` applies to every completed window block.

Invariants (``tests/scheduler/test_retention.py``; ``docs/architecture.md``, "Retention"):
a bad policy or interval is refused with an :class:`~kvforge._checks.ArgumentError` naming
it; under ``"dense"`` every block the tail of some boundary reads is kept, under
``"checkpoints"`` only those of the request's checkpoints and of the interval's multiples;
history groups and per-request snapshots are never affected.
"""

from __future__ import annotations

from numbers import Integral
from typing import Literal

from kvforge._checks import ArgumentError
from kvforge.scheduler.tables import GroupTable

__all__ = [
    "DEFAULT_PREFIX_RETENTION",
    "PREFIX_RETENTIONS",
    "Retention",
    "check_prefix_retention",
    "checkpoints_of",
    "in_some_tail",
    "window_start",
]

Retention = Literal["dense", "checkpoints"]
#: the retention policies of window and state blocks (see :func:`check_prefix_retention`)
PREFIX_RETENTIONS: tuple[str, ...] = ("dense", "checkpoints")
#: chosen by measurement against vLLM 0.33 (``docs/vs_vllm.md``, "Retention")
DEFAULT_PREFIX_RETENTION: Retention = "dense"


def check_prefix_retention(
    prefix_retention: object,
    prefix_retention_interval: object = None,
    boundary: int | None = None,
) -> tuple[Retention, int | None]:
    """``(prefix_retention, prefix_retention_interval)`` themselves, refused unless the policy
    is ``"dense"`` or ``"checkpoints"`` and the interval is ``None`` or (with
    ``"checkpoints"``) a positive multiple of ``boundary``, the LCM of the groups' block
    sizes, where every prefix hit ends (any positive int while ``boundary`` is not known).

    - ``"dense"``: every completed window / state block that the tail of some boundary needs
      is kept reusable (a hit may end on any boundary the full-attention chain reaches);
    - ``"checkpoints"`` (vLLM 0.33's default, ``prefix_cache_retention_interval=0``): only the
      blocks of the tails at the boundaries where a later prompt can end: the request's
      replay boundary (its prompt's last token, rounded down to ``boundary``, where a resend
      of the prompt or a longer one hits), the junction its lookup found (where the
      full-attention chain of a cached prompt it shares a prefix with ends), and, with an
      interval ``I``, every multiple of ``I`` (vLLM's positive interval). A request scheduled
      without a match has no known prompt end: it keeps its blocks densely.

    Full-attention (history) groups and per-request snapshots are not affected.

    Raises:
        ArgumentError (a ``TypeError`` and a ``ValueError``): a bad value, named.
    """
    if not isinstance(prefix_retention, str) or prefix_retention not in PREFIX_RETENTIONS:
        raise ArgumentError(
            f"prefix_retention must be 'dense' or 'checkpoints', got {prefix_retention!r}"
        )
    interval = prefix_retention_interval
    if interval is None:
        return prefix_retention, None  # type: ignore[return-value]
    if prefix_retention != "checkpoints":
        raise ArgumentError(
            f"prefix_retention_interval applies to prefix_retention='checkpoints', got "
            f"{interval!r} with prefix_retention={prefix_retention!r}"
        )
    if isinstance(interval, bool) or not isinstance(interval, Integral) or interval < 1:
        raise ArgumentError(
            f"prefix_retention_interval must be None or a positive int, got {interval!r}"
        )
    if boundary is not None and interval % boundary:
        raise ArgumentError(
            f"prefix_retention_interval must be a multiple of {boundary} (the LCM of the "
            f"groups' block sizes, where prefix hits end), got {interval!r}"
        )
    return prefix_retention, int(interval)  # type: ignore[return-value]


def checkpoints_of(num_prompt_tokens: int, junction: int, boundary: int) -> tuple[int, ...]:
    """The boundaries whose tails a request keeps under ``"checkpoints"``: its replay boundary
    (its prompt's last token rounded down to ``boundary``: where a resend of the prompt, or any
    longer prompt extending it, hits) and the junction its lookup found (0s dropped).

    >>> checkpoints_of(600, 288, 16)
    (288, 592)
    """
    replay = (num_prompt_tokens - 1) // boundary * boundary if num_prompt_tokens else 0
    return tuple(sorted({b for b in (replay, junction // boundary * boundary) if b > 0}))


def window_start(g: GroupTable, num_tokens: int) -> int:
    """First token the step after a prefix of ``num_tokens`` reads in group ``g``."""
    return g.rule.tail_start(g.spec, num_tokens)


def in_some_tail(
    g: GroupTable,
    col: int,
    boundary: int,
    interval: int | None,
    keep: tuple[int, ...] | None = None,
) -> bool:
    """Whether block ``col`` of window group ``g`` lies in the tail some retained boundary
    needs: under ``"dense"`` retention (``keep`` None) every multiple of ``boundary``, under
    ``"checkpoints"`` the boundaries in ``keep`` and the multiples of the retention
    ``interval`` (none when it is ``None``).

    Tails move forward with ``L``, so among evenly spaced boundaries the first at or after
    the block's end decides: a 4-token ``c4_state`` block (window 8, boundary 256) is in a
    tail only if it is one of the two blocks before a multiple of 256 (2 of every 64
    blocks).
    """
    end = (col + 1) * g.block_size
    if keep is None:
        every: int | None = boundary
    else:
        for b in keep:
            if b >= end and window_start(g, b) // g.block_size <= col:
                return True
        every = interval
    if every is None:
        return False
    first = -(-end // every) * every
    return window_start(g, first) // g.block_size <= col
