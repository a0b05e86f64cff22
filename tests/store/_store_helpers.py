"""Helpers the remote tier's tests share: configs for the loopback servers, registered pages of
random bytes, 32-byte keys, and values as older kvforge wrote them (versions 1 and 2)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import xxhash

from kvforge.store.config import StoreConfig
from kvforge.store.servers import MooncakeMaster, RedisServer


def redis_config(server: RedisServer, **fields) -> StoreConfig:
    base = dict(
        backend="redis",
        redis_port=server.port,
        op_timeout_s=2.0,
        connect_timeout_s=1.0,
        retry_after_s=0.2,
        close_timeout_s=1.0,
    )
    return StoreConfig(**{**base, **fields})


def mooncake_config(master: MooncakeMaster, **fields) -> StoreConfig:
    base = dict(
        backend="mooncake",
        mooncake_master=master.address,
        mooncake_global_segment_bytes=32 << 20,
        mooncake_local_buffer_bytes=16 << 20,
        op_timeout_s=5.0,
        retry_after_s=0.2,
        close_timeout_s=5.0,
    )
    return StoreConfig(**{**base, **fields})


class Pages:
    """A registered host buffer cut into equal pages: sources to put and destinations to fill."""

    def __init__(self, pages: int, page_bytes: int, seed: int = 0) -> None:
        self.page_bytes = page_bytes
        self.buf = np.zeros(pages * page_bytes, dtype=np.uint8)
        rng = np.random.default_rng(seed)
        self.buf[:] = rng.integers(0, 256, self.buf.size, dtype=np.uint8)

    def page(self, i: int) -> memoryview:
        return memoryview(self.buf)[i * self.page_bytes : (i + 1) * self.page_bytes]

    def pages(self, ids) -> list[memoryview]:
        return [self.page(i) for i in ids]

    def bytes_of(self, i: int) -> bytes:
        return bytes(self.page(i))


def keys(n: int, tag: bytes = b"") -> list[bytes]:
    """``n`` distinct 32-byte keys (prefix keys are 32-byte digests)."""
    return [(tag + i.to_bytes(4, "little")).ljust(32, b"k") for i in range(n)]


def encode_v1(key: bytes, layout: bytes, payload) -> bytes:
    """A value in format version 1 (BLAKE2b-128 checksum), as kvforge wrote it before version 2,
    built from the documented format alone (``docs/tiered_store.md``)."""
    payload = bytes(payload)
    fixed = struct.pack(
        "<4sHH32s16sQ",
        b"KVFV",
        1,
        80,
        hashlib.blake2b(key, digest_size=32, person=b"kvforge-key").digest(),
        hashlib.blake2b(layout, digest_size=16, person=b"kvforge-layout").digest(),
        len(payload),
    )
    return fixed + hashlib.blake2b(fixed + payload, digest_size=16).digest() + payload


def encode_v2(key: bytes, layout: bytes, payload) -> bytes:
    """A value in format version 2 (XXH3-128 checksum, no content proof), as kvforge wrote it
    before version 3, built from the documented format alone (``docs/tiered_store.md``)."""
    payload = bytes(payload)
    fixed = struct.pack(
        "<4sHH32s16sQ",
        b"KVFV",
        2,
        80,
        hashlib.blake2b(key, digest_size=32, person=b"kvforge-key").digest(),
        hashlib.blake2b(layout, digest_size=16, person=b"kvforge-layout").digest(),
        len(payload),
    )
    return fixed + xxhash.xxh3_128(fixed + payload).digest() + payload


def as_version_2(value: bytes) -> bytes:
    """A version 3 ``value`` rewritten as kvforge wrote values before the content proof: the
    same key and layout digests and payload, an 80-byte header with an XXH3-128 checksum."""
    magic, _, _, kd, ld, _, length = struct.unpack_from("<4sHH32s16s32sQ", value)
    payload = bytes(value[112:])
    fixed = struct.pack("<4sHH32s16sQ", magic, 2, 80, kd, ld, length)
    return fixed + xxhash.xxh3_128(fixed + payload).digest() + payload
