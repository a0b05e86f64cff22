"""Adversarial calls into kvforge's vLLM offloading backend: forged device specs the worker
must refuse (never a silent success that leaves another request's bytes in place), and the
pages of a failed load (never offered again, their removal published)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'kvforge[vllm]' (docs/integrations/vllm.md)"
)
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_manager import HIT, MISS, ctx, key, manager, states, store
from test_vllm_worker import NUM_BLOCKS, blocks, worker

from kvforge.integrations.vllm.checks import TransferRefusedError
from kvforge.integrations.vllm.manager import KVForgeHostSpec


class ForgedGPUSpec:
    """A device spec that skips ``GPULoadStoreSpec``'s own asserts."""

    def __init__(self, block_ids, group_sizes, block_indices):
        self.block_ids = np.asarray(block_ids, dtype=np.int32)
        self.group_sizes = group_sizes
        self.block_indices = block_indices


def host(*pages):
    return KVForgeHostSpec([np.asarray(p, dtype=np.int32) for p in pages])


def snapshot(w):
    dev = blocks(w, 0, list(range(NUM_BLOCKS))) + blocks(w, 1, list(range(NUM_BLOCKS)))
    return [h.clone() for h in w.host], dev


# (bpc, device spec, host spec, direction, message)
BAD_SPECS = [
    # -1 is "skip this row" to kvforge's gather/scatter: a load would leave the device block
    # holding whatever it held (another request's KV), a store the page's previous key's bytes
    (
        1,
        GPULoadStoreSpec([-1, 2], [1, 1], [0, 0]),
        host([1], [1]),
        "load",
        r"group position 0: device block ids must be >= 0, got \[-1\]",
    ),
    (
        1,
        GPULoadStoreSpec([1, -1], [1, 1], [0, 0]),
        host([1], [1]),
        "store",
        r"group position 1: device block ids must be >= 0, got \[-1\]",
    ),
    # group sizes that do not cover the block ids: extra ids were silently dropped
    (
        1,
        ForgedGPUSpec([1, 2, 3], [1, 1], [0, 0]),
        host([1], [1]),
        "store",
        r"3 device block ids, the group sizes \[1, 1\] add up to 2",
    ),
    (
        1,
        ForgedGPUSpec([1, 2, 3], [1, 1], [0, 0]),
        host([1], [1]),
        "load",
        r"3 device block ids, the group sizes \[1, 1\] add up to 2",
    ),
    # a store fills whole chunks (only the first may start mid-chunk): a later partial chunk
    # would put its blocks in the wrong rows and leave the rest of the page stale
    (
        2,
        GPULoadStoreSpec([1, 3], [2, 0], [1, 0]),
        host([1, 2], []),
        "store",
        r"group position 0: a store fills whole chunks: 2 blocks from offset 1 in 2 pages",
    ),
]


@pytest.mark.parametrize(("bpc", "gpu", "hst", "direction", "message"), BAD_SPECS)
def test_forged_device_specs_fail_and_move_nothing(bpc, gpu, hst, direction, message, caplog):
    w = worker(bpc=bpc)
    # page 1 of each group holds a previous key's bytes
    prev = GPULoadStoreSpec([5, 6] * bpc, [bpc, bpc], [0, 0])
    w.submit_store(1, prev, host([1], [1]))
    assert w.get_finished()[0].success
    before_host, before_dev = snapshot(w)
    ok = w.submit_store(7, gpu, hst) if direction == "store" else w.submit_load(7, hst, gpu)
    assert ok
    [done] = w.get_finished()
    assert (done.job_id, done.success) == (7, False)
    assert re.search(message, caplog.text), caplog.text
    after_host, after_dev = snapshot(w)
    assert all(torch.equal(a, b) for a, b in zip(after_host, before_host, strict=True))
    assert after_dev == before_dev
    assert w.failed_transfers == 1


def test_whole_chunk_stores_with_a_partial_first_chunk_and_gaps_still_map_exactly():
    w = worker(bpc=2)
    # chunks 0 (its 2nd block only), 2 and 3 of a request: chunk 1 held already (a gap)
    ids = [7, 2, 6, 1, 8]
    w.submit_store(1, GPULoadStoreSpec(ids, [5, 0], [1, 0]), host([3, 1, 4], []))
    assert w.get_finished()[0].success
    want = blocks(w, 0, ids)
    assert w.page_bytes(0, 3)[104:] == want[0]
    assert w.page_bytes(0, 1) == want[1] + want[2]
    assert w.page_bytes(0, 4) == want[3] + want[4]


def test_a_failed_load_page_is_not_offered_again_while_another_request_reads_it():
    m = manager(pages=3)
    store(m, [key(1)])
    list(m.take_events())
    m.prepare_load([key(1)], ctx("A"))
    m.prepare_load([key(1)], ctx("B"))
    m.mark_failed([key(1)], ctx("A"))  # A's load failed
    m.complete_load([key(1)], ctx("A"))
    # B still reads the page, so it stays; but no new request may start on it
    assert states(m, [key(1)]) == [MISS]
    assert m.held() == {0: 1, 2: 0}
    m.complete_load([key(1)], ctx("B"))
    assert m.held() == {0: 0, 2: 0} and not m._suspect and not m._pins
    # the page went: its removal is published (it was published stored)
    assert [(e.removed, e.metadata_only, e.keys) for e in m.take_events()] == [
        (True, False, [key(1)])
    ]
    # the request's recompute stores fresh bytes, which are offered again
    store(m, [key(1)], req="A")
    assert states(m, [key(1)]) == [HIT]


def test_a_failed_load_page_nobody_else_reads_goes_at_once_with_an_event():
    m = manager(pages=3)
    store(m, [key(1), key(2)])
    list(m.take_events())
    m.prepare_load([key(1), key(2)], ctx("A"))
    m.mark_failed([key(1), key(2)], ctx("A"))
    m.complete_load([key(1), key(2)], ctx("A"))
    assert states(m, [key(1), key(2)]) == [MISS, MISS]
    [event] = list(m.take_events())
    assert event.removed and not event.metadata_only and sorted(event.keys) == [key(1), key(2)]
    # replayed completion and failure reports are refused and change nothing
    with pytest.raises(TransferRefusedError):
        m.complete_load([key(1), key(2)], ctx("A"))
    with pytest.raises(TransferRefusedError):
        m.mark_failed([key(1)], ctx("A"))
    assert list(m.take_events()) == []
    assert m.prepare_store([key(3), key(4), key(5)], ctx()).evicted_keys == []
