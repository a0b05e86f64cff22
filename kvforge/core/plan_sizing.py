"""Sizing shared by every plan: the concurrency setting a plan assumes, the argument checks,
the sizing of a model without a known ``max_model_len``, and how the full groups take what is
left of a budget.

:class:`Setting` records which of ``max_num_seqs`` / ``max_num_batched_tokens`` a planner used
and which were defaulted (in the order it used them: the plan's ``defaulted`` tuple).
:class:`Sizing` is what a planner decided. The sizing for a known length lives in
:mod:`kvforge.core.plan_length`; :mod:`kvforge.core.memory_plan` turns a :class:`Sizing` into
a :class:`~kvforge.core.plan_values.MemoryPlan`. Invariants: every count includes the reserved
null block (so it is >= 2) and none exceeds ``MAX_BLOCKS_PER_GROUP``; a budget that cannot
hold one usable block per group is refused with the bytes it needs
(``tests/core/test_memory_plan.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvforge._checks import check_int
from kvforge.core.layout import CacheLayout
from kvforge.core.plan_values import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    MAX_BLOCKS_PER_GROUP,
)
from kvforge.core.search import largest
from kvforge.platform import MAX_ADDRESSABLE_BYTES
from kvforge.specs import CacheGroup

__all__ = [
    "Setting",
    "Sizing",
    "check_budget",
    "give_rest_to_full",
    "plan_without_length",
    "positive_int",
]


def positive_int(name: str, value: object) -> int:
    """``value`` as a positive int, or a ValueError naming ``name`` and the value."""
    message = "{name} must be a positive int, got {value}"
    return check_int(name, value, 1, type_message=message, range_message=message)


def check_budget(value: object) -> int:
    """A memory budget: a positive int of at most ``2**63 - 1`` bytes."""
    budget = positive_int("memory_budget", value)
    if budget > MAX_ADDRESSABLE_BYTES:
        raise ValueError(
            f"memory_budget={budget:,} bytes is more than any device can address "
            f"({MAX_ADDRESSABLE_BYTES:,} bytes, 2**63 - 1)"
        )
    return budget


def _blocks_for_tokens(group: CacheGroup, tokens: int) -> int:
    return group.blocks_for(tokens) + 1  # + the null block


def _balanced_blocks(
    groups: list[tuple[CacheGroup, int]], budget: int
) -> tuple[int, dict[str, int]] | None:
    """Largest ``T`` such that every group holding ``T`` tokens fits in ``budget`` bytes.

    Returns ``(T, blocks per group)`` or ``None`` when not even ``T = 1`` fits.
    """

    def fits(tokens: int) -> bool:
        counts = [_blocks_for_tokens(g, tokens) for g, _ in groups]
        within = max(counts) <= MAX_BLOCKS_PER_GROUP
        return within and sum(c * bpb for c, (_, bpb) in zip(counts, groups, strict=True)) <= budget

    if not fits(1):
        return None
    tokens = largest(fits, 1)
    return tokens, {g.name: _blocks_for_tokens(g, tokens) for g, _ in groups}


def _fill_full(
    full: list[tuple[CacheGroup, int]], floor: Mapping[str, int], rest: int
) -> dict[str, int]:
    """Blocks of the full groups: at least ``floor[g]`` each, then the largest token count
    ``T`` every full group holds with what is left of ``rest`` bytes."""

    def blocks(tokens: int) -> dict[str, int]:
        return {g.name: max(floor[g.name], _blocks_for_tokens(g, tokens)) for g, _ in full}

    def fits(tokens: int) -> bool:
        got = blocks(tokens)
        within = tokens == 0 or max(got.values()) <= MAX_BLOCKS_PER_GROUP
        return within and sum(got[g.name] * bpb for g, bpb in full) <= rest

    return blocks(largest(fits, 0))


def give_rest_to_full(
    sized: list[tuple[CacheGroup, int]], blocks: dict[str, int], budget: int, host: bool = False
) -> None:
    """Grow the full groups of ``blocks`` (each already at its floor) into what is left; a
    model without one (every layer slides: Mistral-7B) grows its window groups instead, in
    proportion to their floors: more windows at once, and room for cached tails."""
    full = [(g, bpb) for g, bpb in sized if g.rule.history]
    if full:
        others = sum(blocks[g.name] * bpb for g, bpb in sized if not g.rule.history)
        blocks.update(_fill_full(full, blocks, budget - others))
        return
    windows = [(g, bpb) for g, bpb in sized if g.windowed and not host]
    rest = budget - sum(blocks[g.name] * bpb for g, bpb in sized)
    held = sum(blocks[g.name] * bpb for g, bpb in windows)
    if not windows or rest <= 0 or not held:
        return
    for g, bpb in windows:
        extra = rest * blocks[g.name] * bpb // held // bpb
        blocks[g.name] = min(blocks[g.name] + extra, MAX_BLOCKS_PER_GROUP)


def _too_small(budget: int, what: str, groups: list[tuple[CacheGroup, int]]) -> ValueError:
    need = ", ".join(f"{g.name}: {bpb:,} B per block" for g, bpb in groups)
    least = sum(2 * bpb for _, bpb in groups)
    return ValueError(
        f"memory_budget={budget:,} bytes is too small for {what}: one usable block plus the "
        f"reserved null block of each group needs {least:,} bytes ({need})"
    )


class Setting:
    """The concurrency values a plan uses, and which of them were assumed."""

    def __init__(
        self,
        layout: CacheLayout,
        max_num_seqs: int | None,
        max_model_len: int | None,
        max_num_batched_tokens: int | None,
    ) -> None:
        self.defaulted: list[str] = []
        self._seqs = None if max_num_seqs is None else positive_int("max_num_seqs", max_num_seqs)
        self._batched = (
            None
            if max_num_batched_tokens is None
            else positive_int("max_num_batched_tokens", max_num_batched_tokens)
        )
        self.model_len = (
            None if max_model_len is None else positive_int("max_model_len", max_model_len)
        )
        if self.model_len is None and layout.max_model_len is not None:
            self.model_len = layout.max_model_len
            self.defaulted.append("max_model_len")
        self.used_seqs = self._seqs is not None
        self.used_batched = self._batched is not None

    def describe(self, name: str, value: int) -> str:
        """``name=value`` for a sentence, noting a value the plan assumed."""
        note = ""
        if name in self.defaulted:
            note = " (from the model)" if name == "max_model_len" else " (engine default)"
        return f"{name}={value:,}{note}"

    @property
    def seqs(self) -> int:
        """``max_num_seqs``, defaulted (and recorded as such) on first use."""
        self.used_seqs = True
        if self._seqs is None:
            self._seqs = DEFAULT_MAX_NUM_SEQS
            self.defaulted.append("max_num_seqs")
        return self._seqs

    @property
    def batched(self) -> int:
        """``max_num_batched_tokens``, defaulted (and recorded as such) on first use."""
        self.used_batched = True
        if self._batched is None:
            self._batched = DEFAULT_MAX_NUM_BATCHED_TOKENS
            self.defaulted.append("max_num_batched_tokens")
        return self._batched

    @property
    def planned_seqs(self) -> int | None:
        """``max_num_seqs`` as the plan used it (given or defaulted), or None if unused."""
        return self._seqs if self.used_seqs else None

    @property
    def planned_batched(self) -> int | None:
        """``max_num_batched_tokens`` as the plan used it, or None if unused."""
        return self._batched if self.used_batched else None


@dataclass
class Sizing:
    """What a planner decided: blocks per group (null included), the step allowance inside
    each window group's blocks, and sentences for the plan's warnings."""

    blocks: dict[str, int]
    steps: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def plan_without_length(
    sized: list[tuple[CacheGroup, int]], budget: int, setting: Setting, host: bool
) -> Sizing:
    windows = [g.name for g, _ in sized if g.windowed]
    if windows and not host:
        raise ValueError(
            f"max_model_len is needed to size the window groups {windows}: give max_model_len "
            "(the longest sequence the engine will run); the model does not say"
        )
    blocks: dict[str, int] = {}
    per_request = [(g, bpb) for g, bpb in sized if g.rule.per_request]
    for g, _ in per_request:
        blocks[g.name] = setting.seqs * g.slots_per_request + 1
    reserved = sum(blocks[g.name] * bpb for g, bpb in per_request)
    if reserved > budget:
        detail = ", ".join(f"{g.name}: {blocks[g.name] * bpb:,} B" for g, bpb in per_request)
        raise ValueError(
            f"memory_budget={budget:,} bytes is too small: per-request groups alone need "
            f"{reserved:,} bytes for max_num_seqs={setting.seqs} ({detail})"
        )
    shared = [(g, bpb) for g, bpb in sized if not g.rule.per_request]
    warnings = []
    if shared:
        balanced = _balanced_blocks(shared, budget - reserved)
        if balanced is None:
            what = "one block per group" if not per_request else "the groups after per-request"
            raise _too_small(budget - reserved, what, shared)
        blocks.update(balanced[1])
    if windows:
        warnings.append(
            f"max_model_len is unknown, so host pages of the window groups {windows} are sized "
            "like full history (the same token capacity), far more than swapped requests' "
            "windows need; give max_model_len to size them for whole sequences"
        )
    return Sizing(blocks, warnings=warnings)
