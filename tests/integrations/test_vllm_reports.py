"""Reports and ids from vLLM (issue 32, class 8): a report (a finished or failed load or store)
counts only for a job or key that was issued and is still outstanding, and changes nothing
otherwise; ids are ints (a float block id is refused, never truncated to a block).

Who refuses how (docs/integrations/vllm.md, *Reports and ids*): the manager raises
``TransferRefusedError``; the connector's hooks drop a report or job that is not outstanding
with a warning and count it; a malformed id raises ``ArgumentError`` before anything changes;
a malformed transfer spec on a worker is a failed transfer that moves nothing.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'kvforge[vllm]' (docs/integrations/vllm.md)"
)
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult
from vllm.v1.outputs import KVConnectorOutput

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_adversarial import host, snapshot
from test_vllm_connector import engine, parts, prompt
from test_vllm_manager import HIT, MISS, PENDING, ctx, key, manager, states, store
from test_vllm_worker import NUM_BLOCKS, worker

from kvforge._checks import ArgumentError
from kvforge.errors import RequestStateError
from kvforge.integrations.vllm.checks import TransferRefusedError, int_array, int_id
from kvforge.integrations.vllm.connector import KVForgeWorkerMetadata
from kvforge.integrations.vllm.manager import KVForgeHostSpec

# ------------------------------------------------------------------ the manager's reports


def reports_manager():
    """key 1 held (written), key 2 being stored by A, key 3 pinned by A's load, key 4 never
    held; events drained."""
    m = manager(pages=4)
    store(m, [key(1), key(3)])
    m.prepare_store([key(2)], ctx("A"))
    m.prepare_load([key(3)], ctx("A"))
    list(m.take_events())
    return m


def manager_state(m):
    return (
        states(m, [key(i) for i in range(1, 6)]),
        m.held(),
        m.usage(),
        m.stores_failed,
        list(m.take_events()),
    )


# (call, exception, message fragment)
BAD_REPORTS = [
    # the example: a failure report for a key never held
    (
        lambda m: m.mark_failed([key(4)], ctx("A")),
        TransferRefusedError,
        "request 'A' has no store or load of it outstanding",
    ),
    (
        lambda m: m.mark_failed([key(2)], ctx("B")),
        TransferRefusedError,
        "request 'B' has no store or load of it outstanding \\(request 'A' reserved its store\\)",
    ),
    (lambda m: m.mark_failed([key(3)], ctx("B")), TransferRefusedError, "request 'B' has no"),
    (lambda m: m.mark_failed([key(1)], ctx("A")), TransferRefusedError, "request 'A' has no"),
    # all or nothing: key 2's store is A's, key 4 is not: key 2 is not marked failed either
    (lambda m: m.mark_failed([key(2), key(4)], ctx("A")), TransferRefusedError, "has no"),
    (lambda m: m.mark_failed([b"x"], ctx("A")), TransferRefusedError, "has no"),
    (lambda m: m.mark_failed([7], ctx("A")), TransferRefusedError, "has no"),
    (
        lambda m: m.complete_store([key(4)], ctx("A")),
        TransferRefusedError,
        "complete_store: .* request 'A' has no store of it outstanding",
    ),
    (
        lambda m: m.complete_store([key(2)], ctx("B")),
        TransferRefusedError,
        "request 'A' reserved its store",
    ),
    (lambda m: m.complete_store([key(1)], ctx("A")), TransferRefusedError, "no store of it"),
    (lambda m: m.complete_store([key(2), key(4)], ctx("A")), TransferRefusedError, "no store"),
    (
        lambda m: m.complete_store([key(2)], ctx("A"), success="no"),
        ArgumentError,
        "success must be a bool, got 'no'",
    ),
    (
        lambda m: m.complete_store([key(2)], ctx("A"), success=0),
        ArgumentError,
        "success must be a bool, got 0",
    ),
    (
        lambda m: m.complete_load([key(1)], ctx("A")),
        TransferRefusedError,
        "complete_load: .* request 'A' has no load of it outstanding",
    ),
    (lambda m: m.complete_load([key(3)], ctx("B")), TransferRefusedError, "request 'B' has no"),
    (lambda m: m.complete_load([key(3), key(4)], ctx("A")), TransferRefusedError, "has no load"),
    (lambda m: m.complete_load([key(2)], ctx("A")), TransferRefusedError, "has no load"),
]


@pytest.mark.parametrize(("call", "exc", "message"), BAD_REPORTS)
def test_a_report_not_outstanding_is_refused_and_changes_nothing(call, exc, message):
    m = reports_manager()
    before = manager_state(m)
    assert before[0] == [HIT, PENDING, HIT, MISS, MISS]
    with pytest.raises(exc, match=message):
        call(m)
    assert manager_state(m) == before
    # the outstanding transfers still complete exactly as issued
    m.complete_store([key(2)], ctx("A"))
    m.complete_load([key(3)], ctx("A"))
    assert states(m, [key(1), key(2), key(3), key(4)]) == [HIT, HIT, HIT, MISS]
    assert m.stores_failed == 0 and m.usage() == (0.0, 0.0)


def test_a_refused_failure_report_never_blocks_that_keys_later_good_store():
    m = reports_manager()
    with pytest.raises(TransferRefusedError):
        m.mark_failed([key(4)], ctx("A"))  # a forged failure for a key never held
    store(m, [key(4)], req="B")
    assert states(m, [key(4)]) == [HIT]  # served, no reset needed
    spec = m.prepare_load([key(4)], ctx("C"))
    assert [p.tolist() for p in spec.pages] == [[4], []]


def test_a_genuine_failure_report_still_forgets_the_pages():
    m = reports_manager()
    m.mark_failed([key(2), key(3)], ctx("A"))  # A's store of 2 and load of 3 failed
    m.complete_store([key(2)], ctx("A"))
    m.complete_load([key(3)], ctx("A"))
    assert states(m, [key(2), key(3)]) == [MISS, MISS] and m.stores_failed == 1


# ------------------------------------------------------------------ ids


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (3, True),
        (np.int64(3), True),
        (np.uint8(3), True),
        (torch.tensor(3), True),
        (torch.tensor(3, dtype=torch.int16), True),
        (4.5, False),
        (4.0, False),
        (math.nan, False),
        (True, False),
        (np.bool_(True), False),
        ("3", False),
        (None, False),
        (np.float32(3), False),
        (torch.tensor(3.0), False),
        (torch.tensor([3]), False),
        (torch.tensor(True), False),
        (-1, False),
        (12, False),
    ],
)
def test_an_id_is_an_int_in_range(value, ok):
    if ok:
        assert int_id("block_id", value, 0, 12) == 3
    else:
        with pytest.raises(ArgumentError, match=r"^block_id=.*: must be an int in \[0, 12\)$"):
            int_id("block_id", value, 0, 12)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1, 4.5], r"ids\[1\]=4.5: must be an int"),
        (np.array([1.0, 2.0]), r"ids\[0\]=1.0: must be an int"),
        (np.array([True]), r"ids\[0\]=True: must be an int"),
        ([1, math.nan], r"ids\[1\]=nan"),
        (np.array([1, 12]), r"ids\[1\]=12: must be an int in \[0, 12\)"),
        (torch.tensor([0.5]), r"ids\[0\]=0.5"),
        (np.array([[1, 2]]), r"must be a flat sequence of ints"),
        (7, r"must be a flat sequence of ints"),
    ],
)
def test_id_arrays_refuse_anything_but_ints_in_range(values, message):
    with pytest.raises(ArgumentError, match=message):
        int_array("ids", values, 0, 12)
    assert int_array("ids", torch.tensor([1, 2], dtype=torch.int32), 0, 12).tolist() == [1, 2]
    assert int_array("ids", [], 0, 12).tolist() == []


# ------------------------------------------------------------------ a worker's transfer specs

# (device spec, host spec, direction, message): every one a failed transfer that moves nothing
BAD_IDS = []
for direction in ("store", "load"):
    BAD_IDS += [
        # the example: 4.5 was read as block 4
        (
            SimpleNamespace(
                block_ids=np.array([4.5, 2.0]), group_sizes=[1, 1], block_indices=[0, 0]
            ),
            host([1], [1]),
            direction,
            r"device block ids\[0\]=4.5: must be an int",
        ),
        (
            SimpleNamespace(
                block_ids=np.array([True, False]), group_sizes=[1, 1], block_indices=[0, 0]
            ),
            host([1], [1]),
            direction,
            r"device block ids\[0\]=True: must be an int",
        ),
        (
            SimpleNamespace(block_ids=[1, math.nan], group_sizes=[1, 1], block_indices=[0, 0]),
            host([1], [1]),
            direction,
            r"device block ids\[1\]=nan",
        ),
        (
            GPULoadStoreSpec([1, NUM_BLOCKS], [1, 1], [0, 0]),
            host([1], [1]),
            direction,
            rf"group position 1: device block ids must be below {NUM_BLOCKS}, got \[{NUM_BLOCKS}\]",
        ),
        (
            GPULoadStoreSpec([2**30, 1], [1, 1], [0, 0]),
            host([1], [1]),
            direction,
            r"group position 0: device block ids must be below",
        ),
        (
            SimpleNamespace(block_ids=np.array([1, 2]), group_sizes=[1.0, 1], block_indices=[0, 0]),
            host([1], [1]),
            direction,
            r"group_sizes\[0\]=1.0: must be an int",
        ),
        (
            SimpleNamespace(block_ids=np.array([1, 2]), group_sizes=[1, 1], block_indices=[0.5, 0]),
            host([1], [1]),
            direction,
            r"block_indices\[0\]=0.5: must be an int",
        ),
        (
            SimpleNamespace(block_ids=np.array([1, 2]), group_sizes=[1, 1], block_indices=[0]),
            host([1], [1]),
            direction,
            r"names 1 block indices for 2 groups",
        ),
    ]


def forged_host(*pages):
    """Host pages that skip ``HostPages``' own check (which refuses a float page id)."""
    spec = KVForgeHostSpec.__new__(KVForgeHostSpec)
    spec.pages = tuple(np.asarray(p) for p in pages)
    return spec


