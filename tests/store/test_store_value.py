"""The value format: a value decodes to its payload only under its own key and layout, whole
and unchanged; every other byte string is a typed miss, and decoding never raises."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvforge.store.value import (
    HEADER_SIZE,
    MAGIC,
    VERSION,
    MissReason,
    check,
    decode,
    encode,
    encode_header,
    key_digest,
    layout_digest,
)

KEY = bytes(range(32))
LAYOUT = b"gqa|bf16|block=16|tp=0/1"
PAYLOAD = bytes((i * 7) % 256 for i in range(1000))


def test_a_value_decodes_to_its_payload():
    blob = encode(KEY, LAYOUT, PAYLOAD)
    assert len(blob) == HEADER_SIZE + len(PAYLOAD)
    assert bytes(decode(blob, KEY, LAYOUT)) == PAYLOAD
    assert bytes(decode(blob, KEY, LAYOUT, expected_length=len(PAYLOAD))) == PAYLOAD
    assert blob[HEADER_SIZE:] == PAYLOAD


def test_the_header_is_the_documented_layout():
    header = encode_header(KEY, LAYOUT, PAYLOAD)
    magic, version, size, kd, ld, length = struct.unpack_from("<4sHH32s16sQ", header)
    assert (magic, version, size, length) == (MAGIC, VERSION, HEADER_SIZE, len(PAYLOAD))
    assert kd == key_digest(KEY) and ld == layout_digest(LAYOUT)
    assert len(header) == HEADER_SIZE


def test_an_empty_payload_is_a_value_too():
    assert bytes(decode(encode(KEY, LAYOUT, b""), KEY, LAYOUT)) == b""


def _flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1 :]


BLOB = encode(KEY, LAYOUT, PAYLOAD)

# (what, the bytes read, key, layout, expected length, the miss)
MISSES = [
    ("nothing", b"", KEY, LAYOUT, None, MissReason.TRUNCATED),
    ("half a header", BLOB[: HEADER_SIZE // 2], KEY, LAYOUT, None, MissReason.TRUNCATED),
    ("a header only", BLOB[:HEADER_SIZE], KEY, LAYOUT, None, MissReason.TRUNCATED),
    ("one byte short", BLOB[:-1], KEY, LAYOUT, None, MissReason.TRUNCATED),
    ("one byte long", BLOB + b"\0", KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("magic changed", _flip(BLOB, 0), KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("header size changed", _flip(BLOB, 6), KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("key digest changed", _flip(BLOB, 20), KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("layout digest changed", _flip(BLOB, 45), KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("length field grown", _flip(BLOB, 56), KEY, LAYOUT, None, MissReason.TRUNCATED),
    ("length field shrunk", _flip(BLOB, 57), KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("checksum changed", _flip(BLOB, 64), KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("first payload byte", _flip(BLOB, HEADER_SIZE), KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("last payload byte", _flip(BLOB, len(BLOB) - 1), KEY, LAYOUT, None, MissReason.CORRUPTED),
    ("version 2", BLOB[:4] + b"\x02\x00" + BLOB[6:], KEY, LAYOUT, None, MissReason.OTHER_VERSION),
    ("another key", BLOB, KEY[::-1], LAYOUT, None, MissReason.WRONG_KEY),
    ("another layout", BLOB, KEY, LAYOUT + b"!", None, MissReason.OTHER_LAYOUT),
    ("another length", BLOB, KEY, LAYOUT, len(PAYLOAD) + 1, MissReason.OTHER_LENGTH),
]


@pytest.mark.parametrize(
    ("what", "blob", "key", "layout", "length", "reason"), MISSES, ids=[m[0] for m in MISSES]
)
def test_a_bad_value_is_a_typed_miss(what, blob, key, layout, length, reason):
    assert decode(blob, key, layout, expected_length=length) is reason


def test_check_reads_a_header_and_a_payload_apart():
    header = encode_header(KEY, LAYOUT, PAYLOAD)
    assert check(header, PAYLOAD, KEY, LAYOUT) is None
    assert check(header, PAYLOAD[:-1], KEY, LAYOUT) is MissReason.TRUNCATED
    assert check(header[:10], PAYLOAD, KEY, LAYOUT) is MissReason.TRUNCATED
    assert check(header, _flip(PAYLOAD, 5), KEY, LAYOUT) is MissReason.CORRUPTED


def test_digests_are_domain_separated():
    # a key and a layout with the same bytes never give the same digest prefix by construction
    assert key_digest(b"x")[:16] != layout_digest(b"x")


@given(st.binary(max_size=300))
def test_decode_never_raises_and_never_hands_back_foreign_bytes(blob):
    got = decode(blob, KEY, LAYOUT)
    assert isinstance(got, MissReason)


@given(st.binary(max_size=200), st.integers(0, 10_000))
def test_every_single_bit_flip_is_caught(payload, where):
    blob = encode(KEY, LAYOUT, payload)
    at = where % len(blob)
    flipped = blob[:at] + bytes([blob[at] ^ (1 << (where % 8))]) + blob[at + 1 :]
    assert isinstance(decode(flipped, KEY, LAYOUT), MissReason)
