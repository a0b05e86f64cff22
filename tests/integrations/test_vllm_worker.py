"""kvforge's vLLM offloading worker on caches laid out as vLLM lays them out: strided (a view's
block stride above its page), padded (a page above its unpadded bytes) and packed (every layer's
page of a block interleaved in one allocation). Stores and loads move exact bytes through
compact host pages; a bad spec is a failed transfer, never an exception into the engine."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'kvforge[vllm]' (docs/integrations/vllm.md)"
)
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

from kvforge.integrations.vllm.manager import KVForgeHostSpec
from kvforge.integrations.vllm.pages import plan_host_pages
from kvforge.integrations.vllm.worker import (
    KVForgeOffloadingWorker,
    TransferError,
    block_bytes_of,
)

NUM_BLOCKS = 12


def packed_caches(seed: int = 0) -> tuple[CanonicalKVCaches, list[int]]:
    """Two groups over one packed allocation, as DeepSeek-V4's: a block of 160 B holds group
    0's two layers (48 B page, 40 B unpadded; 64 B page, 64 B unpadded) and group 1's one
    layer (32 B page, 24 B unpadded), 16 B of tail padding."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (NUM_BLOCKS * 160,), dtype=torch.int8, generator=g)
    layers = [(0, 48, 40), (48, 64, 64), (112, 32, 24)]  # (offset in block, page, unpadded)
    tensors = [
        CanonicalKVCacheTensor(raw.as_strided((NUM_BLOCKS, page), (160, 1), off), page)
        for off, page, _ in layers
    ]
    refs = [
        [CanonicalKVCacheRef(0, layers[0][2]), CanonicalKVCacheRef(1, layers[1][2])],
        [CanonicalKVCacheRef(2, layers[2][2])],
    ]
    return CanonicalKVCaches(tensors, refs), [40 + 64, 24]


def worker(bpc: int = 1, pages: int = 4) -> KVForgeOffloadingWorker:
    caches, block_bytes = packed_caches()
    plan = plan_host_pages([0, 3], block_bytes, bpc, sum(block_bytes) * bpc * pages)
    return KVForgeOffloadingWorker(caches, plan, impl="torch")


def blocks(w: KVForgeOffloadingWorker, pos: int, ids: list[int]) -> list[bytes]:
    return [block_bytes_of(w.planes[pos], b) for b in ids]


def test_store_then_load_moves_exact_unpadded_bytes():
    w = worker()
    assert [h.shape for h in w.host] == [(4, 104), (4, 24)]  # compact: no padding, per group
    want = blocks(w, 0, [3, 7]) + blocks(w, 1, [5])
    assert w.submit_store(
        1,
        GPULoadStoreSpec([3, 7, 5], [2, 1], [0, 0]),
        KVForgeHostSpec([np.array([2, 4]), np.array([1])]),
    )
    [done] = w.get_finished()
    assert done.success and done.transfer_size == 2 * 104 + 24
    assert w.page_bytes(0, 2) + w.page_bytes(0, 4) + w.page_bytes(1, 1) == b"".join(want)
    # load the pages into other blocks: they receive the stored bytes, nothing else moves
    untouched = blocks(w, 0, [0, 1, 2, 4, 5, 6, 8, 9, 10, 11])
    assert w.submit_load(
        2,
        KVForgeHostSpec([np.array([2, 4]), np.array([1])]),
        GPULoadStoreSpec([9, 10, 11], [2, 1], [0, 0]),
    )
    assert w.get_finished()[0].success
    assert blocks(w, 0, [9, 10]) + blocks(w, 1, [11]) == want
    assert blocks(w, 0, [0, 1, 2, 4, 5, 6, 8]) == untouched[:7]


def test_padding_and_other_layers_bytes_are_never_written():
    w = worker()
    caches, _ = packed_caches()
    raw_before = caches.tensors[0].tensor.as_strided((NUM_BLOCKS * 160,), (1,), 0).clone()
    w.host[0].fill_(0x5A)
    w.host[1].fill_(0x5A)
    w.submit_load(
        1, KVForgeHostSpec([np.array([1]), np.array([1])]), GPULoadStoreSpec([4, 4], [1, 1], [0, 0])
    )
    assert w.get_finished()[0].success
    raw = w.planes[0][0].as_strided((NUM_BLOCKS * 160,), (1,), 0)
    changed = np.flatnonzero((raw != raw_before.view(torch.uint8)).numpy())
    # block 4 = bytes 640..799: group 0's 40 + 64 unpadded bytes and group 1's 24, no padding
    expect = set(range(640, 680)) | set(range(688, 752)) | set(range(752, 776))
    assert set(changed.tolist()) <= expect and len(changed) > 100


