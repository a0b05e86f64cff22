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

This module is the planner's public face: :func:`plan_memory`, :func:`plan_from_blocks`,
:func:`shared_pool_blocks`, :func:`blocks_per_group`, :func:`cache_bytes_per_sequence`, and
the assembly of a decided sizing into a :class:`MemoryPlan`. The pieces below it, one concern
each: :mod:`kvforge.core.plan_values` (the plan values and their sentences),
:mod:`kvforge.core.plan_sizing` (settings, argument checks, sizing without a length, the full
groups' share), :mod:`kvforge.core.plan_length` (the search for ``n`` sequences of a known
length) and :mod:`kvforge.core.search` (the integer search they share). Tests:
``tests/core/test_memory_plan.py``, ``tests/core/test_plan_figures.py``,
``tests/scheduler/test_shared_pools.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvforge.attn_backends.base import AttentionBackend
from kvforge.core.layout import CacheLayout
from kvforge.core.plan_length import per_sequence, plan_with_length, sequences_held
from kvforge.core.plan_sizing import Setting, Sizing, check_budget, plan_without_length
from kvforge.core.plan_values import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    MAX_BLOCKS_PER_GROUP,
    GroupPlan,
    MemoryPlan,
)
from kvforge.kinds import rule_of
from kvforge.platform import (
    MAX_ADDRESSABLE_BYTES,
    check_allocatable,
    device_memory_capacity,
)
from kvforge.specs import CacheGroup

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "MAX_ADDRESSABLE_BYTES",
    "MAX_BLOCKS_PER_GROUP",
    "GroupPlan",
    "MemoryPlan",
    "blocks_per_group",
    "cache_bytes_per_sequence",
    "check_allocatable",
    "device_memory_capacity",
    "plan_from_blocks",
    "plan_memory",
    "shared_pool_blocks",
]


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
    budget = check_budget(memory_budget)
    if not isinstance(host, bool):
        raise ValueError(f"host must be a bool, got {host!r}")
    if host and max_num_batched_tokens is not None:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens!r} does not apply to a host plan: "
            "host pages hold requests at rest, never a step's tokens"
        )
    setting = Setting(layout, max_num_seqs, max_model_len, max_num_batched_tokens)
    page_bytes = layout.host_page_bytes if host else layout.bytes_per_block
    sized = [(g, page_bytes(g.name)) for g in layout.groups]
    sized = [(g, bpb) for g, bpb in sized if bpb > 0]
    if setting.model_len is None:
        sizing = plan_without_length(sized, budget, setting, host)
    else:
        sizing = plan_with_length(sized, budget, setting, host)
    return _assemble(sized, sizing, budget, setting, host)


def _assemble(
    sized: list[tuple[CacheGroup, int]],
    sizing: Sizing,
    budget: int | None,
    setting: Setting | None,
    host: bool,
) -> MemoryPlan:
    """The plan of a decided sizing: every group's figures, the plan's totals, its warnings."""
    model_len = setting.model_len if setting is not None else None
    seqs = setting.planned_seqs if setting is not None else None
    batched = setting.planned_batched if setting is not None else None
    plans = [_group_plan(g, bpb, sizing, model_len, None if host else seqs) for g, bpb in sized]
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


def _group_plan(
    g: CacheGroup, bpb: int, sizing: Sizing, model_len: int | None, seqs: int | None
) -> GroupPlan:
    """One group's figures from its decided block count (``seqs``: None for host pages)."""
    count = sizing.blocks[g.name]
    usable = count - 1
    step = sizing.steps.get(g.name, 0)
    per_seq = held = None
    if model_len is not None:
        per_seq = per_sequence(g, model_len)
        held = sequences_held(g, usable, model_len, seqs, step)
    return GroupPlan(
        group=g.name,
        kind=g.kind,
        block_size=g.block_size,
        num_blocks=count,
        bytes_per_block=bpb,
        total_bytes=count * bpb,
        max_tokens=usable * g.block_size,
        window=g.window,
        slots_per_request=(g.slots_per_request if g.rule.per_request else None),
        blocks_per_sequence=per_seq,
        step_blocks=step,
        max_sequences=held,
    )


def _short_of_seqs(
    plans: list[GroupPlan], concurrency: int, seqs: int, model_len: int, setting: Setting
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
    return _assemble(sized, Sizing(dict(blocks)), None, None, host)


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
