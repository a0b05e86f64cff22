"""The length search: sizing every group for ``n`` sequences of a known ``max_model_len``,
with ``n <= max_num_seqs`` as large as the budget holds.

Window groups get ``n`` windows plus ONE batch-wide step allowance, per-request groups their
slots for ``max_num_seqs`` requests, full groups ``n`` sequences as long as the longest window
(and at least one of ``max_model_len``); then the full groups take the rest
(:func:`~kvforge.core.plan_sizing.give_rest_to_full`). Why the window's length and not
``max_model_len``, and what each kind reserves, is in the docstring of
:mod:`kvforge.core.memory_plan`. :func:`sequences_held` is the inverse question a built plan
answers: how many such sequences a group's blocks hold. Refusals name the bytes a budget
lacks (``tests/core/test_memory_plan.py``, ``tests/core/test_plan_figures.py``).
"""

from __future__ import annotations

from kvforge.core.plan_sizing import Setting, Sizing, give_rest_to_full
from kvforge.core.plan_values import MAX_BLOCKS_PER_GROUP
from kvforge.core.search import largest
from kvforge.specs import CacheGroup

__all__ = ["per_sequence", "plan_with_length", "sequences_held"]


def per_sequence(g: CacheGroup, model_len: int) -> int:
    """Blocks of ``g`` one sequence of ``model_len`` tokens holds at rest."""
    return g.max_live_blocks(model_len)


def _step_blocks(group: CacheGroup, seqs: int, batched: int) -> int:
    """Batch-wide allowance: ``sum(cdiv(k_i, B)) <= cdiv(sum(k_i), B) + requests``."""
    return -(-batched // group.block_size) + seqs


def _fill_length(sized: list[tuple[CacheGroup, int]], model_len: int) -> int:
    """Tokens at which every window group holds a whole window: the longest window (chunk),
    at most ``model_len``; ``model_len`` for a model without window groups."""
    windows = [g.window for g, _ in sized if g.window is not None]
    return min(model_len, max(windows)) if windows else model_len


class _Reservation:
    """What each group reserves for ``n`` resident sequences under one setting."""

    def __init__(
        self, sized: list[tuple[CacheGroup, int]], budget: int, setting: Setting, host: bool
    ) -> None:
        model_len = setting.model_len
        assert model_len is not None
        self.sized = sized
        self.budget = budget
        self.model_len = model_len
        self.seqs = setting.seqs  # read before batched: the order of the plan's ``defaulted``
        windowed = any(g.windowed for g, _ in sized)
        self.batched = setting.batched if windowed and not host else None
        self.fill = _fill_length(sized, model_len)

    def blocks(self, g: CacheGroup, n: int) -> int:
        """Blocks of ``g`` (null included) for ``n`` resident sequences."""
        if g.rule.per_request:
            return self.seqs * g.slots_per_request + 1
        whole = g.blocks_for(self.model_len)
        if g.rule.history:
            return max(n * g.blocks_for(self.fill), whole) + 1
        live = n * per_sequence(g, self.model_len)
        if self.batched is None:  # host pages: requests at rest, no step in flight
            return live + 1
        live += _step_blocks(g, self.seqs, self.batched)
        return min(live, self.seqs * whole) + 1  # N whole sequences never hold more

    def cost(self, n: int) -> int:
        return sum(self.blocks(g, n) * bpb for g, bpb in self.sized)

    def fits(self, n: int) -> bool:
        within = max(self.blocks(g, n) for g, _ in self.sized) <= MAX_BLOCKS_PER_GROUP
        return self.cost(n) <= self.budget and within

    def fixed(self) -> dict[str, int]:
        """Bytes that do not depend on sequences: per-request slots, step allowances, nulls."""
        return {
            g.name: (self.blocks(g, 0) if not g.rule.history else 1) * bpb for g, bpb in self.sized
        }


def plan_with_length(
    sized: list[tuple[CacheGroup, int]], budget: int, setting: Setting, host: bool
) -> Sizing:
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
    r = _Reservation(sized, budget, setting, host)
    _check_one_sequence_fits(r, setting, host)
    n = largest(r.fits, 1, r.seqs)
    blocks = {g.name: r.blocks(g, n) for g, _ in sized}
    steps = {  # what the window blocks hold beyond n resident windows
        g.name: blocks[g.name] - 1 - n * per_sequence(g, r.model_len)
        for g, _ in sized
        if g.windowed and not host
    }
    give_rest_to_full(sized, blocks, budget, host)
    return Sizing(blocks, steps)


def _check_one_sequence_fits(r: _Reservation, setting: Setting, host: bool) -> None:
    """Refuse a budget short of the fixed reservations or of one sequence, and a length
    past int32 block ids, each with the numbers."""
    fixed = r.fixed()
    if sum(fixed.values()) > r.budget:
        detail = ", ".join(f"{name}: {b:,} B" for name, b in fixed.items())
        values = [setting.describe("max_num_seqs", r.seqs)]
        if r.batched is not None:
            values.append(setting.describe("max_num_batched_tokens", r.batched))
        raise ValueError(
            f"memory_budget={r.budget:,} bytes is too small for the reservations that do not "
            f"depend on sequence length: {sum(fixed.values()):,} bytes for {', '.join(values)} "
            f"({detail}); raise the budget or lower those values"
        )
    if r.cost(1) > r.budget:
        what = "host pages" if host else "groups' reservations"
        raise _no_sequence(r.budget, r.model_len, r.cost(1), what)
    if not r.fits(1):
        raise ValueError(
            f"max_model_len={r.model_len:,} tokens needs more than {MAX_BLOCKS_PER_GROUP:,} "
            "blocks in a group, the most int32 block ids can number"
        )


def _no_sequence(budget: int, model_len: int, need: int, what: str) -> ValueError:
    return ValueError(
        f"memory_budget={budget:,} bytes is too small for one sequence of "
        f"max_model_len={model_len:,} tokens: the {what} need {need:,} bytes; raise the "
        "budget or lower max_model_len"
    )


def sequences_held(g: CacheGroup, usable: int, model_len: int, seqs: int | None, step: int) -> int:
    """Sequences of ``model_len`` tokens ``usable`` blocks of ``g`` hold at once (``step``:
    the blocks among them kept for one step's tokens)."""
    if g.rule.per_request:
        return usable // g.slots_per_request
    whole = usable // g.blocks_for(model_len)  # whole sequences fit, step or not
    if g.rule.history:
        return whole
    windows = (usable - step) // per_sequence(g, model_len)
    return max(windows if seqs is None else min(seqs, windows), whole)