BAD_IDS += [
    (
        GPULoadStoreSpec([1, 2], [1, 1], [0, 0]),
        forged_host([1.5], [1]),
        d,
        r"group position 0: host pages\[0\]=1.5: must be an int",
    )
    for d in ("store", "load")
]


@pytest.mark.parametrize(("gpu", "hst", "direction", "message"), BAD_IDS)
def test_ids_that_are_not_ints_in_range_fail_the_transfer_and_move_nothing(
    gpu, hst, direction, message, caplog
):
    w = worker()
    w.submit_store(1, GPULoadStoreSpec([5, 6], [1, 1], [0, 0]), host([1], [1]))
    assert w.get_finished()[0].success
    before_host, before_dev = snapshot(w)
    assert w.submit_store(7, gpu, hst) if direction == "store" else w.submit_load(7, hst, gpu)
    [done] = w.get_finished()
    assert (done.job_id, done.success) == (7, False)
    assert re.search(message, caplog.text), caplog.text
    after_host, after_dev = snapshot(w)
    assert all(torch.equal(a, b) for a, b in zip(after_host, before_host, strict=True))
    assert after_dev == before_dev and w.failed_transfers == 1


@pytest.mark.parametrize("job_id", [4.5, True, "7", None, -1])
def test_a_transfer_names_its_job_by_an_int(job_id):
    w = worker()
    before_host, before_dev = snapshot(w)
    with pytest.raises(ArgumentError, match=r"^job_id=.*: must be an int >= 0$"):
        w.submit_store(job_id, GPULoadStoreSpec([5, 6], [1, 1], [0, 0]), host([1], [1]))
    assert w.get_finished() == [] and w.failed_transfers == 0
    after_host, after_dev = snapshot(w)
    assert all(torch.equal(a, b) for a, b in zip(after_host, before_host, strict=True))
    assert after_dev == before_dev


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ([1.5], r"pages\[0\]\[0\]=1.5"),
        ([True], r"pages\[0\]\[0\]=True"),
        ([-1], r"pages\[0\]\[0\]=-1"),
        ([2**31], r"pages\[0\]\[0\]=2147483648"),
    ],
)
def test_host_pages_refuse_a_page_id_that_is_not_an_int(pages, message):
    with pytest.raises(ArgumentError, match=message):
        KVForgeHostSpec([np.asarray(pages)])


