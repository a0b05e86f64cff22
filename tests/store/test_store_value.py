"""The value format: a value decodes to its payload only under its own key and layout, whole
and unchanged; every other byte string is a typed miss, and decoding never raises. Version 2
(XXH3-128, written) and version 1 (BLAKE2b-128, what older kvforge wrote) are both verified."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest
import xxhash
from _store_helpers import encode_v1
from hypothesis import given
from hypothesis import strategies as st

from kvforge.store.value import (
    CHECKSUM,
    CHECKSUMS,
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
    assert header[64:] == xxhash.xxh3_128(header[:64] + PAYLOAD).digest()


# Version 2's header for KEY, LAYOUT, PAYLOAD, byte for byte: a change to any field, to the
# checksum function, its seed or its byte order fails here (values already in stores would
# stop verifying).
V2_HEADER = bytes.fromhex(
    "4b564656" "0200" "5000"  # magic, version 2, header size 80
    "2db0c2b8880c9b5dc10e362b764bafe825d58a3cfbc810d39a5674bcfe3c9f30"  # key digest
    "441dbc3a437e9bfb03f287ee25b56433"  # layout digest
    "e803000000000000"  # payload length 1000
    "25aacfaf0fbb48db219f186f12719ff8"  # XXH3-128, seed 0, canonical (big-endian) digest
)


def test_version_2_header_bytes_are_exact():
    assert (VERSION, CHECKSUM, CHECKSUMS) == (2, "xxh3-128", {1: "blake2b-128", 2: "xxh3-128"})
    assert encode_header(KEY, LAYOUT, PAYLOAD) == V2_HEADER
    assert key_digest(KEY) == hashlib.blake2b(KEY, digest_size=32, person=b"kvforge-key").digest()
    assert layout_digest(LAYOUT) == V2_HEADER[40:56]


# Version 1's header for KEY, LAYOUT, PAYLOAD as kvforge 0.1.0 (commit acb9209) wrote it.
V1_HEADER = bytes.fromhex(
    "4b564656" "0100" "5000"
    "2db0c2b8880c9b5dc10e362b764bafe825d58a3cfbc810d39a5674bcfe3c9f30"
    "441dbc3a437e9bfb03f287ee25b56433"
    "e803000000000000"
    "241617232b660ebefc5734e65b1c478e"  # BLAKE2b-128
)


def test_version_1_values_are_still_read_and_verified():
    blob = encode_v1(KEY, LAYOUT, PAYLOAD)
    assert blob[:HEADER_SIZE] == V1_HEADER
    assert bytes(decode(blob, KEY, LAYOUT, expected_length=len(PAYLOAD))) == PAYLOAD
    assert check(blob[:HEADER_SIZE], PAYLOAD, KEY, LAYOUT) is None
    assert bytes(decode(encode_v1(KEY, LAYOUT, b""), KEY, LAYOUT)) == b""
    # the same bytes under version 2's number are a corrupted version 2 value, and back
    assert decode(blob[:4] + b"\x02\x00" + blob[6:], KEY, LAYOUT) is MissReason.CORRUPTED
    v2 = encode(KEY, LAYOUT, PAYLOAD)
    assert decode(v2[:4] + b"\x01\x00" + v2[6:], KEY, LAYOUT) is MissReason.CORRUPTED


def test_without_xxhash_the_import_fails_naming_the_package():
    code = "import sys; sys.modules['xxhash'] = None; import kvforge.store.value"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: kvforge.store.value needs the 'xxhash' package")
    assert "pip install xxhash" in last


def test_an_empty_payload_is_a_value_too():
    assert bytes(decode(encode(KEY, LAYOUT, b""), KEY, LAYOUT)) == b""


def _flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1 :]


BLOBS = {2: encode(KEY, LAYOUT, PAYLOAD), 1: encode_v1(KEY, LAYOUT, PAYLOAD)}


def _misses(version: int) -> list[tuple]:
    """(what, the bytes read, key, layout, expected length, the miss) for a value of
    ``version``: every table row holds for both versions."""
    BLOB = BLOBS[version]
    return [
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
    ("version 3", BLOB[:4] + b"\x03\x00" + BLOB[6:], KEY, LAYOUT, None, MissReason.OTHER_VERSION),
    ("version 0", BLOB[:4] + b"\x00\x00" + BLOB[6:], KEY, LAYOUT, None, MissReason.OTHER_VERSION),
    ("high version byte", _flip(BLOB, 5), KEY, LAYOUT, None, MissReason.OTHER_VERSION),
    ("short and a bad checksum", _flip(BLOB, 70)[:-3], KEY, LAYOUT, None, MissReason.TRUNCATED),
    ("middle payload byte", _flip(BLOB, HEADER_SIZE + 500), KEY, LAYOUT, None,
     MissReason.CORRUPTED),
    ("two payload bytes swapped", BLOB[:HEADER_SIZE] + PAYLOAD[1::-1] + PAYLOAD[2:], KEY,
     LAYOUT, None, MissReason.CORRUPTED),
    ("payload zeroed", BLOB[:HEADER_SIZE] + bytes(len(PAYLOAD)), KEY, LAYOUT, None,
     MissReason.CORRUPTED),
    ("another key", BLOB, KEY[::-1], LAYOUT, None, MissReason.WRONG_KEY),
    ("another layout", BLOB, KEY, LAYOUT + b"!", None, MissReason.OTHER_LAYOUT),
    ("another length", BLOB, KEY, LAYOUT, len(PAYLOAD) + 1, MissReason.OTHER_LENGTH),
    ]


MISSES = [(v, *m) for v in (2, 1) for m in _misses(v)]


@pytest.mark.parametrize(
    ("version", "what", "blob", "key", "layout", "length", "reason"),
    MISSES,
    ids=[f"v{m[0]}-{m[1]}" for m in MISSES],
)
def test_a_bad_value_is_a_typed_miss(version, what, blob, key, layout, length, reason):
    assert decode(blob, key, layout, expected_length=length) is reason
    # check() sees the same bytes split into a header and a payload; it has no length to match
    expected = None if reason is MissReason.OTHER_LENGTH else reason
    assert check(blob[:HEADER_SIZE], blob[HEADER_SIZE:], key, layout) is expected


@pytest.mark.parametrize("version", [2, 1])
def test_check_reads_a_header_and_a_payload_apart(version):
    header = BLOBS[version][:HEADER_SIZE]
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


@given(st.binary(max_size=300))
def test_random_bytes_behind_a_valid_prefix_are_misses(tail):
    for blob in BLOBS.values():
        assert isinstance(decode(blob[:HEADER_SIZE] + tail, KEY, LAYOUT), MissReason)


@given(st.binary(max_size=200), st.integers(0, 10_000), st.sampled_from([2, 1]))
def test_every_single_bit_flip_is_caught(payload, where, version):
    blob = (encode if version == 2 else encode_v1)(KEY, LAYOUT, payload)
    at = where % len(blob)
    flipped = blob[:at] + bytes([blob[at] ^ (1 << (where % 8))]) + blob[at + 1 :]
    assert isinstance(decode(flipped, KEY, LAYOUT), MissReason)
