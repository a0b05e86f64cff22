"""The Redis adapter against a real ``redis-server`` on loopback, in a private network namespace
(``conftest.py``): round trips, prefix existence, layouts kept apart, and every fault the issue
names (server killed mid-put and mid-get, frozen, restarted, full; values corrupted, truncated,
written for another key or layout). A fault is a miss or a failed put, counted; never an
exception, never wrong bytes, never a hang."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch
from _store_helpers import Pages, encode_v1, encode_v2, keys, redis_config

from kvforge.store import open_store
from kvforge.store.base import server_key
from kvforge.store.redis_store import RedisStore
from kvforge.store.servers import RedisServer
from kvforge.store.value import HEADER_SIZE, VERSION, encode

redis = pytest.importorskip("redis")

LAYOUT_A = b"gqa|k,v|bf16|block=16|head-major|tp=0/1"
LAYOUT_B = b"gqa|k,v|bf16|block=16|head-major|tp=1/2"


def raw(server: RedisServer):
    return redis.Redis(port=server.port, socket_timeout=5)


def make(stores, server, layout=LAYOUT_A, **fields) -> RedisStore:
    store = stores(RedisStore(redis_config(server, **fields), layout))
    assert store.wait_ready(10)
    return store


def in_thread(fn):
    """Run ``fn`` in a thread; the result box and the thread (joined by the caller)."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # the test asserts there was none
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return box, thread


def test_put_then_get_is_byte_exact(redis_server, stores):
    store = make(stores, redis_server)
    src, dst = Pages(8, 64 << 10, seed=1), Pages(8, 64 << 10, seed=2)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    ks = keys(8)
    assert store.batch_put(ks, src.pages(range(8))) == [True] * 8
    assert store.batch_get_into(ks, dst.pages(range(8))) == [64 << 10] * 8
    assert all(dst.bytes_of(i) == src.bytes_of(i) for i in range(8))
    stats = store.stats()
    assert (stats.puts_ok, stats.gets_hit, stats.gets_missed, stats.errors) == (8, 8, 0, 0)


def test_torch_tensors_are_sources_and_destinations(redis_server, stores):
    store = make(stores, redis_server)
    host = torch.arange(4 * 4096, dtype=torch.int64).to(torch.uint8)
    store.register_buffer(host)
    pages = host.view(4, 4096)
    assert store.batch_put(keys(2), [pages[0], pages[1]]) == [True, True]
    assert store.batch_get_into(keys(2), [pages[2], pages[3]]) == [4096, 4096]
    assert torch.equal(pages[2], pages[0]) and torch.equal(pages[3], pages[1])


def test_batches_larger_than_max_batch_keys_are_split(redis_server, stores):
    store = make(stores, redis_server, max_batch_keys=3)
    src, dst = Pages(10, 1024, seed=3), Pages(10, 1024, seed=4)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    assert store.batch_put(keys(10), src.pages(range(10))) == [True] * 10
    assert store.exists_prefix(keys(10)) == 10
    assert store.batch_get_into(keys(10), dst.pages(range(10))) == [1024] * 10
    assert np.array_equal(src.buf, dst.buf)


def test_exists_prefix_counts_leading_keys_only(redis_server, stores):
    store = make(stores, redis_server)
    src = Pages(6, 512)
    store.register_buffer(src.buf)
    ks = keys(6)
    held = [0, 1, 2, 4]
    assert store.batch_put([ks[i] for i in held], src.pages(held)) == [True] * 4
    assert store.exists_prefix(ks) == 3
    assert store.exists_prefix(ks[3:]) == 0
    assert store.exists_prefix([ks[4], ks[0]]) == 2
    assert store.exists_prefix([]) == 0


