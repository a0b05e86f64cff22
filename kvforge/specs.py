"""Declarative cache specs: what a backend asks the controller to allocate.

A :class:`CacheGroup` is one block table's worth of semantics (block size, kind, window);
a :class:`CacheRole` is one named buffer of one layer that lives in a group. Both are frozen
pydantic models validated strictly: every rule violation is a ``ValueError`` whose message
names the field and the offending value.

Invariants (checked here, relied on everywhere else):

- every size is a positive ``int`` (never a ``bool``, ``float`` or numeric string); byte counts
  use integer arithmetic only, and a per-token figure that a compress ratio makes fractional
  (584 B per 128 tokens) is an exact :class:`~fractions.Fraction`, never a float;
- ``compress_ratio`` divides the group's ``block_size`` (checked where a role meets its group,
  see :func:`check_role_in_group`), so ``entries_per_block`` is exact;
- ``window`` is set exactly when the group kind needs one (``sliding_window``, ``state`` and
  ``chunked``); a ``per_request`` group has ``block_size == 1`` and ``slots_per_request``
  blocks per request, and only it may set ``slots_per_request``;
- a role's device block stride (:meth:`CacheRole.device_block_bytes`) is its meaningful block
  bytes rounded up to ``block_alignment``; host pages keep the meaningful bytes only.
"""

from __future__ import annotations

import math
from enum import Enum
from fractions import Fraction
from numbers import Integral
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvforge._checks import check_int
from kvforge.kinds import GroupFamily, KindRule, rule_of

__all__ = [
    "DTYPE_ITEMSIZE",
    "BlockLayout",
    "CacheGroup",
    "CacheRole",
    "GroupFamily",
    "GroupKind",
    "SwapPurpose",
    "TokenRange",
    "canonical_dtype",
    "check_role_in_group",
    "strict_int",
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
    CHUNKED = "chunked"
    """Chunked local attention (Llama-4): a token reads only its own chunk of ``window``
    tokens, so the window restarts at every multiple of ``window``."""
    PER_REQUEST = "per_request"
    """A fixed number of slots per request whatever its length (linear-attention conv and
    recurrent state): ``slots_per_request`` blocks of one slot each."""


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


def strict_int(field: str, value: Any, minimum: int = 1, unit: str = "") -> int:
    """``value`` if it is an ``int >= minimum``; else a ``ValueError`` naming ``field``.

    ``bool`` is refused although it subclasses ``int`` (``compress_ratio=True`` is a mistake,
    not a ratio of 1), and so are floats and numeric strings, even ``2.0`` and ``"2"``.
    """
    what = f"a positive number of {unit}" if unit and minimum == 1 else f">= {minimum}"
    return check_int(
        field,
        value,
        minimum,
        type_message="{name} must be an int, got {value} ({type})",
        range_message="{name} must be " + what + ", got {value}",
    )


DType = Annotated[str, BeforeValidator(canonical_dtype)]
BlockLayout = Literal["token_major", "head_major"]
_BLOCK_LAYOUTS = ("token_major", "head_major")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_tokens(num_tokens: int) -> int:
    # numbers.Integral admits numpy integers: the scheduler side computes counts in arrays
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, Integral) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    return int(num_tokens)


