"""Group kinds: one rule object per kind, the only place in the engine-free core that switches
on a group's kind.

A group's kind says which of its blocks a request still needs (the live range), how many it
can hold at most, how much a step may add before the next step releases, and where the tail
that a prefix hit must share starts. :class:`KindRule` answers each of these for one kind;
every other module asks ``group.rule`` and never compares kinds. What a kind is in an engine's
own vocabulary (which vLLM ``KVCacheSpec`` a group becomes) is engine-specific and cannot live
here, where nothing imports an engine: each adapter keeps one table of its kinds, keyed by the
rule's name and mapped once (:mod:`kvforge.integrations.vllm.spec_kinds`), and compares no kind
either.

Why this sits beside ``specs.py`` and not in ``core/``: :class:`~kvforge.specs.CacheGroup`
validates its fields by its kind's rule (``window`` required or refused, slots per request),
so the rules are part of the contract. They import nothing of kvforge.

Adding a kind is one rule object: subclass :class:`KindRule`, set its class attributes,
implement :meth:`KindRule.window_start` (and :meth:`KindRule.max_live_blocks` when the bound
differs), and call :func:`register_kind`. ``tests/core/test_kinds.py`` adds a test-only kind
that keeps whole blocks and runs it through the scheduler, the worker and a swap round trip.

Worked example, a sliding window of ``W = 128`` tokens over ``B = 64``-token blocks::

    a request at rest after 300 tokens reads tokens [172, 300): blocks 2..4 (3 blocks)
    its next step's first token (token 300) reads back to token 300 + 1 - 128 = 173
    live_start(300, 301) = 173 -> block 173 // 64 = 2 is the first block still held

>>> swa = rule_of("sliding_window")
>>> from types import SimpleNamespace
>>> g = SimpleNamespace(block_size=64, window=128, slots_per_request=1)
>>> swa.live_start(g, 300), swa.live_start(g, 300, 301), swa.held_blocks(g, 300, 300)
(172, 173, 3)
>>> swa.max_live_blocks(g, 4096)     # W tokens starting mid-block: (128 + 62) // 64 + 1
3
"""

from __future__ import annotations

import math
import threading
from enum import Enum
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

__all__ = [
    "ChunkedRule",
    "FullRule",
    "GroupFamily",
    "GroupShape",
    "KindRule",
    "PerRequestRule",
    "SlidingWindowRule",
    "StateRule",
    "held_blocks",
    "live_start",
    "register_kind",
    "registered_kinds",
    "rule_of",
    "unregister_kind",
]

_N = TypeVar("_N", int, np.ndarray)


class GroupFamily(str, Enum):
    """How a group serves prefix reuse (see the design's *family*)."""

    HISTORY = "history"
    """The whole chain of blocks up to a boundary (``full``)."""
    WINDOW = "window"
    """Only the blocks covering the trailing window at a boundary (``sliding_window``,
    ``state``, ``chunked``)."""
    SNAPSHOT = "snapshot"
    """A copy of the per-request state taken at exactly the boundary (``per_request``)."""


class GroupShape(Protocol):
    """What a rule reads of a group (a :class:`~kvforge.specs.CacheGroup`)."""

    block_size: int
    window: int | None
    slots_per_request: int


