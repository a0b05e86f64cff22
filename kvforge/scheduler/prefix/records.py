"""The plain records of the prefix cache: what it is configured with (:class:`PrefixSettings`),
its counters (:class:`PrefixStats`), what it knows of one registered block (:class:`Entry`),
a block a step completed that waits to be registered (:class:`Registration`), and what one
scheduled step holds until it ends (:class:`StepWork`).

No behaviour lives here beyond making a fresh key chain (:meth:`PrefixSettings.hasher`): the
other modules of :mod:`kvforge.scheduler.prefix` read and write these records, and
:class:`~.cache.PrefixCache` owns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvforge.core.prefix_keys import Algorithm, PrefixHasher
from kvforge.core.values import PrefixQuery
from kvforge.scheduler.prefix.retention import Retention
from kvforge.scheduler.tables import GroupTable

__all__ = ["Entry", "PrefixSettings", "PrefixStats", "Proof", "Registration", "StepWork"]

#: a tail key's proof: (parent, payload, root preimage), what the exact check of a window or
#: state block whose key ends inside a unit compares
Proof = tuple[bytes, bytes, bytes]


@dataclass(frozen=True)
class PrefixSettings:
    """What a prefix cache was built with (fixed for its life).

    Attributes:
        enabled: completed blocks become reusable (off: lookups always miss).
        boundary: the LCM of the token-indexed groups' block sizes: matches end on it.
        unit: tokens per hashed unit of the key chain (every block end, boundary and
            snapshot is a unit end, :func:`kvforge.core.prefix_keys.unit_of`).
        snapshot_interval: tokens between snapshots of per-request state.
        key_algorithm: the digest of the prefix keys.
        retention: which completed window / state blocks become reusable.
        retention_interval: with ``"checkpoints"``, also every multiple of it, or ``None``.
        has_history: some group keeps the whole history (a full-attention chain).
    """

    enabled: bool
    boundary: int
    unit: int
    snapshot_interval: int
    key_algorithm: Algorithm
    retention: Retention
    retention_interval: int | None
    has_history: bool

    def hasher(self, query: PrefixQuery | None = None) -> PrefixHasher:
        """A fresh key chain for the extra keys and multimodal items of ``query`` (none)."""
        if query is None:
            return PrefixHasher(unit=self.unit, algorithm=self.key_algorithm)
        return PrefixHasher(
            query.extra_keys, query.mm_keys, unit=self.unit, algorithm=self.key_algorithm
        )


@dataclass
class PrefixStats:
    """Counters of the prefix cache.

    Attributes:
        queries: prompts looked up.
        query_tokens: their tokens.
        hit_tokens: tokens served from cache (``sum(L)``).
        hit_tokens_by_group: per group, the tokens its shared blocks cover.
        stored_blocks: blocks that became reusable, per group.
        evictions: blocks evicted, per family (``history``, ``window``, ``snapshot``).
        collisions: lookups whose keys named cached blocks of other content (possible only
            with an injected weak key function), cut to the tokens that are truly cached.
    """

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_group: dict[str, int] = field(default_factory=dict)
    stored_blocks: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    collisions: int = 0

    @property
    def hit_rate(self) -> float:
        """Display only: ``hit_tokens / query_tokens``."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class Entry(NamedTuple):
    """What the prefix cache knows of one registered block."""

    key: bytes
    end: int  # the token count its key covers
    group: int  # index of its group
    ref: bytes | None  # the unit record it holds a reference on
    proof: Proof | None  # a tail key's (parent, payload, root preimage)


class Registration(NamedTuple):
    """A block a step completed, to register once the step has ended."""

    index: int  # its group's index
    group: GroupTable
    key: bytes
    block: int
    end: int
    ref: bytes | None
    proof: Proof | None
    snapshot: bool  # written by the step's copies_after, not by its kernels


@dataclass
class StepWork:
    """What one scheduled step holds until it ends: the blocks its copies read or write and
    the blocks it completed (``pins``, one reference each), and what it will register."""

    pins: list[tuple[GroupTable, np.ndarray]] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)
    #: the requests the step grew: until it ends, they are not swapped out or truncated
    request_ids: tuple[str, ...] = ()
