"""The Mooncake Store adapter against a real ``mooncake_master`` and real clients (TCP, no RDMA,
no GPU), in a private network namespace (``conftest.py``): zero-copy round trips, prefix
existence, layouts kept apart, and the faults the issue names. A fault is a miss or a failed
put, counted; never an exception, never wrong bytes, never a hang."""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import time
import weakref

import pytest
from _store_helpers import Pages, as_version_2, keys, mooncake_config

from kvforge.store import open_store
from kvforge.store.base import server_key
from kvforge.store.mooncake_store import MooncakeStore
from kvforge.store.servers import MooncakeMaster, free_port
from kvforge.store.value import HEADER_SIZE, encode

# ImportError, not only ModuleNotFoundError: the wheel without the libibverbs it loads skips too
pytest.importorskip(
    "mooncake.store",
    reason="Mooncake Store's client does not load: pip install 'kvforge[mooncake]' and apt-get install libibverbs1 ibverbs-providers",
    exc_type=ImportError,
)

LAYOUT_A = b"deepseek-v4|mla+indexer|fp8|block=64|tp=0/1"
LAYOUT_B = b"deepseek-v4|mla+indexer|fp8|block=64|tp=0/2"


def make(stores, master, layout=LAYOUT_A, **fields) -> MooncakeStore:
    store = stores(MooncakeStore(mooncake_config(master, **fields), layout))
    assert store.wait_ready(30), store.stats()
    return store


def in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return box, thread


def name_of(store, key):
    return server_key(store.config.namespace, store.fingerprint, key)


def overwrite(store, key, value: bytes) -> None:
    """Replace the stored value of ``key`` with ``value`` (a fault injected in the store)."""
    assert store._client.upsert(name_of(store, key), value) == 0


def test_put_then_get_is_byte_exact(mooncake_master, stores):
    store = make(stores, mooncake_master)
    src, dst = Pages(8, 256 << 10, seed=1), Pages(8, 256 << 10, seed=2)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    ks = keys(8)
    assert store.batch_put(ks, src.pages(range(8))) == [True] * 8
    assert store.exists_prefix(ks) == 8
    assert store.batch_get_into(ks, dst.pages(range(8))) == [256 << 10] * 8
    assert all(dst.bytes_of(i) == src.bytes_of(i) for i in range(8))
    # what the store holds is exactly kvforge's value format
    assert store._client.get(name_of(store, ks[0])) == encode(ks[0], LAYOUT_A, src.page(0))
    stats = store.stats()
    assert (stats.puts_ok, stats.gets_hit, stats.gets_missed, stats.errors) == (8, 8, 0, 0)


def counted(get, asked: list[int], items):
    """A store's ``_get`` that also records how many values each round trip asked for."""
    asked.append(len(items))
    return get(items)


def test_gets_cut_by_bytes_round_trip_exactly(mooncake_master, stores):
    # Mooncake has no byte limit by default (each of its batches costs round trips to the
    # master); a set max_get_batch_bytes cuts gets as for Redis, header slots reused per trip
    sizes = [40 << 10, 24 << 10, 64 << 10, 8 << 10, 100 << 10]  # at 64 KiB: 2, 1, 1, 1 values
    store = make(stores, mooncake_master, max_get_batch_bytes=64 << 10)
    src, dst = Pages(1, sum(sizes), seed=21), Pages(1, sum(sizes), seed=22)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    at = list(itertools.pairwise([sum(sizes[:i]) for i in range(len(sizes) + 1)]))
    ks = keys(len(sizes), tag=b"cut")
    assert store.batch_put(ks, [src.buf[a:b] for a, b in at]) == [True] * 5
    asked: list[int] = []
    store._get = functools.partial(counted, store._get, asked)
    assert store.batch_get_into(ks, [dst.buf[a:b] for a, b in at]) == sizes
    assert asked == [2, 1, 1, 1] and bytes(dst.buf) == bytes(src.buf)
    assert store.stats().gets_hit == 5 and store.stats().errors == 0


