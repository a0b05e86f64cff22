"""The canonical encoding the prefix keys hash: what a chain's inputs are as bytes, and the
records of the units a chain hashed.

This module owns the bytes; :mod:`kvforge.core.prefix_keys` owns the chain that digests them
(:class:`~kvforge.core.prefix_keys.PrefixHasher`). Here: the request-level
:class:`ExtraKeys`, the :class:`MultimodalKey` items, the packed layout of a unit's payload,
the checks of token ids, and :class:`UnitRecords` (each unit's key and the payload it hashed,
what the exact check compares). Byte for byte in ``docs/prefix_keys.md``; the spec is
re-derived with ``struct`` and ``hashlib`` alone in ``tests/core/test_prefix_keys.py``.

Canonical encoding (version 1). ``u8``/``u32``/``u64`` are unsigned little-endian integers of
1/4/8 bytes, ``i64`` a signed (two's complement) little-endian 8-byte integer, ``‖``
concatenation, ``H`` the digest (SHA-256 by default; BLAKE2b with a 32-byte digest and no key,
salt or person as ``algorithm="blake2b"``).

- ``root = H(root_preimage)`` with
  ``root_preimage = b"kvforge-prefix-keys" (19 ASCII bytes) ‖ u32 version (= 1) ‖ extra``.
- ``extra`` (:meth:`ExtraKeys.encode`) ``= u32 N ‖ field_1 ‖ ... ‖ field_N``, one field per
  present value, in this order: ``cache_salt`` (when not ``None``), ``adapter`` (when not
  ``None``), then the custom fields sorted by name (code point order, which is also the order
  of their UTF-8 bytes). A field is ``u8 tag ‖ [name] ‖ value``: tag ``0x01`` cache_salt,
  ``0x02`` adapter, ``0x03`` custom, and only a custom field has ``[name] = u32 len ‖ UTF-8``.
  A value is ``u8 type ‖ body``: ``0x00`` None (no body), ``0x01`` bool (``u8`` 0 or 1),
  ``0x02`` int (``i64``), ``0x03`` str (``u32 len ‖ UTF-8``), ``0x04`` bytes
  (``u32 len ‖ raw``). ``ExtraKeys()`` encodes as ``u32 0``.
- unit ``j`` covers tokens ``[j*g, (j+1)*g)``; ``key_j = H(key_{j-1} ‖ payload_j)`` with
  ``key_{-1} = root`` and ``payload_j = u64 j*g ‖ u32 g ‖ g x u32 token id ‖ u32 M ‖ M x item``,
  where the ``M`` items are the multimodal keys that overlap the unit (``start < (j+1)*g`` and
  ``end > j*g``), sorted by ``(start, end, digest)``, each ``u64 start ‖ u64 end ‖ u32 len ‖
  digest`` with absolute token positions. The key of the prefix of ``(j+1)*g`` tokens is
  ``key_j``.

Every variable-length part carries its length or count, so two different inputs never encode
to the same bytes; only a collision of ``H`` can give two prefixes one key, and the exact check
"""

from __future__ import annotations

import functools
import itertools
import operator
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

__all__ = [
    "DOMAIN_TAG",
    "ENCODING_VERSION",
    "MIN_MM_DIGEST_BYTES",
    "NO_ITEMS",
    "ExtraKeys",
    "MultimodalKey",
    "UnitRecords",
    "as_extra_keys",
    "pack_u32",
    "payload_dtype",
    "show_value",
    "token_ids",
]

DOMAIN_TAG = b"kvforge-prefix-keys"
"""The first bytes of every root preimage (19 ASCII bytes)."""
ENCODING_VERSION = 1
"""Bumped whenever the encoding changes: keys of two versions never meet."""
MIN_MM_DIGEST_BYTES = 32
"""A multimodal content digest is at least this long (SHA-256 and up)."""

_TAG_SALT, _TAG_ADAPTER, _TAG_CUSTOM = b"\x01", b"\x02", b"\x03"
_T_NONE, _T_BOOL, _T_INT, _T_STR, _T_BYTES = b"\x00", b"\x01", b"\x02", b"\x03", b"\x04"
pack_u32 = struct.Struct("<I").pack
"""``u32`` of the encoding: an unsigned little-endian 4-byte int."""
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_TOKEN_LIMIT = 1 << 32
_POSITION_LIMIT = 1 << 63