# ------------------------------------------------------------------ through vLLM


def held_state(eng):
    manager, worker_ = parts(eng)
    return (
        manager.held(),
        manager.stores_failed,
        worker_.bytes_stored,
        worker_.bytes_loaded,
        worker_.failed_transfers,
        [h.clone() for h in worker_.host],
    )


def same(a, b):
    return a[:5] == b[:5] and all(torch.equal(x, y) for x, y in zip(a[5], b[5], strict=True))


def test_forged_reports_through_the_connector_are_refused_and_block_nothing(caplog):
    eng = engine("llama")
    p = prompt("llama")
    eng.add_request("A", p, 3)
    out_a = eng.run_until_done()["A"]
    conn = eng.scheduler_connector
    sched = conn.connector_scheduler
    manager, _ = parts(eng)
    assert manager.held() == {0: 3} and eng.worker_metas
    issued = max(j for meta in eng.worker_metas for j in meta.completed_jobs)
    before = held_state(eng)
    # (report, refused reports): replays, a job never issued, failures for jobs not outstanding
    forged = [
        (eng.worker_metas[0], len(eng.worker_metas[0].completed_jobs)),
        (KVForgeWorkerMetadata({issued + 100: 1}), 1),
        (KVForgeWorkerMetadata({issued + 100: 1}, failed_jobs={issued + 100}), 2),
        (KVForgeWorkerMetadata({}, failed_jobs={0, issued + 50}), 2),
        (OffloadingWorkerMetadata({issued: 1}), 1),
    ]
    for meta, refused in forged:
        n = sched.refused_reports
        conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
        assert sched.refused_reports == n + refused
        assert same(held_state(eng), before)
        assert list(manager.take_events()) == []
    assert "refused a worker report for job" in caplog.text
    # malformed ids: a typed error, nothing changed
    for meta, message in [
        (KVForgeWorkerMetadata({4.5: 1}), r"completed_jobs job id=4.5: must be an int"),
        (KVForgeWorkerMetadata({True: 1}), r"completed_jobs job id=True"),
        (KVForgeWorkerMetadata({issued: 0}), r"completed_jobs\[\d+\]=0: must be an int >= 1"),
        (KVForgeWorkerMetadata({issued: 1.0}), r"completed_jobs\[\d+\]=1.0"),
        (KVForgeWorkerMetadata({}, failed_jobs={"0"}), r"failed_jobs job id='0'"),
        ("done", r"kv_connector_worker_meta='done': must be an offloading worker report"),
    ]:
        with pytest.raises(ArgumentError, match=message):
            conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
        assert same(held_state(eng), before)
    # nothing was blocked: B, with A's prompt, is served from the host pages
    assert eng.reset_prefix_cache()
    eng.add_request("B", p, 3)
    assert eng.run_until_done()["B"] == out_a
    assert eng.num_external_computed_tokens["B"] == 16 * 3