def test_batches_are_split_and_exists_counts_leading_keys(mooncake_master, stores):
    store = make(stores, mooncake_master, max_batch_keys=2)
    src, dst = Pages(6, 4096, seed=3), Pages(6, 4096, seed=4)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    ks = keys(6)
    held = [0, 1, 2, 4]
    assert store.batch_put([ks[i] for i in held], src.pages(held)) == [True] * 4
    assert store.exists_prefix(ks) == 3
    assert store.exists_prefix(ks[3:]) == 0
    got = store.batch_get_into(ks, dst.pages(range(6)))
    assert got == [4096, 4096, 4096, None, 4096, None]
    assert all(dst.bytes_of(i) == src.bytes_of(i) for i in held)
    assert store.stats().misses == {"absent": 2}


def test_put_async_copies_and_writes(mooncake_master, stores):
    store = make(stores, mooncake_master)
    src, dst = Pages(4, 8192, seed=5), Pages(4, 8192, seed=6)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    before = [src.bytes_of(i) for i in range(4)]
    assert store.put_async(keys(4), src.pages(range(4))) == 4
    src.buf[:] = 0
    assert store.flush(30)
    assert store.batch_get_into(keys(4), dst.pages(range(4))) == [8192] * 4
    assert [dst.bytes_of(i) for i in range(4)] == before
    # the written values' buffers are kept, and the next put_async writes exactly from them
    assert store._values.free_bytes == 4 * (8192 + HEADER_SIZE)
    src.buf[:] = 7
    assert store.put_async(keys(4, b"again"), src.pages(range(4))) == 4
    assert store.flush(30)
    assert store.batch_get_into(keys(4, b"again"), dst.pages(range(4))) == [8192] * 4
    assert all(dst.bytes_of(i) == bytes([7]) * 8192 for i in range(4))


def on_client_thread(store, fn=lambda: None):
    """Run ``fn`` on the store's client thread, after every call queued there before it."""
    return store._calls.call(fn, 30)


def test_put_async_writes_from_registered_buffers_and_forgets_those_it_drops(
    mooncake_master, stores
):
    """The writer puts straight out of the value buffers, each registered once; a buffer the
    pool does not keep (over ``max_inflight_put_bytes``) is unregistered and let go."""
    small, large = 4096, 8192
    store = make(stores, mooncake_master, max_inflight_put_bytes=small + HEADER_SIZE)
    src, dst = Pages(2, large, seed=30), Pages(2, large, seed=31)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    short = memoryview(src.buf)[:small]
    assert store.put_async(keys(1, b"s"), [short]) == 1 and store.flush(30)
    on_client_thread(store)
    [kept] = store._value_regs.values()  # registered on first use, kept free for reuse
    assert kept.nbytes == small + HEADER_SIZE and store._values.free_bytes == kept.nbytes
    assert store.put_async(keys(1, b"l"), [src.page(1)]) == 1 and store.flush(30)
    on_client_thread(store)
    # the large value's buffer would pass the bound: dropped and unregistered
    assert list(store._value_regs.values()) == [kept]
    assert store.put_async(keys(1, b"s2"), [short]) == 1 and store.flush(30)
    on_client_thread(store)
    assert list(store._value_regs.values()) == [kept]  # reused, not registered again
    got = store.batch_get_into(
        [*keys(1, b"s"), *keys(1, b"l")], [memoryview(dst.buf)[:small], dst.page(1)]
    )
    assert got == [small, large]
    assert dst.bytes_of(1) == src.bytes_of(1) and bytes(dst.buf[:small]) == bytes(short)
    assert store.stats().puts_ok == 3


class RefusesRegistration:
    """The Mooncake client, except that it refuses to register anything."""

    def __init__(self, client) -> None:
        self._client = client

    def register_buffer(self, addr, size):
        return -600

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_value_buffer_the_client_will_not_register_is_put_by_copy(mooncake_master, stores):
    store = make(stores, mooncake_master)
    src, dst = Pages(2, 4096, seed=32), Pages(2, 4096, seed=33)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    store._client = RefusesRegistration(store._client)
    assert store.put_async(keys(2), src.pages([0, 1])) == 2 and store.flush(30)
    assert store.batch_get_into(keys(2), dst.pages([0, 1])) == [4096, 4096]
    assert dst.bytes_of(0) == src.bytes_of(0) and dst.bytes_of(1) == src.bytes_of(1)
    stats = store.stats()
    assert (
        stats.puts_ok == 2
        and stats.last_error == f"register_buffer({4096 + HEADER_SIZE} bytes) returned -600"
    )
    assert store._value_regs == {}


