"""Prefix keys: a SHA-256 chain over units of ``g`` tokens, on a canonical byte encoding.

Every prefix of ``t = j * g`` tokens of a request has a key: a 32-byte digest that commits to
the request's extra keys (cache salt, adapter, custom fields), to its first ``t`` token ids and
to the multimodal items over them. Keys are plain ``bytes``: the same in every process, on every
machine and in every engine that follows the encoding (``docs/prefix_keys.md``).

The canonical encoding of the chain's inputs, byte for byte, is in the docstring of
:mod:`kvforge.core.key_encoding` (and ``docs/prefix_keys.md``): that module owns the bytes
(:class:`ExtraKeys`, :class:`MultimodalKey`, the unit payload, :class:`UnitRecords`), this one
the chain that digests them: :class:`PrefixHasher` (unit keys, tail keys, copies at a prefix),
:func:`unit_of` and :func:`prefix_keys`. Both are importable from here.

In short: ``root = H(DOMAIN_TAG ‖ u32 version ‖ extra)`` and ``key_j = H(key_{j-1} ‖
payload_j)``, one key per unit of ``g`` tokens; ``H`` is SHA-256 by default, BLAKE2b-256 as
``algorithm="blake2b"``.

Every variable-length part carries its length or count, so two different inputs never encode
to the same bytes; only a collision of ``H`` can give two prefixes one key, and the exact check
(:mod:`kvforge.scheduler.unit_records`) turns even that into a miss.

Worked example (unit ``g = 16``, 40 tokens): units ``[0, 16)`` and ``[16, 32)`` complete, 8
tokens wait for the third unit; 2 digests, not 40. A payload holds ``8 + 4 + 16 * 4 + 4 = 80``
bytes, so a key costs one SHA-256 over ``32 + 80 = 112`` bytes.

>>> import numpy as np
>>> h = PrefixHasher(ExtraKeys(cache_salt="tenant-a"), unit=16)
>>> keys = h.extend(np.arange(40))
>>> len(keys), len(keys[0]), h.num_tokens, h.num_units
(2, 32, 40, 2)
>>> len(h.unit_records().payloads[0])
80
>>> h.root.hex()
'fc1a6dc41c12e5583cbf8cdcb0429759004f0eb41402cea69759424b16b2661b'
>>> keys[0].hex()
'c6c84d2d8e035345f624df226c71f4aa186c17a74e6be3dbda80fc3e7f0e2d2c'
>>> b = PrefixHasher(ExtraKeys(cache_salt="tenant-a"), unit=16)
>>> b.extend(np.arange(10)) + b.extend(np.arange(10, 40)) == keys   # streaming: same keys
True
>>> PrefixHasher(ExtraKeys(adapter="tenant-a")).extend(np.arange(16))[0] == keys[0]
False
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from kvforge.core.key_encoding import (
    DOMAIN_TAG,
    ENCODING_VERSION,
    MIN_MM_DIGEST_BYTES,
    NO_ITEMS,
    ExtraKeys,
    MultimodalKey,
    UnitRecords,
    as_extra_keys,
    pack_u32,
    payload_dtype,
    show_value,
    token_ids,
)

__all__ = [
    "DOMAIN_TAG",
    "ENCODING_VERSION",
    "MIN_MM_DIGEST_BYTES",
    "Algorithm",
    "ExtraKeys",
    "MultimodalKey",
    "PrefixHasher",
    "UnitRecords",
    "as_extra_keys",
    "prefix_keys",
    "unit_of",
]

Algorithm = Literal["sha256", "blake2b"] | Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


_ALGORITHMS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "blake2b": _blake2b}


def _check_at(at: object, before: int, after: int, unit: int) -> np.ndarray:
    arr = np.asarray(at)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"at must be a 1-D sequence of ints, got {show_value(at)}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr % unit)
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"at[{i}] = {int(arr[i])} is not a multiple of the unit ({unit} tokens)")
    bad = np.flatnonzero((arr <= before) | (arr > after))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"at[{i}] = {int(arr[i])} is outside ({before}, {after}]: the prefixes this extend "
            "completes"
        )
    bad = np.flatnonzero(np.diff(arr) < 0)
    if len(bad):
        i = int(bad[0]) + 1
        raise ValueError(f"at must be ascending: at[{i}] = {int(arr[i])} < at[{i - 1}]")
    return arr


def unit_of(block_sizes: Sequence[int], snapshot_interval: int | None = None) -> int:
    """The unit ``g`` of the key chain: the gcd of the given block sizes and the snapshot
    interval.

    Every size given must end on a unit, so ``g`` must divide all of them; the gcd is the
    largest such ``g``, hence the fewest digests (block sizes 16 and 64 with snapshots every
    256 tokens: ``g = 16``). The prefix cache passes the history groups' block sizes and the
    boundary only: window and state blocks that end inside a unit get tail keys
    (:meth:`PrefixHasher.tail_key`), so a 4-token state block does not shrink the unit.

    >>> unit_of([64, 256, 4, 8]), unit_of([16, 64], snapshot_interval=256), unit_of([256])
    (4, 16, 256)
    """
    if isinstance(block_sizes, int | np.integer) or not isinstance(block_sizes, Sequence):
        raise TypeError(f"block_sizes must be a sequence of ints, got {show_value(block_sizes)}")
    sizes = list(block_sizes)
    if snapshot_interval is not None:
        sizes.append(snapshot_interval)
    if not sizes:
        raise ValueError("unit_of needs at least one block size")
    for i, size in enumerate(sizes):
        where = "snapshot_interval" if i == len(block_sizes) else f"block_sizes[{i}]"
        if isinstance(size, bool) or not isinstance(size, int | np.integer):
            raise TypeError(f"{where} must be an int, got {type(size).__name__} {show_value(size)}")
        if size < 1:
            raise ValueError(f"{where} must be >= 1, got {size}")
    return math.gcd(*(int(s) for s in sizes))


class PrefixHasher:
    """The key chain of one request: one digest per unit of ``unit`` tokens.

    Args:
        extra_keys: the request's :class:`ExtraKeys` (``None``: ``ExtraKeys()``). A tuple or
            any other value is a ``TypeError``.
        mm_keys: the request's :class:`MultimodalKey` items, in any order.
        unit: tokens per unit ``g`` (see :func:`unit_of`); every key lies at a multiple of it.
        algorithm: ``"sha256"`` (default), ``"blake2b"`` (BLAKE2b-256), or a function
            ``bytes -> bytes`` used as ``H``. An injected function is for tests and for an
            explicit opt-in to a faster, weaker digest: the exact check
            (:class:`~kvforge.scheduler.unit_records.UnitRecordStore`) keeps even a broken one
            from serving another prompt's KV, at the cost of misses.

    Not thread-safe: a hasher belongs to one request (:meth:`at_prefix` makes a copy).
    """

    __slots__ = (
        "_algorithm",
        "_batch",
        "_digest",
        "_extra",
        "_key",
        "_mm",
        "_mm_enc",
        "_mm_ends",
        "_mm_starts",
        "_pending",
        "_root",
        "_root_preimage",
        "_unit",
        "_units",
    )

    def __init__(
        self,
        extra_keys: ExtraKeys | None = None,
        mm_keys: Sequence[MultimodalKey] = (),
        unit: int = 16,
        algorithm: Algorithm = "sha256",
    ) -> None:
        extra = as_extra_keys(extra_keys)
        if isinstance(unit, bool) or not isinstance(unit, int | np.integer):
            raise TypeError(f"unit must be an int, got {type(unit).__name__} {show_value(unit)}")
        if unit < 1:
            raise ValueError(f"unit must be >= 1 token, got {unit}")
        if isinstance(algorithm, str):
            if algorithm not in _ALGORITHMS:
                raise ValueError(
                    f"algorithm must be 'sha256', 'blake2b' or a bytes -> bytes function, "
                    f"got {algorithm!r}"
                )
            digest = _ALGORITHMS[algorithm]
        elif callable(algorithm):
            digest = algorithm
        else:
            raise TypeError(
                f"algorithm must be 'sha256', 'blake2b' or a bytes -> bytes function, got "
                f"{type(algorithm).__name__}"
            )
        if isinstance(mm_keys, MultimodalKey) or not isinstance(mm_keys, Sequence):
            raise TypeError(
                f"mm_keys must be a sequence of MultimodalKey, got {show_value(mm_keys)}"
            )
        for i, item in enumerate(mm_keys):
            if not isinstance(item, MultimodalKey):
                raise TypeError(
                    f"mm_keys[{i}] is a {type(item).__name__} ({show_value(item)}): pass "
                    "MultimodalKey(start, end, digest)"
                )
        mm = tuple(sorted(mm_keys, key=lambda k: (k.start, k.end, k.digest)))
        root_preimage = DOMAIN_TAG + pack_u32(ENCODING_VERSION) + extra.encode()
        root = digest(root_preimage)
        if type(root) is not bytes or not root:
            raise TypeError(f"algorithm returned {type(root).__name__}, not non-empty bytes")
        self._algorithm = algorithm
        self._digest = digest
        self._extra = extra
        self._unit = int(unit)
        self._mm = mm
        self._mm_starts = np.array([k.start for k in mm], dtype=np.int64)
        self._mm_ends = np.array([k.end for k in mm], dtype=np.int64)
        self._mm_enc = tuple(k.encode() for k in mm)
        self._root_preimage = root_preimage
        self._root = root
        self._units = 0
        self._key = root
        self._pending = np.zeros(0, dtype="<u4")
        self._batch = UnitRecords(self._unit, 0, root, root_preimage, root, (), ())

    # ------------------------------------------------------------------ state
    @property
    def unit(self) -> int:
        """Tokens per unit."""
        return self._unit

    @property
    def extra_keys(self) -> ExtraKeys:
        return self._extra

    @property
    def mm_keys(self) -> tuple[MultimodalKey, ...]:
        """The multimodal items, sorted by ``(start, end, digest)``."""
        return self._mm

    @property
    def algorithm(self) -> Algorithm:
        return self._algorithm

    @property
    def root(self) -> bytes:
        """The key of the empty prefix: ``H(root_preimage)``, which encodes the extra keys."""
        return self._root

    @property
    def root_preimage(self) -> bytes:
        return self._root_preimage

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far (hashed units and the pending tail)."""
        return self._units * self._unit + len(self._pending)

    @property
    def num_units(self) -> int:
        """Completed (hashed) units."""
        return self._units

    @property
    def key(self) -> bytes:
        """The key of the prefix of ``num_units * unit`` tokens (the root before any unit)."""
        return self._key

    # ----------------------------------------------------------------- hashing
    def extend(
        self,
        tokens: Sequence[int] | np.ndarray,
        at: object = None,
        known: Callable[[bytes, Sequence[bytes], bytes | None], list[bytes]] | None = None,
    ) -> list[bytes]:
        """Append tokens; return the keys of the prefixes they complete.

        Tokens that do not complete a unit wait and are hashed with the unit they complete.

        Args:
            tokens: the new token ids (ints in ``[0, 2**32)``).
            at: prefix lengths whose keys to return, ascending, each a multiple of ``unit``
                within ``(num_tokens_before, num_tokens_after]``; default every unit boundary
                in that range.
            known: ``known(last_key, payloads, root_preimage or None)``: the keys of the
                leading units it knows, each exactly this hasher's digest; the rest are
                hashed (the prefix cache passes ``UnitRecordStore.known_keys``).

        Returns:
            One 32-byte key per entry of ``at``.

        Raises:
            TypeError, ValueError: a bad token id or ``at`` entry, named; nothing changes.
        """
        tok = token_ids(tokens)
        unit = self._unit
        before = self.num_tokens
        after = before + len(tok)
        want = None if at is None else _check_at(at, before, after, unit)
        if len(self._pending):
            tok = np.concatenate((self._pending, tok))
        u0 = self._units
        m = len(tok) // unit
        pending = tok[m * unit :].copy()
        if m == 0:
            self._pending = pending
            self._batch = UnitRecords(
                unit, u0 * unit, self._root, self._root_preimage, self._key, (), ()
            )
            return []
        payloads = self._payloads(tok[: m * unit], u0, m)
        keys = self._chain(payloads, u0, m, known)
        k = keys[-1]
        self._batch = UnitRecords(
            unit, u0 * unit, self._root, self._root_preimage, self._key, tuple(keys), payloads
        )
        self._units = u0 + m
        self._key = k
        self._pending = pending
        if want is None:
            return keys
        return [keys[i] for i in (want // unit - u0 - 1).tolist()]

    def _chain(
        self,
        payloads: tuple[bytes, ...],
        u0: int,
        m: int,
        known: Callable[[bytes, Sequence[bytes], bytes | None], list[bytes]] | None,
    ) -> list[bytes]:
        """The keys of ``m`` units after the current key: the leading ones ``known`` knows,
        the rest hashed (SHA-256 and BLAKE2b inline, without a call per unit)."""
        k = self._key
        keys: list[bytes] = []
        if known is not None:
            keys = known(k, payloads, self._root_preimage if u0 == 0 else None)[:m]
            if keys:
                k = keys[-1]
        rest = payloads[len(keys) :] if keys else payloads
        if self._digest is _sha256:
            sha = hashlib.sha256
            for p in rest:
                k = sha(k + p).digest()
                keys.append(k)
        elif self._digest is _blake2b:
            blake = hashlib.blake2b
            for p in rest:
                k = blake(k + p, digest_size=32).digest()
                keys.append(k)
        else:
            fn = self._digest
            for p in rest:
                k = fn(k + p)
                if type(k) is not bytes:
                    raise TypeError(f"algorithm returned {type(k).__name__}, not bytes")
                keys.append(k)
        return keys

    def _payloads(self, tok: np.ndarray, u0: int, m: int) -> tuple[bytes, ...]:
        """The payloads of units ``u0 .. u0 + m - 1``: one numpy layout, sliced per unit."""
        unit = self._unit
        rows = np.zeros(m, dtype=payload_dtype(unit))
        rows["offset"] = np.arange(u0, u0 + m, dtype=np.uint64) * np.uint64(unit)
        rows["count"] = unit
        rows["tokens"] = tok.reshape(m, unit)
        blob = rows.tobytes()
        size = rows.itemsize
        payloads = [blob[i : i + size] for i in range(0, m * size, size)]
        if len(self._mm_enc):
            lo, hi = u0 * unit, (u0 + m) * unit
            items: dict[int, list[bytes]] = {}
            for i in np.flatnonzero((self._mm_ends > lo) & (self._mm_starts < hi)).tolist():
                first = max(int(self._mm_starts[i]) // unit, u0)
                last = min((int(self._mm_ends[i]) - 1) // unit, u0 + m - 1)
                for u in range(first - u0, last - u0 + 1):
                    items.setdefault(u, []).append(self._mm_enc[i])
            for u, encs in items.items():
                payloads[u] = payloads[u][:-4] + pack_u32(len(encs)) + b"".join(encs)
        return tuple(payloads)

    def tail_key(self, end: int) -> tuple[bytes, bytes, bytes]:
        """The key of a prefix that ends inside a unit: ``(key, parent, payload)``.

        Window and state blocks end between unit boundaries (a 4-token state block under a
        256-token unit). Their key hangs off the chain at ``base = end // unit * unit``:
        ``key = H(key_at(base) ‖ payload)`` with ``payload = u64 base ‖ u32 n ‖ n x u32 token
        id ‖ u32 M ‖ M x item`` over tokens ``[base, end)`` (``0 < n < unit``, so it never
        encodes like a unit, whose count is ``unit``), the items overlapping them as in a unit.
        ``base`` must lie in the last :meth:`extend` (``unit_records().start <= base``) and
        ``end <= num_tokens``.

        >>> h = PrefixHasher(unit=16)
        >>> _ = h.extend(np.arange(40))
        >>> key, parent, payload = h.tail_key(20)    # tokens 16..19 after the first unit
        >>> parent == h.unit_records().keys[0], len(payload)    # 8 + 4 + 4 * 4 + 4
        (True, 32)
        """
        unit = self._unit
        batch = self._batch
        if isinstance(end, bool) or not isinstance(end, int | np.integer):
            raise TypeError(f"end must be an int, got {show_value(end)}")
        end = int(end)
        base = end // unit * unit
        if end % unit == 0 or not batch.start <= base or end > self.num_tokens:
            raise ValueError(
                f"tail_key({end}): the end must fall inside a unit of {unit} tokens, after the "
                f"last extend's start ({batch.start}) and at most num_tokens ({self.num_tokens})"
            )
        n = end - base
        if base < batch.end:
            payload = batch.payloads[(base - batch.start) // unit]
            tokens = payload[12 : 12 + 4 * n]
        else:
            tokens = self._pending[:n].astype("<u4").tobytes()
        index = (base - batch.start) // unit - 1
        parent = batch.parent if index < 0 else batch.keys[index]
        items = NO_ITEMS  # without multimodal items, no array pass per tail
        if self._mm_enc:
            hits = np.flatnonzero((self._mm_ends > base) & (self._mm_starts < end)).tolist()
            items = pack_u32(len(hits)) + b"".join(self._mm_enc[i] for i in hits)
        body = struct.pack("<QI", base, n) + tokens + items
        key = self._digest(parent + body)
        if type(key) is not bytes:
            raise TypeError(f"algorithm returned {type(key).__name__}, not bytes")
        return key, parent, body

    def unit_records(self) -> UnitRecords:
        """The records of the units the last :meth:`extend` completed (for a hasher made by
        :meth:`at_prefix`, those of its source's last extend up to its position): what
        :meth:`UnitRecordStore.hold <kvforge.scheduler.unit_records.UnitRecordStore.hold>` and
        ``confirm`` take. No hashing: the payloads were laid out once by :meth:`extend`."""
        return self._batch

    def at_prefix(self, num_tokens: int) -> PrefixHasher:
        """A copy positioned at the prefix of ``num_tokens`` tokens, to continue hashing a
        request's suffix after a prefix hit.

        ``num_tokens`` is :attr:`num_tokens` (a plain copy), 0, or a multiple of ``unit``
        within the units of the last :meth:`extend` (``[unit_records().start,
        unit_records().end]``); the copy's :meth:`unit_records` are those up to it.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer):
            raise TypeError(f"num_tokens must be an int, got {show_value(num_tokens)}")
        n = int(num_tokens)
        other = PrefixHasher.__new__(PrefixHasher)
        for name in PrefixHasher.__slots__:
            setattr(other, name, getattr(self, name))
        if n == self.num_tokens:
            return other
        batch = self._batch
        if n == 0:
            other._batch = UnitRecords(
                self._unit, 0, self._root, self._root_preimage, self._root, (), ()
            )
        elif n % self._unit == 0 and batch.start <= n <= batch.end:
            other._batch = batch.upto(n)
        else:
            raise ValueError(
                f"at_prefix({n}): a hasher can be placed at num_tokens ({self.num_tokens}), 0, "
                f"or a multiple of the unit ({self._unit}) within the last extend "
                f"[{batch.start}, {batch.end}]"
            )
        other._units = n // self._unit
        other._key = other._batch.keys[-1] if other._batch.keys else other._batch.parent
        other._pending = np.zeros(0, dtype="<u4")
        return other

    def __repr__(self) -> str:
        return (
            f"PrefixHasher(num_tokens={self.num_tokens}, unit={self._unit}, "
            f"algorithm={self._algorithm!r}, extra_keys={self._extra!r}, "
            f"mm_keys={len(self._mm)})"
        )


def prefix_keys(
    tokens: Sequence[int] | np.ndarray,
    extra_keys: ExtraKeys | None = None,
    mm_keys: Sequence[MultimodalKey] = (),
    unit: int = 16,
    algorithm: Algorithm = "sha256",
) -> list[bytes]:
    """The keys of every complete unit of ``tokens``: element ``j`` covers
    ``tokens[: (j + 1) * unit]``."""
    return PrefixHasher(extra_keys, mm_keys, unit, algorithm).extend(tokens)
