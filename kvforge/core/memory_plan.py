"""Memory planning: how many blocks each group gets from a byte budget.

All arithmetic is on integers. A pool of ``n`` blocks has ``n - 1`` usable blocks plus the
reserved null block, so every group gets at least 2 blocks.

What the scheduler side holds, and so what a device plan reserves (``B`` = block size,
``N`` = ``max_num_seqs``, ``L`` = ``max_model_len``, ``T`` = ``max_num_batched_tokens``):

- *window groups* (``sliding_window``, ``state``, ``chunked``): within a step a request holds a
  slot for every token scheduled in it (the kernel writes the whole prefill chunk, then reads
  it); blocks that leave the window go back at the request's next step. A request at rest holds
  at most ``max_live_blocks(L)`` blocks (the blocks a window of ``W`` tokens, or one chunk,
  straddles) and a step of ``k`` tokens at most ``cdiv(k, B)`` more. Summed over a batch of at
  most ``N`` requests and ``T`` tokens that is ``n * max_live_blocks(L)`` for ``n`` resident
  sequences plus ONE batch-wide step allowance of ``cdiv(T, B) + N`` blocks (never more than
  ``N * cdiv(L, B)``, what ``N`` whole sequences hold). A per-request allowance
  (``cdiv(W - 1 + T, B) + 1`` each, as vLLM reserves) would cost DeepSeek-V4-Flash 54 GB of
  sliding-window cache at 256 sequences;
- *per-request groups*: ``slots_per_request`` blocks for each of ``N`` running requests,
  however short;
- *full groups* share everything else, so that they run out at the same token count.

How many windows: ``n <= N``, as large as fits with the full groups holding ``n`` sequences
as long as the longest window (and at least one of ``L``). Past its window a sequence costs a
window group the same whatever its length, so this is the split where no group runs out first
at any length from the window up; balancing at ``L`` instead would cap every shorter workload
at the count that fits at ``L`` (15 sequences for DeepSeek-V4-Flash at its 1M-token context).
What the plan holds at ``L`` is :attr:`MemoryPlan.max_concurrency`; when it is less than ``N``
:attr:`MemoryPlan.warnings` says so. No group is silently starved: a budget that cannot hold
one sequence of ``L`` tokens is refused with the bytes it needs.

Host plans size pages for swapped-out requests at rest the same way, with no step allowance.

Without ``max_model_len`` (not given, and not known from the model), only a model whose groups
are all full or per-request can be planned on the device: its full groups share the budget
at one token count, as before. Window groups need ``max_model_len``, and a clear error says so.

Allocation limits: a plan is legal for any machine, but no plan may exceed ``2**63 - 1`` bytes
(64-bit offsets). :func:`check_allocatable` is what an allocator calls before it allocates on
*this* machine: it refuses a size larger than the device's total memory, naming both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from kvforge._checks import check_int
from kvforge.attn_backends.base import AttentionBackend
from kvforge.core.arena import ArenaGeometry
from kvforge.core.layout import CacheLayout
from kvforge.kinds import rule_of
from kvforge.platform import (
    MAX_ADDRESSABLE_BYTES,
    check_allocatable,
    device_memory_capacity,
)
from kvforge.specs import CacheGroup, GroupKind

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "MAX_ADDRESSABLE_BYTES",
    "MAX_BLOCKS_PER_GROUP",
    "GroupPlan",
    "MemoryPlan",
    "cache_bytes_per_sequence",
    "check_allocatable",
    "device_memory_capacity",
    "plan_from_blocks",
    "plan_memory",
    "shared_pool_blocks",
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
        where = "Host" if self.host else "Device"
        unit = "pages" if self.host else "blocks"
        lines = []
        if self.memory_budget is None:
            lines.append(f"{where} memory plan: {_size(self.total_bytes)} from explicit counts")
        else:
            lines.append(
                f"{where} memory plan: {_size(self.total_bytes)} of a "
                f"{_size(self.memory_budget)} budget"
            )
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
        for g in self.groups:
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
            lines.append(line)
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
        if self.arena is not None:
            a = self.arena
            lines.append(
                f"Groups {', '.join(a.groups)} share one arena of {a.num_slabs:,} slabs x "
                f"{a.slab_bytes:,} B: a slab moves to the group that needs it when none of "
                "its blocks is in use (cached ones move out of busy slabs under pressure)"
            )
            lines.append(
                f"  {a.groups[a.home]} keeps slab 0 past the null blocks and "
                f"{a.tail_blocks:,} blocks past the last slab for good"
            )
            lines.append(
                "  device padding per block: "
                + ", ".join(f"{g} {p:.2%}" for g, p in a.padding.items())
            )
        lines.extend(f"Warning: {w}" for w in self.warnings)
        return lines


def _size(nbytes: int) -> str:
    # integer arithmetic, two decimals: display never goes through floats
    hundredths = nbytes * 100 // (1 << 30)
    return f"{nbytes:,} B ({hundredths // 100}.{hundredths % 100:02d} GiB)"


# ====================================================================== argument checks


def _positive_int(name: str, value: object) -> int:
    message = "{name} must be a positive int, got {value}"
    return check_int(name, value, 1, type_message=message, range_message=message)


def _budget(value: object) -> int:
    budget = _positive_int("memory_budget", value)
    if budget > MAX_ADDRESSABLE_BYTES:
        raise ValueError(
            f"memory_budget={budget:,} bytes is more than any device can address "
            f"({MAX_ADDRESSABLE_BYTES:,} bytes, 2**63 - 1)"
        )
    return budget


# ====================================================================== planning


def _blocks_for_tokens(group: CacheGroup, tokens: int) -> int:
    return group.blocks_for(tokens) + 1  # + the null block


def _largest(fits: Callable[[int], bool], lo: int, hi: int | None = None) -> int:
    """Largest ``x >= lo`` with ``fits(x)``, given ``fits(lo)`` and ``fits`` monotone
    (``hi``: a known upper bound, inclusive)."""
    if hi is None:
        hi = max(1, lo * 2)
        while fits(hi):
            lo, hi = hi, hi * 2
        hi -= 1
    while lo < hi:  # fits(lo); the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


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
    tokens = _largest(fits, 1)
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

    return blocks(_largest(fits, 0))


def _give_rest_to_full(
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


class _Setting:
    """The concurrency values a plan uses, and which of them were assumed."""

    def __init__(
        self,
        layout: CacheLayout,
        max_num_seqs: int | None,
        max_model_len: int | None,
        max_num_batched_tokens: int | None,
    ) -> None:
        self.defaulted: list[str] = []
        self._seqs = None if max_num_seqs is None else _positive_int("max_num_seqs", max_num_seqs)
        self._batched = (
            None
            if max_num_batched_tokens is None
            else _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        )
        self.model_len = (
            None if max_model_len is None else _positive_int("max_model_len", max_model_len)
        )
        if self.model_len is None and layout.max_model_len is not None:
            self.model_len = layout.max_model_len
            self.defaulted.append("max_model_len")
        self.used_seqs = self._seqs is not None
        self.used_batched = self._batched is not None

    def describe(self, name: str, value: int) -> str:
        note = ""
        if name in self.defaulted:
            note = " (from the model)" if name == "max_model_len" else " (engine default)"
        return f"{name}={value:,}{note}"

    @property
    def seqs(self) -> int:
        self.used_seqs = True
        if self._seqs is None:
            self._seqs = DEFAULT_MAX_NUM_SEQS
            self.defaulted.append("max_num_seqs")
        return self._seqs

    @property
    def batched(self) -> int:
        self.used_batched = True
        if self._batched is None:
            self._batched = DEFAULT_MAX_NUM_BATCHED_TOKENS
            self.defaulted.append("max_num_batched_tokens")
        return self._batched


@dataclass
class _Sizing:
    """What a planner decided: blocks per group (null included), the step allowance inside
    each window group's blocks, and sentences for the plan's warnings."""

    blocks: dict[str, int]
    steps: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _step_blocks(group: CacheGroup, seqs: int, batched: int) -> int:
    """Batch-wide allowance: ``sum(cdiv(k_i, B)) <= cdiv(sum(k_i), B) + requests``."""
    return -(-batched // group.block_size) + seqs


def plan_memory(
    backends: Mapping[int, AttentionBackend] | CacheLayout,
    memory_budget: int,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    host: bool = False,
) -> MemoryPlan:
    """Size every group from ``memory_budget`` bytes without allocating anything.

    Args:
        backends: layer id -> backend, or a built :class:`CacheLayout`.
        memory_budget: bytes available for the caches (any machine's: nothing is allocated).
        max_num_seqs: sequences that run at once (default 256; the plan lists it in
            ``defaulted``).
        max_model_len: longest sequence in tokens (default: the layout's, when the model
            says; required on the device for models with window groups).
        max_num_batched_tokens: tokens scheduled in one step (default 8192); sizes the window
            groups' step allowance. Device plans only.
        host: plan host pages (offloaded roles only, packed) for requests swapped out at rest.

    Raises:
        ValueError: a non-positive or non-int argument; a budget beyond ``2**63 - 1``; window
            groups and no ``max_model_len``; a budget too small for the reservations that do
            not depend on sequence length, or for one sequence of ``max_model_len`` tokens
            (the message gives the bytes needed).
    """
    layout = backends if isinstance(backends, CacheLayout) else CacheLayout(backends)
    budget = _budget(memory_budget)
    if not isinstance(host, bool):
        raise ValueError(f"host must be a bool, got {host!r}")
    if host and max_num_batched_tokens is not None:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens!r} does not apply to a host plan: "
            "host pages hold requests at rest, never a step's tokens"
        )
    setting = _Setting(layout, max_num_seqs, max_model_len, max_num_batched_tokens)
    page_bytes = layout.host_page_bytes if host else layout.bytes_per_block
    sized = [(g, page_bytes(g.name)) for g in layout.groups]
    sized = [(g, bpb) for g, bpb in sized if bpb > 0]
    if setting.model_len is None:
        sizing = _plan_without_length(sized, budget, setting, host)
    else:
        sizing = _plan_with_length(sized, budget, setting, host)
    return _assemble(sized, sizing, budget, setting, host)


def _plan_without_length(
    sized: list[tuple[CacheGroup, int]], budget: int, setting: _Setting, host: bool
) -> _Sizing:
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
    return _Sizing(blocks, warnings=warnings)


def _per_sequence(g: CacheGroup, model_len: int) -> int:
    return g.max_live_blocks(model_len)


def _no_sequence(budget: int, model_len: int, need: int, what: str) -> ValueError:
    return ValueError(
        f"memory_budget={budget:,} bytes is too small for one sequence of "
        f"max_model_len={model_len:,} tokens: the {what} need {need:,} bytes; raise the "
        "budget or lower max_model_len"
    )


def _fill_length(sized: list[tuple[CacheGroup, int]], model_len: int) -> int:
    """Tokens at which every window group holds a whole window: the longest window (chunk),
    at most ``model_len``; ``model_len`` for a model without window groups."""
    windows = [g.window for g, _ in sized if g.window is not None]
    return min(model_len, max(windows)) if windows else model_len


def _plan_with_length(
    sized: list[tuple[CacheGroup, int]], budget: int, setting: _Setting, host: bool
) -> _Sizing:
    """Window groups for ``n`` sequences, full groups for ``n`` sequences as long as the
    longest window (and at least one of ``max_model_len``), ``n <= max_num_seqs`` as large as
    fits; then the full groups take the rest.

    Why balance at the window's length and not at ``max_model_len``: past its window a
    sequence costs a window group the same whatever its length, so windows sized for the
    sequences that fit at ``max_model_len`` would cap every shorter workload at that count
    (DeepSeek-V4-Flash at its 1M-token context: 15 sequences). Sized this way no group runs
    out first at any length from the window up; ``max_concurrency`` reports what the full
    groups hold at ``max_model_len``.
    """
    model_len = setting.model_len
    assert model_len is not None
    seqs = setting.seqs
    windowed = any(g.windowed for g, _ in sized)
    batched = setting.batched if windowed and not host else None
    fill = _fill_length(sized, model_len)

    def reserve(g: CacheGroup, n: int) -> int:
        """Blocks of ``g`` (null included) for ``n`` resident sequences."""
        if g.rule.per_request:
            return seqs * g.slots_per_request + 1
        whole = g.blocks_for(model_len)
        if g.rule.history:
            return max(n * g.blocks_for(fill), whole) + 1
        live = n * _per_sequence(g, model_len)
        if batched is None:  # host pages: requests at rest, no step in flight
            return live + 1
        live += _step_blocks(g, seqs, batched)
        return min(live, seqs * whole) + 1  # N whole sequences never hold more

    def cost(n: int) -> int:
        return sum(reserve(g, n) * bpb for g, bpb in sized)

    def fits(n: int) -> bool:
        return cost(n) <= budget and max(reserve(g, n) for g, _ in sized) <= MAX_BLOCKS_PER_GROUP

    # what does not depend on sequences: per-request slots, step allowances, null blocks
    fixed = {
        g.name: (reserve(g, 0) if not g.rule.history else 1) * bpb for g, bpb in sized
    }
    if sum(fixed.values()) > budget:
        detail = ", ".join(f"{name}: {b:,} B" for name, b in fixed.items())
        values = [setting.describe("max_num_seqs", seqs)]
        if batched is not None:
            values.append(setting.describe("max_num_batched_tokens", batched))
        raise ValueError(
            f"memory_budget={budget:,} bytes is too small for the reservations that do not "
            f"depend on sequence length: {sum(fixed.values()):,} bytes for {', '.join(values)} "
            f"({detail}); raise the budget or lower those values"
        )
    if cost(1) > budget:
        what = "host pages" if host else "groups' reservations"
        raise _no_sequence(budget, model_len, cost(1), what)
    if not fits(1):
        raise ValueError(
            f"max_model_len={model_len:,} tokens needs more than {MAX_BLOCKS_PER_GROUP:,} "
            "blocks in a group, the most int32 block ids can number"
        )
    n = _largest(fits, 1, seqs)
    blocks = {g.name: reserve(g, n) for g, _ in sized}
    steps = {  # what the window blocks hold beyond n resident windows
        g.name: blocks[g.name] - 1 - n * _per_sequence(g, model_len)
        for g, _ in sized
        if g.windowed and not host
    }
    _give_rest_to_full(sized, blocks, budget, host)
    return _Sizing(blocks, steps)


def _held(g: CacheGroup, usable: int, model_len: int, seqs: int | None, step: int) -> int:
    """Sequences of ``model_len`` tokens ``usable`` blocks of ``g`` hold at once (``step``:
    the blocks among them kept for one step's tokens)."""
    if g.rule.per_request:
        return usable // g.slots_per_request
    whole = usable // g.blocks_for(model_len)  # whole sequences fit, step or not
    if g.rule.history:
        return whole
    windows = (usable - step) // _per_sequence(g, model_len)
    return max(windows if seqs is None else min(seqs, windows), whole)


def _assemble(
    sized: list[tuple[CacheGroup, int]],
    sizing: _Sizing,
    budget: int | None,
    setting: _Setting | None,
    host: bool,
) -> MemoryPlan:
    model_len = setting.model_len if setting is not None else None
    seqs = setting._seqs if setting is not None and setting.used_seqs else None
    batched = setting._batched if setting is not None and setting.used_batched else None
    plans = []
    for g, bpb in sized:
        count = sizing.blocks[g.name]
        usable = count - 1
        step = sizing.steps.get(g.name, 0)
        per_seq = held = None
        if model_len is not None:
            per_seq = _per_sequence(g, model_len)
            held = _held(g, usable, model_len, None if host else seqs, step)
        plans.append(
            GroupPlan(
                group=g.name,
                kind=g.kind,
                block_size=g.block_size,
                num_blocks=count,
                bytes_per_block=bpb,
                total_bytes=count * bpb,
                max_tokens=usable * g.block_size,
                window=g.window,
                slots_per_request=(
                    g.slots_per_request if g.rule.per_request else None
                ),
                blocks_per_sequence=per_seq,
                step_blocks=step,
                max_sequences=held,
            )
        )
    full = [p.max_tokens for p in plans if rule_of(p.kind).history]
    helds = [p.max_sequences for p in plans if p.max_sequences is not None]
    concurrency = min(helds) if helds else None
    warnings = list(sizing.warnings)
    capped = [p.group for p in plans if p.num_blocks == MAX_BLOCKS_PER_GROUP]
    if capped and budget is not None:
        spare = budget - sum(p.total_bytes for p in plans)
        warnings.append(
            f"groups {capped} reached {MAX_BLOCKS_PER_GROUP:,} blocks, the most int32 block ids "
            f"can number; {spare:,} bytes of the budget stay unallocated"
        )
    if concurrency is not None and seqs is not None and not host and concurrency < seqs:
        assert setting is not None and model_len is not None
        warnings.append(_short_of_seqs(plans, concurrency, seqs, model_len, setting))
    return MemoryPlan(
        groups=tuple(plans),
        memory_budget=budget,
        total_bytes=sum(p.total_bytes for p in plans),
        max_tokens=min(full) if full else None,
        max_num_seqs=seqs,
        max_model_len=model_len,
        max_num_batched_tokens=batched,
        defaulted=tuple(setting.defaulted) if setting is not None else (),
        max_concurrency=concurrency,
        warnings=tuple(warnings),
        host=host,
    )


def _short_of_seqs(
    plans: list[GroupPlan], concurrency: int, seqs: int, model_len: int, setting: _Setting
) -> str:
    limiting = [p.group for p in plans if p.max_sequences == concurrency]
    one = sum((p.blocks_per_sequence or 0) * p.bytes_per_block for p in plans)
    return (
        f"the plan holds {concurrency:,} sequences of "
        f"{setting.describe('max_model_len', model_len)} tokens at once, fewer than "
        f"{setting.describe('max_num_seqs', seqs)}: groups "
        f"{limiting} limit it, and one such sequence needs {one:,} bytes of cache; raise the "
        "budget or lower max_num_seqs or max_model_len"
    )


def blocks_per_group(
    names: Sequence[str], num_blocks: int | Mapping[str, int], what: str = "num_blocks"
) -> dict[str, int]:
    """``num_blocks`` as group -> count: an int for every group, or a mapping that names every
    group exactly; each count an int in ``[2, MAX_BLOCKS_PER_GROUP]`` (one usable block plus
    the reserved null block; int32 ids).

    Raises:
        ValueError: an unknown or missing group, or a bad count (naming the group and value).
    """
    if isinstance(num_blocks, Mapping):
        unknown = sorted(set(num_blocks) - set(names), key=str)
        missing = [n for n in names if n not in num_blocks]
        if unknown or missing:
            raise ValueError(
                f"{what} must name every group exactly: unknown {unknown}, missing {missing} "
                f"(groups are {list(names)})"
            )
        blocks = {n: num_blocks[n] for n in names}
    else:
        blocks = dict.fromkeys(names, num_blocks)
    for name, count in blocks.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 2:
            raise ValueError(
                f"{what}[{name!r}] must be an int >= 2 (one usable block plus the reserved "
                f"null block), got {count!r}"
            )
        if count > MAX_BLOCKS_PER_GROUP:
            raise ValueError(
                f"{what}[{name!r}]={count:,} is more blocks than int32 block ids can number "
                f"(at most {MAX_BLOCKS_PER_GROUP:,})"
            )
    return blocks


def plan_from_blocks(
    layout: CacheLayout, blocks: Mapping[str, int], host: bool = False
) -> MemoryPlan:
    """The plan of explicit block counts (pages with ``host=True``, offloaded roles only).

    ``max_tokens`` is the smallest token capacity among full groups (None without any).

    Raises:
        ValueError: a group without a count, an unknown group, a count that is not an int
            >= 2, or counts whose bytes exceed ``2**63 - 1`` (no device can address them).
    """
    blocks = blocks_per_group([g.name for g in layout.groups], blocks)
    page_bytes = layout.host_page_bytes if host else layout.bytes_per_block
    sized = [(g, page_bytes(g.name)) for g in layout.groups]
    sized = [(g, bpb) for g, bpb in sized if bpb > 0]
    total = 0
    for g, bpb in sized:
        count = blocks[g.name]
        if not isinstance(count, int) or isinstance(count, bool) or count < 2:
            raise ValueError(
                f"num_blocks[{g.name!r}] must be an int >= 2 (one usable block plus the "
                f"reserved null block), got {count!r}"
            )
        if count > MAX_BLOCKS_PER_GROUP:
            raise ValueError(
                f"num_blocks[{g.name!r}]={count:,} is more blocks than int32 block ids can "
                f"number (at most {MAX_BLOCKS_PER_GROUP:,})"
            )
        total += count * bpb
        if total > MAX_ADDRESSABLE_BYTES:
            raise ValueError(
                f"num_blocks[{g.name!r}]={count:,} blocks of {bpb:,} B brings the plan to "
                f"{total:,} bytes, more than any device can address ({MAX_ADDRESSABLE_BYTES:,} "
                "bytes, 2**63 - 1)"
            )
    return _assemble(sized, _Sizing(dict(blocks)), None, None, host)


def shared_pool_blocks(layout: CacheLayout, num_blocks: Mapping[str, int]) -> dict[str, int]:
    """Per-group block counts turned into the counts of shared pools (``share_pools=True``).

    A plan sizes each group on its own, each with its own reserved null block. When the
    groups of a set of :attr:`CacheLayout.pool_sets` share one pool, the pool needs only ONE
    null block, so the ``k - 1`` null blocks the other members no longer need become usable
    blocks: the pool is ``sum(num_blocks[m])`` blocks, ``k - 1`` more usable blocks than the
    members' plans, and every member is given that count (one id space). Since the members'
    pages are the same bytes, the pool costs ``pool * bytes_per_block`` once: exactly the
    plan's bytes (as vLLM's one pool of ``budget // page`` blocks with one null block spends
    them). Groups alone in their set keep their count.

    Worked example, gpt-oss-20b: 12 sliding-window and 12 full layers whose pages are both
    ``12 layers * 2 roles * 16 tokens * 8 heads * 64 dims * 2 B = 393,216 B``::

        >>> from kvforge.models import from_hf_config
        >>> layout = CacheLayout(from_hf_config("gpt-oss-20b"))
        >>> layout.pool_sets
        (('swa', 'kv'),)
        >>> shared_pool_blocks(layout, {"swa": 301, "kv": 2_001})
        {'swa': 2302, 'kv': 2302}

    ``301 + 2001 = 2302`` blocks for the plan's ``(301 + 2001) * 393,216 B``: 2,301 usable,
    one more than the plan's 2,300 (the ``kv`` group's null block is not needed twice).

    Raises:
        ValueError: a group without a count, or a pool of more blocks than int32 block ids
            can number (``MAX_BLOCKS_PER_GROUP``).
    """
    blocks = {g.name: num_blocks[g.name] for g in layout.groups if g.name in num_blocks}
    missing = [g.name for g in layout.groups if g.name not in blocks]
    if missing:
        raise ValueError(f"num_blocks has no count for groups {missing}")
    for members in layout.pool_sets:
        if len(members) < 2:
            continue
        pool = sum(blocks[m] for m in members)  # one null block; the spare ones are usable
        if pool > MAX_BLOCKS_PER_GROUP:
            raise ValueError(
                f"the shared pool of groups {list(members)} would hold {pool:,} blocks, more "
                f"than int32 block ids can number (at most {MAX_BLOCKS_PER_GROUP:,})"
            )
        blocks.update(dict.fromkeys(members, pool))
    return blocks


def cache_bytes_per_sequence(
    backends: Mapping[int, AttentionBackend] | CacheLayout,
    num_tokens: int,
    include_state: bool = True,
) -> int:
    """Exact meaningful bytes one sequence of ``num_tokens`` tokens keeps live, without block
    rounding or padding.

    Token-indexed roles keep ``entries_for(len(live_token_range(num_tokens)))`` entries: all of
    them for full groups, the window's for sliding-window and state groups, the current chunk's
    for chunked groups. Per-request roles keep ``slots_per_request`` entries once the sequence
    holds a token. ``include_state=False`` leaves out state and per-request groups.
    """
    layout = backends if isinstance(backends, CacheLayout) else CacheLayout(backends)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    total = 0
    for e in layout.buffers:
        rule = e.group.rule
        if (rule.recomputed_for_prefix or rule.per_request) and not include_state:
            continue
        if rule.per_request:
            total += e.group.blocks_for(num_tokens) * e.role.entry_bytes
            continue
        live = e.group.live_token_range(num_tokens)
        total += e.role.entries_for(live.end - live.start) * e.role.entry_bytes
    return total