def test_an_over_counted_report_for_an_outstanding_job_is_refused():
    eng = engine("llama")
    eng.add_request("A", prompt("llama"), 3)
    sched = eng.scheduler_connector.connector_scheduler
    outstanding = set()
    while eng.has_requests() and not outstanding:
        so = eng.step()
        outstanding = set(so.kv_connector_metadata.store_jobs)  # reported next step
    assert outstanding
    job = min(outstanding)
    meta = KVForgeWorkerMetadata({job: 2}, failed_jobs={job})  # one worker: 1 outstanding
    eng.scheduler_connector.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=meta)
    )
    assert sched.refused_reports == 2
    manager, worker_ = parts(eng)
    eng.run_until_done()
    assert manager.stores_failed == 0 and manager.held() == {0: 3} and worker_.bytes_stored > 0


def test_block_ids_from_vllm_must_be_ints_in_range():
    eng = engine("llama")  # 64 blocks
    eng.add_request("A", prompt("llama"), 2)
    conn = eng.scheduler_connector
    sched = conn.connector_scheduler
    req = eng.scheduler.requests["A"]

    def blocks(*ids):
        return SimpleNamespace(blocks=([SimpleNamespace(block_id=b) for b in ids],))

    def output(new=(), cached=((), ()), copies=None, finished=(), boundary=None):
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b) for r, b in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=list(cached[0]), new_block_ids=list(cached[1])
            ),
            kv_cache_block_copies=copies,
            finished_req_ids=set(finished),
            preempted_req_ids=set(),
            kv_connector_block_state=None
            if boundary is None
            else SimpleNamespace(boundary_state_offloads=boundary),
        )

    calls = [
        (
            lambda: conn.update_state_after_alloc(req, blocks(1, 4.5), 16),
            ArgumentError,
            r"update_state_after_alloc: blocks.blocks\[0\] block_id\[1\]=4.5: must be an int in "
            r"\[0, \d+\)",
        ),
        (
            lambda: conn.update_state_after_alloc(req, blocks(True), 16),
            ArgumentError,
            r"block_id\[0\]=True",
        ),
        (
            lambda: conn.update_state_after_alloc(req, blocks(math.nan), 16),
            ArgumentError,
            r"block_id\[0\]=nan",
        ),
        (
            lambda: conn.update_state_after_alloc(req, blocks(-1), 16),
            ArgumentError,
            r"block_id\[0\]=-1",
        ),
        (
            lambda: conn.update_state_after_alloc(req, blocks(10**6), 16),
            ArgumentError,
            r"block_id\[0\]=1000000: must be an int in \[0, \d+\)",
        ),
        (
            lambda: conn.update_state_after_alloc(req, blocks(1), 1.5),
            ArgumentError,
            r"num_external_tokens=1.5",
        ),
        (
            lambda: conn.get_num_new_matched_tokens(req, 16.0),
            ArgumentError,
            r"get_num_new_matched_tokens: num_computed_tokens=16.0: must be an int >= 0",
        ),
        (
            lambda: conn.get_num_new_matched_tokens(req, -16),
            ArgumentError,
            r"num_computed_tokens=-16",
        ),
        (
            lambda: conn.get_external_cache_hit_sources(req, math.nan),
            ArgumentError,
            r"get_external_cache_hit_sources: num_external_tokens=nan",
        ),
        (
            lambda: conn.request_finished(req, [1, 2.5]),
            ArgumentError,
            r"request_finished: block_ids\[1\]=2.5",
        ),
        (lambda: conn.request_finished(req, "1,2"), ArgumentError, r"must be a list"),
        (
            lambda: conn.request_finished_all_groups(req, ([1], [np.float64(2)])),
            ArgumentError,
            r"request_finished: block_ids\[1\]\[0\]=2.0",
        ),
        (
            lambda: conn.request_finished_all_groups(req, [[1]]),
            ArgumentError,
            r"must be a tuple of one list of block ids per group",
        ),
        (
            lambda: conn.build_connector_meta(output(new=[("A", ([1, 4.5],))])),
            ArgumentError,
            r"scheduled_new_reqs\[0\].block_ids\[0\]\[1\]=4.5",
        ),
        (
            lambda: conn.build_connector_meta(output(new=[("ghost", ([1],))])),
            RequestStateError,
            r"scheduled_new_reqs\[0\].req_id='ghost' is not a request this connector was told of",
        ),
        (
            lambda: conn.build_connector_meta(output(cached=(["A"], [([2.5],)]))),
            ArgumentError,
            r"scheduled_cached_reqs.new_block_ids\[0\]\[0\]\[0\]=2.5",
        ),
        (
            lambda: conn.build_connector_meta(output(cached=(["A"], []))),
            ArgumentError,
            r"1 request ids and 0 block id lists",
        ),
        (
            lambda: conn.build_connector_meta(
                output(copies=[SimpleNamespace(src_block_id=1, dst_block_id=1.5)])
            ),
            ArgumentError,
            r"kv_cache_block_copies\[0\]\[1\]=1.5",
        ),
        (
            lambda: conn.build_connector_meta(output(finished=[3])),
            ArgumentError,
            r"finished_req_ids: request id 3 is not a string",
        ),
        (
            lambda: conn.build_connector_meta(output(boundary={"A": [(0, 2.5, 16)]})),
            ArgumentError,
            r"boundary_state_offloads\['A'\]\[0\] block id=2.5",
        ),
    ]
    for call, exc, message in calls:
        with pytest.raises(exc, match=message):
            call()
        assert sched.has_pending_push_work() is False  # no job issued, the step lock released
    sched.check_finished_block_ids([np.int64(3), torch.tensor(2), 0])  # integer types pass
    # nothing changed: the request runs as if none of it had happened
    assert eng.run_until_done()["A"]
    assert parts(eng)[0].held() == {0: 3}


