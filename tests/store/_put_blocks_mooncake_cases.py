"""The cases of ``test_store_put_blocks_mooncake.py``, which runs this module in a process of
its own: Mooncake's client keeps process-wide state in the network namespace of the first
client, so these cannot share a process with ``test_store_mooncake.py`` (``conftest.py``).

``batch_put_blocks`` on the Mooncake adapter against a real ``mooncake_master`` (TCP, in a
private network namespace): values put straight from the planes are byte for byte those
``batch_put`` writes from packed pages, calls are cut to Mooncake's per-peer transfer queue, and
a plane outside every registered buffer raises before anything is put. Then a segment lent by
another process (:class:`MooncakeSegmentHost`, the wheel's ``mooncake_client``), as
``kvforge bench --tiers`` measures by default: a client lending no memory puts from planes and
pages and gets back over TCP, byte for byte; the host is its own pid and stops by it."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
from _store_helpers import Pages, keys, mooncake_config
from test_store_put_blocks import Planes

from kvforge._checks import ArgumentError
from kvforge.store.base import server_key
from kvforge.store.mooncake_store import MooncakeStore
from kvforge.store.servers import MooncakeSegmentHost, free_port
from kvforge.store.value import decode

# ImportError, not only ModuleNotFoundError: the wheel without the libibverbs it loads skips too
pytest.importorskip(
    "mooncake.store",
    reason="Mooncake Store's client does not load: pip install 'kvforge[mooncake]' and apt-get install libibverbs1 ibverbs-providers",
    exc_type=ImportError,
)

LAYOUT = b"deepseek-v4|mla+indexer|fp8|block=64|tp=0/1"


def make(stores, master, **fields) -> MooncakeStore:
    store = stores(MooncakeStore(mooncake_config(master, **fields), LAYOUT))
    assert store.wait_ready(30), store.stats()
    return store


def stored(store, key: bytes) -> bytes:
    return store._client.get(server_key(store.config.namespace, store.fingerprint, key))


def test_blocks_put_from_planes_are_the_values_of_their_packed_pages(mooncake_master, stores):
    planes = Planes(10, [300, 4096, 17, 2000])
    store = make(stores, mooncake_master, namespace="blocks")
    pages_store = make(stores, mooncake_master, namespace="pages", mooncake_global_segment_bytes=0)
    planes.register(store)
    page_bytes = len(planes.page(0))
    packed, chosen = Pages(4, page_bytes), [2, 7, 0, 9]
    for i, block in enumerate(chosen):
        packed.buf[i * page_bytes : (i + 1) * page_bytes] = np.frombuffer(
            planes.page(block), np.uint8
        )
    pages_store.register_buffer(packed.buf)
    ks = keys(4)
    assert store.batch_put_blocks(ks, planes.planes, chosen) == [True] * 4
    assert pages_store.batch_put(ks, packed.pages(range(4))) == [True] * 4
    for key in ks:  # same key, same layout: the same bytes, header included
        assert stored(store, key) == stored(pages_store, key)
    out = Pages(4, page_bytes, seed=9)
    store.register_buffer(out.buf)
    assert store.batch_get_into(ks, out.pages(range(4))) == [page_bytes] * 4
    assert [out.bytes_of(i) for i in range(4)] == [planes.page(b) for b in chosen]
    stats = store.stats()
    assert (stats.puts_ok, stats.puts_failed, stats.gets_hit, stats.errors) == (4, 0, 4, 0)


def test_calls_stay_under_the_transfer_queue(mooncake_master, stores):
    # 40 values of 64 planes (65 buffers each): 2,600 buffers, cut into calls of at most
    # max_put_parts (1,024), i.e. 15 values each
    planes = Planes(40, [32] * 64, pad=0, seed=4)
    store = make(stores, mooncake_master)
    planes.register(store)
    calls: list[int] = []
    put = store._put_blocks
    store._put_blocks = lambda items, spans: calls.append(len(items)) or put(items, spans)
    ks = keys(40)
    assert store.batch_put_blocks(ks, planes.planes, list(range(39, -1, -1))) == [True] * 40
    assert calls == [15, 15, 10] and max(calls) * 65 <= store.max_put_parts
    for key, block in zip(ks, range(39, -1, -1), strict=True):
        assert bytes(decode(stored(store, key), key, LAYOUT)) == planes.page(block)


def test_an_unregistered_plane_raises_and_puts_nothing(mooncake_master, stores):
    planes, other = Planes(4, [64, 64]), Planes(4, [64], seed=5)
    store = make(stores, mooncake_master)
    planes.register(store)
    before = store.stats()
    with pytest.raises(
        ArgumentError, match=r"planes\[2\] \(451 bytes at 0x[0-9a-f]+\) lies outside"
    ):
        store.batch_put_blocks(keys(2), [*planes.planes[:2], other.planes[0]], [0, 1])
    assert store.stats() == before
    assert store.exists_prefix(keys(1)) == 0
    assert store.batch_put_blocks(keys(2), planes.planes, [0, 1]) == [True, True]


@pytest.fixture
def segment_host(mooncake_master, tmp_path):
    if shutil.which("mooncake_client") is None:
        pytest.skip("the wheel's mooncake_client is not on PATH")
    host = MooncakeSegmentHost(free_port(), mooncake_master.address, 64 << 20, tmp_path / "seg.log")
    host.start()
    try:
        yield host
    finally:
        host.stop()


def test_a_client_lending_nothing_puts_and_gets_through_another_process(
    mooncake_master, segment_host, stores
):
    assert os.path.basename(os.readlink(f"/proc/{segment_host.pid}/exe")) == "mooncake_client"
    config = mooncake_config(mooncake_master, mooncake_global_segment_bytes=0)
    store = stores(MooncakeStore(config, LAYOUT))
    assert store.wait_ready(30), store.stats()
    planes = Planes(6, [4096, 300, 8192])
    planes.register(store)
    page_bytes = len(planes.page(0))
    src, out = Pages(2, page_bytes, seed=3), Pages(5, page_bytes, seed=4)
    store.register_buffer(src.buf)
    store.register_buffer(out.buf)
    ks = keys(5)
    # the segment is mounted a little after the host's port answers: retry the first put
    for _ in range(50):
        if store.batch_put_blocks(ks[:3], planes.planes, [5, 0, 3]) == [True] * 3:
            break
        time.sleep(0.1)
    assert store.exists_prefix(ks[:3]) == 3, store.stats()
    assert store.batch_put(ks[3:], src.pages([0, 1])) == [True, True]
    assert store.batch_get_into(ks, out.pages(range(5))) == [page_bytes] * 5
    assert [out.bytes_of(i) for i in range(3)] == [planes.page(b) for b in (5, 0, 3)]
    assert [out.bytes_of(3), out.bytes_of(4)] == [src.bytes_of(0), src.bytes_of(1)]


def test_the_host_stops_by_its_pid(mooncake_master, segment_host):
    pid = segment_host.pid
    assert os.path.exists(f"/proc/{pid}")
    segment_host.stop()
    assert segment_host.proc.poll() is not None  # reaped
    assert not os.path.exists(f"/proc/{pid}")
