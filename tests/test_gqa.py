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


def test_bad_quant_names_the_value():
    with pytest.raises(ValueError, match=r"kv_cache_quant must be None or one of .* got 'int4'"):
        GQABackend(8, 128, 16, kv_cache_quant="int4")
    with pytest.raises(ValueError, match="entry_shape"):
        GQABackend(0, 128, 16)
    with pytest.raises(ValueError, match="block_size must be a positive"):
        GQABackend(8, 128, 0)