def test_a_worker_runs_each_job_once_and_refuses_malformed_jobs(caplog):
    eng = engine("llama")
    p = prompt("llama")
    eng.add_request("A", p, 3)
    metas = []
    while eng.has_requests():
        metas.append(eng.step().kv_connector_metadata)
    assert eng.reset_prefix_cache()
    eng.add_request("B", p, 3)
    while eng.has_requests():
        metas.append(eng.step().kv_connector_metadata)
    conn = eng.worker_connector
    cw = conn.connector_worker
    with_jobs = [m for m in metas if m.load_jobs or m.store_jobs]
    assert any(m.load_jobs for m in with_jobs) and any(m.store_jobs for m in with_jobs)
    before = held_state(eng)

    def raw(t):
        return t.contiguous().view(torch.uint8).clone()  # bytes: a NaN equals itself

    caches_before = {n: raw(t) for n, t in eng.kv_caches.items()}

    def unchanged():
        assert same(held_state(eng), before)
        assert all(torch.equal(raw(eng.kv_caches[n]), t) for n, t in caches_before.items())
        assert cw.worker.get_finished() == [] and conn.build_connector_worker_meta() is None

    # replays, older first and the last one again: nothing runs, each job counted once
    replayed = sum(len(m.load_jobs) + len(m.store_jobs) for m in with_jobs)
    n = cw.refused_jobs
    for meta in [*with_jobs, metas[-1]]:
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        conn.wait_for_save()
        conn.clear_connector_metadata()
        cw.start_kv_transfers(meta)  # the same metadata twice in a row
    assert cw.refused_jobs == n + replayed
    unchanged()
    assert "a replay (this worker was handed it before)" in caplog.text
    # a result for a job never submitted
    real = cw.worker.get_finished
    cw.worker.get_finished = lambda: [TransferResult(10**6, True, 64, 0.1)]
    assert cw.get_finished(set()) == (set(), set())
    cw.worker.get_finished = real
    assert cw.refused_jobs == n + replayed + 1
    # malformed jobs: a typed error, nothing queued or run
    spec = GPULoadStoreSpec([1], [1], [0])
    pages = KVForgeHostSpec([np.array([1])])
    top = 10**6
    for meta, message in [
        (
            OffloadingConnectorMetadata({4.5: TransferJob("A", pages, spec)}, {}),
            r"load_jobs job id=4.5: must be an int",
        ),
        (
            OffloadingConnectorMetadata({}, {True: TransferJob("A", spec, pages)}),
            r"store_jobs job id=True",
        ),
        (OffloadingConnectorMetadata({top: "job"}, {}), r"load_jobs\[1000000\]='job'"),
        (
            OffloadingConnectorMetadata({top: TransferJob(7, pages, spec)}, {}),
            r"must be a TransferJob of a request id",
        ),
        (
            OffloadingConnectorMetadata({}, {top: TransferJob("A", pages, spec)}),
            r"store_jobs\[1000000\]: must move between a GPULoadStoreSpec and kvforge host pages",
        ),
        (OffloadingConnectorMetadata({}, {}, jobs_to_flush={"1"}), r"jobs_to_flush job id='1'"),
        ("meta", r"kv_connector_metadata='meta': must be an OffloadingConnectorMetadata"),
    ]:
        for call in (conn.handle_preemptions, cw.start_kv_transfers, cw.prepare_store_kv):
            with pytest.raises(ArgumentError, match=message):
                call(meta)
            unchanged()
        conn.bind_connector_metadata(meta)
        for call in (lambda: conn.start_load_kv(None), conn.wait_for_save):
            with pytest.raises(ArgumentError, match=message):
                call()
            unchanged()
        conn.clear_connector_metadata()
    with pytest.raises(ArgumentError, match=r"finished_req_ids: request id 1 is not a string"):
        cw.get_finished({1})
