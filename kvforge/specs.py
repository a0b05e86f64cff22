"""Declarative cache specs: what a backend asks the controller to allocate.

A :class:`CacheGroup` is one block table's worth of semantics (block size, kind, window);
a :class:`CacheRole` is one named buffer of one layer that lives in a group. Both are frozen
pydantic models validated strictly: every rule violation is a ``ValueError`` whose message
names the field and the offending value.

Invariants (checked here, relied on everywhere else):

- every size is a positive ``int``; byte counts are computed with integer arithmetic only;
- ``compress_ratio`` divides the group's ``block_size`` (checked where a role meets its group,
  see :func:`check_role_in_group`), so ``entries_per_block`` is exact;
- ``window`` is set exactly when the group kind needs one (``sliding_window`` and ``state``).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "DTYPE_ITEMSIZE",
    "CacheGroup",
    "CacheRole",
    "GroupKind",
    "SwapPurpose",
    "TokenRange",
    "canonical_dtype",
    "check_role_in_group",
    "torch_dtype",
]


class GroupKind(str, Enum):
    """How long the positions of a group stay readable."""

    FULL = "full"
    """All history is kept."""
    SLIDING_WINDOW = "sliding_window"
    """Only the last ``window`` tokens are live."""
    STATE = "state"
    """Recurrent / compressor state: only the newest ``window`` positions are live."""


class SwapPurpose(str, Enum):
    """Why a request's caches leave the device."""

    PREEMPT = "preempt"
    """Move everything needed to resume decoding."""
    PREFIX = "prefix"
    """Keep a cold prefix for reuse; state roles may be skipped and recomputed."""


# Storage item sizes in bytes, by canonical dtype name. Integers only: no float byte math.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
}

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def canonical_dtype(value: Any) -> str:
    """Return the canonical dtype name for ``value`` (a ``torch.dtype`` or a string).

    Raises:
        ValueError: if the dtype is not one kvforge can store.
    """
    if isinstance(value, torch.dtype):
        name = str(value).removeprefix("torch.")
    elif isinstance(value, str):
        name = value.removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
    else:
        raise ValueError(f"dtype must be a torch.dtype or a string, got {value!r}")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(
            f"dtype {value!r} is not supported; choose one of {sorted(DTYPE_ITEMSIZE)}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a canonical dtype name."""
    return getattr(torch, canonical_dtype(name))


DType = Annotated[str, BeforeValidator(canonical_dtype)]


class CacheGroup(BaseModel):
    """A set of (layer, role) buffers that share one block table per request.

    Attributes:
        name: the group's name; backends that declare the same name must declare the same spec.
        block_size: tokens per block (the paging unit).
        kind: ``full``, ``sliding_window`` or ``state``.
        window: live tokens for ``sliding_window`` / ``state`` groups; ``None`` for ``full``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = Field(min_length=1)
    block_size: int
    kind: GroupKind = GroupKind.FULL
    window: int | None = None

    @field_validator("kind", mode="before")
    @classmethod
    def _kind(cls, value: Any) -> GroupKind:
        try:
            return GroupKind(value)
        except ValueError:
            kinds = [k.value for k in GroupKind]
            raise ValueError(f"kind must be one of {kinds}, got {value!r}") from None

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"block_size must be a positive number of tokens, got {value}")
        return value

    @model_validator(mode="after")
    def _window(self) -> CacheGroup:
        if self.kind is GroupKind.FULL:
            if self.window is not None:
                raise ValueError(
                    f"window must be None for a full group, got window={self.window} "
                    f"on group {self.name!r}"
                )
        elif self.window is None:
            raise ValueError(
                f"window is required for a {self.kind.value} group; group {self.name!r} has none"
            )
        elif self.window <= 0:
            raise ValueError(
                f"window must be a positive number of tokens, got {self.window} "
                f"on group {self.name!r}"
            )
        return self

    @property
    def windowed(self) -> bool:
        """True when only the newest ``window`` tokens stay live."""
        return self.kind is not GroupKind.FULL

    def live_token_range(self, num_tokens: int) -> TokenRange:
        """Tokens of a sequence of ``num_tokens`` that can still be read."""
        if self.window is None:
            return TokenRange(start=0, end=num_tokens)
        return TokenRange(start=max(0, num_tokens - self.window), end=num_tokens)

    def blocks_for(self, num_tokens: int) -> int:
        """Block-table length that covers ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def max_live_blocks(self, max_model_len: int) -> int:
        """The most blocks one sequence of at most ``max_model_len`` tokens holds at once."""
        total = self.blocks_for(max_model_len)
        if self.window is None:
            return total
        # A window of W tokens that starts mid-block straddles at most this many blocks.
        return min(total, (self.window + self.block_size - 2) // self.block_size + 1)


class TokenRange(BaseModel):
    """A half-open token range ``[start, end)``."""

    model_config = ConfigDict(frozen=True)

    start: int = Field(ge=0)
    end: int = Field(ge=0)

    @property
    def empty(self) -> bool:
        return self.end <= self.start


class CacheRole(BaseModel):
    """One named cache buffer of one layer.

    Attributes:
        name: the role's name (``key``, ``value``, ``indexer``, ...); unique within a backend.
        group: name of the :class:`CacheGroup` whose block table addresses it.
        entry_shape: shape of one entry (one token, or one compressed token).
        dtype: storage dtype (canonical name, e.g. ``"bfloat16"``, ``"uint8"``).
        compress_ratio: tokens per entry (``r``): one entry per ``r`` tokens. Default 1.
        offload: whether swap out / swap in move this role.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    group: str = Field(min_length=1)
    entry_shape: tuple[int, ...]
    dtype: DType
    compress_ratio: int = 1
    offload: bool = True

    @field_validator("entry_shape", mode="before")
    @classmethod
    def _entry_shape(cls, value: Any) -> tuple[int, ...]:
        if isinstance(value, int):
            value = (value,)
        shape = tuple(value)
        if not shape:
            raise ValueError("entry_shape must have at least one dimension, got ()")
        for i, dim in enumerate(shape):
            if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
                raise ValueError(f"entry_shape[{i}] must be a positive int, got {dim!r} in {shape}")
        return shape

    @field_validator("compress_ratio")
    @classmethod
    def _compress_ratio(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"compress_ratio must be >= 1, got {value}")
        return value

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry: ``prod(entry_shape) * itemsize``."""
        return math.prod(self.entry_shape) * DTYPE_ITEMSIZE[self.dtype]

    def entries_per_block(self, group: CacheGroup) -> int:
        """Entries of this role in one block of ``group`` (``block_size // compress_ratio``)."""
        check_role_in_group(self, group)
        return group.block_size // self.compress_ratio

    def block_bytes(self, group: CacheGroup) -> int:
        """Bytes of one block of this role: ``entries_per_block * entry_bytes``."""
        return self.entries_per_block(group) * self.entry_bytes

    def entries_for(self, num_tokens: int) -> int:
        """Entries ``num_tokens`` tokens produce (a compressed entry exists once complete)."""
        return num_tokens // self.compress_ratio


def check_role_in_group(role: CacheRole, group: CacheGroup) -> None:
    """Check that ``role`` can live in ``group``.

    Raises:
        ValueError: if the names disagree or ``compress_ratio`` does not divide ``block_size``.
    """
    if role.group != group.name:
        raise ValueError(f"role {role.name!r} belongs to group {role.group!r}, not {group.name!r}")
    if group.block_size % role.compress_ratio:
        raise ValueError(
            f"compress_ratio={role.compress_ratio} of role {role.name!r} does not divide "
            f"block_size={group.block_size} of group {group.name!r}"
        )
