"""The reused value buffers of ``put_async`` (``kvforge.store.value_buffers``) and
``encode_into``: a buffer goes to one value at a time, the free ones stay under their bound,
and a value encoded into a reused buffer is byte for byte the one ``encode`` gives."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvforge.store.value import HEADER_SIZE, decode, encode, encode_into
from kvforge.store.value_buffers import ValueBuffers

KEY = bytes(range(32))
LAYOUT = b"gqa|bf16|block=16|tp=0/1"


def test_a_buffer_given_back_is_taken_again_by_its_size_only():
    pool = ValueBuffers(keep_bytes=10_000)
    a = pool.take(4096)
    assert (a.dtype, a.shape) == (np.uint8, (4096,))
    pool.give(a)
    assert pool.free_bytes == 4096
    b = pool.take(1024)  # another size: a new buffer, the 4,096-byte one stays free
    assert b is not a and b.nbytes == 1024 and pool.free_bytes == 4096
    assert pool.take(4096) is a and pool.free_bytes == 0


def test_free_buffers_never_pass_keep_bytes():
    pool = ValueBuffers(keep_bytes=10_000)
    bufs = [pool.take(4096) for _ in range(3)]
    for buf in bufs:
        pool.give(buf)
    assert pool.free_bytes == 8192  # the third would pass 10,000: dropped
    assert pool.take(4096) is bufs[1] and pool.take(4096) is bufs[0]
    assert pool.take(4096) is not bufs[2]


def test_on_drop_hears_of_each_buffer_not_kept_and_of_no_other():
    dropped: list[np.ndarray] = []
    pool = ValueBuffers(keep_bytes=5000, on_drop=dropped.extend)
    a, b = pool.take(4096), pool.take(4096)
    pool.give(a)
    pool.give(b)  # would pass 5,000 bytes
    assert dropped == [b] and pool.free_bytes == 4096
    assert pool.take(4096) is a and dropped == [b]


def test_a_size_no_longer_written_gives_its_room_to_the_one_written_now():
    dropped: list[np.ndarray] = []
    pool = ValueBuffers(keep_bytes=3 * 4096, on_drop=dropped.extend)
    old = [pool.take(4096) for _ in range(2)]
    tiny = pool.take(1024)
    for buf in (*old, tiny):
        pool.give(buf)
    assert pool.free_bytes == 2 * 4096 + 1024
    big = pool.take(8192)
    pool.give(big)  # the 4,096-byte list was started first: it goes, the 1,024 one stays
    assert [id(b) for b in dropped] == [id(b) for b in old]
    assert pool.free_bytes == 8192 + 1024
    assert pool.take(8192) is big and pool.take(1024) is tiny and pool.free_bytes == 0


def test_a_buffer_larger_than_the_bound_is_let_go_and_the_rest_kept():
    dropped: list[np.ndarray] = []
    pool = ValueBuffers(keep_bytes=4096, on_drop=dropped.extend)
    small = pool.take(4096)
    pool.give(small)
    huge = pool.take(8192)
    pool.give(huge)  # cannot fit even alone: it goes, and makes no other buffer go
    assert [id(b) for b in dropped] == [id(huge)] and pool.free_bytes == 4096
    assert pool.take(4096) is small


def test_clear_lets_every_free_buffer_go_unannounced():
    dropped: list[np.ndarray] = []
    pool = ValueBuffers(keep_bytes=1 << 20, on_drop=dropped.extend)
    a = pool.take(4096)
    pool.give(a)
    pool.clear()
    assert pool.free_bytes == 0 and dropped == [] and pool.take(4096) is not a


def test_two_threads_never_hold_the_same_buffer():
    pool = ValueBuffers(keep_bytes=1 << 20)
    held: set[int] = set()
    lock = threading.Lock()
    errors: list[str] = []

    def run() -> None:
        for _ in range(2000):
            buf = pool.take(512)
            with lock:
                if id(buf) in held:
                    errors.append("a buffer was handed to two takers")
                held.add(id(buf))
            with lock:
                held.discard(id(buf))
            pool.give(buf)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.free_bytes % 512 == 0 and 512 <= pool.free_bytes <= 1024


@pytest.mark.parametrize("size", [0, 1, 4096, 100_003])
def test_encode_into_writes_the_value_encode_gives(size):
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    out = np.full(HEADER_SIZE + size, 0xEE, dtype=np.uint8)  # stale bytes of a reused buffer
    encode_into(out, KEY, LAYOUT, payload)
    assert out.tobytes() == encode(KEY, LAYOUT, payload)
    assert bytes(decode(out, KEY, LAYOUT, expected_length=size)) == payload.tobytes()


@pytest.mark.parametrize(
    ("out_bytes", "message"),
    [
        (
            HEADER_SIZE + 99,
            f"out must hold {HEADER_SIZE + 100} bytes (header and payload), got {HEADER_SIZE + 99}",
        ),
        (100, f"out must hold {HEADER_SIZE + 100} bytes (header and payload), got 100"),
    ],
)
def test_encode_into_a_buffer_of_another_size_is_refused_untouched(out_bytes, message):
    out = np.full(out_bytes, 0xEE, dtype=np.uint8)
    with pytest.raises(ValueError) as info:
        encode_into(out, KEY, LAYOUT, bytes(100))
    assert str(info.value) == message
    assert (out == 0xEE).all()