def test_two_layouts_never_read_each_others_values(redis_server, stores):
    a = make(stores, redis_server, LAYOUT_A)
    b = make(stores, redis_server, LAYOUT_B)
    pa, pb, out = Pages(2, 2048, seed=5), Pages(2, 2048, seed=6), Pages(2, 2048, seed=7)
    for store in (a, b):
        store.register_buffer(pa.buf)
        store.register_buffer(pb.buf)
        store.register_buffer(out.buf)
    ks = keys(2)
    assert a.batch_put(ks, pa.pages([0, 1])) == [True, True]
    assert b.exists_prefix(ks) == 0
    assert b.batch_get_into(ks, out.pages([0, 1])) == [None, None]
    assert b.batch_put(ks, pb.pages([0, 1])) == [True, True]
    assert a.batch_get_into(ks, out.pages([0, 1])) == [2048, 2048]
    assert out.bytes_of(0) == pa.bytes_of(0) and out.bytes_of(1) == pa.bytes_of(1)
    assert b.batch_get_into(ks, out.pages([0, 1])) == [2048, 2048]
    assert out.bytes_of(0) == pb.bytes_of(0) and out.bytes_of(1) == pb.bytes_of(1)
    assert len(raw(redis_server).keys("kvforge/*")) == 4


def _stored(store: RedisStore, key: bytes) -> str:
    return server_key(store.config.namespace, store.fingerprint, key)


def _put_one(store, pages: Pages, key: bytes, page: int = 0) -> bytes:
    assert store.batch_put([key], [pages.page(page)]) == [True]
    return raw_value(store, key)


def raw_value(store, key):
    return raw_client(store).get(_stored(store, key))


def raw_client(store):
    return redis.Redis(port=store.config.redis_port, socket_timeout=5)


def _get_one(store, pages: Pages, key: bytes, page: int = 1):
    before = store.stats().misses
    got = store.batch_get_into([key], [pages.page(page)])
    after = store.stats().misses
    new = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
    return got, new


# (what is done to the stored value, the miss reason)
TAMPERING = [
    (
        "flip a payload byte",
        lambda v: (
            v[: HEADER_SIZE + 100] + bytes([v[HEADER_SIZE + 100] ^ 1]) + v[HEADER_SIZE + 101 :]
        ),
        "corrupted",
    ),
    ("flip a checksum byte", lambda v: v[:100] + bytes([v[100] ^ 0x80]) + v[101:], "corrupted"),
    ("flip a proof byte", lambda v: v[:70] + bytes([v[70] ^ 0x80]) + v[71:], "corrupted"),
    ("flip a key-digest byte", lambda v: v[:9] + bytes([v[9] ^ 1]) + v[10:], "corrupted"),
    ("wrong magic", lambda v: b"XXXX" + v[4:], "corrupted"),
    (
        "other version",
        lambda v: v[:4] + (VERSION + 1).to_bytes(2, "little") + v[6:],
        "other_version",
    ),
    ("cut inside the payload", lambda v: v[:-1], "truncated"),
    ("cut inside the header", lambda v: v[: HEADER_SIZE - 1], "truncated"),
    ("cut to nothing", lambda v: b"", "truncated"),
    ("a byte appended", lambda v: v + b"\0", "corrupted"),
    ("not kvforge's format", lambda v: b"hello", "truncated"),
]


@pytest.mark.parametrize(("what", "tamper", "reason"), TAMPERING, ids=[t[0] for t in TAMPERING])
def test_a_tampered_value_is_a_miss(redis_server, stores, what, tamper, reason):
    store = make(stores, redis_server)
    pages = Pages(2, 4096, seed=8)
    store.register_buffer(pages.buf)
    key = keys(1)[0]
    value = _put_one(store, pages, key)
    raw_client(store).set(_stored(store, key), tamper(value))
    got, new = _get_one(store, pages, key)
    assert got == [None]
    assert new == {reason: 1}
    assert store.stats().errors == 0  # a bad value is not a client error
    assert store.exists_prefix([key]) == 1  # it exists; reading it is what misses


