"""DSA backend (DeepSeek V3.2): key then indexer, packed fp8 layouts."""

import pytest
import torch

from kvforge import CacheController, DSABackend


def test_fp8_layout_bytes():
    backend = DSABackend()
    key, indexer = backend.cache_roles()
    assert (key.name, indexer.name) == ("key", "indexer")
    # 512 fp8 latent + 4 float32 scales (one per 128 values) + 64 bf16 rope
    assert key.entry_bytes == 512 + 4 * 4 + 64 * 2 == 656
    # 128 fp8 + one float32 scale
    assert indexer.entry_bytes == 128 + 4 == 132
    assert key.dtype == indexer.dtype == "uint8"
    ctl = CacheController(dict.fromkeys(range(61), backend))
    assert ctl.kv_bytes_per_token() == 61 * (656 + 132) == 48_068
    assert ctl.bytes_per_block("kv") == 61 * 64 * (656 + 132)


def test_bf16_layout_bytes():
    key, indexer = DSABackend(kv_cache_dtype="bf16").cache_roles()
    assert key.entry_shape == (576,) and key.entry_bytes == 1152
    assert indexer.entry_shape == (128,) and indexer.entry_bytes == 256


def test_dsa_tensors_and_names():
    ctl = CacheController({0: DSABackend(), 1: DSABackend()})
    ctl.initialize_kv_cache(num_blocks=3)
    assert ctl.get("key", 1).shape == (3, 64, 656)
    assert ctl.get("indexer", 1).shape == (3, 64, 132)
    assert ctl.get("indexer", 1).dtype == torch.uint8
    assert ctl.storage_names == [
        "key_caches_0_rank0.device0",
        "indexer_caches_0_rank0.device0",
        "key_caches_1_rank0.device0",
        "indexer_caches_1_rank0.device0",
    ]
    assert ctl.index_of("indexer", 1) == 3


def test_bad_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'fp8' or 'bf16', got 'int8'"):
        DSABackend(kv_cache_dtype="int8")
