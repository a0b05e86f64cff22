"""Memory planning: how many blocks each group gets from a byte budget.

All arithmetic is on integers. A pool of ``n`` blocks has ``n - 1`` usable blocks plus the
reserved null block, so every plan gives each group at least 2 blocks.

Two policies:

- budget only: every group gets enough blocks for the same number of tokens ``T`` (its
  share is proportional to its bytes per token), with the largest ``T`` that fits;
- budget with ``max_num_seqs`` and ``max_model_len``: window and state groups get what
  ``max_num_seqs`` sequences hold live at once (a window's worth each), and full groups share
  the rest so that they run out at the same token count.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from kvforge.attn_backends.base import AttentionBackend
from kvforge.cache_controller.layout import CacheLayout
from kvforge.specs import CacheGroup, GroupKind

__all__ = [
    "GroupPlan",
    "MemoryPlan",
    "cache_bytes_per_sequence",
    "plan_from_blocks",
    "plan_memory",
]


class GroupPlan(BaseModel):
    """One group's share of a plan."""

    model_config = ConfigDict(frozen=True)

    group: str
    kind: GroupKind
    block_size: int
    num_blocks: int
    """Physical blocks, including the reserved null block."""
    bytes_per_block: int
    total_bytes: int
    max_tokens: int
    """Tokens its usable blocks can hold (all sequences together, before windows)."""


class MemoryPlan(BaseModel):
    """A sizing of every group; ``CacheController.initialize_kv_cache`` allocates exactly it."""

    model_config = ConfigDict(frozen=True)

    groups: tuple[GroupPlan, ...]
    memory_budget: int | None
    total_bytes: int
    max_tokens: int | None
    """Token capacity of the full groups (None when the model has none)."""
    max_num_seqs: int | None = None
    max_model_len: int | None = None

    @property
    def num_blocks(self) -> dict[str, int]:
        return {g.group: g.num_blocks for g in self.groups}


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _blocks_for_tokens(group: CacheGroup, tokens: int) -> int:
    return group.blocks_for(tokens) + 1  # + the null block


