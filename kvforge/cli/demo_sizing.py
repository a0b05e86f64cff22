"""How big the demo's pools are: a share of what its requests would hold at once, in integers.

The demo wants pools too small for its load, so that requests compete for blocks and get
preempted. Per group it counts, in blocks:

- ``demand``: what every request would hold at once at its peak (a full group: all its
  blocks; a window or state group: its live window), plus ONE prefill allowance, the largest
  (a memory plan also budgets one batch-wide step allowance, not one per request);
- ``alone``: the most blocks any one request holds, so that each request can always run alone.

At share ``s`` (a fraction in ``[0, 1]``) the group gets ``max(alone, ceil(s * demand)) + 1``
blocks (the ``+ 1`` is the null block). Every group is sized by the same share, rather than by
a planner's reservation of windows for a fixed ``max_num_seqs``, so any group can run dry and
preemption is driven by growth in all of them.

Without a budget the share is ``DemoConfig.device_share`` (a third) and the budget is what
those blocks cost. With one, the share is the largest whose blocks fit. The blocks only
change at shares ``j / demand`` of some group, so that share is found exactly: per group, an
integer binary search for the largest ``j`` that fits, then the largest of those fractions.
Block counts become bytes through the integer planner
(:func:`~kvforge.core.memory_plan.plan_from_blocks`), which also refuses counts past int32
block ids or 64-bit byte offsets, so the demo allocates exactly what a plan says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from kvforge.cli.formatting import format_bytes
from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import MemoryPlan, plan_from_blocks
from kvforge.core.search import largest
from kvforge.kinds import held_blocks
from kvforge.specs import CacheGroup

__all__ = [
    "PREFILL_CHUNK",
    "DeviceSizing",
    "live_blocks",
    "prefill_peak",
    "size_device",
    "size_host",
]

#: Prompts are prefilled in chunks of this many tokens, one step each, as engines do (small,
#: so a window group's prefill allowance stays small next to the full groups it competes with).
PREFILL_CHUNK = 16

_SHARE_DENOMINATOR = 1_000_000
"""``DemoConfig.device_share`` is a float; read as the nearest fraction with at most this
denominator, so ``1 / 3`` means a third, not the binary float next to it."""


def live_blocks(group: CacheGroup, num_tokens: int) -> int:
    """Blocks a request of ``num_tokens`` tokens holds in ``group`` between steps."""
    return held_blocks(group, num_tokens, num_tokens)


def prefill_peak(group: CacheGroup, prompt_len: int) -> int:
    """The most blocks a request holds in ``group`` while its prompt is prefilled in chunks:
    a window group holds a block for every token of the current chunk, plus its window."""
    return max(
        held_blocks(group, start, min(prompt_len, start + PREFILL_CHUNK))
        for start in range(0, prompt_len, PREFILL_CHUNK)
    )


def _peak_blocks(group: CacheGroup, prompt_len: int, final_len: int) -> int:
    """The most blocks a request holds in ``group``: its prefill peak, then its live window
    as it decodes."""
    return max(prefill_peak(group, prompt_len), group.max_live_blocks(final_len))


@dataclass(frozen=True)
class DeviceSizing:
    """What :func:`size_device` decided."""

    blocks: dict[str, int]
    """Physical blocks per group (null block included)."""
    plan: MemoryPlan
    """The device plan of those counts: their bytes, checked against the planner's limits."""
    budget: int
    """The budget given, or the one derived (then exactly ``plan.total_bytes``)."""
    share: Fraction
    """Share of the requests' combined peak demand the pools hold, per group."""
    longest: int
    """Tokens the longest request reaches."""


def size_device(
    layout: CacheLayout, lengths: Sequence[tuple[int, int]], budget: int | None, share: float
) -> DeviceSizing:
    """Device blocks per group for requests of ``(prompt_len, final_len)`` ``lengths``:
    ``share`` of what they would hold at once, or the largest share ``budget`` bytes hold
    (see the module docstring).

    Raises:
        ValueError: the budget cannot hold the longest request alone (says what would).
    """
    longest = max(final for _, final in lengths)
    groups = list(layout.groups)
    bpb = {g.name: layout.bytes_per_block(g.name) for g in groups}
    # Between steps a request holds its live window; during its prefill a window group also
    # holds the chunk's other blocks, until its first decode step.
    steady = {g.name: [g.max_live_blocks(f) for _, f in lengths] for g in groups}
    peaks = {g.name: [_peak_blocks(g, p, f) for p, f in lengths] for g in groups}
    demand = {
        name: sum(steady[name])
        + max(pk - st for pk, st in zip(peaks[name], steady[name], strict=True))
        for name in peaks
    }
    alone = {name: max(counts) for name, counts in peaks.items()}

    def blocks_at(s: Fraction) -> dict[str, int]:
        # -(-a // b) is ceil(a / b) in integers: ceil(s * demand) with s = a / b
        return {
            name: max(alone[name], -(-s.numerator * demand[name] // s.denominator)) + 1
            for name in demand
        }

    def cost(s: Fraction) -> int:
        return sum(count * bpb[name] for name, count in blocks_at(s).items())

    if budget is None:
        chosen = Fraction(share).limit_denominator(_SHARE_DENOMINATOR)
        blocks = blocks_at(chosen)
        plan = plan_from_blocks(layout, blocks)
        return DeviceSizing(blocks, plan, plan.total_bytes, chosen, longest)
    least = cost(Fraction(0))
    if budget < least:
        short = ", ".join(f"{name}: {alone[name]} blocks" for name in demand)
        raise ValueError(
            f"device memory {format_bytes(budget)} cannot hold even one request alone: the "
            f"longest request reaches {longest} tokens and needs {short}; raise "
            f"--device-memory to at least {format_bytes(least)} ({least} bytes)"
        )
    # cost only rises just past a share j / demand[g]: the largest share that fits is the
    # largest such fraction that fits (capped at 1: more blocks than that are never used)
    chosen = max(
        (
            Fraction(largest(lambda j, d=d: cost(Fraction(j, d)) <= budget, 0, d), d)
            for d in demand.values()
            if d > 0
        ),
        default=Fraction(0),
    )
    blocks = blocks_at(chosen)
    return DeviceSizing(blocks, plan_from_blocks(layout, blocks), budget, chosen, longest)


def size_host(
    layout: CacheLayout, max_len: int, requests: int, budget: int | None
) -> dict[str, int]:
    """Host pages per group: room for ``requests`` swapped requests, or what ``budget`` holds."""
    need = {g.name: g.max_live_blocks(max_len) for g in layout.groups}
    page = {g.name: layout.host_page_bytes(g.name) for g in layout.groups}
    per_request = sum(need[n] * page[n] for n in need)
    held = requests
    if budget is not None:
        null_pages = sum(page.values())
        held = (budget - null_pages) // per_request if per_request else requests
        if held < 1:
            raise ValueError(
                f"host memory {format_bytes(budget)} cannot hold one preempted request (the "
                f"longest needs {format_bytes(per_request)} of host pages plus "
                f"{format_bytes(null_pages)} of reserved pages); raise --host-memory to at "
                f"least {format_bytes(per_request + null_pages)}"
            )
    return {n: max(2, held * need[n] + 1) for n in need}