@pytest.mark.parametrize("old", [encode_v1, encode_v2], ids=["version-1", "version-2"])
@pytest.mark.parametrize("length", [4096, 4096 + 32], ids=["same-payload", "read-as-v3-size"])
def test_a_value_of_an_older_format_is_an_old_format_miss(redis_server, stores, old, length):
    """A store may hold values an older kvforge wrote, without a content proof: whatever
    their checksum, they are counted misses (``old_format``), never read; a value whose total
    size equals this format's (a payload 32 bytes longer) is cut at 112 bytes and still
    recognised."""
    store = make(stores, redis_server)
    pages = Pages(3, 4096, seed=10)
    store.register_buffer(pages.buf)
    key = keys(1, b"old")[0]
    payload = bytes(range(256)) * (length // 256)
    raw_client(store).set(
        _stored(store, key), old(key, store.fingerprint, payload[: length - 32 * (length > 4096)])
    )
    before = pages.bytes_of(0)
    got, new = _get_one(store, pages, key)
    assert (got, new) == ([None], {"old_format": 1})
    assert store.stats().gets_hit == 0 and store.stats().errors == 0
    assert pages.bytes_of(0) == before  # the source page is untouched


def test_a_value_is_read_only_with_the_proof_it_was_put_with(redis_server, stores):
    store = make(stores, redis_server)
    pages = Pages(3, 4096, seed=12)
    store.register_buffer(pages.buf)
    key = keys(1, b"proof")[0]
    mine, other = b"m" * 32, b"o" * 32
    assert store.batch_put([key], [pages.page(0)], [mine]) == [True]
    assert store.batch_get_into([key], [pages.page(1)], [other]) == [None]
    assert store.batch_get_into([key], [pages.page(2)]) == [None]  # no proof: NO_PROOF
    assert store.stats().misses == {"other_content": 2}
    assert store.batch_get_into([key], [pages.page(1)], [mine]) == [4096]
    assert pages.bytes_of(1) == pages.bytes_of(0)


# (call, exception type, message): a malformed proofs argument, refused before anything moves
BAD_PROOFS = [
    (
        "batch_put",
        lambda s, p, k: s.batch_put(k, p.pages([0, 1]), [b"x" * 32]),
        "2 keys but 1 proofs",
    ),
    (
        "batch_put",
        lambda s, p, k: s.batch_put(k, p.pages([0, 1]), [b"x" * 32, b"y"]),
        "proofs[1] must be 32 bytes",
    ),
    (
        "put_async",
        lambda s, p, k: s.put_async(k, p.pages([0, 1]), b"x" * 64),
        "proofs must be a sequence",
    ),
    (
        "put_async",
        lambda s, p, k: s.put_async(k, p.pages([0, 1]), ["x" * 32] * 2),
        "proofs[0] must be 32 bytes",
    ),
    (
        "batch_put_blocks",
        lambda s, p, k: s.batch_put_blocks(k, [p.buf.reshape(4, -1)], [0, 1], [None, None]),
        "proofs[0]",
    ),
    (
        "batch_get_into",
        lambda s, p, k: s.batch_get_into(k, p.pages([2, 3]), [b"x" * 33] * 2),
        "proofs[0] must be 32 bytes",
    ),
]


@pytest.mark.parametrize(
    ("call", "bad", "message"),
    BAD_PROOFS,
    ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(BAD_PROOFS)],
)
def test_malformed_proofs_are_refused_with_nothing_changed(
    redis_server, stores, call, bad, message
):
    from kvforge._checks import ArgumentError

    store = make(stores, redis_server)
    pages = Pages(4, 4096, seed=13)
    store.register_buffer(pages.buf)
    before = pages.buf.copy()
    ks = keys(2, b"bad-proof")
    with pytest.raises(ArgumentError, match=re.escape(message)):
        bad(store, pages, ks)
    assert store.flush(5)
    assert raw_client(store).keys("*") == []  # nothing written
    assert (pages.buf == before).all()  # nothing read into the destinations
    stats = store.stats()
    assert (stats.puts_ok, stats.puts_failed, stats.puts_dropped, stats.gets_hit, stats.misses) == (
        0,
        0,
        0,
        0,
        {},
    )


