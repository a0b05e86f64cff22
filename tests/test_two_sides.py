"""The scheduler side and the worker side in two processes that exchange only plain values.

The scheduler process builds a ``BlockManager``; the worker process a ``CacheStorage``. They
talk over a pipe in pickled values (steps, table deltas, swap plans and results); the
scheduler checks that no torch tensor crosses and that it never loaded the host cache, the
kernels or the worker side. Swap round trips are byte-exact, and a copy failure injected in
the worker is rolled back on both sides.
"""

import multiprocessing as mp

import pytest
from _two_sides import MODELS, scheduler_main, worker_main


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.slow
def test_scheduler_and_worker_in_two_processes(model):
    ctx = mp.get_context("spawn")
    sched_end, worker_end = ctx.Pipe()
    out = ctx.Queue()
    worker = ctx.Process(target=worker_main, args=(worker_end, model))
    scheduler = ctx.Process(target=scheduler_main, args=(sched_end, model, out))
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
    assert result["forbidden"] == []  # the scheduler never imported host_cache, ops, worker
    # every live entry written before the swap out came back byte for byte
    assert sum(entries for entries, _ in result["checks"]) == result["written"] > 0
    assert all(bad == 0 for _, bad in result["checks"])
    # the injected copy failure came back as a typed result and both sides rolled back
    assert result["rolled_back"] and result["failure"] == "injected copy failure"
    assert result["pools_full"]
