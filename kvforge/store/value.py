"""The remote tier's value format: a 112-byte header, then the payload (a block's packed pages).

Invariant: :func:`decode` hands back payload bytes only when the magic, the version, the key,
the layout fingerprint (which covers the model identity), the content proof, the length and
the checksum all match; anything else is a typed :class:`MissReason`, never an exception and
never bytes that belong to another key, layout, model or prompt. The checksum covers the
header's first 96 bytes and the payload, so a flipped bit anywhere in the value is a miss
(``docs/tiered_store.md``). It detects truncated or corrupted values; it is not a MAC (keys
carry the tenant, layout and model separation), so a fast unkeyed hash will do: XXH3-128
(``xxhash.xxh3_128``, seed 0, its canonical big-endian ``digest()``), 23-31 GB/s on one core
here where BLAKE2b runs at 0.7-0.9. The ``xxhash`` package is required (``pip install
xxhash``; the extras ``redis``, ``mooncake`` and ``test`` name it): importing this module
without it raises an :class:`ImportError` that says so.

The content proof is what the reader needs to prove that the stored block's tokens and extra
keys equal its prompt's, whatever digest the prefix keys use: the writer's SHA-256 chain over
the block's prefix ``[0, end)`` in the canonical encoding of ``docs/prefix_keys.md`` (with the
default ``sha256`` keys it is the block's own prefix key). A key collision (an injected or
fast key digest) therefore finds a value whose proof differs: :attr:`MissReason.OTHER_CONTENT`,
a counted miss. Callers that pass no proof write and expect :data:`NO_PROOF` (32 zero bytes).

Versions 1 and 2 (80-byte header, no content proof) are no longer read: such a value is
:attr:`MissReason.OLD_FORMAT`, a counted miss (rewritten by the next publish of its block).

Header (little-endian, :data:`HEADER_SIZE` = 112 bytes)::

    offset  size  field
    0       4     magic           b"KVFV"
    4       2     version         u16 = 3 (1 and 2: old format, a miss)
    6       2     header size     u16 = 112
    8       32    key digest      BLAKE2b-256 of the key's bytes (person b"kvforge-key")
    40      16    layout digest   BLAKE2b-128 of the layout fingerprint (person b"kvforge-layout")
    56      32    content proof   SHA-256 chain over the block's tokens and extra keys
    88      8     payload length  u64
    96      16    checksum        XXH3-128 of bytes [0, 96) of the header, then the payload

>>> key, layout, proof = b"k" * 32, b"gqa:bf16:16", b"p" * 32
>>> blob = encode(key, layout, b"payload", proof)
>>> len(blob) == HEADER_SIZE + 7
True
>>> bytes(decode(blob, key, layout, proof=proof))
b'payload'
>>> decode(blob[:-1], key, layout, proof=proof)
<MissReason.TRUNCATED: 'truncated'>
>>> decode(blob, key, b"mla:bf16:64", proof=proof)
<MissReason.OTHER_LAYOUT: 'other_layout'>
>>> decode(blob, key, layout, proof=b"q" * 32)
<MissReason.OTHER_CONTENT: 'other_content'>
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
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
    "NO_PROOF",
    "OLD_VERSIONS",
    "PROOF_SIZE",
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
#: the version :func:`encode_header` writes, the only one read
VERSION = 3
#: versions written before the content proof: recognised and counted as old-format misses
OLD_VERSIONS = (1, 2)
HEADER_SIZE = 112
#: bytes of a content proof
PROOF_SIZE = 32
#: the proof of a value written (and expected) without one
NO_PROOF = bytes(PROOF_SIZE)
#: the checksum of the version read, by name (as the docs report it)
CHECKSUMS = {3: "xxh3-128"}
#: the checksum written, by name
CHECKSUM = CHECKSUMS[VERSION]

_FIXED = struct.Struct("<4sHH32s16s32sQ")  # the 96 bytes the checksum covers
_CHECKSUM_AT = _FIXED.size
_LEAD = struct.Struct("<4sHH")  # magic, version, header size: the same in every version
assert _CHECKSUM_AT == 96 and HEADER_SIZE == _CHECKSUM_AT + 16


class MissReason(str, enum.Enum):
    """Why a lookup of one key gave no payload. Every reason is a miss: the caller recomputes."""

    #: the store has no value under the key
    ABSENT = "absent"
    #: the value is shorter than its header says (or than a header)
    TRUNCATED = "truncated"
    #: magic, header size or checksum do not match: bytes changed after the put
    CORRUPTED = "corrupted"
    #: a version this reader does not know (a newer one)
    OTHER_VERSION = "other_version"
    #: a value in a format older than the content proof (versions 1 and 2): never trusted
    OLD_FORMAT = "old_format"
    #: a whole, unchanged value written for another key
    WRONG_KEY = "wrong_key"
    #: a whole, unchanged value written by an engine with another layout fingerprint (another
    #: cache layout, model identity or parallel rank)
    OTHER_LAYOUT = "other_layout"
    #: a whole value of this key and layout whose content proof names other tokens or extra
    #: keys than the reader's prompt: a prefix key collision, never served
    OTHER_CONTENT = "other_content"
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


def _proof(proof: Any) -> bytes:
    if not isinstance(proof, bytes) or len(proof) != PROOF_SIZE:
        raise ValueError(
            f"a content proof is {PROOF_SIZE} bytes, got {type(proof).__name__} {proof!r:.60}"
        )
    return proof


def _fixed(key: bytes, fingerprint: bytes, proof: bytes, length: int) -> bytes:
    return _FIXED.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        key_digest(key),
        layout_digest(fingerprint),
        _proof(proof),
        length,
    )


def encode_header(key: bytes, fingerprint: bytes, payload: Any, proof: bytes = NO_PROOF) -> bytes:
    """The :data:`HEADER_SIZE` bytes that precede ``payload`` (any contiguous buffer) in a
    value of ``key`` written under layout ``fingerprint`` with content ``proof``. Reads the
    payload once (checksum)."""
    view = memoryview(payload).cast("B")
    fixed = _fixed(key, fingerprint, proof, view.nbytes)
    h = xxhash.xxh3_128(fixed)
    h.update(view)
    return fixed + h.digest()


def encode_header_of_parts(
    key: bytes, fingerprint: bytes, parts: Sequence[Any], proof: bytes = NO_PROOF
) -> bytes:
    """The header :func:`encode_header` gives for the payload ``b"".join(parts)``, without
    joining: ``parts`` are 1-D byte buffers (``memoryview`` of format ``"B"``, ``bytes``), fed
    to the checksum one after another. XXH3-128's streaming state hashes a sequence of
    updates exactly as one call over their concatenation, so the value written header, then
    parts, is byte for byte the one written from a packed page (``tests/store``)."""
    fixed = _fixed(key, fingerprint, proof, sum(map(len, parts)))
    h = xxhash.xxh3_128(fixed)
    for part in parts:
        h.update(part)
    return fixed + h.digest()


def encode(key: bytes, fingerprint: bytes, payload: Any, proof: bytes = NO_PROOF) -> bytes:
    """A whole value: header then payload, as one ``bytes`` (one copy of the payload)."""
    return b"".join(
        (encode_header(key, fingerprint, payload, proof), memoryview(payload).cast("B"))
    )


def encode_into(
    out: Any, key: bytes, fingerprint: bytes, payload: Any, proof: bytes = NO_PROOF
) -> None:
    """Write the value :func:`encode` gives into ``out``, a writable buffer of exactly
    :data:`HEADER_SIZE` plus the payload's bytes: the payload first, then the header, whose
    checksum then reads the payload from the CPU cache the copy just filled."""
    dst = memoryview(out).cast("B")
    src = memoryview(payload).cast("B")
    if dst.nbytes != HEADER_SIZE + src.nbytes:
        raise ValueError(
            f"out must hold {HEADER_SIZE + src.nbytes} bytes (header and payload), got {dst.nbytes}"
        )
    dst[HEADER_SIZE:] = src
    dst[:HEADER_SIZE] = encode_header(key, fingerprint, dst[HEADER_SIZE:], proof)


def check(
    header: Any, payload: Any, key: bytes, fingerprint: bytes, proof: bytes = NO_PROOF
) -> MissReason | None:
    """``None`` if ``header`` (a value's first :data:`HEADER_SIZE` bytes, or all of it when
    shorter) and ``payload`` (all the bytes the store gave after them) form a value of ``key``
    under ``fingerprint`` whose content proof is ``proof``; else the reason. Never raises on
    any bytes (a malformed ``proof`` argument is a :class:`ValueError`)."""
    _proof(proof)
    head = memoryview(header).cast("B")
    body = memoryview(payload).cast("B")
    if head.nbytes < _LEAD.size:
        return MissReason.TRUNCATED
    magic, version, header_size = _LEAD.unpack_from(head)
    if magic != MAGIC:
        return MissReason.CORRUPTED
    if version in OLD_VERSIONS:
        return MissReason.OLD_FORMAT
    if version != VERSION:
        return MissReason.OTHER_VERSION
    if head.nbytes < HEADER_SIZE:
        return MissReason.TRUNCATED
    if header_size != HEADER_SIZE:
        return MissReason.CORRUPTED
    _, _, _, kd, ld, pd, length = _FIXED.unpack_from(head)
    if body.nbytes < length:
        return MissReason.TRUNCATED
    if body.nbytes > length:
        return MissReason.CORRUPTED
    h = xxhash.xxh3_128(head[:_CHECKSUM_AT])
    h.update(body)
    if h.digest() != bytes(head[_CHECKSUM_AT:HEADER_SIZE]):
        return MissReason.CORRUPTED
    if kd != key_digest(key):
        return MissReason.WRONG_KEY
    if ld != layout_digest(fingerprint):
        return MissReason.OTHER_LAYOUT
    if pd != proof:
        return MissReason.OTHER_CONTENT
    return None


def decode(
    blob: Any,
    key: bytes,
    fingerprint: bytes,
    *,
    expected_length: int | None = None,
    proof: bytes = NO_PROOF,
) -> memoryview | MissReason:
    """The payload of a whole value ``blob`` (a view into it, no copy), or why it is a miss.

    ``expected_length``: the payload length the caller needs (its destination's size); a value
    with another length is :attr:`MissReason.OTHER_LENGTH`. ``proof``: the content proof the
    reader computed for its own prompt. Never raises on any bytes."""
    view = memoryview(blob).cast("B")
    reason = check(view[:HEADER_SIZE], view[HEADER_SIZE:], key, fingerprint, proof)
    if reason is not None:
        return reason
    body = view[HEADER_SIZE:]
    if expected_length is not None and body.nbytes != expected_length:
        return MissReason.OTHER_LENGTH
    return body