def show_value(value: object) -> str:
    """A short description of a refused value for an error message (never an encoding)."""
    text = object.__repr__(value) if isinstance(value, np.ndarray) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _utf8(text: str, where: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where} is not valid Unicode text ({e.reason}): {show_value(text)}"
        ) from e


def _encode_value(value: object) -> bytes:
    """``u8 type ‖ body`` of a custom value already checked by :func:`_check_value`."""
    kind = type(value)
    if value is None:
        return _T_NONE
    if kind is bool:
        return _T_BOOL + (b"\x01" if value else b"\x00")
    if kind is int:
        return _T_INT + value.to_bytes(8, "little", signed=True)  # type: ignore[union-attr]
    if kind is str:
        raw = value.encode("utf-8")  # type: ignore[union-attr]
        return _T_STR + pack_u32(len(raw)) + raw
    return _T_BYTES + pack_u32(len(value)) + value  # type: ignore[arg-type,operator]


def _check_value(value: object, where: str) -> object:
    kind = type(value)
    if value is None or kind in (bool, bytes):
        return value
    if kind is int:
        if not _I64_MIN <= value <= _I64_MAX:  # type: ignore[operator]
            raise ValueError(f"{where} = {value} does not fit the canonical signed 64-bit int")
        return value
    if kind is str:
        _utf8(value, where)  # type: ignore[arg-type]
        return value
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    raise TypeError(
        f"{where} has type {name} ({show_value(value)}), which has no "
        "canonical encoding: pass an int, str, bytes, bool or None (e.g. int(x) for a numpy "
        "integer, a str or bytes rendering you define for anything else)"
    )


