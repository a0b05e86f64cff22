"""The exact check of prefix hits: a refcounted chain of unit records keyed by unit key.

A prefix key (:mod:`kvforge.core.prefix_keys`) only names content; this store proves it. Each
record is a unit's ``(parent record, payload)``, the very bytes its key hashed, and the first
unit's parent is a root record holding the root preimage (the encoded extra keys). A hit that
ends at unit ``t`` is exact iff :meth:`UnitRecordStore.confirm` returns at least ``t``: the
stored chain then equals the query's token ids, multimodal items and extra keys byte for
byte, for every unit from 0, so it holds even when the cached blocks of a group are only a
window tail or a state snapshot. A key collision (possible only with an injected weak digest)
therefore costs a miss, never another prompt's KV.

Reference counts. A record's count is the references taken on it (:meth:`~UnitRecordStore.hold`
``at=``: one per cached block that ends there; one per request whose chain cursor is there)
plus its child records. A record whose count reaches 0 goes, and its parent loses a child
(:meth:`~UnitRecordStore.release` cascades). A record therefore lives exactly while some
cached block or running request needs the chain through it.

Chains are verified as they are stored. A batch that starts at unit 0 is checked from the root;
a later batch continues the *cursor* that the previous ``hold`` of the same request returned,
which is only ever a record this request's own content matched. A unit whose key is stored
with other content is a conflict: the store keeps the first, holds nothing from there on, and
returns no cursor, so a request whose chain conflicts stops adding records.

Integration, per request (the block manager's lock serialises calls; the store is not
thread-safe on its own)::

    n = store.confirm(hasher.unit_records(), L // unit)   # lookup: hit at L is exact iff
    hit = n * unit >= L                                    # n >= L // unit, else a counted miss
    held = store.hold(match_hasher.unit_records())         # adopt: verify 0..L, cursor at L
    ...
    hasher.extend(new_tokens)                              # a step: units it completed
    held = store.hold(hasher.unit_records(), at=ends_of_blocks_to_cache, cursor=held.cursor)
    # cache a block ending at at[i] only if held.keys[i] is not None; on eviction
    store.release(key)
    store.release(held.cursor)                             # the request ends (if not None)

Memory (``docs/prefix_keys.md``): per cached unit one record object, its key, its payload and a
dict slot; about 18 bytes per token at unit 16 and 5 at unit 256 (4 of them token ids).

>>> import numpy as np
>>> from kvforge.core.prefix_keys import ExtraKeys, PrefixHasher
>>> store = UnitRecordStore()
>>> h = PrefixHasher(ExtraKeys(cache_salt="t"), unit=16)
>>> keys = h.extend(np.arange(64))                 # 4 units
>>> held = store.hold(h.unit_records(), at=[32])   # a block ends at 32; cursor at 64
>>> held.keys == [keys[1]], held.cursor == keys[3], store.num_records
(True, True, 4)
>>> store.confirm(h.unit_records())                # all 4 units equal the stored records
4
>>> store.release(held.cursor)                     # units ending at 48, 64 go; 16, 32 stay
2
>>> other = PrefixHasher(ExtraKeys(cache_salt="u"), unit=16)
>>> _ = other.extend(np.arange(64))
>>> store.confirm(other.unit_records())            # another salt: not even the root matches
0
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvforge.core.prefix_keys import PrefixHasher, UnitRecords

__all__ = ["Held", "UnitRecordStore"]


class _Node:
    """A stored unit record (or a root: ``parent is None``, ``payload`` the root preimage).

    ``kids`` links the records whose parent this is, so a lookup can walk a stored chain by
    payload (:meth:`UnitRecordStore.known_keys`): ``None``, the one child, or a dict
    ``payload -> child`` where the chain branches."""

    __slots__ = ("count", "key", "kids", "parent", "payload", "proof")

    def __init__(self, key: bytes, parent: _Node | None, payload: bytes) -> None:
        self.key = key
        self.parent = parent
        self.payload = payload
        self.count = 0
        #: the SHA-256 chain up to here, once computed (UnitRecordStore.sha256_chain)
        self.proof: bytes | None = None
        self.kids: _Node | dict[bytes, _Node] | None = None

    def kid(self, payload: bytes) -> _Node | None:
        kids = self.kids
        if kids is None:
            return None
        if type(kids) is _Node:
            return kids if kids.payload == payload else None
        return kids.get(payload)  # type: ignore[union-attr]

    def link(self, child: _Node) -> None:
        kids = self.kids
        if kids is None:
            self.kids = child
        elif type(kids) is _Node:
            self.kids = {kids.payload: kids, child.payload: child}
        else:
            kids[child.payload] = child  # type: ignore[index]

    def unlink(self, child: _Node) -> None:
        kids = self.kids
        if kids is child:
            self.kids = None
        elif type(kids) is dict:
            del kids[child.payload]
            if len(kids) == 1:
                self.kids = next(iter(kids.values()))


_NODE_BYTES = sys.getsizeof(_Node(b"", None, b""))
_BYTES_HEADER = sys.getsizeof(b"")  # a bytes object of n bytes takes _BYTES_HEADER + n
_NODE_FIXED = _NODE_BYTES + 2 * _BYTES_HEADER  # a record object, its key's and payload's headers


class Held(NamedTuple):
    """What :meth:`UnitRecordStore.hold` did.

    Attributes:
        keys: for each entry of ``at``, the key it took a reference on, or ``None`` where the
            chain is not held (a conflict): do not cache a block there.
        cursor: the key of the request's last held unit, on which it now holds a reference
            (pass it to the next ``hold``; release it when the request ends), or ``None``
            when the chain conflicts or holds nothing yet (a batch at unit 0 with no units).
    """

    keys: list[bytes | None]
    cursor: bytes | None


def _records(value: object, name: str) -> UnitRecords:
    if isinstance(value, PrefixHasher):
        return value.unit_records()
    if isinstance(value, UnitRecords):
        return value
    raise TypeError(
        f"{name} must be UnitRecords (PrefixHasher.unit_records()) or a PrefixHasher, got "
        f"{type(value).__name__}"
    )


class UnitRecordStore:
    """Refcounted unit records: ``key -> (parent, payload)``, and roots ``key -> preimage``.

    Not thread-safe: its owner (the block manager) serialises calls.
    """

    __slots__ = ("_object_bytes", "_records", "_roots")

    def __init__(self) -> None:
        self._records: dict[bytes, _Node] = {}
        self._roots: dict[bytes, _Node] = {}
        self._object_bytes = 0

    # ---------------------------------------------------------------- queries
    @property
    def num_records(self) -> int:
        """Unit records stored (roots not counted)."""
        return len(self._records)

    @property
    def num_roots(self) -> int:
        """Distinct roots (extra keys) with at least one unit stored."""
        return len(self._roots)

    @property
    def nbytes(self) -> int:
        """Approximate bytes held: record objects, keys, payloads and the two dicts."""
        return self._object_bytes + sys.getsizeof(self._records) + sys.getsizeof(self._roots)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def refcount(self, key: bytes) -> int:
        """References plus children of the record ``key`` (0 when it is not stored)."""
        node = self._records.get(key)
        return 0 if node is None else node.count

    def confirm(self, records: UnitRecords | PrefixHasher, num_units: int | None = None) -> int:
        """How many leading units of ``records`` (from unit 0; at most ``num_units``) equal the
        stored chain byte for byte: extra keys (root preimage), then each unit's parent and
        payload. A hit that ends at unit ``t`` is exact iff the result is ``>= t``."""
        rec = _records(records, "records")
        if rec.start != 0:
            raise ValueError(
                f"confirm needs the chain from unit 0; these records start at token {rec.start}"
            )
        n = len(rec.keys) if num_units is None else num_units
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 0 <= n <= len(rec):
            raise ValueError(f"num_units must be an int in [0, {len(rec)}], got {num_units!r}")
        if n == 0:
            return 0
        prev = self._roots.get(rec.root)
        if prev is None or prev.payload != rec.root_preimage:
            return 0
        get = self._records.get
        for i, (key, payload) in enumerate(zip(rec.keys[:n], rec.payloads, strict=False)):
            node = get(key)
            if node is None or node.parent is not prev or node.payload != payload:
                return i
            prev = node
        return int(n)

    def known_keys(
        self, parent: bytes, payloads: Sequence[bytes], root_preimage: bytes | None = None
    ) -> list[bytes]:
        """The keys of the leading ``payloads`` that are stored under ``parent``, found by
        walking the stored chain by payload instead of hashing: the hook of
        :meth:`PrefixHasher.extend` (``known=``). ``parent`` is the hasher's last key; pass
        ``root_preimage`` when it is the root (no unit hashed yet).

        Each key returned is a stored record's: its parent is the previous key's record and
        its payload is byte for byte the unit's, so it is the key the hasher would compute
        (records are only ever stored from a hasher's own output, :meth:`hold`) and those
        units are exact, as :meth:`confirm` would find. A root is followed only when its
        stored preimage equals ``root_preimage``.

        >>> import numpy as np
        >>> from kvforge.core.prefix_keys import PrefixHasher
        >>> store, h = UnitRecordStore(), PrefixHasher(unit=16)
        >>> keys = h.extend(np.arange(64))
        >>> _ = store.hold(h.unit_records(), at=[64])
        >>> recs = h.unit_records()
        >>> store.known_keys(recs.root, recs.payloads, recs.root_preimage) == keys
        True
        >>> store.known_keys(keys[1], recs.payloads[2:]) == keys[2:]
        True
        """
        if root_preimage is not None:
            node = self._roots.get(parent)
            if node is None or node.payload != root_preimage:
                return []
        else:
            node = self._records.get(parent)
            if node is None:
                return []
        keys: list[bytes] = []
        for payload in payloads:
            node = node.kid(payload)
            if node is None:
                break
            keys.append(node.key)
        return keys

    def sha256_chain(self, key: bytes) -> bytes:
        """The SHA-256 chain over the stored bytes up to the record ``key``: ``d = SHA-256(root
        preimage)``, then ``d = SHA-256(d ‖ payload)`` for every unit from unit 0 to ``key``,
        which is the ``sha256`` prefix key of that content whatever digest the keys use (a
        remote tier's content proof, ``docs/tiered_store.md``). Each record keeps its digest
        once computed, so a chain is hashed once while its records live; a record made again
        under the same key (a weak digest's collision) is a new record and is hashed anew.

        Raises:
            KeyError: ``key`` is not a held record.
        """
        node: _Node | None = self._records.get(key) if isinstance(key, bytes) else None
        if node is None:
            shown = key.hex()[:16] + "..." if isinstance(key, bytes) else repr(key)
            raise KeyError(f"sha256_chain({shown}): no such record is held")
        path: list[_Node] = []
        while node is not None and node.proof is None:
            path.append(node)
            node = node.parent
        digest = b"" if node is None else node.proof
        for n in reversed(path):
            data = n.payload if n.parent is None else digest + n.payload
            digest = hashlib.sha256(data).digest()
            n.proof = digest
            self._object_bytes += _BYTES_HEADER + len(digest)
        return digest  # type: ignore[return-value]

    # ---------------------------------------------------------------- updates
    def hold(
        self,
        records: UnitRecords | PrefixHasher,
        at: Sequence[int] | np.ndarray = (),
        cursor: bytes | None = None,
    ) -> Held:
        """Store the records of a batch of units, take references, move the request's cursor.

        Args:
            records: consecutive units of one request (``PrefixHasher.unit_records()``).
            at: token counts where a cached block ends (multiples of the unit in
                ``(start, end]``, or ``start`` itself when ``start > 0``); one reference is
                taken at each, repeats allowed.
            cursor: the cursor the previous ``hold`` of this request returned; ``None`` for a
                batch that starts at unit 0 (verified from the root).

        Returns:
            :class:`Held`: the key referenced for each ``at`` (``None`` past a conflict) and
            the new cursor. The old cursor's reference is released.

        Raises:
            TypeError, ValueError: bad arguments (named); nothing changes.
        """
        rec = _records(records, "records")
        at_list = self._check_at(at, rec)
        prev, conflict = self._chain_start(rec, cursor)
        anchor = prev
        chain: list[_Node] = []
        if not conflict:
            conflict = self._store_chain(rec, prev, chain)
        keys: list[bytes | None] = []
        for t in at_list:
            i = (t - rec.start) // rec.unit - 1
            node = anchor if i < 0 else chain[i] if i < len(chain) else None
            if node is None:
                keys.append(None)
            else:
                node.count += 1
                keys.append(node.key)
        new_cursor: bytes | None
        if conflict:
            new_cursor = None
            if chain:
                self._prune(chain[-1])
        elif chain:
            chain[-1].count += 1
            new_cursor = chain[-1].key
        else:
            new_cursor = cursor  # an empty batch: the cursor stays where it is
        if cursor is not None and new_cursor != cursor:
            self._drop(self._records[cursor])
        return Held(keys, new_cursor)

    def _chain_start(self, rec: UnitRecords, cursor: bytes | None) -> tuple[_Node, bool]:
        """The record a batch continues (a root, new or stored, for a batch at unit 0; else
        the request's cursor), and whether the stored root conflicts with the batch's extra
        keys. Changes nothing.

        Raises:
            TypeError, ValueError: a cursor given where none applies, missing, not held, or
                not the record these records continue.
        """
        if rec.start == 0:
            if cursor is not None:
                raise ValueError(
                    "records that start at unit 0 are verified from the root: pass cursor=None"
                )
            prev = self._roots.get(rec.root)
            if prev is None:
                return _Node(rec.root, None, rec.root_preimage), False
            return prev, prev.payload != rec.root_preimage
        if cursor is None:
            raise ValueError(
                f"records that start at token {rec.start} continue a held chain: pass the "
                "cursor the previous hold of this request returned (a request whose cursor "
                "is None holds no more records)"
            )
        if not isinstance(cursor, bytes):
            raise TypeError(f"cursor must be bytes or None, got {type(cursor).__name__}")
        prev = self._records.get(cursor)
        if prev is None:
            raise ValueError(f"cursor {cursor.hex()[:16]}... is not held (released?)")
        if cursor != rec.parent:
            raise ValueError(
                f"records continue key {rec.parent.hex()[:16]}..., not the cursor "
                f"{cursor.hex()[:16]}...: the hasher and the cursor are out of step"
            )
        return prev, False

    def _store_chain(self, rec: UnitRecords, prev: _Node, chain: list[_Node]) -> bool:
        """Walk ``rec``'s units from ``prev``, storing each unit not stored yet (a new root is
        stored with its first unit) and appending every unit's record to ``chain``; stop at
        the first unit stored with other content. Returns whether one was (a conflict)."""
        records_map = self._records
        added = 0
        conflict = False
        for key, payload in zip(rec.keys, rec.payloads, strict=True):
            node = records_map.get(key)
            if node is None:
                node = _Node(key, prev, payload)
                if prev.count == 0 and prev.parent is None:  # a root gets its first unit
                    self._roots[prev.key] = prev
                    added += self._size(prev)
                prev.count += 1
                prev.link(node)
                records_map[key] = node
                added += len(key) + len(payload)
                added += _NODE_FIXED
            elif node.parent is not prev or node.payload != payload:
                conflict = True
                break
            chain.append(node)
            prev = node
        self._object_bytes += added
        return conflict

    def retain(self, key: bytes) -> None:
        """Take one more reference on the held record ``key`` (a host tier page keeps the
        record its evicted device block held, which the prefix cache then releases)."""
        node = self._records.get(key) if isinstance(key, bytes) else None
        if node is None:
            shown = key.hex()[:16] + "..." if isinstance(key, bytes) else repr(key)
            raise KeyError(f"retain({shown}): no such record is held")
        node.count += 1

    def release(self, key: bytes) -> int:
        """Drop one reference on the record ``key``; remove the records whose count reaches 0
        (cascading to parents and the root). Returns how many unit records went."""
        node = self._records.get(key) if isinstance(key, bytes) else None
        if node is None:
            shown = key.hex()[:16] + "..." if isinstance(key, bytes) else repr(key)
            raise KeyError(f"release({shown}): no such record is held")
        return self._drop(node)

    def clear(self) -> None:
        """Forget every record (references included)."""
        self._records.clear()
        self._roots.clear()
        self._object_bytes = 0

    # --------------------------------------------------------------- internals
    @staticmethod
    def _size(node: _Node) -> int:
        proof = 0 if node.proof is None else _BYTES_HEADER + len(node.proof)
        return _NODE_FIXED + len(node.key) + len(node.payload) + proof

    @staticmethod
    def _check_at(at: object, rec: UnitRecords) -> list[int]:
        arr = np.asarray(at)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError(f"at must be a 1-D sequence of ints, got {at!r}")
        lo = rec.start if rec.start > 0 else rec.unit
        values = arr.astype(np.int64).tolist()
        for i, t in enumerate(values):
            if t % rec.unit or not lo <= t <= rec.end:
                raise ValueError(
                    f"at[{i}] = {t} is not a unit boundary ({rec.unit} tokens) in "
                    f"[{lo}, {rec.end}], the prefixes these records (and the cursor) cover"
                )
        return values

    def _drop(self, node: _Node) -> int:
        node.count -= 1
        return self._prune(node)

    def _prune(self, node: _Node | None) -> int:
        removed = 0
        while node is not None and node.count == 0:
            parent = node.parent
            if parent is None:
                del self._roots[node.key]
            else:
                del self._records[node.key]
                removed += 1
                parent.count -= 1
                parent.unlink(node)
            self._object_bytes -= self._size(node)
            node = parent
        return removed
