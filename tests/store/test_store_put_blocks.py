"""``batch_put_blocks``: a value put straight from the planes of device blocks (no packed page
first) is byte for byte the value ``batch_put`` writes from the page that packs the same
blocks, and reads back into a page with the existing reader. Redis against a real
``redis-server`` (``conftest.py``); the Mooncake adapter is in
``test_store_put_blocks_mooncake.py``. Bad input raises an ``ArgumentError`` naming the field
and the value, and puts nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from _store_helpers import Pages, keys, redis_config

from kvforge._checks import ArgumentError
from kvforge.store.base import server_key
from kvforge.store.redis_store import RedisStore
from kvforge.store.value import HEADER_SIZE, decode, encode, encode_header_of_parts

redis = pytest.importorskip("redis")

LAYOUT = b"gqa|k,v|bf16|block=16|head-major|tp=0/1"


class Planes:
    """Planes as a device cache holds them: ``widths[p]`` bytes per block, each plane a
    strided slice (``stride`` bytes per block, the rest padding) of one ``torch.uint8``
    allocation, plus one plane in a numpy array of its own; every byte random."""

    def __init__(self, num_blocks: int, widths: list[int], pad: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.stride = sum(widths) + len(widths) + pad  # one byte between planes too
        self.base = torch.randint(
            0, 256, (num_blocks, self.stride), dtype=torch.uint8, generator=gen
        )
        at, self.planes = 0, []
        for width in widths:
            self.planes.append(self.base[:, at : at + width])
            at += width + 1
        rng = np.random.default_rng(seed)
        self.extra = rng.integers(0, 256, (num_blocks, 48), dtype=np.uint8)
        self.planes.append(self.extra)

    def register(self, store) -> None:
        store.register_buffer(self.base.view(-1))
        store.register_buffer(self.extra.reshape(-1))

    def page(self, block: int) -> bytes:
        """What a host page of ``block`` holds: its bytes of every plane, packed in order."""
        return b"".join(bytes(np.asarray(p[block])) for p in self.planes)


def make(stores, server, **fields) -> RedisStore:
    store = stores(RedisStore(redis_config(server, **fields), LAYOUT))
    assert store.wait_ready(10)
    return store


def raw_value(store, key: bytes) -> bytes | None:
    name = server_key(store.config.namespace, store.fingerprint, key)
    return redis.Redis(port=store.config.redis_port, socket_timeout=5).get(name)


@pytest.mark.parametrize(
    "splits",
    [[], [0], [1], [7, 64], [0, 0, 5], [63, 64, 65, 1000, 4095]],
    ids=lambda s: "/".join(map(str, s)) or "whole",
)
def test_the_header_of_parts_is_the_header_of_their_join(splits):
    payload = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    view = memoryview(payload)
    edges = [0, *splits, len(payload)]
    parts = [view[a:b] for a, b in itertools.pairwise(edges)]
    key = b"k" * 32
    whole = encode(key, LAYOUT, payload)
    assert encode_header_of_parts(key, LAYOUT, parts) == whole[:HEADER_SIZE]
    assert (
        bytes(decode(encode_header_of_parts(key, LAYOUT, parts) + payload, key, LAYOUT)) == payload
    )


def test_blocks_put_from_planes_are_the_values_of_their_packed_pages(redis_server, stores):
    planes = Planes(10, [300, 4096, 17, 2000])
    blocks_store = make(stores, redis_server, namespace="blocks")
    pages_store = make(stores, redis_server, namespace="pages")
    planes.register(blocks_store)
    page_bytes = len(planes.page(0))
    packed = Pages(4, page_bytes)
    for i, block in enumerate([2, 7, 0, 9]):
        packed.buf[i * page_bytes : (i + 1) * page_bytes] = np.frombuffer(
            planes.page(block), np.uint8
        )
    pages_store.register_buffer(packed.buf)
    ks = keys(4)
    assert blocks_store.batch_put_blocks(ks, planes.planes, [2, 7, 0, 9]) == [True] * 4
    assert pages_store.batch_put(ks, packed.pages(range(4))) == [True] * 4
    for key in ks:  # same key, same layout: the same bytes, header included
        assert raw_value(blocks_store, key) == raw_value(pages_store, key) is not None
    out = Pages(4, page_bytes, seed=9)
    blocks_store.register_buffer(out.buf)
    assert blocks_store.batch_get_into(ks, out.pages(range(4))) == [page_bytes] * 4
    assert [out.bytes_of(i) for i in range(4)] == [planes.page(b) for b in (2, 7, 0, 9)]
    stats = blocks_store.stats()
    assert (stats.puts_ok, stats.puts_failed, stats.gets_hit, stats.errors) == (4, 0, 4, 0)


def test_more_planes_than_one_vectored_write_and_large_blocks(redis_server, stores):
    # 1,100 planes: more buffers than one sendmsg takes (IOV_MAX 1024); then 3 MiB blocks,
    # which the socket takes in several partial sends
    many = Planes(3, [16] * 1100, pad=0, seed=1)
    large = Planes(2, [3 << 20, 5], pad=0, seed=2)
    store = make(stores, redis_server, max_batch_keys=2)  # and batches of two values
    many.register(store)
    large.register(store)
    ks, kl = keys(3, b"m"), keys(2, b"l")
    assert store.batch_put_blocks(ks, many.planes, [1, 2, 0]) == [True] * 3
    assert store.batch_put_blocks(kl, large.planes, [1, 0]) == [True] * 2
    expected = [many.page(1), many.page(2), many.page(0), large.page(1), large.page(0)]
    for key, page in zip([*ks, *kl], expected, strict=True):
        assert bytes(decode(raw_value(store, key), key, LAYOUT)) == page


def test_a_value_over_max_value_bytes_is_counted_never_sent(redis_server, stores):
    planes = Planes(2, [1000, 1000])
    store = make(stores, redis_server, max_value_bytes=HEADER_SIZE + 2000)  # 48 bytes short
    planes.register(store)
    assert store.batch_put_blocks(keys(2), planes.planes, [0, 1]) == [False, False]
    assert store.stats().puts_too_large == 2
    assert raw_value(store, keys(1)[0]) is None


def test_a_server_that_is_gone_is_failed_puts(redis_server, stores):
    planes = Planes(2, [100])
    store = make(stores, redis_server, retry_after_s=30.0)
    planes.register(store)
    redis_server.kill()
    assert store.batch_put_blocks(keys(2), planes.planes, [0, 1]) == [False, False]
    stats = store.stats()
    assert (stats.puts_ok, stats.puts_failed, stats.errors) == (0, 2, 1)


def _unregistered():
    return torch.zeros((4, 64), dtype=torch.uint8)


def _bad_cases(p: Planes):
    ok = p.planes
    outside = torch.zeros((8, 64), dtype=torch.uint8)
    return [
        # (keys, planes, block_ids, message)
        (b"key", ok, [0], "keys must be a sequence of bytes, got bytes"),
        (keys(1), ok[0], [0], "planes must be a sequence of planes, got Tensor"),
        (keys(1), [], [0], "planes must name at least one plane, got none"),
        (keys(1), [*ok, "x"], [0], f"planes[{len(ok)}] must be a 2-D torch.uint8 tensor"),
        (
            keys(1),
            [ok[0].to(torch.int8)],
            [0],
            "planes[0] must be a CPU torch.uint8 tensor, got dtype=torch.int8",
        ),
        (keys(1), [p.base.view(-1)], [0], "planes[0] must be 2-D [num_blocks, block_bytes]"),
        (keys(1), [p.base[:, :0]], [0], "got shape (4, 0)"),
        (keys(1), [p.base.t()[:4]], [0], "planes[0] must hold each block's bytes contiguously"),
        (
            keys(1),
            [p.extra.astype(np.int16)],
            [0],
            "planes[0] must be a uint8 array, got dtype=int16",
        ),
        (keys(1), [*ok, outside], [0], f"planes[{len(ok)}] (512 bytes at 0x"),
        (keys(1), [*ok, outside], [0], "lies outside every registered buffer"),
        (keys(1), ok, [0, 1], "batch_put_blocks: 1 keys but 2 block_ids"),
        (keys(2), ok, [0, 4], "block_ids[1] = 4 is out of range [0, 4)"),
        (keys(2), ok, [-1, 0], "block_ids[0] = -1 is out of range [0, 4)"),
        (
            keys(1),
            ok,
            [0.0],
            "block_ids must be a 1-D sequence of integers, got shape (1,) dtype float64",
        ),
        (keys(1), ok, [True], "dtype bool"),
        (keys(1), ok, [[0]], "got shape (1, 1)"),
        (keys(1), ok, "0", "block_ids must be integers, got str"),
    ]


def test_bad_input_raises_naming_the_field_and_puts_nothing(redis_server, stores):
    planes = Planes(4, [64, 64])
    store = make(stores, redis_server)
    planes.register(store)
    before = store.stats()
    for ks, ps, ids, message in _bad_cases(planes):
        with pytest.raises(ArgumentError) as info:
            store.batch_put_blocks(ks, ps, ids)
        assert message in str(info.value), (message, str(info.value))
    assert store.stats() == before
    assert redis.Redis(port=redis_server.port, socket_timeout=5).dbsize() == 0
    # the registry is unchanged: a good call still works
    assert store.batch_put_blocks(keys(1), planes.planes, [3]) == [True]