def test_chunks_of_two_blocks_and_a_load_that_starts_mid_chunk():
    w = worker(bpc=2)
    assert [h.shape for h in w.host] == [(8, 104), (8, 24)]
    # store logical blocks 0..3 of a request (two chunks) of group 0 in pages 3, 1
    ids = [2, 6, 1, 8]
    w.submit_store(
        1,
        GPULoadStoreSpec(ids, [4, 0], [0, 0]),
        KVForgeHostSpec([np.array([3, 1]), np.array([], dtype=np.int32)]),
    )
    assert w.get_finished()[0].success
    want = blocks(w, 0, ids)
    # load logical blocks 1..3 (block 0 is cached on the device): the first chunk's 2nd row on
    w.submit_load(
        2,
        KVForgeHostSpec([np.array([3, 1]), np.array([], dtype=np.int32)]),
        GPULoadStoreSpec([9, 10, 11], [3, 0], [1, 0]),
    )
    assert w.get_finished()[0].success
    assert blocks(w, 0, [9, 10, 11]) == want[1:]


@pytest.mark.parametrize(
    ("gpu", "host", "message"),
    [
        (
            GPULoadStoreSpec([1], [1, 0], [0, 0]),
            KVForgeHostSpec([np.array([1, 2]), np.array([])]),
            "1 blocks span 1 chunks, the host spec names 2 pages",
        ),
        (
            GPULoadStoreSpec([1], [1, 0], [0, 0]),
            KVForgeHostSpec([np.array([5]), np.array([])]),
            r"page ids must be in \[1, 4\], got \[5\]",
        ),
        (
            GPULoadStoreSpec([1], [1, 0], [0, 0]),
            KVForgeHostSpec([np.array([0]), np.array([])]),
            r"page ids must be in \[1, 4\], got \[0\]",
        ),
        (
            GPULoadStoreSpec([1], [1], [0]),
            KVForgeHostSpec([np.array([1])]),
            "names 1 device groups and 1 host groups, 2 are offloaded",
        ),
        (
            GPULoadStoreSpec([], [0, 0], [0, 0]),
            KVForgeHostSpec([np.array([1]), np.array([])]),
            "host pages but no blocks",
        ),
        (
            GPULoadStoreSpec([99], [1, 0], [0, 0]),
            KVForgeHostSpec([np.array([1]), np.array([])]),
            "99",
        ),
        (
            GPULoadStoreSpec([1], [1, 0], [0, 0]),
            GPULoadStoreSpec([1], [1, 0], [0, 0]),
            "expected kvforge host pages, got GPULoadStoreSpec",
        ),
    ],
)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_bad_spec_is_a_failed_transfer_and_moves_nothing(gpu, host, message, direction, caplog):
    w = worker()
    host_before = [h.clone() for h in w.host]
    dev_before = blocks(w, 0, list(range(NUM_BLOCKS))) + blocks(w, 1, list(range(NUM_BLOCKS)))
    ok = w.submit_store(7, gpu, host) if direction == "store" else w.submit_load(7, host, gpu)
    assert ok
    [done] = w.get_finished()
    assert (done.job_id, done.success) == (7, False)
    assert re.search(message, caplog.text), caplog.text
    assert all(torch.equal(a, b) for a, b in zip(w.host, host_before, strict=True))
    after = blocks(w, 0, list(range(NUM_BLOCKS))) + blocks(w, 1, list(range(NUM_BLOCKS)))
    assert after == dev_before


def test_rows_hold_each_layers_own_bytes_whatever_the_plan_estimated(caplog):
    # the scheduler saw 60 B per block of group 1 (one page for unequal layers): the page count
    # comes from the plan, a row from the layers themselves
    caches, _ = packed_caches()
    w = KVForgeOffloadingWorker(caches, plan_host_pages([0, 1], [104, 60], 1, 164 * 3), "torch")
    assert w.block_bytes == [104, 24] and [h.shape for h in w.host] == [(3, 104), (3, 24)]
    assert caplog.text == ""
    w = KVForgeOffloadingWorker(caches, plan_host_pages([0, 1], [104, 10], 1, 114 * 3), "torch")
    assert [h.shape for h in w.host] == [(3, 104), (3, 24)]
    assert "kvforge host pages take 384 B, above the 342 B planned" in caplog.text


def test_caches_that_do_not_match_the_plan_are_refused():
    caches, _ = packed_caches()
    with pytest.raises(TransferError, match="vLLM registered 2 offloaded groups, the host plan"):
        KVForgeOffloadingWorker(caches, plan_host_pages([0], [104], 1, 10_000))