class CacheGroup(BaseModel):
    """A set of (layer, role) buffers that share one block table per request.

    Attributes:
        name: the group's name; backends that declare the same name must declare the same spec.
        block_size: tokens per block (the paging unit); 1 for a ``per_request`` group, whose
            blocks are state slots.
        kind: ``full``, ``sliding_window``, ``state``, ``chunked`` or ``per_request``.
        window: live tokens for ``sliding_window`` / ``state`` groups, the chunk size of a
            ``chunked`` group; ``None`` for ``full`` and ``per_request``.
        slots_per_request: blocks every request holds in a ``per_request`` group (default 1);
            any other value on another kind is refused.

    What each kind keeps live for a sequence of ``n`` tokens (the newest token's view, which
    is what a request holds between steps):

    ==================  ==============================  =====================================
    kind                ``live_token_range(n)``          blocks held (``max_live_blocks``)
    ==================  ==============================  =====================================
    full                ``[0, n)``                       ``cdiv(n, B)``
    sliding_window,     ``[max(0, n - W), n)``           ``(W + B - 2) // B + 1`` at most:
    state                                                W tokens starting mid-block
    chunked             ``[((n - 1) // W) * W, n)``      ``cdiv(W + B - gcd(W, B), B)`` at
                                                         most: one chunk at its worst offset
    per_request         ``[0, n)`` (the state sums up    ``slots_per_request``, whatever ``n``
                        every token; its slots are not
                        token positions)
    ==================  ==============================  =====================================
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = Field(min_length=1)
    block_size: int
    kind: GroupKind | str = GroupKind.FULL
    window: int | None = None
    slots_per_request: int = 1

    @field_validator("kind", mode="before")
    @classmethod
    def _kind(cls, value: Any) -> GroupKind | str:
        rule = rule_of(value)  # a ValueError listing the registered kinds
        try:
            return GroupKind(rule.name)
        except ValueError:
            return rule.name  # a kind registered with kvforge.kinds.register_kind

    @field_validator("block_size", mode="before")
    @classmethod
    def _block_size(cls, value: Any) -> int:
        return strict_int("block_size", value, unit="tokens")

    @field_validator("window", mode="before")
    @classmethod
    def _window_value(cls, value: Any, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        try:
            return strict_int("window", value, unit="tokens")
        except ValueError as exc:
            raise ValueError(f"{exc} on group {info.data.get('name')!r}") from None

    @field_validator("slots_per_request", mode="before")
    @classmethod
    def _slots(cls, value: Any) -> int:
        return strict_int("slots_per_request", value, unit="slots")

    @model_validator(mode="after")
    def _kind_rules(self) -> CacheGroup:
        rule = self.rule
        if not rule.per_request and self.slots_per_request != 1:
            raise ValueError(
                f"slots_per_request={self.slots_per_request} is only for per_request groups; "
                f"group {self.name!r} is {rule.name}"
            )
        if not rule.needs_window:
            if self.window is not None:
                raise ValueError(
                    f"window must be None for a {rule.name} group, got window={self.window} "
                    f"on group {self.name!r}"
                )
        elif self.window is None:
            raise ValueError(
                f"window is required for a {rule.name} group; group {self.name!r} has none"
            )
        if rule.per_request and self.block_size != 1:
            raise ValueError(
                f"block_size must be 1 for a per_request group (one block per state slot), "
                f"got block_size={self.block_size} on group {self.name!r}"
            )
        return self

    def __repr_args__(self) -> Any:
        # slots_per_request means something only for per_request groups: keep other reprs short
        for name, value in super().__repr_args__():
            if name != "slots_per_request" or self.rule.per_request:
                yield name, value

    # ------------------------------------------------------------------ semantics
    # Every answer below comes from the kind's rule (kvforge.kinds): nothing here switches
    # on the kind.

    @property
    def rule(self) -> KindRule:
        """The rule object of this group's kind (:mod:`kvforge.kinds`)."""
        return rule_of(self.kind)

    @property
    def windowed(self) -> bool:
        """True when only a trailing window of tokens stays live (sliding_window, state,
        chunked)."""
        return self.rule.windowed

    @property
    def family(self) -> GroupFamily:
        """How the group serves prefix reuse: history, window or snapshot."""
        return self.rule.family

    def live_token_range(self, num_tokens: int) -> TokenRange:
        """Tokens of a sequence of ``num_tokens`` that can still be read (see the class table).

        The newest token's view: a sliding window of ``W`` keeps the last ``W`` tokens; a
        chunked group keeps the chunk of the newest token (all of it when ``num_tokens`` ends a
        chunk); full and per-request groups keep ``[0, num_tokens)``.
        """
        start, end = self.rule.live_token_range(self, _check_tokens(num_tokens))
        return TokenRange(start=start, end=end)

    def blocks_for(self, num_tokens: int) -> int:
        """Block-table length of a sequence of ``num_tokens`` tokens.

        ``cdiv(num_tokens, block_size)`` for token-indexed kinds; ``slots_per_request`` for a
        per-request group once the request holds any token (0 for an empty sequence).
        """
        return self.rule.blocks_for(self, _check_tokens(num_tokens))

    def first_live_block(self, num_tokens: int) -> int:
        """Index in the block table of the first block still live (``blocks_for`` ends it)."""
        start, _ = self.rule.live_token_range(self, _check_tokens(num_tokens))
        return 0 if self.rule.per_request else start // self.block_size

    def max_live_blocks(self, max_model_len: int) -> int:
        """The most blocks one sequence of at most ``max_model_len`` tokens holds at rest.

        An upper bound per kind (see the class table), reached for long enough sequences:

        - full: ``cdiv(max_model_len, B)``;
        - sliding_window / state: a window of ``W`` tokens that starts mid-block straddles
          ``(W + B - 2) // B + 1`` blocks (W = 128, B = 64: tokens 1..128 touch 3 blocks);
        - chunked: chunks start at multiples of ``W``, so at offsets that are multiples of
          ``g = gcd(W, B)`` within a block; one whole chunk at the worst offset ``B - g`` spans
          ``cdiv(W + B - g, B)`` blocks (``W / B`` when ``B`` divides ``W``);
        - per_request: ``slots_per_request``.

        Capped at ``blocks_for(max_model_len)``. A step that schedules ``k`` new tokens holds
        at most ``cdiv(k, B)`` more until the request's next step (see ``memory_plan``).
        """
        return self.rule.max_live_blocks(self, _check_tokens(max_model_len))


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
        block_alignment: bytes the device block stride is a multiple of (default 1: no
            padding). Any positive int: FlashMLA pages need 576, not a power of two.
        block_layout: ``"token_major"`` blocks are ``[entries_per_block, *entry_shape]``;
            ``"head_major"`` blocks are ``[entry_shape[0], entries_per_block,
            *entry_shape[1:]]`` (FastDeploy's ``[kv_heads, block, head_dim]``, FlashInfer HND)
            and need at least two entry dimensions.

    Alignment, worked example (DeepSeek-V4 fp8 ``swa_kv``, 64-token blocks of 584-byte
    entries, ``block_alignment=576``)::

        block_bytes        = 64 * 584                 = 37,376 B   (host page share)
        device_block_bytes = cdiv(37,376, 576) * 576  = 65 * 576 = 37,440 B   (device stride)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    group: str = Field(min_length=1)
    entry_shape: tuple[int, ...]
    dtype: DType
    compress_ratio: int = 1
    offload: bool = True
    block_alignment: int = 1
    block_layout: BlockLayout = "token_major"

    @field_validator("entry_shape", mode="before")
    @classmethod
    def _entry_shape(cls, value: Any) -> tuple[int, ...]:
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value,)
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"entry_shape must be a tuple of ints, got {value!r}")
        shape = tuple(value)
        if not shape:
            raise ValueError("entry_shape must have at least one dimension, got ()")
        for i, dim in enumerate(shape):
            if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
                raise ValueError(f"entry_shape[{i}] must be a positive int, got {dim!r} in {shape}")
        return shape

    @field_validator("compress_ratio", mode="before")
    @classmethod
    def _compress_ratio(cls, value: Any) -> int:
        return strict_int("compress_ratio", value)

    @field_validator("block_alignment", mode="before")
    @classmethod
    def _block_alignment(cls, value: Any) -> int:
        return strict_int("block_alignment", value, unit="bytes")

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"offload must be a bool, got {value!r} ({type(value).__name__})")
        return value

    @field_validator("block_layout", mode="before")
    @classmethod
    def _block_layout(cls, value: Any) -> str:
        if value not in _BLOCK_LAYOUTS:
            raise ValueError(f"block_layout must be one of {list(_BLOCK_LAYOUTS)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _layout_rules(self) -> CacheRole:
        if self.block_layout == "head_major" and len(self.entry_shape) < 2:
            raise ValueError(
                f"block_layout='head_major' needs an entry_shape of at least 2 dimensions "
                f"(heads first), got entry_shape={self.entry_shape} on role {self.name!r}"
            )
        return self

    # ------------------------------------------------------------------ bytes

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry: ``prod(entry_shape) * itemsize``."""
        return math.prod(self.entry_shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def bytes_per_token(self) -> Fraction:
        """Meaningful bytes per token, exact: ``entry_bytes / compress_ratio``."""
        return Fraction(self.entry_bytes, self.compress_ratio)

    def entries_per_block(self, group: CacheGroup) -> int:
        """Entries of this role in one block of ``group`` (``block_size // compress_ratio``)."""
        check_role_in_group(self, group)
        return group.block_size // self.compress_ratio

    def block_bytes(self, group: CacheGroup) -> int:
        """Meaningful bytes of one block: ``entries_per_block * entry_bytes`` (a host page's
        share; no padding)."""
        return self.entries_per_block(group) * self.entry_bytes

    def device_block_bytes(self, group: CacheGroup) -> int:
        """Device block stride: :meth:`block_bytes` rounded up to ``block_alignment``."""
        return _cdiv(self.block_bytes(group), self.block_alignment) * self.block_alignment

    def device_bytes_per_token(self, group: CacheGroup) -> Fraction:
        """Device bytes per token, block-amortised and exact (padding included)."""
        return Fraction(self.device_block_bytes(group), group.block_size)

    def block_shape(self, group: CacheGroup) -> tuple[int, ...]:
        """Shape of the meaningful part of one block, per ``block_layout``."""
        entries = self.entries_per_block(group)
        if self.block_layout == "head_major":
            return (self.entry_shape[0], entries, *self.entry_shape[1:])
        return (entries, *self.entry_shape)

    def entries_for(self, num_tokens: int) -> int:
        """Entries ``num_tokens`` tokens produce (a compressed entry exists once complete)."""
        return num_tokens // self.compress_ratio


def check_role_in_group(role: CacheRole, group: CacheGroup) -> None:
    """Check that ``role`` can live in ``group``.

    Raises:
        ValueError: the names disagree, ``compress_ratio`` does not divide ``block_size`` (or
            is not 1 in a per-request group), or ``block_alignment`` makes a device block
            stride that is not a whole number of the role's dtype elements.
    """
    if role.group != group.name:
        raise ValueError(f"role {role.name!r} belongs to group {role.group!r}, not {group.name!r}")
    if group.kind is GroupKind.PER_REQUEST and role.compress_ratio != 1:
        raise ValueError(
            f"compress_ratio={role.compress_ratio} of role {role.name!r} is not allowed in "
            f"per_request group {group.name!r}: its slots are states, not tokens (use 1)"
        )
    if group.block_size % role.compress_ratio:
        raise ValueError(
            f"compress_ratio={role.compress_ratio} of role {role.name!r} does not divide "
            f"block_size={group.block_size} of group {group.name!r}"
        )
    if role.block_alignment != 1:
        meaningful = group.block_size // role.compress_ratio * role.entry_bytes
        stride = _cdiv(meaningful, role.block_alignment) * role.block_alignment
        if stride % role.itemsize:
            raise ValueError(
                f"block_alignment={role.block_alignment} of role {role.name!r} gives a device "
                f"block stride of {stride} bytes, not a whole number of {role.dtype} elements "
                f"({role.itemsize} bytes each)"
            )
