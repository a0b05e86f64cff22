"""DeepSeek-V4 backend: groups, roles, per-block bytes; device blocks padded to 576 B, host
pages packed."""

import pytest
import torch

from kvforge import CacheController, DeepseekV4Backend, cache_bytes_per_sequence
from kvforge.core.layout import CacheLayout


def roles_of(ratio, **kw):
    return {r.name: r for r in DeepseekV4Backend(ratio, **kw).cache_roles()}


def test_groups_are_the_contract():
    groups = {g.name: g for g in DeepseekV4Backend(4).cache_groups()}
    assert (groups["swa"].block_size, groups["swa"].kind.value, groups["swa"].window) == (
        64,
        "sliding_window",
        128,
    )
    assert (groups["compressed"].block_size, groups["compressed"].kind.value) == (256, "full")
    assert (
        groups["c4_state"].block_size,
        groups["c4_state"].kind.value,
        groups["c4_state"].window,
    ) == (4, "state", 8)
    c128 = {g.name: g for g in DeepseekV4Backend(128).cache_groups()}["c128_state"]
    assert (c128.block_size, c128.kind.value, c128.window) == (8, "state", 128)
    assert [g.name for g in DeepseekV4Backend(0).cache_groups()] == ["swa"]


def test_role_order_per_ratio():
    assert list(roles_of(0)) == ["swa_kv"]
    assert list(roles_of(4)) == [
        "swa_kv",
        "compressed_kv",
        "indexer",
        "compressor_state",
        "indexer_compressor_state",
    ]
    assert list(roles_of(128)) == ["swa_kv", "compressed_kv", "compressor_state"]