def test_a_byte_overwritten_in_the_server_is_a_miss(redis_server, stores):
    store = make(stores, redis_server)
    pages = Pages(2, 4096, seed=9)
    store.register_buffer(pages.buf)
    key = keys(1)[0]
    value = _put_one(store, pages, key)
    at = HEADER_SIZE + 2000
    raw_client(store).setrange(_stored(store, key), at, bytes([value[at] ^ 0xFF]))
    got, new = _get_one(store, pages, key)
    assert (got, new) == ([None], {"corrupted": 1})


def test_a_value_of_another_key_or_layout_is_a_miss(redis_server, stores):
    a = make(stores, redis_server, LAYOUT_A)
    b = make(stores, redis_server, LAYOUT_B)
    pages = Pages(2, 4096, seed=10)
    for store in (a, b):
        store.register_buffer(pages.buf)
    k0, k1 = keys(2)
    r = raw_client(a)
    # a whole, valid value of layout A copied under layout B's name for the same key
    r.set(_stored(b, k0), _put_one(a, pages, k0))
    assert _get_one(b, pages, k0) == ([None], {"other_layout": 1})
    # a whole, valid value of key k0 copied under k1's name, same layout
    r.set(_stored(a, k1), raw_value(a, k0))
    assert _get_one(a, pages, k1) == ([None], {"wrong_key": 1})
    # the right value under its own name still reads
    assert _get_one(a, pages, k0)[0] == [4096]


def test_a_destination_of_another_length_is_a_miss(redis_server, stores):
    store = make(stores, redis_server)
    pages = Pages(2, 4096, seed=11)
    store.register_buffer(pages.buf)
    key = keys(1)[0]
    _put_one(store, pages, key)
    shorter = memoryview(pages.buf)[4096 : 4096 + 4000]
    assert store.batch_get_into([key], [shorter]) == [None]
    assert store.stats().misses == {"other_length": 1}


def test_a_full_server_refuses_puts_and_keeps_what_it_took(net, tmp_path, stores):
    server = RedisServer(net.port(6390), tmp_path / "full.log", maxmemory=3 << 20)
    with server:
        store = make(stores, server)
        src, dst = Pages(64, 64 << 10, seed=12), Pages(64, 64 << 10, seed=13)
        store.register_buffer(src.buf)
        store.register_buffer(dst.buf)
        ks = keys(64)
        done = store.batch_put(ks, src.pages(range(64)))
        assert 0 < sum(done) < 64
        stats = store.stats()
        assert stats.puts_failed == 64 - sum(done) and stats.errors >= 1
        assert "maxmemory" in (stats.last_error or "")
        assert stats.available  # a full server is alive: no back-off
        got = store.batch_get_into(ks, dst.pages(range(64)))
        for i in range(64):
            if done[i]:
                assert got[i] == 64 << 10 and dst.bytes_of(i) == src.bytes_of(i)
            else:
                assert got[i] is None
        store.close()


def test_server_killed_mid_put(redis_server, stores):
    store = make(stores, redis_server, op_timeout_s=30)
    src = Pages(16, 1 << 20, seed=14)
    store.register_buffer(src.buf)
    ks = keys(16)
    redis_server.freeze()  # the put below is stuck in flight until the kill
    box, thread = in_thread(lambda: store.batch_put(ks, src.pages(range(16))))
    time.sleep(0.3)
    redis_server.kill()
    thread.join(60)
    assert not thread.is_alive() and "error" not in box
    assert box["result"] == [False] * 16
    stats = store.stats()
    assert stats.puts_failed == 16 and stats.errors >= 1 and stats.puts_ok == 0
    # a restarted (empty) server costs hits, nothing else
    redis_server.start()
    assert store.wait_ready(10)
    out = Pages(1, 1 << 20, seed=15)
    store.register_buffer(out.buf)
    assert store.batch_get_into(ks[:1], [out.page(0)]) == [None]
    assert store.batch_put(ks[:1], [src.page(0)]) == [True]


