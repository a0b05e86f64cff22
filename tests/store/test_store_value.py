"""The value format: a value decodes to its payload only under its own key, layout and content
proof, whole and unchanged; every other byte string is a typed miss, and decoding never raises.
Version 3 (a content proof in the header) is the only one read: values of versions 1 and 2,
which older kvforge wrote without a proof, are old-format misses."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest
import xxhash
from _store_helpers import encode_v1, encode_v2
from hypothesis import given
from hypothesis import strategies as st

from kvforge.store.value import (
    CHECKSUM,
    CHECKSUMS,
    HEADER_SIZE,
    MAGIC,
    NO_PROOF,
    OLD_VERSIONS,
    PROOF_SIZE,
    VERSION,
    MissReason,
    check,
    decode,
    encode,
    encode_header,
    encode_header_of_parts,
    encode_into,
    key_digest,
    layout_digest,
)

KEY = bytes(range(32))
LAYOUT = b"gqa|bf16|block=16|tp=0/1"
PAYLOAD = bytes((i * 7) % 256 for i in range(1000))
PROOF = bytes(range(100, 132))


def test_a_value_decodes_to_its_payload():
    blob = encode(KEY, LAYOUT, PAYLOAD, PROOF)
    assert len(blob) == HEADER_SIZE + len(PAYLOAD)
    assert bytes(decode(blob, KEY, LAYOUT, proof=PROOF)) == PAYLOAD
    assert bytes(decode(blob, KEY, LAYOUT, expected_length=len(PAYLOAD), proof=PROOF)) == PAYLOAD
    assert blob[HEADER_SIZE:] == PAYLOAD
    # without a proof: written and expected as 32 zero bytes
    assert bytes(decode(encode(KEY, LAYOUT, PAYLOAD), KEY, LAYOUT)) == PAYLOAD
    assert bytes(PROOF_SIZE) == NO_PROOF


def test_the_header_is_the_documented_layout():
    header = encode_header(KEY, LAYOUT, PAYLOAD, PROOF)
    magic, version, size, kd, ld, proof, length = struct.unpack_from("<4sHH32s16s32sQ", header)
    assert (magic, version, size, length) == (MAGIC, VERSION, HEADER_SIZE, len(PAYLOAD))
    assert kd == key_digest(KEY) and ld == layout_digest(LAYOUT) and proof == PROOF
    assert len(header) == HEADER_SIZE == 112
    assert header[96:] == xxhash.xxh3_128(header[:96] + PAYLOAD).digest()


# Version 3's header for KEY, LAYOUT, PAYLOAD, PROOF, byte for byte: a change to any field, to
# the checksum function, its seed or its byte order fails here (values already in stores would
# stop verifying).
V3_HEADER = bytes.fromhex(
    "4b564656"
    "0300"
    "7000"  # magic, version 3, header size 112
    "2db0c2b8880c9b5dc10e362b764bafe825d58a3cfbc810d39a5674bcfe3c9f30"  # key digest
    "441dbc3a437e9bfb03f287ee25b56433"  # layout digest
    "6465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f80818283"  # content proof
    "e803000000000000"  # payload length 1000
    "6a58816738bf10f6f45ba4efd2a3d700"  # XXH3-128, seed 0, canonical (big-endian) digest
)


def test_version_3_header_bytes_are_exact():
    assert (VERSION, CHECKSUM, CHECKSUMS, OLD_VERSIONS) == (3, "xxh3-128", {3: "xxh3-128"}, (1, 2))
    assert encode_header(KEY, LAYOUT, PAYLOAD, PROOF) == V3_HEADER
    assert key_digest(KEY) == hashlib.blake2b(KEY, digest_size=32, person=b"kvforge-key").digest()
    assert layout_digest(LAYOUT) == V3_HEADER[40:56]


def test_parts_and_into_write_the_same_value():
    parts = [memoryview(PAYLOAD)[:300], memoryview(PAYLOAD)[300:]]
    assert encode_header_of_parts(KEY, LAYOUT, parts, PROOF) == V3_HEADER
    out = bytearray(HEADER_SIZE + len(PAYLOAD))
    encode_into(out, KEY, LAYOUT, PAYLOAD, PROOF)
    assert bytes(out) == encode(KEY, LAYOUT, PAYLOAD, PROOF)


# Version 2's header for KEY, LAYOUT, PAYLOAD as kvforge wrote it before the content proof,
# and version 1's as kvforge 0.1.0 (commit acb9209) wrote it: both are old-format misses now.
V2_HEADER = bytes.fromhex(
    "4b564656"
    "0200"
    "5000"
    "2db0c2b8880c9b5dc10e362b764bafe825d58a3cfbc810d39a5674bcfe3c9f30"
    "441dbc3a437e9bfb03f287ee25b56433"
    "e803000000000000"
    "25aacfaf0fbb48db219f186f12719ff8"  # XXH3-128
)
V1_HEADER = bytes.fromhex(
    "4b564656"
    "0100"
    "5000"
    "2db0c2b8880c9b5dc10e362b764bafe825d58a3cfbc810d39a5674bcfe3c9f30"
    "441dbc3a437e9bfb03f287ee25b56433"
    "e803000000000000"
    "241617232b660ebefc5734e65b1c478e"  # BLAKE2b-128
)
OLD = {1: (encode_v1, V1_HEADER), 2: (encode_v2, V2_HEADER)}


@pytest.mark.parametrize("version", sorted(OLD))
def test_values_without_a_content_proof_are_old_format_misses(version):
    old, header = OLD[version]
    blob = old(KEY, LAYOUT, PAYLOAD)
    assert blob[:80] == header  # the helper writes the documented old format
    for proof in (NO_PROOF, PROOF):
        assert decode(blob, KEY, LAYOUT, proof=proof) is MissReason.OLD_FORMAT
        assert decode(blob, KEY, LAYOUT, expected_length=1000, proof=proof) is MissReason.OLD_FORMAT
        # however a reader cuts it (Redis: 112 bytes of header when the length matches)
        assert check(blob[:HEADER_SIZE], blob[HEADER_SIZE:], KEY, LAYOUT, proof) is (
            MissReason.OLD_FORMAT
        )
        assert check(blob[:8], b"", KEY, LAYOUT, proof) is MissReason.OLD_FORMAT
    # an old value read with another key or layout is still an old-format miss, never a hit
    assert decode(blob, KEY[::-1], LAYOUT + b"!") is MissReason.OLD_FORMAT


@pytest.mark.parametrize("proof", [b"", b"x" * 31, b"x" * 33, "x" * 32, None, bytearray(32)])
def test_a_malformed_proof_argument_is_refused(proof):
    blob = encode(KEY, LAYOUT, PAYLOAD, PROOF)
    for call in (
        lambda: encode(KEY, LAYOUT, PAYLOAD, proof),
        lambda: encode_header_of_parts(KEY, LAYOUT, [PAYLOAD], proof),
        lambda: decode(blob, KEY, LAYOUT, proof=proof),
        lambda: check(blob[:HEADER_SIZE], PAYLOAD, KEY, LAYOUT, proof),
    ):
        with pytest.raises(ValueError, match="a content proof is 32 bytes"):
            call()


def test_without_xxhash_the_import_fails_naming_the_package():
    code = "import sys; sys.modules['xxhash'] = None; import kvforge.store.value"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: kvforge.store.value needs the 'xxhash' package")
    assert "pip install xxhash" in last


def test_an_empty_payload_is_a_value_too():
    assert bytes(decode(encode(KEY, LAYOUT, b"", PROOF), KEY, LAYOUT, proof=PROOF)) == b""


def _flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1 :]


BLOB = encode(KEY, LAYOUT, PAYLOAD, PROOF)
OTHER_PROOF = hashlib.sha256(b"another prompt's tokens").digest()

# (what, the bytes read, key, layout, expected length, proof, the miss)
MISSES = [
    ("nothing", b"", KEY, LAYOUT, None, PROOF, MissReason.TRUNCATED),
    ("half a header", BLOB[: HEADER_SIZE // 2], KEY, LAYOUT, None, PROOF, MissReason.TRUNCATED),
    ("a header only", BLOB[:HEADER_SIZE], KEY, LAYOUT, None, PROOF, MissReason.TRUNCATED),
    ("one byte short", BLOB[:-1], KEY, LAYOUT, None, PROOF, MissReason.TRUNCATED),
    ("one byte long", BLOB + b"\0", KEY, LAYOUT, None, PROOF, MissReason.CORRUPTED),
    ("magic changed", _flip(BLOB, 0), KEY, LAYOUT, None, PROOF, MissReason.CORRUPTED),
    ("header size changed", _flip(BLOB, 6), KEY, LAYOUT, None, PROOF, MissReason.CORRUPTED),
    ("key digest changed", _flip(BLOB, 20), KEY, LAYOUT, None, PROOF, MissReason.CORRUPTED),
    ("layout digest changed", _flip(BLOB, 45), KEY, LAYOUT, None, PROOF, MissReason.CORRUPTED),
    ("length field grown", _flip(BLOB, 88), KEY, LAYOUT, None, PROOF, MissReason.TRUNCATED),
    ("length field shrunk", _flip(BLOB, 89), KEY, LAYOUT, None, PROOF, MissReason.CORRUPTED),
    ("proof changed", _flip(BLOB, 60), KEY, LAYOUT, None, PROOF, MissReason.CORRUPTED),
    (
        "first payload byte",
        _flip(BLOB, HEADER_SIZE),
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.CORRUPTED,
    ),
    (
        "last payload byte",
        _flip(BLOB, len(BLOB) - 1),
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.CORRUPTED,
    ),
    (
        "version 4",
        BLOB[:4] + b"\x04\x00" + BLOB[6:],
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.OTHER_VERSION,
    ),
    (
        "version 0",
        BLOB[:4] + b"\x00\x00" + BLOB[6:],
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.OTHER_VERSION,
    ),
    ("high version byte", _flip(BLOB, 5), KEY, LAYOUT, None, PROOF, MissReason.OTHER_VERSION),
    (
        "short and a bad checksum",
        _flip(BLOB, 100)[:-3],
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.TRUNCATED,
    ),
    (
        "middle payload byte",
        _flip(BLOB, HEADER_SIZE + 500),
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.CORRUPTED,
    ),
    (
        "two payload bytes swapped",
        BLOB[:HEADER_SIZE] + PAYLOAD[1::-1] + PAYLOAD[2:],
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.CORRUPTED,
    ),
    (
        "payload zeroed",
        BLOB[:HEADER_SIZE] + bytes(len(PAYLOAD)),
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.CORRUPTED,
    ),
    ("another key", BLOB, KEY[::-1], LAYOUT, None, PROOF, MissReason.WRONG_KEY),
    ("another layout", BLOB, KEY, LAYOUT + b"!", None, PROOF, MissReason.OTHER_LAYOUT),
    ("another length", BLOB, KEY, LAYOUT, len(PAYLOAD) + 1, PROOF, MissReason.OTHER_LENGTH),
    ("checksum changed", _flip(BLOB, 96), KEY, LAYOUT, None, PROOF, MissReason.CORRUPTED),
    # a key collision: this key and layout, another prompt's tokens
    ("another prompt's proof", BLOB, KEY, LAYOUT, None, OTHER_PROOF, MissReason.OTHER_CONTENT),
    ("no proof expected", BLOB, KEY, LAYOUT, None, NO_PROOF, MissReason.OTHER_CONTENT),
    (
        "version 2 number",
        BLOB[:4] + b"\x02\x00" + BLOB[6:],
        KEY,
        LAYOUT,
        None,
        PROOF,
        MissReason.OLD_FORMAT,
    ),
]


@pytest.mark.parametrize(
    ("what", "blob", "key", "layout", "length", "proof", "reason"),
    MISSES,
    ids=[m[0] for m in MISSES],
)
def test_a_bad_value_is_a_typed_miss(what, blob, key, layout, length, proof, reason):
    assert decode(blob, key, layout, expected_length=length, proof=proof) is reason
    # check() sees the same bytes split into a header and a payload; it has no length to match
    expected = None if reason is MissReason.OTHER_LENGTH else reason
    assert check(blob[:HEADER_SIZE], blob[HEADER_SIZE:], key, layout, proof) is expected


def test_check_reads_a_header_and_a_payload_apart():
    header = BLOB[:HEADER_SIZE]
    assert check(header, PAYLOAD, KEY, LAYOUT, PROOF) is None
    assert check(header, PAYLOAD[:-1], KEY, LAYOUT, PROOF) is MissReason.TRUNCATED
    assert check(header[:10], PAYLOAD, KEY, LAYOUT, PROOF) is MissReason.TRUNCATED
    assert check(header, _flip(PAYLOAD, 5), KEY, LAYOUT, PROOF) is MissReason.CORRUPTED


def test_digests_are_domain_separated():
    # a key and a layout with the same bytes never give the same digest prefix by construction
    assert key_digest(b"x")[:16] != layout_digest(b"x")


@given(st.binary(max_size=300))
def test_decode_never_raises_and_never_hands_back_foreign_bytes(blob):
    got = decode(blob, KEY, LAYOUT, proof=PROOF)
    assert isinstance(got, MissReason)


@given(st.binary(max_size=300))
def test_random_bytes_behind_a_valid_prefix_are_misses(tail):
    for blob in (BLOB, encode_v2(KEY, LAYOUT, PAYLOAD), encode_v1(KEY, LAYOUT, PAYLOAD)):
        assert isinstance(decode(blob[:HEADER_SIZE] + tail, KEY, LAYOUT, proof=PROOF), MissReason)


@given(st.binary(max_size=200), st.integers(0, 10_000))
def test_every_single_bit_flip_is_caught(payload, where):
    blob = encode(KEY, LAYOUT, payload, PROOF)
    at = where % len(blob)
    flipped = blob[:at] + bytes([blob[at] ^ (1 << (where % 8))]) + blob[at + 1 :]
    assert isinstance(decode(flipped, KEY, LAYOUT, proof=PROOF), MissReason)


@given(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32))
def test_a_value_is_read_only_with_its_own_proof(written, asked):
    blob = encode(KEY, LAYOUT, PAYLOAD, written)
    got = decode(blob, KEY, LAYOUT, proof=asked)
    assert (got is MissReason.OTHER_CONTENT) == (written != asked)