class ExtraKeys(BaseModel):
    """Request-level keys that must match for two prompts to share cached blocks.

    Each field is encoded with its tag and its type (module docstring), so a salt and an
    adapter with the same text, or ``1``, ``"1"``, ``True`` and ``b"1"``, never share a key.
    A value with no canonical encoding (float, list, numpy array, any other object) is refused
    with a ``TypeError`` naming the field and the value's type; a value out of range (an empty
    salt, an int beyond 64 bits, a duplicate custom name) with a ``ValueError``.

    Attributes:
        cache_salt: the tenant's salt, as in vLLM's request API (``None``: no salt). Prompts
            with different salts never share a block.
        adapter: the LoRA / adapter id the KV was computed with (``None``: the base model).
        custom: named custom fields ``(name, value)``, value an ``int`` (signed 64-bit),
            ``str``, ``bytes``, ``bool`` or ``None``. A mapping or a sequence of pairs is
            accepted; it is stored sorted by name, and a repeated name is refused.

    >>> ExtraKeys(cache_salt="x") == ExtraKeys(adapter="x")
    False
    >>> ExtraKeys(custom={"b": 1, "a": "1"}).custom
    (('a', '1'), ('b', 1))
    >>> ExtraKeys().encode().hex()
    '00000000'
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    cache_salt: str | None = None
    adapter: str | None = None
    custom: tuple[tuple[str, int | str | bytes | bool | None], ...] = ()

    @field_validator("cache_salt", "adapter", mode="before")
    @classmethod
    def _text_field(cls, value: object, info: Any) -> object:
        where = f"ExtraKeys.{info.field_name}"
        if value is None:
            return None
        if type(value) is not str:
            raise TypeError(
                f"{where} must be a str or None, got {type(value).__name__} ({show_value(value)})"
            )
        if not value:
            raise ValueError(f"{where} must be a non-empty str; pass None for no {info.field_name}")
        _utf8(value, where)
        return value

    @field_validator("custom", mode="before")
    @classmethod
    def _custom_field(cls, value: object) -> tuple[tuple[str, object], ...]:
        if isinstance(value, Mapping):
            pairs: list[object] = list(value.items())
        elif isinstance(value, tuple | list):
            pairs = list(value)
        else:
            raise TypeError(
                "ExtraKeys.custom must be a mapping or a sequence of (name, value) pairs, got "
                f"{type(value).__name__} ({show_value(value)})"
            )
        out: list[tuple[str, object]] = []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise TypeError(
                    f"ExtraKeys.custom[{i}] must be a (name, value) pair, got {show_value(pair)}"
                )
            name, item = pair
            if type(name) is not str:
                raise TypeError(
                    f"ExtraKeys.custom[{i}] has a {type(name).__name__} name ({show_value(name)}); "
                    "names are non-empty str"
                )
            if not name:
                raise ValueError(f"ExtraKeys.custom[{i}] has an empty name")
            _utf8(name, f"ExtraKeys.custom[{i}] name")
            out.append((name, _check_value(item, f"ExtraKeys.custom[{name!r}]")))
        out.sort(key=operator.itemgetter(0))
        for (a, _), (b, _) in itertools.pairwise(out):
            if a == b:
                raise ValueError(f"ExtraKeys.custom names a field {a!r} twice; names are unique")
        return tuple(out)

    def encode(self) -> bytes:
        """The canonical bytes of these keys (``extra`` in the module docstring)."""
        fields: list[bytes] = []
        if self.cache_salt is not None:
            fields.append(_TAG_SALT + _encode_value(self.cache_salt))
        if self.adapter is not None:
            fields.append(_TAG_ADAPTER + _encode_value(self.adapter))
        for name, value in self.custom:
            raw = name.encode("utf-8")
            fields.append(_TAG_CUSTOM + pack_u32(len(raw)) + raw + _encode_value(value))
        return pack_u32(len(fields)) + b"".join(fields)


_EMPTY_EXTRA = ExtraKeys()


def as_extra_keys(value: ExtraKeys | None, name: str = "extra_keys") -> ExtraKeys:
    """``value`` checked as extra keys: ``None`` is ``ExtraKeys()``; anything else but an
    :class:`ExtraKeys` (a tuple, a dict, a str) is a ``TypeError`` that says what to pass."""
    if value is None:
        return _EMPTY_EXTRA
    if isinstance(value, ExtraKeys):
        return value
    raise TypeError(
        f"{name} must be an ExtraKeys (or None), got {type(value).__name__} {show_value(value)}: "
        "pass ExtraKeys(cache_salt=..., adapter=..., custom={...}) so that every key is "
        "encoded with its name and type"
    )


@dataclass(frozen=True, slots=True)
class MultimodalKey:
    """A multimodal item over token positions ``[start, end)`` and its content digest.

    The item is encoded, whole and by position, into every unit it overlaps (never folded
    into the token ids): the same item twice is two entries, never a cancellation.

    Attributes:
        start: first token position of the item (``0 <= start < end < 2**63``).
        end: one past its last position.
        digest: a digest of the item's content, ``bytes`` of at least 32 bytes (a SHA-256 of
            the pixels, say); it is never truncated.
    """

    start: int
    end: int
    digest: bytes

    def __post_init__(self) -> None:
        for field in ("start", "end"):
            value = getattr(self, field)
            if isinstance(value, bool | np.bool_):
                raise TypeError(f"MultimodalKey.{field} must be an int, got bool {value!r}")
            try:
                number = operator.index(value)
            except TypeError:
                raise TypeError(
                    f"MultimodalKey.{field} must be an int, got {type(value).__name__} "
                    f"({show_value(value)})"
                ) from None
            object.__setattr__(self, field, number)
        if not 0 <= self.start < self.end < _POSITION_LIMIT:
            raise ValueError(
                f"MultimodalKey needs 0 <= start < end < 2**63, got start={self.start}, "
                f"end={self.end}"
            )
        if type(self.digest) is not bytes:
            raise TypeError(
                f"MultimodalKey.digest must be bytes, got {type(self.digest).__name__} "
                f"({show_value(self.digest)})"
            )
        if len(self.digest) < MIN_MM_DIGEST_BYTES:
            raise ValueError(
                f"MultimodalKey.digest has {len(self.digest)} bytes; a content digest needs at "
                f"least {MIN_MM_DIGEST_BYTES} (e.g. hashlib.sha256(content).digest())"
            )
        if len(self.digest) >= _TOKEN_LIMIT:
            raise ValueError(f"MultimodalKey.digest has {len(self.digest)} bytes (>= 2**32)")

    def encode(self) -> bytes:
        """``u64 start ‖ u64 end ‖ u32 len ‖ digest``."""
        return struct.pack("<QQI", self.start, self.end, len(self.digest)) + self.digest


@dataclass(frozen=True, slots=True)
class UnitRecords:
    """What the exact check needs of consecutive units: each unit's key and the bytes it
    hashed after its parent's key, so that ``keys[i] == H(parent_of(i) ‖ payloads[i])``.

    Attributes:
        unit: tokens per unit (``g``).
        start: tokens before the first unit here (a multiple of ``unit``).
        root: the chain's root key (encodes the extra keys).
        root_preimage: the bytes hashed into ``root`` (compared byte for byte).
        parent: the key of the prefix of ``start`` tokens (``root`` when ``start == 0``).
        keys: the key of each unit, ``keys[i]`` ending at ``start + (i + 1) * unit`` tokens.
        payloads: each unit's canonical payload (module docstring).
    """

    unit: int
    start: int
    root: bytes
    root_preimage: bytes
    parent: bytes
    keys: tuple[bytes, ...]
    payloads: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.payloads):
            raise ValueError(
                f"UnitRecords has {len(self.keys)} keys but {len(self.payloads)} payloads"
            )
        if self.unit < 1 or self.start < 0 or self.start % self.unit:
            raise ValueError(
                f"UnitRecords.start ({self.start}) must be a multiple of unit ({self.unit})"
            )
        if self.start == 0 and self.parent != self.root:
            raise ValueError("UnitRecords starting at token 0 must have the root as parent")

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def end(self) -> int:
        """Tokens covered at the end of the last unit here."""
        return self.start + len(self.keys) * self.unit

    def upto(self, num_tokens: int) -> UnitRecords:
        """The records of the units that end at or before ``num_tokens`` (a unit boundary in
        ``[start, end]``)."""
        if num_tokens % self.unit or not self.start <= num_tokens <= self.end:
            raise ValueError(
                f"upto({num_tokens}): not a unit boundary ({self.unit} tokens) in "
                f"[{self.start}, {self.end}]"
            )
        n = (num_tokens - self.start) // self.unit
        return UnitRecords(
            self.unit,
            self.start,
            self.root,
            self.root_preimage,
            self.parent,
            self.keys[:n],
            self.payloads[:n],
        )


_U4 = np.dtype("<u4")
NO_ITEMS = struct.pack("<I", 0)
"""``u32 M`` of a payload without multimodal items."""


@functools.lru_cache(maxsize=32)
def payload_dtype(unit: int) -> np.dtype:
    """One unit's payload without multimodal items, as a packed little-endian record."""
    return np.dtype([("offset", "<u8"), ("count", "<u4"), ("tokens", "<u4", (unit,)), ("m", "<u4")])


