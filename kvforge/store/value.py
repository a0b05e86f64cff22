"""The remote tier's value format: an 80-byte header, then the payload (a block's packed pages).

Invariant: :func:`decode` hands back payload bytes only when the magic, the version, the
key, the layout fingerprint, the length and the checksum all match; anything else is a typed
:class:`MissReason`, never an exception and never bytes that belong to another key or layout.
The checksum covers the header's first 64 bytes and the payload, so a flipped bit anywhere in
the value is a miss (``docs/tiered_store.md``). It detects truncated or corrupted values; it is
not a MAC (keys carry the tenant and layout separation), so a fast unkeyed hash will do:

- version 2 (written): XXH3-128 (``xxhash.xxh3_128``, seed 0, its canonical big-endian
  ``digest()``), 23-31 GB/s on one core here where BLAKE2b runs at 0.7-0.9;
- version 1 (read and verified, never written): BLAKE2b-128 (``hashlib.blake2b``,
  ``digest_size=16``, no key, no person), what kvforge wrote before XXH3.

Both versions have the same header; only the checksum function differs. The ``xxhash``
package is required (``pip install xxhash``; the extras ``redis``, ``mooncake`` and ``test``
name it): importing this module without it raises an :class:`ImportError` that says so.

Header (little-endian, :data:`HEADER_SIZE` = 80 bytes)::

    offset  size  field
    0       4     magic           b"KVFV"
    4       2     version         u16 = 2 (1 is still read)
    6       2     header size     u16 = 80
    8       32    key digest      BLAKE2b-256 of the key's bytes (person b"kvforge-key")
    40      16    layout digest   BLAKE2b-128 of the layout fingerprint (person b"kvforge-layout")
    56      8     payload length  u64
    64      16    checksum        of bytes [0, 64) of the header, then the payload:
                                  version 2 XXH3-128, version 1 BLAKE2b-128

>>> key, layout = b"k" * 32, b"gqa:bf16:16"
>>> blob = encode(key, layout, b"payload")
>>> len(blob) == HEADER_SIZE + 7
True
>>> bytes(decode(blob, key, layout))
b'payload'
>>> decode(blob[:-1], key, layout)
<MissReason.TRUNCATED: 'truncated'>
>>> decode(blob, key, b"mla:bf16:64")
<MissReason.OTHER_LAYOUT: 'other_layout'>
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

try:
    import xxhash
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "kvforge.store.value needs the 'xxhash' package for its XXH3-128 value checksum: "
        "pip install xxhash (or pip install 'kvforge[redis]' / 'kvforge[mooncake]')"
    ) from exc

__all__ = [
    "CHECKSUM",
    "CHECKSUMS",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "MissReason",
    "check",
    "decode",
    "encode",
    "encode_header",
    "encode_header_of_parts",
    "encode_into",
    "key_digest",
    "layout_digest",
]

MAGIC = b"KVFV"
#: the version :func:`encode_header` writes
VERSION = 2
HEADER_SIZE = 80
#: the checksum of each version this reader verifies, by name (as the docs report it)
CHECKSUMS = {1: "blake2b-128", 2: "xxh3-128"}
#: the checksum written, by name
CHECKSUM = CHECKSUMS[VERSION]

_FIXED = struct.Struct("<4sHH32s16sQ")  # the 64 bytes the checksum covers
_CHECKSUM_AT = _FIXED.size
assert _CHECKSUM_AT == 64 and HEADER_SIZE == _CHECKSUM_AT + 16


class MissReason(str, enum.Enum):
    """Why a lookup of one key gave no payload. Every reason is a miss: the caller recomputes."""

    #: the store has no value under the key
    ABSENT = "absent"
    #: the value is shorter than its header says (or than a header)
    TRUNCATED = "truncated"
    #: magic, header size or checksum do not match: bytes changed after the put
    CORRUPTED = "corrupted"
    #: a version this reader does not know
    OTHER_VERSION = "other_version"
    #: a whole, unchanged value written for another key
    WRONG_KEY = "wrong_key"
    #: a whole, unchanged value written by an engine with another layout fingerprint
    OTHER_LAYOUT = "other_layout"
    #: a whole value of this key and layout whose payload length differs from the destination's
    OTHER_LENGTH = "other_length"
    #: the client or the server failed (down, slow, restarting, full): counted as an error
    STORE_ERROR = "store_error"
    #: not asked: the store was closed, or backs off after an error (``retry_after_s``)
    UNAVAILABLE = "unavailable"

    def __repr__(self) -> str:
        return f"<MissReason.{self.name}: {self.value!r}>"


def key_digest(key: bytes) -> bytes:
    """The 32 bytes a header carries for ``key``."""
    return hashlib.blake2b(key, digest_size=32, person=b"kvforge-key").digest()


def layout_digest(fingerprint: bytes) -> bytes:
    """The 16 bytes a header carries for a layout ``fingerprint``."""
    return hashlib.blake2b(fingerprint, digest_size=16, person=b"kvforge-layout").digest()


def _blake2b_128(fixed: bytes | memoryview, payload: Any) -> bytes:
    h = hashlib.blake2b(fixed, digest_size=16)
    h.update(payload)
    return h.digest()


def _xxh3_128(fixed: bytes | memoryview, payload: Any) -> bytes:
    h = xxhash.xxh3_128(fixed)
    h.update(payload)
    return h.digest()


# version -> the 16-byte checksum of (header bytes [0, 64), payload)
_CHECKSUM_OF: dict[int, Callable[[bytes | memoryview, Any], bytes]] = {
    1: _blake2b_128,
    2: _xxh3_128,
}
assert set(_CHECKSUM_OF) == set(CHECKSUMS)


def encode_header(key: bytes, fingerprint: bytes, payload: Any) -> bytes:
    """The :data:`HEADER_SIZE` bytes that precede ``payload`` (any contiguous buffer) in a
    value of ``key`` written under layout ``fingerprint``. Reads the payload once (checksum)."""
    view = memoryview(payload).cast("B")
    fixed = _FIXED.pack(
        MAGIC, VERSION, HEADER_SIZE, key_digest(key), layout_digest(fingerprint), view.nbytes
    )
    return fixed + _CHECKSUM_OF[VERSION](fixed, view)


def encode_header_of_parts(key: bytes, fingerprint: bytes, parts: Sequence[Any]) -> bytes:
    """The header :func:`encode_header` gives for the payload ``b"".join(parts)``, without
    joining: ``parts`` are 1-D byte buffers (``memoryview`` of format ``"B"``, ``bytes``), fed
    to the checksum one after another. XXH3-128's streaming state hashes a sequence of
    updates exactly as one call over their concatenation, so the value written header, then
    parts, is byte for byte the one written from a packed page (``tests/store``)."""
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        key_digest(key),
        layout_digest(fingerprint),
        sum(map(len, parts)),
    )
    h = xxhash.xxh3_128(fixed)
    for part in parts:
        h.update(part)
    return fixed + h.digest()


assert VERSION == 2, "encode_header_of_parts streams XXH3-128, the checksum of version 2"


def encode(key: bytes, fingerprint: bytes, payload: Any) -> bytes:
    """A whole value: header then payload, as one ``bytes`` (one copy of the payload)."""
    return b"".join((encode_header(key, fingerprint, payload), memoryview(payload).cast("B")))


def encode_into(out: Any, key: bytes, fingerprint: bytes, payload: Any) -> None:
    """Write the value :func:`encode` gives into ``out``, a writable buffer of exactly
    :data:`HEADER_SIZE` plus the payload's bytes: the payload first, then the header, whose
    checksum then reads the payload from the CPU cache the copy just filled."""
    dst = memoryview(out).cast("B")
    src = memoryview(payload).cast("B")
    if dst.nbytes != HEADER_SIZE + src.nbytes:
        raise ValueError(
            f"out must hold {HEADER_SIZE + src.nbytes} bytes (header and payload), "
            f"got {dst.nbytes}"
        )
    dst[HEADER_SIZE:] = src
    dst[:HEADER_SIZE] = encode_header(key, fingerprint, dst[HEADER_SIZE:])


def check(header: Any, payload: Any, key: bytes, fingerprint: bytes) -> MissReason | None:
    """``None`` if ``header`` (a value's first :data:`HEADER_SIZE` bytes) and ``payload`` (all
    the bytes the store gave after them) form a value of ``key`` under ``fingerprint``; else
    the reason. Values of every version in :data:`CHECKSUMS` are verified with their own
    checksum. Never raises on any bytes."""
    head = memoryview(header).cast("B")
    body = memoryview(payload).cast("B")
    if head.nbytes < HEADER_SIZE:
        return MissReason.TRUNCATED
    magic, version, header_size, kd, ld, length = _FIXED.unpack_from(head)
    if magic != MAGIC or header_size != HEADER_SIZE:
        return MissReason.CORRUPTED
    checksum = _CHECKSUM_OF.get(version)
    if checksum is None:
        return MissReason.OTHER_VERSION
    if body.nbytes < length:
        return MissReason.TRUNCATED
    if body.nbytes > length:
        return MissReason.CORRUPTED
    if checksum(head[:_CHECKSUM_AT], body) != bytes(head[_CHECKSUM_AT:HEADER_SIZE]):
        return MissReason.CORRUPTED
    if kd != key_digest(key):
        return MissReason.WRONG_KEY
    if ld != layout_digest(fingerprint):
        return MissReason.OTHER_LAYOUT
    return None


def decode(
    blob: Any, key: bytes, fingerprint: bytes, *, expected_length: int | None = None
) -> memoryview | MissReason:
    """The payload of a whole value ``blob`` (a view into it, no copy), or why it is a miss.

    ``expected_length``: the payload length the caller needs (its destination's size); a value
    with another length is :attr:`MissReason.OTHER_LENGTH`. Never raises on any bytes."""
    view = memoryview(blob).cast("B")
    if view.nbytes < HEADER_SIZE:
        return MissReason.TRUNCATED
    body = view[HEADER_SIZE:]
    reason = check(view[:HEADER_SIZE], body, key, fingerprint)
    if reason is not None:
        return reason
    if expected_length is not None and body.nbytes != expected_length:
        return MissReason.OTHER_LENGTH
    return body
