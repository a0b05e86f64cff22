"""Round trips on a CUDA device (skipped without one): Triton kernels, pinned host pages,
side-stream copies. Run on a GPU machine with ``TRITON_INTERPRET=0``."""

import os

import pytest
import torch

from kvforge import CacheController, DeepseekV4Backend, DSABackend, GQABackend, MLABackend
from kvforge.ops import gather_blocks, resolve_impl, scatter_blocks
from kvforge.verify import verify_request, write_request

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device and TRITON_INTERPRET=0",
)


def flash_like():
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]
    kinds = {r: DeepseekV4Backend(r) for r in (0, 4, 128)}
    return {layer: kinds[r] for layer, r in enumerate(ratios)}


MODELS = {
    "gqa": lambda: {i: GQABackend(8, 128, 16) for i in range(4)},
    "gqa_block_wise_fp8": lambda: {
        i: GQABackend(8, 128, 16, kv_cache_quant="block_wise_fp8") for i in range(4)
    },
    "mla": lambda: {i: MLABackend() for i in range(4)},
    "dsa": lambda: {i: DSABackend() for i in range(4)},
    "deepseek_v4_flash_mtp": flash_like,
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_cuda_round_trip(model):
    ctl = CacheController(MODELS[model](), device="cuda")
    assert resolve_impl("auto", ctl.device) == "triton"
    ctl.initialize_kv_cache(num_blocks=40)
    ctl.initialize_host_cache(num_pages=40)
    assert ctl._host.groups[ctl.groups[0]].pages.is_pinned()
    n = 500  # 4-layer GQA: 32 blocks of 16 tokens, within 39 usable
    ctl.allocate("r", n)
    written = write_request(ctl, "r", seed=5, positions=range(n))
    before = {g: ctl.block_table("r", g) for g in ctl.groups}
    ctl.swap_out("r").wait()
    ctl.allocate("blocker", 1)
    for cache in ctl.kv_caches:
        cache.view(torch.uint8).fill_(0x5A)
    ctl.swap_in("r").wait()
    assert {g: ctl.block_table("r", g) for g in ctl.groups} != before
    check = verify_request(ctl, "r", seed=5)
    assert (check.entries, check.mismatched) == (written, 0)
    ctl.free()


@pytest.mark.parametrize("sizes", [(1_168, 8_448, 37_376), (1, 3, 1_168), (32_768,) * 40])
def test_cuda_triton_equals_torch(sizes):
    g = torch.Generator(device="cpu").manual_seed(0)
    planes = [torch.randint(0, 256, (33, s), dtype=torch.uint8, generator=g).cuda() for s in sizes]
    ids = torch.tensor([5, -1, 0, 32, 5, 17], dtype=torch.int64, device="cuda")
    rows = sum(sizes)
    ref = torch.zeros(len(ids), rows, dtype=torch.uint8, device="cuda")
    got = torch.zeros_like(ref)
    gather_blocks(planes, ids, ref, impl="torch")
    gather_blocks(planes, ids, got, impl="triton")
    assert torch.equal(ref, got)
    src = torch.randint(0, 256, (4, rows), dtype=torch.uint8, generator=g).cuda()
    dst_ids = torch.tensor([3, -1, 30, 0], dtype=torch.int64, device="cuda")
    a = [p.clone() for p in planes]
    b = [p.clone() for p in planes]
    scatter_blocks(a, dst_ids, src, impl="torch")
    scatter_blocks(b, dst_ids, src, impl="triton")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("chunk_rows", [1, 2, 3])
def test_cuda_batched_swaps_through_two_staging_slots(monkeypatch, chunk_rows):
    # tiny pipeline chunks: every swap runs many chunks through the two staging slots, so the
    # events that gate slot reuse on the real compute and copy streams are exercised
    from kvforge.worker import transfer as swap

    backends = {i: GQABackend(8, 128, 16) for i in range(4)}  # pages of 4 * 2 * 32 KiB
    monkeypatch.setattr(swap, "PIPELINE_CHUNK_BYTES", chunk_rows * 4 * 2 * 32_768)
    ctl = CacheController(backends, device="cuda")
    ctl.initialize_kv_cache(num_blocks=64)
    ctl.initialize_host_cache(num_pages=64)
    lengths = {"a": 160, "b": 37, "c": 300}
    written = {}
    for i, (r, n) in enumerate(lengths.items()):
        ctl.allocate(r, n)
        written[r] = write_request(ctl, r, seed=i, positions=range(n))
    for h in ctl.swap_out_many(["a", "b", "c"]):
        h.wait()
    ctl.allocate("blocker", 1)
    for cache in ctl.kv_caches:
        cache.view(torch.uint8).fill_(0x5A)
    for h in ctl.swap_in_many(["c", "a", "b"]):
        h.wait()
    for i, r in enumerate(lengths):
        check = verify_request(ctl, r, seed=i)
        assert (check.entries, check.mismatched) == (written[r], 0)
    ctl.free()


def test_cuda_triton_row_ids_equal_torch():
    g = torch.Generator(device="cpu").manual_seed(1)
    sizes = (1_168, 8_448, 16)
    planes = [torch.randint(0, 256, (20, s), dtype=torch.uint8, generator=g).cuda() for s in sizes]
    ids = torch.tensor([5, -1, 0, 19], dtype=torch.int64)
    rows = torch.tensor([7, 2, 0, 3], dtype=torch.int64)
    ref = torch.zeros(8, sum(sizes), dtype=torch.uint8, device="cuda")
    got = torch.zeros_like(ref)
    gather_blocks(planes, ids, ref, impl="torch", row_ids=rows)
    gather_blocks(planes, ids, got, impl="triton", row_ids=rows)
    assert torch.equal(ref, got)
    a = [p.clone() for p in planes]
    b = [p.clone() for p in planes]
    scatter_blocks(a, ids, ref, impl="torch", row_ids=rows)
    scatter_blocks(b, ids, ref, impl="triton", row_ids=rows)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