def token_ids(tokens: object) -> np.ndarray:
    """``tokens`` as ``<u4`` ids; refuses non-integers and ids outside ``[0, 2**32)``."""
    try:
        arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    except (OverflowError, ValueError, TypeError) as e:
        raise ValueError(f"token ids must be a 1-D sequence of ints in [0, 2**32): {e}") from e
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype == _U4:  # every unsigned 32-bit value is a token id
        return arr
    if arr.dtype.kind == "O":
        for i, value in enumerate(arr.tolist()):
            if type(value) is not int:
                raise TypeError(f"token ids must be ints, got tokens[{i}] = {show_value(value)}")
            if not 0 <= value < _TOKEN_LIMIT:
                raise ValueError(
                    f"token ids are unsigned 32-bit: tokens[{i}] = {value} is outside [0, 2**32)"
                )
        return arr.astype("<u4")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got an array of {arr.dtype}")
    lo, hi = arr.min(), arr.max()
    if lo < 0 or hi >= _TOKEN_LIMIT:
        i = int(np.flatnonzero((arr < 0) | (arr >= _TOKEN_LIMIT))[0])
        raise ValueError(
            f"token ids are unsigned 32-bit: tokens[{i}] = {int(arr[i])} is outside [0, 2**32)"
        )
    return arr.astype("<u4", copy=False)