class SlowClose:
    """The Mooncake client, whose ``close`` sets ``closed`` once done and then takes half a
    second more (a master that is down takes seconds)."""

    def __init__(self, client, closed: threading.Event) -> None:
        self._client, self._closed_event = client, closed

    def close(self):
        rc = self._client.close()
        self._closed_event.set()
        time.sleep(0.5)
        return rc

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_buffer_let_go_while_the_client_closes_calls_no_closed_client(mooncake_master, stores):
    """A call into a closed Mooncake client crashes the process: a value buffer the pool lets
    go while ``close`` runs (here: its writer hands the batch back during the close) must not
    be unregistered after it, nor a write queued before it run after it."""
    size = 4096
    store = make(stores, mooncake_master, max_inflight_put_bytes=2 * (size + HEADER_SIZE))
    src = Pages(2, 2 * size + HEADER_SIZE, seed=34)
    store.register_buffer(src.buf)
    assert store.put_async(keys(1, b"w"), [src.page(0)]) == 1 and store.flush(30)
    assert store._values.free_bytes == 2 * (size + HEADER_SIZE)  # full, of another size
    closed = threading.Event()
    store._client = SlowClose(store._client, closed)
    write = store._write_encoded

    def slow_writer(items):
        ok = write(items)  # the put returned: nothing reads the buffer any more
        assert closed.wait(10)  # ... but the writer hands it back only once the client closed
        return ok

    store._write_encoded = slow_writer
    assert store.put_async(keys(1, b"x"), [memoryview(src.page(1))[:size]]) == 1
    time.sleep(0.2)
    store.close()  # giving the batch back lets the other size's buffer go, after the close
    assert store.wait_closed(10)
    assert store._client_closed and store._value_regs == {}  # and the process is alive
    assert store.stats().puts_ok == 2


def test_a_store_closed_while_its_master_hangs_is_freed_once_closed(mooncake_master, stores):
    """The writer's call times out after close() began: the buffers it drops queue no job
    behind the client thread's stop, so nothing keeps the store alive once its client closed."""
    store = MooncakeStore(
        mooncake_config(mooncake_master, op_timeout_s=3.0, close_timeout_s=0.5), LAYOUT_A
    )
    assert store.wait_ready(30)
    src = Pages(4, 4096, seed=35)
    store.register_buffer(src.buf)
    assert store.put_async(keys(4, b"a"), src.pages(range(4))) == 4 and store.flush(30)
    mooncake_master.freeze()
    assert store.put_async(keys(4, b"b"), src.pages(range(4))) == 4
    time.sleep(0.2)
    store.close()
    time.sleep(4.0)  # the writer's call times out now, after close() returned
    mooncake_master.thaw()
    assert store.wait_closed(30)
    assert store._calls._jobs.qsize() == 0 and store._value_regs == {}
    ref = weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None


def test_two_layouts_never_read_each_others_values(mooncake_master, stores):
    a = make(stores, mooncake_master, LAYOUT_A)
    b = make(stores, mooncake_master, LAYOUT_B)
    pa, pb, out = Pages(2, 4096, seed=7), Pages(2, 4096, seed=8), Pages(2, 4096, seed=9)
    for store, pages in ((a, pa), (b, pb)):
        store.register_buffer(pages.buf)
        store.register_buffer(out.buf)
    ks = keys(2)
    assert a.batch_put(ks, pa.pages([0, 1])) == [True, True]
    assert b.exists_prefix(ks) == 0
    assert b.batch_get_into(ks, out.pages([0, 1])) == [None, None]
    assert b.batch_put(ks, pb.pages([0, 1])) == [True, True]
    assert a.batch_get_into(ks, out.pages([0, 1])) == [4096, 4096]
    assert out.bytes_of(0) == pa.bytes_of(0) and out.bytes_of(1) == pa.bytes_of(1)
    assert b.batch_get_into(ks, out.pages([0, 1])) == [4096, 4096]
    assert out.bytes_of(0) == pb.bytes_of(0) and out.bytes_of(1) == pb.bytes_of(1)


