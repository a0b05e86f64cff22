"""GQA / MHA backend: roles, shapes, dtypes and bytes, with the arithmetic written out."""

import pytest
import torch

from kvforge import CacheController, GQABackend, MHABackend


def llama3_8b(block_size=16, **kw):
    # Llama-3-8B: 32 layers, 8 kv heads, head_dim 128, bf16
    return {layer: GQABackend(8, 128, block_size, "bfloat16", **kw) for layer in range(32)}


def test_llama3_8b_bytes():
    ctl = CacheController(llama3_8b())
    # one key block: 16 tokens * 8 heads * 128 dims * 2 bytes
    assert ctl.layout.entry("key", 0).block_bytes == 16 * 8 * 128 * 2 == 32_768
    # per token: 32 layers * 2 (k, v) * 8 heads * 128 dims * 2 bytes
    assert ctl.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131_072
    assert ctl.bytes_per_block("kv") == 32 * 2 * 32_768 == 2_097_152


def test_gqa_cache_shapes_and_dtypes():
    ctl = CacheController(llama3_8b())
    ctl.initialize_kv_cache(num_blocks=5)
    key = ctl.get("key", 3)
    assert key.shape == (5, 16, 8, 128)
    assert key.dtype == torch.bfloat16
    assert ctl.get("value", 31).shape == (5, 16, 8, 128)
    assert len(ctl.kv_caches) == 64


def test_fp8_is_one_byte_per_element():
    backend = GQABackend(8, 128, 16, "bfloat16", kv_cache_quant="fp8")
    assert [r.name for r in backend.cache_roles()] == ["key", "value"]
    assert all(r.entry_bytes == 8 * 128 * 1 for r in backend.cache_roles())
    ctl = CacheController({0: backend})
    ctl.initialize_kv_cache(num_blocks=3)
    assert ctl.get("key", 0).dtype == torch.float8_e4m3fn
    assert ctl.kv_bytes_per_token() == 2 * 8 * 128 == 2048


def test_block_wise_fp8_adds_float32_scales_in_order():
    backend = GQABackend(8, 128, 16, "bfloat16", kv_cache_quant="block_wise_fp8")
    roles = backend.cache_roles()
    assert [r.name for r in roles] == ["key", "value", "key_scale", "value_scale"]
    scale = roles[2]
    assert scale.dtype == "float32" and scale.entry_shape == (8,)
    assert scale.entry_bytes == 8 * 4 == 32  # one float32 per kv head per token
    ctl = CacheController({0: backend, 1: backend})
    # per token per layer: 2 * 8*128 (fp8) + 2 * 8*4 (scales) = 2112
    assert ctl.kv_bytes_per_token() == 2 * (2 * 8 * 128 + 2 * 8 * 4) == 4224
    ctl.initialize_kv_cache(num_blocks=2)
    assert ctl.get("key_scale", 1).shape == (2, 16, 8)
    assert ctl.storage_name("key_scale", 1) == "key_cache_scales_1_rank0.device0"
    assert ctl.storage_name("value_scale", 0) == "value_cache_scales_0_rank0.device0"


def test_mha_is_gqa_with_all_heads():
    mha = MHABackend(num_heads=32, head_dim=128, block_size=16)
    assert mha.cache_roles()[0].entry_shape == (32, 128)
    assert mha.num_kv_heads == 32


def test_sliding_window_gqa_uses_a_window_group():
    backend = GQABackend(4, 64, 16, sliding_window=4096)
    (group,) = backend.cache_groups()
    assert (group.name, group.kind.value, group.window) == ("swa", "sliding_window", 4096)


def test_head_major_blocks_follow_fastdeploy():
    # FastDeploy: key/value [blocks, kv_heads, block_size, head_dim], scales bf16
    # [blocks, kv_heads, block_size] (declared (kv_heads, 1) head-major: [.., kv_heads, B, 1])
    backend = GQABackend(
        8,
        128,
        64,
        kv_cache_quant="block_wise_fp8",
        block_layout="head_major",
        scale_dtype="bfloat16",
    )
    roles = {r.name: r for r in backend.cache_roles()}
    assert {r.block_layout for r in roles.values()} == {"head_major"}
    assert roles["key_scale"].entry_shape == (8, 1) and roles["key_scale"].dtype == "bfloat16"
    assert backend.block_shape(roles["key"]) == (8, 64, 128)
    assert backend.block_shape(roles["value_scale"]) == (8, 64, 1)
    ctl = CacheController({0: backend})
    # per token: 2 * 8*128 fp8 + 2 * 8 bf16 scales = 2,048 + 32 = 2,080 B
    assert ctl.kv_bytes_per_token() == 2 * 8 * 128 + 2 * 8 * 2 == 2_080
    ctl.initialize_kv_cache(num_blocks=3)
    key, scale = ctl.get("key", 0), ctl.get("key_scale", 0)
    assert key.shape == (3, 8, 64, 128) and key.dtype == torch.float8_e4m3fn
    assert scale.shape == (3, 8, 64, 1) and scale.dtype == torch.bfloat16
    assert scale.squeeze(-1).shape == (3, 8, 64)  # FastDeploy's scale tensor, same bytes


def test_token_major_is_the_default_with_float32_scales():
    backend = GQABackend(8, 128, 16, kv_cache_quant="block_wise_fp8")
    assert backend.block_layout == "token_major" and backend.scale_dtype == "float32"
    roles = {r.name: r for r in backend.cache_roles()}
    assert backend.block_shape(roles["key"]) == (16, 8, 128)
    assert backend.block_shape(roles["key_scale"]) == (16, 8)
    assert GQABackend(8, 128, 16).scale_dtype is None
    bf16 = GQABackend(8, 128, 16, kv_cache_quant="block_wise_fp8", scale_dtype="bfloat16")
    # token-major bf16 scales: [B, kv_heads], 8 * 2 = 16 B per token
    assert bf16.role("value_scale").entry_bytes == 16
    assert "scale_dtype='bfloat16'" in repr(bf16)
    mha = MHABackend(4, 64, 16, block_layout="head_major")
    assert mha.block_shape(mha.role("key")) == (4, 16, 64)


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"block_layout": "HND"}, ValueError, "block_layout must be one of .*got 'HND'"),
        (
            {"scale_dtype": "bfloat16"},
            ValueError,
            r"scale_dtype='bfloat16' needs kv_cache_quant='block_wise_fp8', got "
            r"kv_cache_quant=None",
        ),
        (
            {"scale_dtype": "float32", "kv_cache_quant": "fp8"},
            ValueError,
            r"scale_dtype='float32' needs kv_cache_quant='block_wise_fp8', got "
            r"kv_cache_quant='fp8'",
        ),
        (
            {"scale_dtype": "float16", "kv_cache_quant": "block_wise_fp8"},
            ValueError,
            r"scale_dtype must be one of \['float32', 'bfloat16'\], got 'float16'",
        ),
    ],
)
def test_bad_layout_options(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        GQABackend(8, 128, 16, **kwargs)


def test_bad_quant_names_the_value():
    with pytest.raises(ValueError, match=r"kv_cache_quant must be None or one of .* got 'int4'"):
        GQABackend(8, 128, 16, kv_cache_quant="int4")
    with pytest.raises(ValueError, match="num_kv_heads must be a positive number of heads, got 0"):
        GQABackend(0, 128, 16)
    with pytest.raises(ValueError, match="block_size must be a positive"):
        GQABackend(8, 128, 0)
