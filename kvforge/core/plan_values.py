"""What a memory plan is, and how it reads: the frozen values :class:`GroupPlan` and
:class:`MemoryPlan`, the limits every planner shares, and :meth:`MemoryPlan.describe`.

The planners (:mod:`kvforge.core.plan_sizing`, :mod:`kvforge.core.plan_length`) decide the
counts and :mod:`kvforge.core.memory_plan` builds these values from them; nothing here
computes a count. :meth:`MemoryPlan.describe` shows the plan's own figures in sentences and
recomputes nothing (``tests/core/test_memory_plan.py``, ``tests/cli/test_cli.py``). Sizes are
shown with integer arithmetic only, never through floats.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kvforge.core.arena import ArenaGeometry
from kvforge.kinds import rule_of
from kvforge.specs import GroupKind

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "MAX_BLOCKS_PER_GROUP",
    "GroupPlan",
    "MemoryPlan",
    "format_size",
]

DEFAULT_MAX_NUM_SEQS = 256
"""Engine default for concurrent sequences (vLLM's ``max_num_seqs``)."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""Engine default for tokens scheduled in one step (vLLM's ``max_num_batched_tokens``)."""
MAX_BLOCKS_PER_GROUP = (1 << 31) - 1
"""Block ids are int32 in block tables and slot mappings: no pool has more blocks."""


class GroupPlan(BaseModel):
    """One group's share of a plan (every figure an exact int)."""

    model_config = ConfigDict(frozen=True)

    group: str
    kind: GroupKind | str
    block_size: int
    num_blocks: int
    """Physical blocks, including the reserved null block."""
    bytes_per_block: int
    """Device block bytes with alignment padding (host plans: packed page bytes)."""
    total_bytes: int
    max_tokens: int
    """Tokens its usable blocks can hold (all sequences together, before windows)."""
    window: int | None = None
    slots_per_request: int | None = None
    """Blocks each request holds (per-request groups only)."""
    blocks_per_sequence: int | None = None
    """Blocks one sequence of ``max_model_len`` holds at rest (None without a length)."""
    step_blocks: int = 0
    """Blocks reserved, batch-wide, for the tokens scheduled in one step (window groups)."""
    max_sequences: int | None = None
    """Sequences of ``max_model_len`` tokens the group holds at once (None without a length)."""


class MemoryPlan(BaseModel):
    """A sizing of every group; the controller allocates exactly it.

    Print :meth:`describe` to show it; nothing is recomputed.
    """

    model_config = ConfigDict(frozen=True)

    groups: tuple[GroupPlan, ...]
    memory_budget: int | None
    total_bytes: int
    max_tokens: int | None
    """Token capacity of the full groups: the least any full group holds (None without one)."""
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    defaulted: tuple[str, ...] = ()
    """Which of ``max_num_seqs``, ``max_model_len`` (taken from the model) and
    ``max_num_batched_tokens`` the plan assumed because they were not given."""
    max_concurrency: int | None = None
    """Sequences of ``max_model_len`` tokens the plan holds at once: the least any group holds
    (full groups are not bounded by ``max_num_seqs``). None without a ``max_model_len``."""
    warnings: tuple[str, ...] = ()
    """Human sentences about what the plan cannot do (fewer sequences than asked, ...)."""
    host: bool = False
    """A plan of host pages (offloaded roles only, no padding) rather than device blocks."""
    arena: ArenaGeometry | None = None
    """Groups whose bytes flow through one slab arena (``kvforge.core.flow``), or None."""

    @property
    def num_blocks(self) -> dict[str, int]:
        return {g.group: g.num_blocks for g in self.groups}

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.group == name:
                return g
        raise ValueError(f"group {name!r} is not in the plan; groups are {self._names()}")

    def _names(self) -> list[str]:
        return [g.group for g in self.groups]

    def describe(self) -> list[str]:
        """The plan in human sentences, one per line."""
        lines = [*self._header(), *(self._group_line(g) for g in self.groups)]
        lines += self._totals()
        if self.arena is not None:
            lines += _arena_lines(self.arena)
        lines.extend(f"Warning: {w}" for w in self.warnings)
        return lines

    def _header(self) -> list[str]:
        """What the plan spends, and the concurrency values it was planned for."""
        where = "Host" if self.host else "Device"
        if self.memory_budget is None:
            lines = [f"{where} memory plan: {format_size(self.total_bytes)} from explicit counts"]
        else:
            lines = [
                f"{where} memory plan: {format_size(self.total_bytes)} of a "
                f"{format_size(self.memory_budget)} budget"
            ]
        assumed = []
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is None:
                continue
            note = ""
            if name in self.defaulted:
                note = " (from the model)" if name == "max_model_len" else " (engine default)"
            assumed.append(f"{name}={value:,}{note}")
        if assumed:
            lines.append("Planned for " + ", ".join(assumed))
        return lines

    def _group_line(self, g: GroupPlan) -> str:
        """One group's blocks, bytes and what they hold."""
        unit = "pages" if self.host else "blocks"
        shape = rule_of(g.kind).name
        if g.window is not None:
            shape += f", window {g.window:,}"
        if g.slots_per_request is not None:
            shape += f", {g.slots_per_request} slots per request"
        else:
            shape += f", {g.block_size}-token blocks"
        line = (
            f"  {g.group} ({shape}): {g.num_blocks:,} {unit} x {g.bytes_per_block:,} B = "
            f"{g.total_bytes:,} B"
        )
        parts = []
        if g.max_sequences is not None:
            parts.append(f"{g.max_sequences:,} sequences of max_model_len")
        if g.step_blocks:
            parts.append(f"{g.step_blocks:,} {unit} for one step's tokens")
        if rule_of(g.kind).history:
            parts.append(f"{g.max_tokens:,} tokens of history")
        if parts:
            line += "; " + ", ".join(parts)
        return line

    def _totals(self) -> list[str]:
        """Capacity, concurrency, and budget bytes no group takes."""
        lines = []
        if self.max_tokens is not None:
            lines.append(f"Full-history capacity: {self.max_tokens:,} tokens")
        if self.max_concurrency is not None and self.max_model_len is not None:
            lines.append(
                f"Holds {self.max_concurrency:,} sequences of {self.max_model_len:,} tokens at once"
            )
        spare = 0 if self.memory_budget is None else self.memory_budget - self.total_bytes
        least = min((g.bytes_per_block for g in self.groups), default=0)
        if spare >= least and not any(rule_of(g.kind).history for g in self.groups):
            lines.append(
                f"Leaves {spare:,} B of the budget unallocated: no full-history group needs them"
            )
        return lines


def _arena_lines(a: ArenaGeometry) -> list[str]:
    """The slab arena a plan's groups share, in sentences."""
    return [
        f"Groups {', '.join(a.groups)} share one arena of {a.num_slabs:,} slabs x "
        f"{a.slab_bytes:,} B: a slab moves to the group that needs it when none of "
        "its blocks is in use (cached ones move out of busy slabs under pressure)",
        f"  {a.groups[a.home]} keeps slab 0 past the null blocks and "
        f"{a.tail_blocks:,} blocks past the last slab for good",
        "  device padding per block: " + ", ".join(f"{g} {p:.2%}" for g, p in a.padding.items()),
    ]


def format_size(nbytes: int) -> str:
    """``nbytes`` as exact bytes and GiB to two decimals (integer arithmetic: display never
    goes through floats)."""
    hundredths = nbytes * 100 // (1 << 30)
    return f"{nbytes:,} B ({hundredths // 100}.{hundredths % 100:02d} GiB)"