def test_server_killed_mid_get(redis_server, stores):
    store = make(stores, redis_server, op_timeout_s=30)
    src, dst = Pages(8, 1 << 20, seed=16), Pages(8, 1 << 20, seed=17)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    ks = keys(8)
    assert store.batch_put(ks, src.pages(range(8))) == [True] * 8
    redis_server.freeze()
    box, thread = in_thread(lambda: store.batch_get_into(ks, dst.pages(range(8))))
    time.sleep(0.3)
    redis_server.kill()
    thread.join(60)
    assert not thread.is_alive() and "error" not in box
    assert box["result"] == [None] * 8
    # round trips of 4 MiB (default_get_batch_bytes, 4 values each): the first one's read
    # failed, and the second is not asked once the store backs off
    assert store.stats().misses == {"store_error": 4, "unavailable": 4}
    # backing off: the next call asks nobody and is a miss at once
    assert store.batch_get_into(ks[:1], dst.pages([0])) == [None]
    assert store.stats().misses["unavailable"] == 4 + 1


def test_a_frozen_server_costs_hits_until_it_answers_again(redis_server, stores):
    store = make(stores, redis_server, op_timeout_s=0.3, retry_after_s=0.1)
    src, dst = Pages(2, 4096, seed=18), Pages(2, 4096, seed=19)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    ks = keys(2)
    assert store.batch_put(ks, src.pages([0, 1])) == [True, True]
    redis_server.freeze()
    assert store.batch_get_into(ks, dst.pages([0, 1])) == [None, None]
    assert store.exists_prefix(ks) == 0
    assert not store.stats().available
    redis_server.thaw()
    assert store.wait_ready(10)
    assert store.batch_get_into(ks, dst.pages([0, 1])) == [4096, 4096]
    assert dst.bytes_of(0) == src.bytes_of(0)


def test_no_server_at_all_is_misses_and_failed_puts(net, stores):
    from kvforge.store.servers import free_port

    cfg = redis_config(RedisServer(free_port()), retry_after_s=0.0)
    store = stores(RedisStore(cfg, LAYOUT_A))
    pages = Pages(2, 1024)
    store.register_buffer(pages.buf)
    ks = keys(2)
    assert not store.wait_ready(0.2)
    assert store.batch_put(ks, pages.pages([0, 1])) == [False, False]
    assert store.put_async(ks, pages.pages([0, 1])) == 2  # no back-off: retry_after_s=0
    assert store.flush(30)
    assert store._values.free_bytes == 0  # a write that raised keeps its buffers from reuse
    assert store.exists_prefix(ks) == 0
    assert store.batch_get_into(ks, pages.pages([0, 1])) == [None, None]
    stats = store.stats()
    assert (stats.puts_ok, stats.puts_failed, stats.misses) == (0, 4, {"store_error": 2})
    assert stats.errors >= 4 and "Connection" in (stats.last_error or "")  # one per client call
    store.close()
    assert store.stats().closed


def test_put_async_copies_the_source_and_writes_it(redis_server, stores):
    store = make(stores, redis_server)
    src, dst = Pages(4, 8192, seed=20), Pages(4, 8192, seed=21)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    ks = keys(4)
    before = [src.bytes_of(i) for i in range(4)]
    assert store.put_async(ks, src.pages(range(4))) == 4
    src.buf[:] = 0  # the caller reuses its pages at once
    assert store.flush(10)
    assert store.batch_get_into(ks, dst.pages(range(4))) == [8192] * 4
    assert [dst.bytes_of(i) for i in range(4)] == before
    assert store.stats().puts_ok == 4
    # the written values' buffers are kept; the next put_async copies into them, exactly
    assert store._values.free_bytes == 4 * (8192 + HEADER_SIZE)
    src.buf[:] = np.random.default_rng(22).integers(0, 256, src.buf.size, dtype=np.uint8)
    again = [src.bytes_of(i) for i in range(4)]
    assert store.put_async(keys(4, b"again"), src.pages(range(4))) == 4
    assert store.flush(10)
    assert store.batch_get_into(keys(4, b"again"), dst.pages(range(4))) == [8192] * 4
    assert [dst.bytes_of(i) for i in range(4)] == again != before
    assert store._values.free_bytes == 4 * (8192 + HEADER_SIZE)