def test_fp8_per_block_bytes():
    b4, b128 = DeepseekV4Backend(4), DeepseekV4Backend(128)
    g4, g128 = b4.groups_by_name(), b128.groups_by_name()
    r4, r128 = roles_of(4), roles_of(128)
    # 448 fp8 + 64 bf16 rope (128 B) + 8 scale bytes
    assert r4["swa_kv"].entry_bytes == 448 + 128 + 8 == 584
    assert r4["swa_kv"].block_bytes(g4["swa"]) == 64 * 584 == 37_376
    assert r4["compressed_kv"].block_bytes(g4["compressed"]) == (256 // 4) * 584 == 37_376
    assert r4["indexer"].block_bytes(g4["compressed"]) == 64 * (128 + 4) == 8_448
    assert r128["compressed_kv"].block_bytes(g128["compressed"]) == (256 // 128) * 584 == 1_168
    # float32 states: 2*2*512 and 2*2*128 values, 4 tokens per block
    assert r4["compressor_state"].block_bytes(g4["c4_state"]) == 4 * (2 * 2 * 512 * 4) == 4 * 8_192
    assert (
        r4["indexer_compressor_state"].block_bytes(g4["c4_state"])
        == 4 * (2 * 2 * 128 * 4)
        == 4 * 2_048
    )
    assert (
        r128["compressor_state"].block_bytes(g128["c128_state"]) == 8 * (2 * 512 * 4) == 8 * 4_096
    )


# (ratio, role, group): (meaningful block bytes = host page share, device block stride)
FP8_BLOCKS = {
    (0, "swa_kv", "swa"): (64 * 584, 65 * 576),  # 37,376 -> 37,440
    (4, "swa_kv", "swa"): (64 * 584, 65 * 576),
    (4, "compressed_kv", "compressed"): (256 // 4 * 584, 65 * 576),  # 37,376 -> 37,440
    (4, "indexer", "compressed"): (256 // 4 * 132, 15 * 576),  # 8,448 -> 8,640
    (4, "compressor_state", "c4_state"): (4 * 2 * 2 * 512 * 4, 57 * 576),  # 32,768 -> 32,832
    (4, "indexer_compressor_state", "c4_state"): (4 * 2 * 2 * 128 * 4, 15 * 576),  # 8,192 -> 8,640
    (128, "swa_kv", "swa"): (64 * 584, 65 * 576),
    (128, "compressed_kv", "compressed"): (256 // 128 * 584, 3 * 576),  # 1,168 -> 1,728
    (128, "compressor_state", "c128_state"): (8 * 2 * 512 * 4, 57 * 576),  # 32,768 -> 32,832
}


@pytest.mark.parametrize(("ratio", "role", "group"), sorted(FP8_BLOCKS))
def test_fp8_device_strides_are_576_aligned(ratio, role, group):
    backend = DeepseekV4Backend(ratio)
    spec, g = backend.role(role), backend.groups_by_name()[group]
    meaningful, stride = FP8_BLOCKS[(ratio, role, group)]
    assert spec.block_alignment == 576
    assert (spec.block_bytes(g), spec.device_block_bytes(g)) == (meaningful, stride)
    assert stride % 576 == 0 and 0 <= stride - meaningful < 576
    # the exact figures of the published layouts
    figures = {
        "swa_kv": 37_440,
        "compressed_kv": 37_440 if ratio == 4 else 1_728,
        "indexer": 8_640,
        "compressor_state": 32_832,
        "indexer_compressor_state": 8_640,
    }
    assert stride == figures[role]
    unpadded = DeepseekV4Backend(ratio, block_alignment=1).role(role)
    assert unpadded.device_block_bytes(g) == unpadded.block_bytes(g) == meaningful


def test_bf16_layouts():
    r = roles_of(4, kv_cache_dtype="bf16")
    assert r["swa_kv"].entry_shape == (512,) and r["swa_kv"].dtype == "bfloat16"
    # the indexer stays 128 fp8 bytes + one float32 scale in bf16 mode
    assert r["indexer"].entry_shape == (128 + 4,) and r["indexer"].dtype == "uint8"
    assert r["indexer"].entry_bytes == 132
    assert r["compressor_state"].dtype == "float32"
    g = DeepseekV4Backend(4, kv_cache_dtype="bf16").groups_by_name()
    # 64 tokens * 512 bf16 = 65,536 B -> cdiv(65,536, 576) = 114 pages of 576 = 65,664 B
    assert r["swa_kv"].block_bytes(g["swa"]) == 64 * 512 * 2 == 65_536
    assert r["swa_kv"].device_block_bytes(g["swa"]) == 114 * 576 == 65_664
    assert r["indexer"].device_block_bytes(g["compressed"]) == 15 * 576 == 8_640


def test_tensors_are_padded_strided_views():
    ctl = CacheController(
        {0: DeepseekV4Backend(0), 1: DeepseekV4Backend(4), 2: DeepseekV4Backend(128)}
    )
    ctl.initialize_kv_cache(num_blocks={"swa": 3, "compressed": 4, "c4_state": 5, "c128_state": 6})
    # (role, layer): element strides; the block stride is the device stride in elements
    strides = {
        ("swa_kv", 0): (37_440, 584, 1),
        ("compressed_kv", 1): (37_440, 584, 1),
        ("indexer", 1): (8_640, 132, 1),
        ("compressed_kv", 2): (1_728, 584, 1),
        ("compressor_state", 1): (32_832 // 4, 2048, 1),  # float32: 8,208 elements
        ("indexer_compressor_state", 1): (8_640 // 4, 512, 1),  # 2,160 elements
        ("compressor_state", 2): (32_832 // 4, 1024, 1),
    }
    for (role, layer), stride in strides.items():
        assert ctl.get(role, layer).stride() == stride, (role, layer)
    # device memory counts the padding: 3 swa blocks of 37,440 B for each of 3 layers, ...
    assert ctl.bytes_per_block("swa") == 3 * 37_440
    assert ctl.bytes_per_block("compressed") == 37_440 + 8_640 + 1_728
    assert ctl.bytes_per_block("c4_state") == 32_832 + 8_640
    assert ctl.bytes_per_block("c128_state") == 32_832
    # host pages carry the meaningful bytes only
    assert ctl.layout.host_page_bytes("compressed") == 37_376 + 8_448 + 1_168
    assert ctl.layout.host_page_bytes("c4_state") == 32_768 + 8_192


def test_tensors_have_exact_unpadded_shapes():
    ctl = CacheController(
        {0: DeepseekV4Backend(0), 1: DeepseekV4Backend(4), 2: DeepseekV4Backend(128)}
    )
    ctl.initialize_kv_cache(num_blocks={"swa": 3, "compressed": 4, "c4_state": 5, "c128_state": 6})
    assert ctl.get("swa_kv", 0).shape == (3, 64, 584)
    assert ctl.get("compressed_kv", 1).shape == (4, 64, 584)
    assert ctl.get("indexer", 1).shape == (4, 64, 132)
    assert ctl.get("compressed_kv", 2).shape == (4, 2, 584)
    assert ctl.get("compressor_state", 1).shape == (5, 4, 2048)
    assert ctl.get("compressor_state", 1).dtype == torch.float32
    assert ctl.get("indexer_compressor_state", 1).shape == (5, 4, 512)
    assert ctl.get("compressor_state", 2).shape == (6, 8, 1024)
    assert ctl.groups == ["swa", "compressed", "c4_state", "c128_state"]
    assert ctl.storage_name("compressor_state", 2) == "compressor_state_caches_2_rank0.device0"
    assert ctl.storage_name("indexer", 1) == "indexer_caches_1_rank0.device0"


def flash_ratios():
    # DeepSeek-V4-Flash shape: 43 layers, ratios [0, 0] then 4 and 128 alternating, + MTP (0)
    main = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)]
    return [*main, 0]


def test_flash_shaped_role_counts_per_group():
    ratios = flash_ratios()
    kinds = {r: DeepseekV4Backend(r) for r in (0, 4, 128)}
    layout = CacheLayout({layer: kinds[r] for layer, r in enumerate(ratios)})
    n4, n128 = ratios.count(4), ratios.count(128)
    assert (len(ratios), n4, n128) == (44, 21, 20)

    def count(group, role):
        return sum(1 for e in layout.buffers_of(group) if e.role.name == role)

    assert count("swa", "swa_kv") == 44
    assert count("compressed", "compressed_kv") == n4 + n128 == 41
    assert count("compressed", "indexer") == n4 == 21
    assert count("c4_state", "compressor_state") == n4
    assert count("c4_state", "indexer_compressor_state") == n4
    assert count("c128_state", "compressor_state") == n128 == 20
    # per-block device bytes of each group across all layers, 576-byte padding included
    assert layout.bytes_per_block("swa") == 44 * 37_440
    assert layout.bytes_per_block("compressed") == 21 * (37_440 + 8_640) + 20 * 1_728
    assert layout.bytes_per_block("c4_state") == 21 * (32_832 + 8_640)
    assert layout.bytes_per_block("c128_state") == 20 * 32_832
    # host pages: meaningful bytes only
    assert layout.host_page_bytes("swa") == 44 * 37_376
    assert layout.host_page_bytes("compressed") == 21 * (37_376 + 8_448) + 20 * 1_168
    assert layout.host_page_bytes("c4_state") == 21 * 4 * (8_192 + 2_048)
    assert layout.host_page_bytes("c128_state") == 20 * 8 * 4_096


def test_cache_bytes_per_sequence_is_exact():
    backends = {0: DeepseekV4Backend(0), 1: DeepseekV4Backend(4), 2: DeepseekV4Backend(128)}
    n = 1000
    swa = 3 * min(n, 128) * 584  # three layers keep the last 128 tokens
    compressed = (n // 4) * (584 + 132) + (n // 128) * 584
    state = min(n, 8) * (8_192 + 2_048) + min(n, 128) * 4_096
    assert cache_bytes_per_sequence(backends, n) == swa + compressed + state
    assert cache_bytes_per_sequence(backends, n, include_state=False) == swa + compressed
    assert cache_bytes_per_sequence(backends, 3) == 3 * 3 * 584 + 3 * (8_192 + 2_048) + 3 * 4_096


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"compress_ratio must be one of \[0, 4, 128\], got 8"):
        DeepseekV4Backend(8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'fp8' or 'bf16', got 'fp4'"):
        DeepseekV4Backend(4, kv_cache_dtype="fp4")
    with pytest.raises(
        ValueError, match=r"qk_rope_head_dim must be in \(0, head_dim=512\), got 600"
    ):
        DeepseekV4Backend(4, qk_rope_head_dim=600)
    with pytest.raises(ValueError, match="block_alignment must be a positive number of bytes"):
        DeepseekV4Backend(4, block_alignment=0)
    with pytest.raises(ValueError, match=r"block_alignment must be an int, got '576'"):
        DeepseekV4Backend(4, block_alignment="576")
    with pytest.raises(
        ValueError, match=r"block_alignment=10 of role 'compressor_state' gives a device block"
    ):
        DeepseekV4Backend(4, block_alignment=10)  # 32,770 B: not whole float32 elements
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0, got -1"):
        cache_bytes_per_sequence({0: DeepseekV4Backend(0)}, -1)