# (what is done to the stored value, the miss reason)
TAMPERING = [
    (
        "flip a payload byte",
        lambda v: v[: HEADER_SIZE + 9] + bytes([v[HEADER_SIZE + 9] ^ 4]) + v[HEADER_SIZE + 10 :],
        "corrupted",
    ),
    ("flip a checksum byte", lambda v: v[:66] + bytes([v[66] ^ 1]) + v[67:], "corrupted"),
    ("cut the last byte", lambda v: v[:-1], "truncated"),
    ("cut to a header", lambda v: v[:HEADER_SIZE], "truncated"),
    # a value of another size is read whole and decoded: the reason is the exact one
    ("a byte appended", lambda v: v + b"\0", "corrupted"),
    ("flip a proof byte", lambda v: v[:70] + bytes([v[70] ^ 1]) + v[71:], "corrupted"),
    ("the older format (no proof)", as_version_2, "old_format"),
]


@pytest.mark.parametrize(("what", "tamper", "reason"), TAMPERING, ids=[t[0] for t in TAMPERING])
def test_a_tampered_value_is_a_miss(mooncake_master, stores, what, tamper, reason):
    store = make(stores, mooncake_master)
    pages = Pages(2, 4096, seed=10)
    store.register_buffer(pages.buf)
    key = keys(1)[0]
    assert store.batch_put([key], [pages.page(0)]) == [True]
    overwrite(store, key, tamper(encode(key, LAYOUT_A, pages.page(0))))
    assert store.batch_get_into([key], [pages.page(1)]) == [None]
    assert store.stats().misses == {reason: 1}


def test_a_value_is_read_only_with_the_proof_it_was_put_with(mooncake_master, stores):
    store = make(stores, mooncake_master)
    pages = Pages(3, 4096, seed=12)
    store.register_buffer(pages.buf)
    key = keys(1, b"proof")[0]
    assert store.batch_put([key], [pages.page(0)], [b"m" * 32]) == [True]
    assert store.batch_get_into([key], [pages.page(1)], [b"o" * 32]) == [None]
    assert store.batch_get_into([key], [pages.page(1)]) == [None]  # no proof: NO_PROOF
    assert store.stats().misses == {"other_content": 2}
    assert store.batch_get_into([key], [pages.page(2)], [b"m" * 32]) == [4096]
    assert pages.bytes_of(2) == pages.bytes_of(0)


def test_a_value_of_another_key_or_layout_is_a_miss(mooncake_master, stores):
    a = make(stores, mooncake_master, LAYOUT_A)
    b = make(stores, mooncake_master, LAYOUT_B)
    pages = Pages(2, 4096, seed=11)
    for store in (a, b):
        store.register_buffer(pages.buf)
    k0, k1 = keys(2)
    valid_a = encode(k0, LAYOUT_A, pages.page(0))
    overwrite(b, k0, valid_a)  # layout A's whole value under layout B's name
    assert b.batch_get_into([k0], [pages.page(1)]) == [None]
    assert b.stats().misses == {"other_layout": 1}
    overwrite(a, k1, valid_a)  # key k0's whole value under k1's name
    assert a.batch_get_into([k1], [pages.page(1)]) == [None]
    assert a.stats().misses == {"wrong_key": 1}


def test_a_full_store_refuses_puts_and_keeps_what_it_took(mooncake_master, stores):
    store = make(stores, mooncake_master, mooncake_global_segment_bytes=16 << 20)
    src, dst = Pages(24, 1 << 20, seed=12), Pages(24, 1 << 20, seed=13)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    ks = keys(24)
    done = store.batch_put(ks, src.pages(range(24)))
    assert 0 < sum(done) < 24
    stats = store.stats()
    assert stats.puts_failed == 24 - sum(done) and "full" in (stats.last_error or "")
    assert stats.available
    got = store.batch_get_into(ks, dst.pages(range(24)))
    for i in range(24):
        # a value the store took reads back exactly, or is a miss (evicted); never other bytes
        assert got[i] is None or (done[i] and dst.bytes_of(i) == src.bytes_of(i))
    assert sum(g is not None for g in got) > 0


