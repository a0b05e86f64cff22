"""A worker in its own process refuses what it must not trust (issue 20, class 5).

The scheduler process drives the worker process over a pipe, as ``test_two_sides.py`` does,
with: replayed swap plans (after completion, once the blocks belong to another request),
reordered, skipped and repeated deltas and steps, deltas and plans of another scheduler, null
and out-of-range block ids, rows and host pages, copies aimed at another request's blocks, a
swap in sent with its direction flipped, and a success the worker never reported.
Each is refused with a typed error (``kvforge.errors.WorkerRefusedError`` subclasses, carried
back as their names) before anything moved: a SHA-256 of every cache byte, host page and
mirrored table is the same before and after, and every live entry of every resident request
still holds its own bytes. The protocol then goes on: a swap round trip is byte-exact.
"""

import multiprocessing as mp

import pytest
from _adversarial import scheduler_main, worker_main


@pytest.mark.slow
def test_a_worker_in_its_own_process_refuses_what_it_must_not_trust():
    ctx = mp.get_context("spawn")
    sched_end, worker_end = ctx.Pipe()
    out = ctx.Queue()
    worker = ctx.Process(target=worker_main, args=(worker_end,))
    scheduler = ctx.Process(target=scheduler_main, args=(sched_end, out))
    worker.start()
    scheduler.start()
    try:
        result = out.get(timeout=240)
    finally:
        scheduler.join(60)
        worker.join(60)
        for proc in (scheduler, worker):
            if proc.is_alive():
                proc.kill()
    assert "error" not in result, result.get("error")
    assert scheduler.exitcode == 0 and worker.exitcode == 0
    assert result["forbidden"] == []  # the scheduler never imported the worker side
    cases = result["cases"]
    kinds = " ".join(c["name"] for c in cases)
    for word in (
        "replayed",
        "reversed",
        "skipped",
        "repeat",
        "another scheduler",
        "10000",
        "null",
        "-1",
        "b's block",
        "direction flipped",
    ):
        assert word in kinds, word
    for case in cases:
        assert case["status"] == "refused", case
        assert case["error"] == case["expected"], case
        assert case["unchanged"], case  # not a byte, page or table cell moved
        assert case["entries"] > 0 and case["bad"] == 0, case  # every request's bytes intact
    assert result["reused"]  # the replayed swap in would have landed in d's blocks
    assert result["receipt_refused"]  # a success the worker never reported
    assert all(bad == 0 and total > 0 for total, bad in result["final"])
    assert result["pools_full"]