def _balanced_blocks(
    groups: list[tuple[CacheGroup, int]], budget: int
) -> tuple[int, dict[str, int]] | None:
    """Largest ``T`` such that every group holding ``T`` tokens fits in ``budget`` bytes.

    Returns ``(T, blocks per group)`` or ``None`` when not even ``T = 1`` fits.
    """

    def cost(tokens: int) -> int:
        return sum(_blocks_for_tokens(g, tokens) * bpb for g, bpb in groups)

    if cost(1) > budget:
        return None
    lo, hi = 1, 2
    while cost(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # cost(lo) fits, cost(hi) does not
        mid = (lo + hi) // 2
        if cost(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo, {g.name: _blocks_for_tokens(g, lo) for g, _ in groups}


def _too_small(budget: int, what: str, groups: list[tuple[CacheGroup, int]]) -> ValueError:
    need = ", ".join(f"{g.name}: {bpb:,} B per block" for g, bpb in groups)
    least = sum(2 * bpb for _, bpb in groups)
    return ValueError(
        f"memory_budget={budget:,} bytes is too small for {what}: one usable block plus the "
        f"reserved null block of each group needs {least:,} bytes ({need})"
    )


def plan_memory(
    backends: Mapping[int, AttentionBackend] | CacheLayout,
    memory_budget: int,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    host: bool = False,
) -> MemoryPlan:
    """Size every group from ``memory_budget`` bytes without allocating anything.

    Args:
        backends: layer id -> backend, or a built :class:`CacheLayout`.
        memory_budget: bytes available for the caches.
        max_num_seqs: sequences that run at once (with ``max_model_len``: reserve window and
            state groups for them).
        max_model_len: longest sequence in tokens.
        host: plan host pages (offloaded roles only) instead of device blocks.

    Raises:
        ValueError: a non-positive argument, only one of ``max_num_seqs`` / ``max_model_len``,
            or a budget too small for one block per group (the message says how much one block
            of each group needs).
    """
    layout = backends if isinstance(backends, CacheLayout) else CacheLayout(backends)
    budget = _positive_int("memory_budget", memory_budget)
    if (max_num_seqs is None) != (max_model_len is None):
        raise ValueError(
            "max_num_seqs and max_model_len go together; got "
            f"max_num_seqs={max_num_seqs!r}, max_model_len={max_model_len!r}"
        )
    page_bytes = layout.host_page_bytes if host else layout.bytes_per_block
    sized = [(g, page_bytes(g.name)) for g in layout.groups]
    sized = [(g, bpb) for g, bpb in sized if bpb > 0]

    blocks: dict[str, int] = {}
    if max_num_seqs is None:
        balanced = _balanced_blocks(sized, budget)
        if balanced is None:
            raise _too_small(budget, "one block per group", sized)
        full_tokens: int | None = balanced[0]
        blocks.update(balanced[1])
    else:
        seqs = _positive_int("max_num_seqs", max_num_seqs)
        model_len = _positive_int("max_model_len", max_model_len)
        windowed = [(g, bpb) for g, bpb in sized if g.windowed]
        full = [(g, bpb) for g, bpb in sized if not g.windowed]
        for g, _ in windowed:
            blocks[g.name] = seqs * g.max_live_blocks(model_len) + 1
        reserved = sum(blocks[g.name] * bpb for g, bpb in windowed)
        if reserved > budget:
            detail = ", ".join(f"{g.name}: {blocks[g.name] * bpb:,} B" for g, bpb in windowed)
            raise ValueError(
                f"memory_budget={budget:,} bytes is too small: window and state groups alone "
                f"need {reserved:,} bytes for max_num_seqs={seqs} ({detail})"
            )
        full_tokens = None
        if full:
            balanced = _balanced_blocks(full, budget - reserved)
            if balanced is None:
                raise _too_small(budget - reserved, "the full groups after windows", full)
            full_tokens = balanced[0]
            blocks.update(balanced[1])
    if max_num_seqs is None and not any(not g.windowed for g, _ in sized):
        full_tokens = None

    return _assemble(sized, blocks, budget, full_tokens, max_num_seqs, max_model_len)


def _assemble(
    sized: list[tuple[CacheGroup, int]],
    blocks: Mapping[str, int],
    budget: int | None,
    full_tokens: int | None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
) -> MemoryPlan:
    plans = tuple(
        GroupPlan(
            group=g.name,
            kind=g.kind,
            block_size=g.block_size,
            num_blocks=blocks[g.name],
            bytes_per_block=bpb,
            total_bytes=blocks[g.name] * bpb,
            max_tokens=(blocks[g.name] - 1) * g.block_size,
        )
        for g, bpb in sized
    )
    return MemoryPlan(
        groups=plans,
        memory_budget=budget,
        total_bytes=sum(p.total_bytes for p in plans),
        max_tokens=full_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )


def plan_from_blocks(
    layout: CacheLayout, blocks: Mapping[str, int], host: bool = False
) -> MemoryPlan:
    """The plan of explicit block counts (pages with ``host=True``, offloaded roles only).

    ``max_tokens`` is the smallest token capacity among full groups (None without any).
    """
    page_bytes = layout.host_page_bytes if host else layout.bytes_per_block
    sized = [(g, page_bytes(g.name)) for g in layout.groups]
    sized = [(g, bpb) for g, bpb in sized if bpb > 0]
    full = [(blocks[g.name] - 1) * g.block_size for g, _ in sized if not g.windowed]
    return _assemble(sized, blocks, None, min(full) if full else None)


def cache_bytes_per_sequence(
    backends: Mapping[int, AttentionBackend] | CacheLayout,
    num_tokens: int,
    include_state: bool = True,
) -> int:
    """Exact bytes one sequence of ``num_tokens`` tokens keeps live, without block rounding.

    Full roles keep ``num_tokens // r`` entries (``r`` = compress ratio); window and state
    roles keep ``min(num_tokens, window) // r`` entries. ``include_state=False`` leaves out
    state groups.
    """
    layout = backends if isinstance(backends, CacheLayout) else CacheLayout(backends)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    total = 0
    for e in layout.entries:
        if e.group.kind is GroupKind.STATE and not include_state:
            continue
        live = e.group.live_token_range(num_tokens)
        total += e.role.entries_for(live.end - live.start) * e.role.entry_bytes
    return total