def test_the_put_queue_never_holds_more_than_its_bytes(redis_server, stores):
    """Values of 4,096 + 112 bytes (payload, header) under a 3-value byte bound: the fourth is
    dropped however many values the count bound would allow, and nothing is lost after."""
    value = 4096 + HEADER_SIZE
    store = make(stores, redis_server, max_inflight_put_bytes=3 * value, op_timeout_s=30)
    assert store.config.max_inflight_puts == 4096  # the count bound is not what stops it
    src = Pages(8, 4096, seed=23)
    store.register_buffer(src.buf)
    ks = keys(8)
    redis_server.freeze()
    accepted = [store.put_async([ks[i]], [src.page(i)]) for i in range(8)]
    stats = store.stats()
    assert accepted == [1, 1, 1, 0, 0, 0, 0, 0]
    assert (stats.inflight_puts, stats.inflight_put_bytes) == (3, 3 * value)
    assert stats.puts_dropped == 5
    redis_server.thaw()
    assert store.flush(30)
    assert store.stats().inflight_put_bytes == 0 and store.stats().puts_ok == 3
    assert store.exists_prefix(ks[:3]) == 3


def test_the_put_queue_never_grows_past_its_bound(redis_server, stores):
    bound = 5
    store = make(stores, redis_server, max_inflight_puts=bound, op_timeout_s=30)
    src = Pages(20, 4096, seed=22)
    store.register_buffer(src.buf)
    ks = keys(20)
    redis_server.freeze()  # the writer takes a batch and waits on the frozen server
    accepted = []
    for i in range(20):
        accepted.append(store.put_async([ks[i]], [src.page(i)]))
        assert store.stats().inflight_puts <= bound
    stats = store.stats()
    assert sum(accepted) == bound and accepted[:bound] == [1] * bound
    assert stats.peak_inflight_puts == bound and stats.puts_dropped == 20 - bound
    redis_server.thaw()
    assert store.flush(30)
    assert store.exists_prefix(ks[:bound]) == bound
    assert store.stats().puts_ok == bound


@pytest.mark.parametrize("server_state", ["killed", "frozen"])
def test_close_returns_with_the_server_gone(redis_server, stores, server_state):
    store = make(stores, redis_server, op_timeout_s=60, close_timeout_s=0.5)
    src = Pages(8, 1 << 20, seed=23)
    store.register_buffer(src.buf)
    redis_server.freeze()
    assert store.put_async(keys(8), src.pages(range(8))) == 8
    if server_state == "killed":
        redis_server.kill()
    box, thread = in_thread(store.close)
    thread.join(30)  # a hang detector, not a timing
    assert not thread.is_alive() and "error" not in box
    stats = store.stats()
    assert stats.closed and stats.inflight_puts == 0
    assert stats.puts_ok == 0 and stats.puts_failed + stats.puts_dropped == 8
    # after close every call is a miss or a refused put, without an exception
    assert store.batch_get_into(keys(1), [src.page(0)]) == [None]
    assert store.put_async(keys(1), [src.page(0)]) == 0
    store.close()  # twice is fine


def test_open_store_builds_the_redis_adapter(redis_server, stores):
    store = stores(open_store(redis_config(redis_server), LAYOUT_A))
    assert isinstance(store, RedisStore) and store.wait_ready(10)
    pages = Pages(2, 256)
    store.register_buffer(pages.buf)
    assert store.batch_put(keys(1), [pages.page(0)]) == [True]
    value = raw(redis_server).get(_stored(store, keys(1)[0]))
    assert value == encode(keys(1)[0], LAYOUT_A, pages.page(0))
