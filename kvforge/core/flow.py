"""Memory that flows: a per-group plan turned into one whose window, state and full groups
draw on one slab arena (:mod:`kvforge.core.arena`) where their pages differ.

:func:`plan_with_arena` keeps every group outside the arena as planned and pools the bytes the
plan gave the arena's groups (the budget less everything else) into slabs. Each arena group's
figures then describe what it *could* hold with every slab: its id space, its padded stride,
the arena's bytes.
"""

from __future__ import annotations

from kvforge.core.arena import ArenaGeometry, arena_groups, plan_arena
from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import GroupPlan, MemoryPlan
from kvforge.core.search import largest
from kvforge.kinds import rule_of

__all__ = ["plan_with_arena"]


def plan_with_arena(plan: MemoryPlan, layout: CacheLayout) -> MemoryPlan:
    """``plan`` with its arena groups in one arena; ``plan`` itself when no arena applies
    (fewer than two groups whose pages differ, a host plan, or a budget of too few slabs).

    >>> from kvforge.core.memory_plan import plan_memory
    >>> from kvforge.models import from_hf_config
    >>> layout = CacheLayout(from_hf_config("deepseek-v4-tiny"))
    >>> flowing = plan_with_arena(plan_memory(layout, 1 << 30, 64, 65_536), layout)
    >>> flowing.arena.groups
    ('swa', 'compressed', 'c4_state', 'c128_state')
    >>> flowing.total_bytes <= 1 << 30
    True
    """
    if plan.host or plan.memory_budget is None or plan.arena is not None:
        return plan
    names = arena_groups(layout)
    if not names:
        return plan
    others = sum(p.total_bytes for p in plan.groups if p.group not in names)
    geometry = plan_arena(layout, plan.memory_budget - others, names)
    if geometry is None:
        return plan
    usable = geometry.num_slabs - 1  # slabs that move (slab 0 is the home group's for good)
    need = {}  # slabs' worth of blocks one sequence of max_model_len holds, per group
    groups = []
    for p in plan.groups:
        if p.group in names:
            need[p.group] = _need(p, geometry)
            p = _in_arena(p, geometry, usable)
        groups.append(p)
    concurrency = plan.max_concurrency
    if plan.max_model_len is not None and all(b is not None for b, _, _ in need.values()):
        limit = plan.max_num_seqs or 1 << 20
        held = _sequences(need, usable, limit)
        others_held = [p.max_sequences for p in groups if p.group not in names and p.max_sequences]
        concurrency = min([held, *others_held])
    full = [p.max_tokens for p in groups if rule_of(p.kind).history]
    return plan.model_copy(
        update={
            "groups": tuple(groups),
            "arena": geometry,
            "total_bytes": others + geometry.total_bytes,
            "max_tokens": min(full) if full else None,
            "max_concurrency": concurrency,
            "warnings": tuple(w for w in plan.warnings if "sequences of" not in w),
        }
    )


def _need(p: GroupPlan, geometry: ArenaGeometry) -> tuple[int | None, int, int]:
    """An arena group's (blocks per sequence, step blocks less its pinned ones, blocks per
    slab): what :func:`_sequences` counts in slabs."""
    k = geometry.blocks_per_slab[geometry.index(p.group)]
    return p.blocks_per_sequence, p.step_blocks - geometry.pinned_blocks(p.group), k


def _in_arena(p: GroupPlan, geometry: ArenaGeometry, usable: int) -> GroupPlan:
    """An arena group's figures with every slab: its id space, padded stride, the arena's
    bytes."""
    i = geometry.index(p.group)
    k = geometry.blocks_per_slab[i]
    pinned = geometry.pinned_blocks(p.group)
    return p.model_copy(
        update={
            "num_blocks": geometry.num_blocks(p.group),
            "bytes_per_block": geometry.block_stride[i],
            "total_bytes": geometry.total_bytes,
            "max_tokens": (usable * k + pinned) * p.block_size,
            "step_blocks": 0,
            "max_sequences": None,
        }
    )


def _sequences(need: dict[str, tuple[int | None, int, int]], slabs: int, limit: int) -> int:
    """The most sequences (at most ``limit``) whose blocks, plus one step's, fit the slabs."""

    def fits(n: int) -> bool:
        total = 0
        for per_seq, step, k in need.values():  # step: less what the group holds for good
            total += max(0, -(-(n * (per_seq or 0) + step) // k))
        return total <= slabs

    return largest(fits, 0, limit) if fits(0) else 0
