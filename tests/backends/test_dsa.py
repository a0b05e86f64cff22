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
    backend = DSABackend(kv_cache_dtype="bf16")
    key, indexer = backend.cache_roles()
    assert key.entry_shape == (576,) and key.entry_bytes == 576 * 2 == 1152
    assert key.dtype == "bfloat16"
    # bf16 changes only the main KV: the indexer keeps 128 fp8 bytes + one float32 scale
    assert indexer.entry_shape == (132,) and indexer.dtype == "uint8"
    assert indexer.entry_bytes == 128 + 4 == 132
    ctl = CacheController(dict.fromkeys(range(61), backend))
    # DeepSeek-V3.2 bf16: (1,152 + 132) = 1,284 B per token per layer
    assert ctl.kv_bytes_per_token() == 61 * (1152 + 132) == 61 * 1284 == 78_324
    ctl.initialize_kv_cache(num_blocks=2)
    assert ctl.get("key", 0).dtype == torch.bfloat16
    assert ctl.get("indexer", 0).shape == (2, 64, 132)
    assert ctl.get("indexer", 0).dtype == torch.uint8


def test_block_alignment_pads_device_blocks_only():
    backend = DSABackend(block_alignment=576)
    (g,) = backend.cache_groups()
    key, indexer = backend.cache_roles()
    # key: 64 * 656 = 41,984 B -> cdiv(41,984, 576) = 73 pages of 576 = 42,048 B
    assert (key.block_bytes(g), key.device_block_bytes(g)) == (64 * 656, 73 * 576)
    # indexer: 64 * 132 = 8,448 B -> 15 * 576 = 8,640 B
    assert (indexer.block_bytes(g), indexer.device_block_bytes(g)) == (8_448, 15 * 576)
    ctl = CacheController({0: backend})
    ctl.initialize_kv_cache(num_blocks=3)
    assert ctl.get("key", 0).shape == (3, 64, 656)
    assert ctl.get("key", 0).stride() == (42_048, 656, 1)
    assert ctl.bytes_per_block("kv") == 42_048 + 8_640
    assert ctl.layout.host_page_bytes("kv") == 41_984 + 8_448
    assert DSABackend().cache_roles()[0].block_alignment == 1  # unpadded by default


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


def test_a_layer_without_indexer_keeps_the_latent_only():
    # GLM-5.2's shared-index layers reuse another layer's top-k: no indexer keys, the same
    # 656-byte fp8_ds_mla latent in the same group, so both kinds of layer share one pool
    shared = DSABackend(indexer=False)
    (key,) = shared.cache_roles()
    assert (key.name, key.entry_bytes, key.dtype) == ("key", 656, "uint8")
    assert repr(shared).endswith("kv_cache_dtype='fp8', indexer=False)")
    ctl = CacheController({0: DSABackend(), 1: shared, 2: shared})
    assert [g.name for g in ctl.layout.groups] == ["kv"]
    assert ctl.kv_bytes_per_token() == (656 + 132) + 2 * 656 == 2_100
    ctl.initialize_kv_cache(num_blocks=2)
    assert ctl.get("key", 1).shape == (2, 64, 656)
    with pytest.raises(KeyError):
        ctl.get("indexer", 1)
    with pytest.raises(TypeError, match="DSABackend: indexer must be a bool, got 1"):
        DSABackend(indexer=1)