def _cdiv(a: Any, b: int) -> Any:
    return -(-a // b)


class KindRule:
    """The rules of one group kind.

    Class attributes:
        name: the kind's name, as ``CacheGroup(kind=...)`` takes it.
        family: how the kind serves prefix reuse.
        needs_window: ``window`` is required (True) or refused (False).
        per_request: blocks are a fixed number of state slots per request, not token
            positions (``block_size`` must be 1).
    """

    name: ClassVar[str]
    family: ClassVar[GroupFamily]
    needs_window: ClassVar[bool] = False
    per_request: ClassVar[bool] = False
    recomputed_for_prefix: ClassVar[bool] = False
    """Swaps for purpose ``prefix`` skip the kind's roles: they are recomputed (``state``)."""

    # ------------------------------------------------------------ the one kind-specific rule

    def window_start(self, group: GroupShape, first_read: _N) -> _N:
        """First token that a token at position ``first_read`` reads (ints or int64 arrays).

        The only rule a token-indexed kind must give: every live range below follows."""
        raise NotImplementedError

    # ------------------------------------------------------------ derived, overridable

    @property
    def history(self) -> bool:
        """Whether the kind keeps every block (the history family)."""
        return self.family is GroupFamily.HISTORY

    @property
    def windowed(self) -> bool:
        """Whether blocks behind the window are released as a request grows."""
        return self.family is GroupFamily.WINDOW

    def live_start(
        self, group: GroupShape, num_computed: int, num_tokens: int | None = None
    ) -> int:
        """First token a step's kernels may still read, for a request that held
        ``num_computed`` tokens before the step (``num_tokens`` after it; a request at rest,
        ``num_tokens in (None, num_computed)``, reads its newest token's view).

        A request holds block ``i`` of a token-indexed group exactly when
        ``live_start(...) // block_size <= i < cdiv(num_tokens, block_size)``.
        """
        if num_tokens is None or num_tokens == num_computed:
            first_read = max(0, num_computed - 1)
        else:
            first_read = num_computed  # the first scheduled token's view
        return int(self.window_start(group, first_read))

    def live_starts(self, group: GroupShape, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        """:meth:`live_start` for a batch (``int64`` arrays of tokens before and after a step)."""
        first_read = np.where(after > before, before, np.maximum(before - 1, 0))
        return self.window_start(group, first_read)

    def tail_start(self, group: GroupShape, length: int) -> int:
        """First token the step after a prefix of ``length`` tokens reads: where the blocks a
        prefix hit must share start (0 for history)."""
        return int(self.window_start(group, length))

    def live_token_range(self, group: GroupShape, num_tokens: int) -> tuple[int, int]:
        """``(start, end)``: the tokens of a sequence at rest that can still be read."""
        if self.per_request or not num_tokens:
            return 0, num_tokens
        return int(self.window_start(group, num_tokens - 1)), num_tokens

    def blocks_for(self, group: GroupShape, num_tokens: int) -> int:
        """Block-table length of a sequence of ``num_tokens`` tokens."""
        if self.per_request:
            return group.slots_per_request if num_tokens else 0
        return _cdiv(num_tokens, group.block_size)

    def held_blocks(self, group: GroupShape, num_computed: int, num_tokens: int) -> int:
        """Blocks a request holds once a step took it from ``num_computed`` to ``num_tokens``
        tokens (``num_computed == num_tokens``: between steps)."""
        if self.per_request:
            return group.slots_per_request
        start = self.live_start(group, num_computed, num_tokens)
        return _cdiv(num_tokens, group.block_size) - start // group.block_size

    def max_live_blocks(self, group: GroupShape, max_model_len: int) -> int:
        """The most blocks one sequence of at most ``max_model_len`` tokens holds at rest."""
        return self.blocks_for(group, max_model_len)

    def step_allowance(self, group: GroupShape, max_num_seqs: int, batched_tokens: int) -> int:
        """Blocks a batch-wide step may hold beyond every request's resting live blocks,
        until the next step releases them: ``sum(cdiv(k_i, B)) <= cdiv(sum(k_i), B) +
        requests`` for a windowed kind; nothing for kinds that never release."""
        if not self.windowed:
            return 0
        return _cdiv(batched_tokens, group.block_size) + max_num_seqs

    def table_width(self, group: GroupShape, max_model_len: int) -> int:
        """Columns of the group's block table for requests of up to ``max_model_len``."""
        if self.per_request:
            return group.slots_per_request
        return self.blocks_for(group, max_model_len)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FullRule(KindRule):
    """All history is kept: block ``i`` stays until the request ends."""

    name = "full"
    family = GroupFamily.HISTORY

    def window_start(self, group: GroupShape, first_read: _N) -> _N:
        return first_read * 0


class SlidingWindowRule(KindRule):
    """Only the last ``window`` tokens are live (``state`` uses the same rule: compressor
    state keeps its newest ``window`` positions)."""

    needs_window = True
    family = GroupFamily.WINDOW

    def __init__(self, name: str = "sliding_window") -> None:
        self.name = name  # type: ignore[misc]

    def window_start(self, group: GroupShape, first_read: _N) -> _N:
        start = first_read + 1 - int(group.window or 0)
        if type(start) is int:  # one token (the per-request path): no numpy call
            return start if start > 0 else 0
        return np.maximum(0, start)

    def max_live_blocks(self, group: GroupShape, max_model_len: int) -> int:
        # W tokens that start mid-block straddle (W + B - 2) // B + 1 blocks
        window, block = int(group.window or 0), group.block_size
        return min(self.blocks_for(group, max_model_len), (window + block - 2) // block + 1)


class StateRule(SlidingWindowRule):
    """Compressor state: the newest ``window`` positions are live, like a sliding window, and
    a swap for prefix reuse skips them (the state is recomputed from the prefix)."""

    recomputed_for_prefix = True

    def __init__(self) -> None:
        super().__init__("state")


class ChunkedRule(KindRule):
    """Chunked local attention (Llama-4): a token reads its own chunk of ``window`` tokens, so
    the window restarts at every multiple of ``window``."""

    name = "chunked"
    needs_window = True
    family = GroupFamily.WINDOW

    def window_start(self, group: GroupShape, first_read: _N) -> _N:
        window = int(group.window or 0)
        return (first_read // window) * window

    def max_live_blocks(self, group: GroupShape, max_model_len: int) -> int:
        # chunks start at multiples of gcd(W, B) within a block; the worst offset is B - gcd
        window, block = int(group.window or 0), group.block_size
        live = _cdiv(window + block - math.gcd(window, block), block)
        return min(self.blocks_for(group, max_model_len), live)


class PerRequestRule(KindRule):
    """A fixed number of state slots per request whatever its length (linear-attention conv
    and recurrent state): prefix reuse copies a snapshot taken at the boundary."""

    name = "per_request"
    family = GroupFamily.SNAPSHOT
    per_request = True

    def window_start(self, group: GroupShape, first_read: _N) -> _N:
        return first_read * 0


_LOCK = threading.Lock()
_RULES: dict[str, KindRule] = {}
_BUNDLED = ("full", "sliding_window", "state", "chunked", "per_request")


def register_kind(rule: KindRule) -> KindRule:
    """Make ``rule`` a kind ``CacheGroup(kind=rule.name)`` accepts.

    Raises:
        TypeError: ``rule`` is not a :class:`KindRule` instance.
        ValueError: its name is empty, not a str, or already registered (bundled kinds can
            never be replaced).
    """
    if not isinstance(rule, KindRule):
        raise TypeError(f"rule must be a KindRule instance, got {type(rule).__name__}")
    name = getattr(rule, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"rule.name must be a non-empty str, got {name!r}")
    family = getattr(rule, "family", None)
    if not isinstance(family, GroupFamily):
        raise ValueError(f"rule.family must be a GroupFamily, got {family!r}")
    with _LOCK:
        if name in _RULES:
            raise ValueError(f"group kind {name!r} is already registered ({_RULES[name]!r})")
        _RULES[name] = rule
    return rule


def unregister_kind(name: str) -> None:
    """Remove a kind registered with :func:`register_kind` (tests, plugins that unload).

    Raises:
        ValueError: ``name`` is a bundled kind or not registered.
    """
    with _LOCK:
        if name in _BUNDLED:
            raise ValueError(f"group kind {name!r} is bundled and cannot be removed")
        if name not in _RULES:
            raise ValueError(f"group kind {name!r} is not registered")
        del _RULES[name]


def registered_kinds() -> tuple[str, ...]:
    """Names of every kind, the bundled ones first."""
    return tuple(_RULES)


def rule_of(kind: object) -> KindRule:
    """The rule of a kind name (a ``GroupKind`` member is a str) or of a group's ``kind``.

    Raises:
        ValueError: the kind is not registered; the message lists those that are.
    """
    name = getattr(kind, "value", kind)
    rule = _RULES.get(name) if isinstance(name, str) else None
    if rule is None:
        raise ValueError(f"kind must be one of {list(_RULES)}, got {kind!r}")
    return rule


for _rule in (
    FullRule(),
    SlidingWindowRule("sliding_window"),
    StateRule(),
    ChunkedRule(),
    PerRequestRule(),
):
    register_kind(_rule)


def live_start(group: Any, num_computed: int, num_tokens: int | None = None) -> int:
    """:meth:`KindRule.live_start` of ``group``'s kind (``group``: a ``CacheGroup``).

    >>> from kvforge.specs import CacheGroup
    >>> swa = CacheGroup(name="swa", block_size=64, kind="sliding_window", window=128)
    >>> live_start(swa, 0, 512)        # a 512-token first chunk: every token is written
    0
    >>> live_start(swa, 511, 512)      # a decode step: token 511 reads tokens 384..511
    384
    >>> live_start(swa, 512)           # at rest after 512 tokens: the last 128
    384
    """
    return rule_of(group.kind).live_start(group, num_computed, num_tokens)


def held_blocks(group: Any, num_computed: int, num_tokens: int) -> int:
    """:meth:`KindRule.held_blocks` of ``group``'s kind.

    >>> from kvforge.specs import CacheGroup
    >>> swa = CacheGroup(name="swa", block_size=64, kind="sliding_window", window=128)
    >>> held_blocks(swa, 0, 512), held_blocks(swa, 512, 513), held_blocks(swa, 513, 513)
    (8, 3, 3)
    """
    return rule_of(group.kind).held_blocks(group, num_computed, num_tokens)
