"""``batch_get_into``'s round trips: at most ``max_batch_keys`` values and at most
``max_get_batch_bytes`` of payload each (the adapter's ``default_get_batch_bytes`` when unset; a
larger value alone). Bytes round-trip exactly wherever the cuts fall, and a round trip that
fails costs its own values and the ones after it (not asked: the store backs off), never the
ones before it, and never a hang. Also the Redis adapter's replies read by hand (RESP2 and
RESP3): each is the hit or the miss ``value.decode`` says, and the next reply stays in step.
Against a real ``redis-server`` (``conftest.py``) where a server is needed."""

from __future__ import annotations

import itertools
import socket
import threading

import numpy as np
import pytest
from _store_helpers import encode_v2, keys, redis_config

from kvforge.store.base import server_key, span_of
from kvforge.store.config import StoreConfig
from kvforge.store.redis_store import RedisStore, _Replies
from kvforge.store.servers import free_port
from kvforge.store.value import MissReason, encode

redis = pytest.importorskip("redis")

LAYOUT = b"gqa|k,v|bf16|block=16|tp=0/1"
KIB = 1 << 10
MIB = 1 << 20


def spans(sizes: list[int]) -> list:
    buf = np.zeros(sum(sizes), dtype=np.uint8)
    at = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
    return [span_of(buf[a:b], f"v{i}") for i, (a, b) in enumerate(itertools.pairwise(at))]


# (payload sizes, max_get_batch_bytes, max_batch_keys, round trips as lists of positions)
CUTS = [
    ("one value", [100], 256, 256, [[0]]),
    ("exactly one batch", [64, 64, 128], 256, 256, [[0, 1, 2]]),
    ("one batch and one value", [64, 64, 128, 1], 256, 256, [[0, 1, 2], [3]]),
    ("a value over the limit goes alone", [10, 300, 10, 10], 256, 256, [[0], [1], [2, 3]]),
    ("uneven", [100, 100, 100, 50, 250], 256, 256, [[0, 1], [2, 3], [4]]),
    ("max_batch_keys still cuts", [10] * 5, 256, 2, [[0, 1], [2, 3], [4]]),
    ("the Redis default: 4 MiB", [2 * MIB, 2 * MIB, MIB], None, 256, [[0, 1], [2]]),
]


@pytest.mark.parametrize(
    ("sizes", "limit", "most", "expected"), [c[1:] for c in CUTS], ids=[c[0] for c in CUTS]
)
def test_round_trips_cut_by_keys_and_bytes(sizes, limit, most, expected):
    # nothing listens on the port: cutting a batch asks no server
    config = StoreConfig(
        backend="redis", redis_port=free_port(), max_get_batch_bytes=limit, max_batch_keys=most
    )
    store = RedisStore(config, LAYOUT)
    try:
        assert [list(r) for r in store._get_batches(spans(sizes))] == expected
    finally:
        store.close()


class Spy:
    """Wraps a store's ``_get`` (its one client call per round trip): records how many values
    each round trip asked for, and raises ``ConnectionError`` instead of the ``fail``-th."""

    def __init__(self, store: RedisStore, fail: int | None = None) -> None:
        self.real, self.fail, self.asked = store._get, fail, []
        store._get = self  # type: ignore[method-assign]

    def __call__(self, items):
        self.asked.append(len(items))
        if len(self.asked) == self.fail:
            raise ConnectionError("the connection broke (injected)")
        return self.real(items)


def stored(stores, server, sizes: list[int], **fields):
    """A store holding one value of each size, the registered source and destination buffers."""
    store = stores(RedisStore(redis_config(server, **fields), LAYOUT))
    assert store.wait_ready(10)
    src = np.random.default_rng(len(sizes)).integers(0, 256, sum(sizes), dtype=np.uint8)
    dst = np.zeros_like(src)
    store.register_buffer(src)
    store.register_buffer(dst)
    at = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
    cut = lambda buf: [buf[a:b] for a, b in itertools.pairwise(at)]  # noqa: E731
    ks = keys(len(sizes))
    assert store.batch_put(ks, cut(src)) == [True] * len(sizes)
    return store, ks, cut(src), cut(dst)


# (payload sizes in KiB, max_get_batch_bytes, values per round trip)
ROUND_TRIPS = [
    ("one value", [16], 64 * KIB, [1]),
    ("exactly one batch", [16, 16, 16, 16], 64 * KIB, [4]),
    ("one batch and one value", [16, 16, 16, 16, 16], 64 * KIB, [4, 1]),
    ("uneven", [10, 50, 30, 70, 5], 64 * KIB, [2, 1, 1, 1]),
    ("no byte limit", [16, 16, 16], 1 << 40, [3]),
]


