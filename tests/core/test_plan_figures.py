"""kvforge's per-group plan figures (``plan_memory``; ``docs/plans.md``), exactly.

``B`` block size, ``N`` max_num_seqs, ``T`` = 8,192 max_num_batched_tokens, ``L``
max_model_len. A window group gets ``n * max_live + cdiv(T, B) + N + 1`` blocks (``n`` resident
windows, one batch-wide step allowance, the null block); the full group gets the rest of the
budget. The comparison with vLLM drives vLLM's real scheduler instead of a formula
(``benchmarks/capacity_vs_vllm.py``).
"""

from __future__ import annotations

import pytest

from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import plan_memory
from kvforge.models.hf_config import from_hf_config

GIB = 1 << 30


@pytest.fixture(scope="module")
def v4() -> CacheLayout:
    return CacheLayout(from_hf_config("deepseek-v4-flash"))


@pytest.fixture(scope="module")
def gemma() -> CacheLayout:
    return CacheLayout(from_hf_config("gemma-2-9b", dtype="bfloat16"))


def test_v4_block_bytes_device_padded_host_unpadded(v4: CacheLayout) -> None:
    # 43 layers x 64 tokens x 584 B = 1,607,168 B of swa entries; a device page of
    # 64 x 584 = 37,376 B is padded to 576-byte alignment: 65 x 576 = 37,440 B, x 43 = 1,609,920
    assert v4.host_page_bytes("swa") == 43 * 64 * 584 == 1_607_168
    assert v4.bytes_per_block("swa") == 43 * 65 * 576 == 1_609_920
    # compressed, 256-token blocks: 21 c4 layers (64 entries x 584 B + indexer 64 x 132 B) and
    # 20 c128 layers (2 entries x 584 B): 21 x 45,824 + 20 x 1,168 = 985,664 B on the host
    assert v4.host_page_bytes("compressed") == 21 * (64 * 584 + 64 * 132) + 20 * 2 * 584
    assert v4.host_page_bytes("compressed") == 985_664
    assert v4.bytes_per_block("compressed") == 1_002_240
    assert v4.host_page_bytes("c4_state") == 860_160
    assert v4.bytes_per_block("c4_state") == 870_912
    assert v4.host_page_bytes("c128_state") == 655_360
    assert v4.bytes_per_block("c128_state") == 656_640


def test_gemma_block_bytes_unpadded(gemma: CacheLayout) -> None:
    # 21 layers per group x 16 tokens x 8 heads x 256 dims x (K + V) x 2 B (bf16) = 2,752,512
    for group in ("swa", "kv"):
        assert gemma.bytes_per_block(group) == 21 * 16 * 8 * 256 * 2 * 2 == 2_752_512
        assert gemma.host_page_bytes(group) == 2_752_512


# (group, num_blocks, step_blocks) per concurrency; then full-history tokens, max_concurrency
V4_CASES = [
    (
        16,
        # swa: 16 x 3 + (cdiv(8192, 64) + 16 = 144) + 1 = 193
        # c4_state: 16 x 3 + (cdiv(8192, 4) + 16 = 2,064) + 1 = 2,113
        # c128_state: 16 x 17 + (cdiv(8192, 8) + 16 = 1,040) + 1 = 1,313
        # compressed: the rest, (60 GiB - 3,013,119,936 B) // 1,002,240 = 61,274 blocks
        {
            "swa": (193, 144),
            "compressed": (61_274, 0),
            "c4_state": (2_113, 2_064),
            "c128_state": (1_313, 1_040),
        },
        61_273 * 256,  # 15,685,888 tokens
        16,
    ),
    (
        256,
        # swa: 256 x 3 + (128 + 256 = 384) + 1 = 1,153; c4: 256 x 3 + 2,304 + 1 = 3,073;
        # c128: 256 x 17 + 1,280 + 1 = 5,633; compressed: the rest, 56,067 blocks
        {
            "swa": (1_153, 384),
            "compressed": (56_067, 0),
            "c4_state": (3_073, 2_304),
            "c128_state": (5_633, 1_280),
        },
        56_066 * 256,  # 14,352,896 tokens
        219,  # 56,066 // cdiv(65,536, 256) = 56,066 // 256 = 219 sequences of 65,536 tokens
    ),
]


@pytest.mark.parametrize(("seqs", "blocks", "tokens", "concurrency"), V4_CASES)
def test_v4_flash_60gib(
    v4: CacheLayout, seqs: int, blocks: dict[str, tuple[int, int]], tokens: int, concurrency: int
) -> None:
    plan = plan_memory(v4, 60 * GIB, seqs, 65_536, 8_192)
    assert {g.group: (g.num_blocks, g.step_blocks) for g in plan.groups} == blocks
    assert plan.max_tokens == tokens
    assert plan.max_concurrency == concurrency
    for g in plan.groups:
        assert g.total_bytes == g.num_blocks * v4.bytes_per_block(g.group)
    assert plan.total_bytes <= 60 * GIB
    if seqs == 16:
        assert plan.warnings == ()
        assert plan.total_bytes == 64_424_373_696
    else:
        assert plan.total_bytes == 64_423_993_536
        assert plan.warnings == (
            "the plan holds 219 sequences of max_model_len=65,536 tokens at once, fewer than "
            "max_num_seqs=256: groups ['compressed'] limit it, and one such sequence needs "
            "275,178,816 bytes of cache; raise the budget or lower max_num_seqs or "
            "max_model_len",
        )


GEMMA_CASES = [
    (
        16,
        # n = 14 windows: the full group holds 14 sequences of 4,096 tokens (the window)
        # swa: 14 x 257 + (cdiv(8192, 16) + 16 = 528) + 1 = 4,127 (257 = cdiv(4096, 16) + 1)
        # kv: (20 GiB // 2,752,512) = 7,801 blocks in all, 7,801 - 4,127 = 3,674
        {"swa": (4_127, 528), "kv": (3_674, 0)},
        3_673 * 16,  # 58,768 tokens
    ),
    (
        256,
        # n = 13: swa 13 x 257 + (512 + 256 = 768) + 1 = 4,110; kv 7,801 - 4,110 = 3,691
        {"swa": (4_110, 768), "kv": (3_691, 0)},
        3_690 * 16,  # 59,040 tokens
    ),
]


@pytest.mark.parametrize(("seqs", "blocks", "tokens"), GEMMA_CASES)
def test_gemma_2_9b_20gib(
    gemma: CacheLayout, seqs: int, blocks: dict[str, tuple[int, int]], tokens: int
) -> None:
    plan = plan_memory(gemma, 20 * GIB, seqs, 8_192, 8_192)
    assert {g.group: (g.num_blocks, g.step_blocks) for g in plan.groups} == blocks
    assert plan.max_tokens == tokens
    # 7,801 blocks of 2,752,512 B = 21,472,346,112 B, the same bytes as vLLM's pool
    assert plan.total_bytes == 7_801 * 2_752_512 == 21_472_346_112
    # tokens // 8,192 = 7 sequences of max_model_len in the full group
    assert plan.max_concurrency == 7
    assert plan.warnings == (
        f"the plan holds 7 sequences of max_model_len=8,192 tokens at once, fewer than "
        f"max_num_seqs={seqs}: groups ['kv'] limit it, and one such sequence needs "
        "2,116,681,728 bytes of cache; raise the budget or lower max_num_seqs or max_model_len",
    )