def test_master_killed_mid_put(mooncake_master, stores):
    store = make(stores, mooncake_master, op_timeout_s=60)
    src = Pages(8, 64 << 10, seed=14)
    store.register_buffer(src.buf)
    mooncake_master.freeze()  # the put's RPC is in flight until the kill
    box, thread = in_thread(lambda: store.batch_put(keys(8), src.pages(range(8))))
    time.sleep(0.3)
    mooncake_master.kill()
    thread.join(120)
    assert not thread.is_alive() and "error" not in box
    assert box["result"] == [False] * 8
    stats = store.stats()
    assert stats.puts_failed == 8 and stats.errors >= 1 and not stats.available
    # with the master gone every call is a miss or a failed put, without an exception
    assert store.batch_get_into(keys(1), [src.page(0)]) == [None]
    assert store.exists_prefix(keys(1)) == 0


def test_master_killed_mid_get(mooncake_master, stores):
    store = make(stores, mooncake_master)
    src, dst = Pages(4, 64 << 10, seed=15), Pages(4, 64 << 10, seed=16)
    store.register_buffer(src.buf)
    store.register_buffer(dst.buf)
    assert store.batch_put(keys(4), src.pages(range(4))) == [True] * 4
    mooncake_master.freeze()
    box, thread = in_thread(lambda: store.batch_get_into(keys(4), dst.pages(range(4))))
    time.sleep(0.3)
    mooncake_master.kill()
    thread.join(120)
    assert not thread.is_alive() and "error" not in box
    assert box["result"] == [None] * 4
    assert store.stats().misses == {"store_error": 4}


def test_a_frozen_master_bounds_puts_by_op_timeout(mooncake_master, stores):
    store = make(stores, mooncake_master, op_timeout_s=0.5)
    src = Pages(2, 4096, seed=17)
    store.register_buffer(src.buf)
    mooncake_master.freeze()
    assert store.batch_put(keys(2), src.pages([0, 1])) == [False, False]
    stats = store.stats()
    assert "did not answer" in (stats.last_error or "") and not stats.available
    # the abandoned call still runs: later calls are misses at once instead of queueing
    assert store.exists_prefix(keys(2)) == 0
    assert store.batch_get_into(keys(1), [src.page(1)]) == [None]
    assert store.stats().misses == {"unavailable": 1}
    mooncake_master.thaw()
    store.close()
    assert store.wait_closed(120)


@pytest.mark.parametrize("master_state", ["killed", "frozen"])
def test_close_returns_with_the_master_gone(mooncake_master, stores, master_state):
    store = make(stores, mooncake_master, op_timeout_s=0.5, close_timeout_s=1.0)
    src = Pages(4, 4096, seed=18)
    store.register_buffer(src.buf)
    mooncake_master.freeze()
    store.put_async(keys(4), src.pages(range(4)))
    if master_state == "killed":
        mooncake_master.kill()
    box, thread = in_thread(store.close)
    thread.join(60)  # a hang detector, not a timing
    assert not thread.is_alive() and "error" not in box
    stats = store.stats()
    assert stats.closed and stats.puts_ok == 0
    assert store.batch_get_into(keys(1), [src.page(0)]) == [None]
    mooncake_master.thaw()
    mooncake_master.stop()
    # the client itself is closed by its own thread once the master answers or is gone
    assert store.wait_closed(120)


def test_no_master_is_misses_and_close_returns(mooncake_net, stores):
    if not mooncake_net.private:
        pytest.skip(mooncake_net.why)
    missing = MooncakeMaster(free_port(), free_port())
    store = MooncakeStore(mooncake_config(missing, close_timeout_s=0.5, retry_after_s=30), LAYOUT_A)
    pages = Pages(2, 1024)
    store.register_buffer(pages.buf)
    assert not store.wait_ready(0.3)  # setup keeps retrying in the background
    assert store.batch_put(keys(1), [pages.page(0)]) == [False]
    assert store.batch_get_into(keys(1), [pages.page(1)]) == [None]
    assert store.exists_prefix(keys(1)) == 0
    box, thread = in_thread(store.close)
    thread.join(60)
    assert not thread.is_alive() and "error" not in box
    assert store.stats().misses == {"unavailable": 1}


def test_open_store_builds_the_mooncake_adapter(mooncake_master, stores):
    store = stores(open_store(mooncake_config(mooncake_master), LAYOUT_A))
    assert isinstance(store, MooncakeStore) and store.wait_ready(30)
