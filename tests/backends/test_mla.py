"""MLA backend (DeepSeek V2/V3): one latent key cache, no value."""

import torch

from kvforge import CacheController, MLABackend


def test_deepseek_v3_bytes():
    backend = MLABackend(kv_lora_rank=512, qk_rope_head_dim=64, block_size=64, dtype="bfloat16")
    (role,) = backend.cache_roles()
    assert role.name == "key" and role.entry_shape == (512 + 64,)
    assert role.entry_bytes == 576 * 2 == 1152
    ctl = CacheController(dict.fromkeys(range(61), backend))
    # 61 layers * 576 values * 2 bytes
    assert ctl.kv_bytes_per_token() == 61 * 576 * 2 == 70_272
    assert ctl.bytes_per_block("kv") == 61 * 64 * 1152


def test_mla_has_no_value_cache():
    ctl = CacheController({0: MLABackend(block_size=16)})
    ctl.initialize_kv_cache(num_blocks=4)
    assert ctl.storage_names == ["key_caches_0_rank0.device0"]
    assert ctl.get("key", 0).shape == (4, 16, 576)
    assert ctl.get("key", 0).dtype == torch.bfloat16


def test_block_alignment_option():
    # fp8 MLA pages of 64 tokens * 656 B = 41,984 B, padded to 73 * 576 = 42,048 B
    backend = MLABackend(dtype="uint8", kv_lora_rank=512 + 16, qk_rope_head_dim=128)
    assert backend.cache_roles()[0].entry_bytes == 656
    padded = MLABackend(
        dtype="uint8", kv_lora_rank=512 + 16, qk_rope_head_dim=128, block_alignment=576
    )
    (role,), (group,) = padded.cache_roles(), padded.cache_groups()
    assert (role.block_bytes(group), role.device_block_bytes(group)) == (41_984, 42_048)
    ctl = CacheController({0: padded})
    ctl.initialize_kv_cache(num_blocks=2)
    assert ctl.get("key", 0).shape == (2, 64, 656)
    assert ctl.get("key", 0).stride() == (42_048, 656, 1)
    # bf16 DeepSeek-V3 blocks are already whole pages: 64 * 1,152 = 73,728 = 128 * 576
    (bf16,), (g,) = MLABackend(block_alignment=576).cache_roles(), MLABackend().cache_groups()
    assert bf16.device_block_bytes(g) == bf16.block_bytes(g) == 128 * 576