@pytest.mark.parametrize(
    ("kib", "limit", "trips"), [r[1:] for r in ROUND_TRIPS], ids=[r[0] for r in ROUND_TRIPS]
)
def test_bytes_round_trip_exactly_wherever_the_cuts_fall(redis_server, stores, kib, limit, trips):
    sizes = [k * KIB for k in kib]
    store, ks, src, dst = stored(stores, redis_server, sizes, max_get_batch_bytes=limit)
    spy = Spy(store)
    assert store.batch_get_into(ks, dst) == sizes
    assert spy.asked == trips
    assert all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True))
    stats = store.stats()
    assert (stats.gets_hit, stats.misses, stats.errors) == (len(sizes), {}, 0)


def test_a_failed_round_trip_costs_its_values_and_the_later_ones_only(redis_server, stores):
    sizes = [16 * KIB] * 6  # three round trips of two values
    store, ks, src, dst = stored(stores, redis_server, sizes, max_get_batch_bytes=32 * KIB)
    spy = Spy(store, fail=2)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=store.batch_get_into(ks, dst)))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    # the first round trip's values arrived whole; the second failed; the third was not asked
    assert box["result"] == [16 * KIB] * 2 + [None] * 4
    assert spy.asked == [2, 2]
    assert all(np.array_equal(src[i], dst[i]) for i in range(2))
    stats = store.stats()
    assert stats.gets_hit == 2 and stats.misses == {"store_error": 2, "unavailable": 2}
    assert stats.errors == 1 and "injected" in (stats.last_error or "")
    assert not stats.available  # backing off, as after any client error


# (what the server sent, the reason) for one GET reply read off the socket by hand
VALUE = np.arange(64, dtype=np.uint8)
PROOF = b"p" * 32
GOOD = encode(b"k" * 32, LAYOUT, VALUE, PROOF)
OTHER = encode(b"k" * 32, LAYOUT, VALUE, b"q" * 32)  # another prompt's value under this key
OLD = encode_v2(b"k" * 32, LAYOUT, VALUE)  # as kvforge wrote it before the content proof
REPLIES = [
    ("RESP2 null", b"$-1\r\n", MissReason.ABSENT),
    ("RESP3 null", b"_\r\n", MissReason.ABSENT),
    (
        "error",
        b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
        MissReason.STORE_ERROR,
    ),
    ("RESP3 bulk error", b"!9\r\nERR no\r\nx\r\n", MissReason.STORE_ERROR),
    ("the value", b"$%d\r\n%s\r\n" % (len(GOOD), GOOD), None),
    ("one byte short", b"$%d\r\n%s\r\n" % (len(GOOD) - 1, GOOD[:-1]), MissReason.TRUNCATED),
    ("one byte long", b"$%d\r\n%s\r\n" % (len(GOOD) + 1, GOOD + b"!"), MissReason.CORRUPTED),
    (
        "a flipped payload bit",
        b"$%d\r\n%s\r\n" % (len(GOOD), GOOD[:-1] + bytes([GOOD[-1] ^ 1])),
        MissReason.CORRUPTED,
    ),
    ("an empty value", b"$0\r\n\r\n", MissReason.TRUNCATED),
    ("another prompt's proof", b"$%d\r\n%s\r\n" % (len(OTHER), OTHER), MissReason.OTHER_CONTENT),
    ("an old-format value", b"$%d\r\n%s\r\n" % (len(OLD), OLD), MissReason.OLD_FORMAT),
]


@pytest.mark.parametrize(("sent", "reason"), [r[1:] for r in REPLIES], ids=[r[0] for r in REPLIES])
def test_a_reply_read_by_hand_is_the_hit_or_miss_it_was(sent, reason):
    store = RedisStore(StoreConfig(backend="redis", redis_port=free_port()), LAYOUT)
    dst = np.zeros(64, dtype=np.uint8)
    left, right = socket.socketpair()
    try:
        # the reply, then a second one that must still be read whole after it (no desync)
        left.sendall(sent + b"$-1\r\n")
        replies = _Replies(right)
        span = span_of(dst, "dst", writable=True)
        assert store._read_value(replies, b"k" * 32, PROOF, span) == reason
        assert replies.line() == b"$-1"
        if reason is None:
            assert np.array_equal(dst, VALUE)
        assert store.stats().errors == (reason is MissReason.STORE_ERROR)
    finally:
        left.close()
        right.close()
        store.close()


def test_a_wrong_type_amid_values_costs_that_value_only(redis_server, stores):
    sizes = [16 * KIB] * 3
    store, ks, src, dst = stored(stores, redis_server, sizes)
    client = redis.Redis(port=redis_server.port, socket_timeout=5)
    name = server_key(store.config.namespace, store.fingerprint, ks[1])
    client.delete(name)
    client.rpush(name, b"not a value")
    assert store.batch_get_into(ks, dst) == [16 * KIB, None, 16 * KIB]
    assert np.array_equal(src[0], dst[0]) and np.array_equal(src[2], dst[2])
    stats = store.stats()
    assert stats.misses == {"store_error": 1} and stats.errors == 1 and stats.available
    assert "WRONGTYPE" in (stats.last_error or "")
    # the connection is still in step: the next call reads every reply right
    assert store.batch_get_into([ks[0], ks[2]], [dst[0], dst[2]]) == [16 * KIB] * 2
