"""The bounded put queue on its own: the bound holds while the writer is stuck, offers beyond it
are refused at once, close drains what it can and returns even with the writer stuck."""

from __future__ import annotations

import threading

from kvforge.store.put_queue import PutQueue


class Writer:
    """A writer that blocks until released, recording what it was handed."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.written: list[int] = []

    def __call__(self, batch: list[int]) -> None:
        self.entered.set()
        assert self.release.wait(30)
        self.written.extend(batch)


def test_the_bound_counts_queued_and_held_items():
    writer = Writer()
    q = PutQueue(bound=4, batch=2, write=writer, name="t")
    assert q.offer([0]) == 1
    assert writer.entered.wait(10)  # the writer holds item 0
    assert q.offer([1, 2, 3, 4, 5]) == 3  # room for 3 more, 2 refused
    assert (q.inflight, q.peak) == (4, 4)
    assert q.offer([6]) == 0
    writer.release.set()
    assert q.wait_idle(10)
    assert writer.written == [0, 1, 2, 3] and q.inflight == 0
    assert q.close(5) == 0 and not q.writer_alive


def test_close_drains_then_drops_and_never_waits_past_its_timeout():
    writer = Writer()
    q = PutQueue(bound=10, batch=1, write=writer, name="t")
    assert q.offer(list(range(5))) == 5
    assert writer.entered.wait(10)
    # the writer is stuck on item 0: close waits 0.05 s, then drops items 1..4
    assert q.close(0.05) == 4
    assert q.inflight == 1  # item 0, still held by the stuck writer
    assert q.offer([9]) == 0  # closed
    writer.release.set()
    assert q.wait_idle(10) and writer.written == [0]


def test_a_writer_that_raises_does_not_kill_the_queue():
    seen: list[list[int]] = []

    def write(batch: list[int]) -> None:
        seen.append(batch)
        raise RuntimeError("boom")

    q = PutQueue(bound=3, batch=8, write=write, name="t")
    assert q.offer([1]) == 1
    assert q.wait_idle(10)
    assert q.offer([2]) == 1
    assert q.wait_idle(10)
    assert seen == [[1], [2]] and q.inflight == 0
    assert q.close(5) == 0


def test_wait_idle_times_out_while_a_write_is_stuck():
    writer = Writer()
    q = PutQueue(bound=2, batch=1, write=writer, name="t")
    q.offer([1])
    assert writer.entered.wait(10)
    assert not q.wait_idle(0.01)
    writer.release.set()
    assert q.wait_idle(10)
    q.close(5)


def test_the_byte_bound_counts_queued_and_held_bytes():
    """Items of 40 bytes under a 100-byte bound: two fit beside each other, a third waits
    for room; one item larger than the bound is taken alone, when nothing else is in flight."""
    writer = Writer()
    q = PutQueue(bound=100, batch=1, write=writer, name="t", bound_bytes=100, size=lambda i: i)
    assert q.offer([40]) == 1
    assert writer.entered.wait(10)  # the writer holds 40 bytes
    assert q.offer([40, 40, 10]) == 1  # 80 in flight; the next 40 would pass 100: stop there
    assert (q.inflight, q.inflight_bytes) == (2, 80)
    assert q.offer([10, 10]) == 2  # 100 exactly
    assert q.offer([1]) == 0 and q.inflight_bytes == 100
    writer.release.set()
    assert q.wait_idle(10)
    assert writer.written == [40, 40, 10, 10] and (q.inflight, q.inflight_bytes) == (0, 0)
    assert q.offer([500]) == 1  # alone: taken, so no item is refused for its size alone
    assert q.wait_idle(10) and writer.written[-1] == 500
    assert q.close(5) == 0 and q.inflight_bytes == 0


def test_close_returns_the_dropped_items_bytes():
    writer = Writer()
    q = PutQueue(bound=10, batch=1, write=writer, name="t", bound_bytes=1000, size=lambda i: i)
    assert q.offer([7, 11, 13]) == 3
    assert writer.entered.wait(10)
    assert q.close(0.05) == 2  # 11 and 13 dropped; 7 still held by the stuck writer
    assert (q.inflight, q.inflight_bytes) == (1, 7)
    writer.release.set()
    assert q.wait_idle(10) and q.inflight_bytes == 0
