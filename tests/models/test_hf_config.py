"""HF config loading: bundled configs, per-family backends, MTP layers, every error path.

Byte counts are written as the arithmetic a reader can check by hand.
"""

from __future__ import annotations

import json
import pickle
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

import kvforge.models.configs
from kvforge.attn_backends import DeepseekV4Backend, DSABackend, GQABackend, MLABackend
from kvforge.core.layout import CacheLayout
from kvforge.models import (
    ModelBackends,
    build_deepseek_v4,
    build_dsa,
    build_falcon_h1,
    build_gemma2,
    build_gemma3,
    build_glm4_moe_lite,
    build_glm_moe_dsa,
    build_gpt_oss,
    build_gqa,
    build_granite_hybrid,
    build_kimi_k25,
    build_llama4,
    build_minimax_m2,
    build_mistral,
    build_mistral3,
    build_mla,
    build_nemotron_h,
    build_olmo2,
    build_phi3,
    build_qwen,
    build_qwen2_5_vl,
    build_qwen3_5,
    build_qwen3_5_moe,
    build_qwen3_next,
    build_qwen3_vl,
    build_qwen3_vl_moe,
    build_step3p5,
    bundled_models,
    from_hf_config,
    load_model_config,
    registered_model_types,
)
from kvforge.models import registry as registry_module
from kvforge.models.per_layer import (
    build_gemma3n,
    build_gemma4,
    build_mimo_v2,
    build_nemotron_nas,
    kv_sharing,
)

REPO = Path(__file__).resolve().parents[2]

BUNDLED = [
    "deepseek-v2-lite",
    "deepseek-v3",
    "deepseek-v3.2",
    "deepseek-v4-flash",
    "deepseek-v4-tiny",
    "falcon-h1-7b",
    "gemma-2-9b",
    "gemma-3-12b",
    "gemma-3-4b",
    "gemma-3n-e4b",
    "gemma-4-31b",
    "glm-4.5-air",
    "glm-4.7-flash",
    "glm-5",
    "gpt-oss-20b",
    "granite-4.0-h-small",
    "kimi-k2.5",
    "llama-3-8b",
    "llama-3.3-nemotron-super-49b",
    "llama-4-scout-17b-16e",
    "mimo-v2-flash",
    "minimax-m2",
    "mistral-7b-v0.1",
    "mistral-small-3.1-24b",
    "nemotron-nano-9b-v2",
    "olmo-2-1124-7b",
    "phi-4",
    "qwen2.5-7b",
    "qwen2.5-vl-7b",
    "qwen3-8b",
    "qwen3-next-80b-a3b",
    "qwen3-vl-30b-a3b",
    "qwen3-vl-8b",
    "qwen3.5-27b",
    "qwen3.5-35b-a3b",
    "step-3.5-flash",
]

# multimodal wrappers, whose language model is their ``text_config``
WRAPPED = (
    "gemma-3-12b",
    "gemma-3n-e4b",
    "gemma-4-31b",
    "llama-4-scout-17b-16e",
    "gemma-3-4b",
    "mistral-small-3.1-24b",
    "qwen3-vl-8b",
    "qwen3-vl-30b-a3b",
    "qwen3.5-27b",
    "qwen3.5-35b-a3b",
    "kimi-k2.5",
)

# DeepSeek-V4-Flash: layers 0, 1 uncompressed, then ratio 4 and 128 alternating (starting with
# 4) for the other 41 layers, then one MTP layer of ratio 0: 2 + 41 + 1 = 44 entries.
FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]


def llama(**overrides):
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not ...}


def deepseek_v3(**overrides):
    cfg = load_model_config("deepseek-v3")
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not ...}


def v4(**overrides):
    cfg = load_model_config("deepseek-v4-tiny")
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not ...}


def roles_in(layout: CacheLayout, group: str) -> Counter:
    return Counter(e.role.name for e in layout.buffers_of(group))


# ------------------------------------------------------------------ bundled configs


def test_bundled_models_are_listed_sorted():
    assert sorted(BUNDLED) == BUNDLED
    assert bundled_models() == BUNDLED


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_config_loads(name):
    cfg = load_model_config(name)
    for key in ("model_type", "architectures", "torch_dtype"):
        assert key in cfg, key
    # multimodal configs (Gemma-3, Llama-4) keep the language model in ``text_config``, as
    # published; the layer count lives there
    text = cfg.get("text_config", cfg)
    assert "num_hidden_layers" in text
    assert ("text_config" in cfg) == (name in WRAPPED)
    backends = from_hf_config(name)
    n, mtp = text["num_hidden_layers"], text.get("num_nextn_predict_layers", 0)
    # Nemotron-H's MLP / MoE layers keep no cache; Falcon-H1's mixers are layers n .. 2n - 1
    skipped = {i for i, c in enumerate(cfg.get("hybrid_override_pattern", "")) if c in "-E"}
    # NAS layers whose attention is no_op and KV-shared layers keep no cache either
    blocks = cfg.get("block_configs", [])
    skipped |= set(kv_sharing(cfg)) | {i for i, b in enumerate(blocks) if b["attention"]["no_op"]}
    n = 2 * n if cfg["model_type"] == "falcon_h1" else n
    # MTP layers only with speculative decoding
    assert list(backends) == [i for i in range(n) if i not in skipped]
    CacheLayout(backends)  # the declarations merge without conflict
    if mtp:
        speculative = from_hf_config(name, num_speculative_tokens=1)
        assert list(speculative) == list(range(n + mtp))
        CacheLayout(speculative)


@pytest.mark.parametrize("name", BUNDLED)
def test_examples_configs_is_the_bundle(name):
    path = REPO / "examples" / "configs" / f"{name}.json"
    assert json.loads(path.read_text()) == load_model_config(name)
    assert from_hf_config(path).keys() == from_hf_config(name).keys()


def test_every_bundled_config_has_its_source_documented():
    for name in bundled_models():
        assert f"``{name}``" in kvforge.models.configs.__doc__


def test_bundled_v4_flash_ratios_are_the_published_pattern():
    cfg = load_model_config("deepseek-v4-flash")
    assert cfg["compress_ratios"] == FLASH_RATIOS
    assert len(FLASH_RATIOS) == 44 == cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]


# ------------------------------------------------------------------ GQA / MHA


def test_llama_3_8b():
    backends = from_hf_config("llama-3-8b")
    assert list(backends) == list(range(32))
    b = backends[0]
    assert isinstance(b, GQABackend) and all(x is b for x in backends.values())
    # head_dim is not in the config: hidden_size // num_attention_heads = 4096 // 32
    assert (b.num_kv_heads, b.head_dim, b.block_size, b.dtype) == (8, 128, 16, "bfloat16")
    assert b.sliding_window is None
    # layers * (K + V) * kv_heads * head_dim * bf16
    assert CacheLayout(backends).kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131_072


def test_qwen3_8b():
    backends = from_hf_config("qwen3-8b")
    assert len(backends) == 36
    assert CacheLayout(backends).kv_bytes_per_token() == 36 * 2 * 8 * 128 * 2 == 147_456


def test_qwen2_5_7b_ignores_sliding_window_when_not_used():
    # sliding_window 131072 is in the config, but use_sliding_window is false.
    backends = from_hf_config("qwen2.5-7b")
    b = backends[0]
    assert (b.num_kv_heads, b.head_dim, b.sliding_window) == (4, 3584 // 28, None)
    assert CacheLayout(backends).kv_bytes_per_token() == 28 * 2 * 4 * 128 * 2 == 57_344


def test_mistral_slides_on_every_layer():
    backends = from_hf_config("mistral-7b-v0.1")
    layout = CacheLayout(backends)
    assert [g.name for g in layout.groups] == ["swa"]
    assert layout.group("swa").window == 4096
    assert all(b.sliding_window == 4096 for b in backends.values())
    # no full group: a token costs its bytes only while it is in the window
    # layers * (K + V) * kv_heads * head_dim * bf16
    assert layout.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131_072
    # layers * (K + V) * block_size * kv_heads * head_dim * bf16
    assert layout.bytes_per_block("swa") == 32 * 2 * 16 * 8 * 128 * 2 == 2_097_152


def test_mistral_without_sliding_window_is_full():
    cfg = load_model_config("mistral-7b-v0.1") | {"sliding_window": None}
    assert all(b.sliding_window is None for b in from_hf_config(cfg).values())


def test_llama_never_slides():
    backends = from_hf_config(llama(sliding_window=64))
    assert all(b.sliding_window is None for b in backends.values())


def test_qwen_use_sliding_window_slides_from_max_window_layers():
    cfg = load_model_config("qwen2.5-7b") | {
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 20,
    }
    backends = from_hf_config(cfg)
    full, swa = backends[0], backends[27]
    assert full.sliding_window is None and swa.sliding_window == 4096
    assert all(backends[i] is full for i in range(20))
    assert all(backends[i] is swa for i in range(20, 28))
    layout = CacheLayout(backends)
    assert [g.name for g in layout.groups] == ["kv", "swa"]
    assert layout.kv_bytes_per_token() == 20 * 2 * 4 * 128 * 2


def test_layer_types_decide_per_layer():
    cfg = llama(
        model_type="qwen3",
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    backends = from_hf_config(cfg)
    assert [b.sliding_window for b in backends.values()] == [128, None, 128, None]
    assert backends[0] is backends[2] and backends[1] is backends[3]


def test_mha_when_num_key_value_heads_is_absent():
    b = from_hf_config(llama(num_key_value_heads=...))[0]
    assert (b.num_kv_heads, b.head_dim) == (8, 512 // 8)


def test_explicit_head_dim_wins_over_hidden_size():
    b = from_hf_config(llama(head_dim=96))[0]
    assert b.head_dim == 96


def test_gqa_mtp_layers_follow_main_layers():
    assert list(from_hf_config(llama(num_nextn_predict_layers=2))) == [0, 1, 2, 3]
    # two MTP layers, whatever the number of draft tokens they produce
    for tokens in (1, 2, 5):
        backends = from_hf_config(llama(num_nextn_predict_layers=2), num_speculative_tokens=tokens)
        assert list(backends) == [0, 1, 2, 3, 4, 5]
        assert backends[4] is backends[0] and backends[5] is backends[0]


def test_gqa_mtp_layer_of_a_sliding_model_is_full():
    cfg = load_model_config("mistral-7b-v0.1") | {"num_nextn_predict_layers": 1}
    backends = from_hf_config(cfg, num_speculative_tokens=1)
    assert backends[31].sliding_window == 4096 and backends[32].sliding_window is None


@pytest.mark.parametrize(
    ("tp_size", "per_rank"),
    [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1)],  # 16 ranks: each of 8 heads on two ranks
)
def test_gqa_tensor_parallel_heads(tp_size, per_rank):
    cfg = load_model_config("llama-3-8b")
    b = from_hf_config(cfg, tp_size=tp_size)[0]
    assert b.num_kv_heads == per_rank == max(1, 8 // tp_size)
    assert CacheLayout({0: b}).kv_bytes_per_token() == 2 * per_rank * 128 * 2


def test_gqa_options():
    b = from_hf_config(llama(), block_size=32, dtype="float16")[0]
    assert (b.block_size, b.dtype) == (32, "float16")
    b = from_hf_config(llama(), kv_cache_dtype="fp8")[0]
    assert b.kv_cache_quant == "fp8" and b.role("key").entry_bytes == 2 * 64 * 1
    b = from_hf_config(llama(), kv_cache_dtype="block_wise_fp8")[0]
    assert [r.name for r in b.cache_roles()] == ["key", "value", "key_scale", "value_scale"]
    b = from_hf_config(llama(), kv_cache_dtype="float32")[0]
    assert b.dtype == "float32" and b.kv_cache_quant is None
    b = from_hf_config(llama(), kv_cache_dtype="auto", dtype="float16")[0]
    assert b.dtype == "float16"


@pytest.mark.parametrize(
    ("torch_dtype", "expected"),
    [
        ("float16", "float16"),
        ("float32", "bfloat16"),  # served in 16-bit, as vLLM's _resolve_auto_dtype does
        ("bfloat16", "bfloat16"),
        ("auto", "bfloat16"),
        ("int8", "bfloat16"),
        (..., "bfloat16"),
    ],
)
def test_dtype_from_config(torch_dtype, expected):
    assert from_hf_config(llama(torch_dtype=torch_dtype))[0].dtype == expected


def test_dtype_key_of_newer_transformers():
    assert from_hf_config(llama(dtype="float16"))[0].dtype == "float16"


def test_explicit_dtype_wins_over_config():
    assert from_hf_config(llama(torch_dtype="float16"), dtype="bf16")[0].dtype == "bfloat16"


# ------------------------------------------------------------------ MLA / DSA


def test_deepseek_v3_without_speculative_decoding_has_61_cache_layers():
    # vLLM and SGLang allocate 61 cache layers unless speculative decoding uses the MTP layer
    backends = from_hf_config("deepseek-v3")
    assert list(backends) == list(range(61))
    b = backends[0]
    assert isinstance(b, MLABackend) and all(x is b for x in backends.values())
    assert (b.kv_lora_rank, b.qk_rope_head_dim, b.block_size, b.dtype) == (512, 64, 64, "bfloat16")
    layout = CacheLayout(backends)
    # (kv_lora_rank + qk_rope_head_dim) * bf16 = (512 + 64) * 2 = 1152 bytes per layer
    assert layout.kv_bytes_per_token() == 61 * (512 + 64) * 2 == 70_272
    assert layout.bytes_per_block("kv") == 61 * 64 * 1152


def test_deepseek_v3_with_mtp_layer():
    backends = from_hf_config("deepseek-v3", num_speculative_tokens=1)
    # 61 main layers (0..60) + 1 MTP layer with id 61
    assert list(backends) == list(range(62))
    assert all(x is backends[0] for x in backends.values())
    layout = CacheLayout(backends)
    assert layout.kv_bytes_per_token() == 62 * (512 + 64) * 2 == 71_424
    assert layout.bytes_per_block("kv") == 62 * 64 * 1152


def test_deepseek_v2_lite_has_no_mtp():
    backends = from_hf_config("deepseek-v2-lite")
    assert list(backends) == list(range(27))
    assert CacheLayout(backends).kv_bytes_per_token() == 27 * 1152 == 31_104


def test_mla_options():
    b = from_hf_config("deepseek-v3", kv_cache_dtype="fp8", block_size=16)[0]
    assert (b.dtype, b.block_size) == ("float8_e4m3fn", 16)
    assert b.role("key").entry_bytes == 576 * 1
    assert from_hf_config("deepseek-v3", kv_cache_dtype="float16")[0].dtype == "float16"
    # The latent is replicated on every TP rank: tp_size does not change the cache.
    assert from_hf_config("deepseek-v3", tp_size=8)[0].role("key").entry_bytes == 1152


def test_deepseek_v3_2_dsa():
    backends = from_hf_config("deepseek-v3.2")
    assert list(backends) == list(range(61))
    b = backends[60]
    assert isinstance(b, DSABackend) and all(x is b for x in backends.values())
    assert (b.index_head_dim, b.block_size, b.kv_cache_dtype) == (128, 64, "fp8")
    # fp8 key: 512 fp8 + 4 float32 tile scales + 64 bf16 rope = 512 + 16 + 128 = 656 bytes;
    # indexer: 128 fp8 + 1 float32 scale = 132 bytes
    assert CacheLayout(backends).kv_bytes_per_token() == 61 * (656 + 132) == 48_068
    speculative = from_hf_config("deepseek-v3.2", num_speculative_tokens=2)
    assert list(speculative) == list(range(62)) and speculative[61] is speculative[0]
    assert CacheLayout(speculative).kv_bytes_per_token() == 62 * (656 + 132) == 48_856


def test_dsa_bf16():
    b = from_hf_config("deepseek-v3.2", kv_cache_dtype="bf16")[0]
    assert b.kv_cache_dtype == "bf16"
    # bf16 latent: (512 + 64) x 2 = 1,152 bytes; the indexer stays 128 fp8 + 1 float32 scale
    # = 132 uint8 bytes whatever the main KV dtype: 1,152 + 132 = 1,284
    assert b.role("indexer").entry_bytes == 132 and b.role("indexer").dtype == "uint8"
    assert CacheLayout({0: b}).kv_bytes_per_token() == (512 + 64) * 2 + 128 + 4 == 1_284


def test_v3_with_index_head_dim_is_dsa():
    assert isinstance(from_hf_config(deepseek_v3(index_head_dim=128))[0], DSABackend)


# ------------------------------------------------------------------ DeepSeek-V4


def test_deepseek_v4_flash_layers_and_shared_instances():
    assert list(from_hf_config("deepseek-v4-flash")) == list(range(43))  # the main layers
    backends = from_hf_config("deepseek-v4-flash", num_speculative_tokens=1)
    assert list(backends) == list(range(44))  # 43 main layers + MTP layer 43
    assert [b.compress_ratio for b in backends.values()] == FLASH_RATIOS
    assert all(isinstance(b, DeepseekV4Backend) for b in backends.values())
    # one instance per layer kind, shared by every layer of that kind
    assert len({id(b) for b in backends.values()}) == 3
    assert backends[0] is backends[1] is backends[43]
    assert backends[2] is backends[4] is backends[42]
    assert backends[3] is backends[5] is backends[41]
    b = backends[2]
    assert (b.head_dim, b.qk_rope_head_dim, b.index_head_dim) == (512, 64, 128)
    assert (b.sliding_window, b.kv_cache_dtype) == (128, "fp8")


def test_deepseek_v4_flash_role_counts_per_group():
    backends = from_hf_config("deepseek-v4-flash", num_speculative_tokens=1)
    r4 = [i for i, r in enumerate(FLASH_RATIOS) if r == 4]
    r128 = [i for i, r in enumerate(FLASH_RATIOS) if r == 128]
    r0 = [i for i, r in enumerate(FLASH_RATIOS) if r == 0]
    assert r4 == list(range(2, 43, 2)) and len(r4) == 21
    assert r128 == list(range(3, 42, 2)) and len(r128) == 20
    assert r0 == [0, 1, 43]  # the MTP layer is uncompressed

    layout = CacheLayout(backends)
    assert [g.name for g in layout.groups] == ["swa", "compressed", "c4_state", "c128_state"]
    assert roles_in(layout, "swa") == {"swa_kv": 44}
    assert roles_in(layout, "compressed") == {"compressed_kv": 21 + 20, "indexer": 21}
    assert roles_in(layout, "c4_state") == {"compressor_state": 21, "indexer_compressor_state": 21}
    assert roles_in(layout, "c128_state") == {"compressor_state": 20}
    # which layers carry which roles
    assert [e.layer for e in layout.buffers_of("compressed") if e.role.name == "indexer"] == r4
    assert [e.layer for e in layout.buffers_of("c128_state")] == r128
    compressed_kv = [e for e in layout.buffers_of("compressed") if e.role.name == "compressed_kv"]
    assert {e.layer: e.role.compress_ratio for e in compressed_kv} == {
        i: FLASH_RATIOS[i] for i in sorted(r4 + r128)
    }

    # Host page bytes per block (meaningful bytes, no padding), fp8: swa_kv 64 x 584; ratio-4
    # compressed_kv 64 x 584 and indexer 64 x 132; ratio-128 compressed_kv 2 x 584; c4 states
    # 4 x 8192 + 4 x 2048; c128 state 8 x 4096.
    assert layout.host_page_bytes("swa") == 44 * 64 * 584 == 1_644_544
    assert layout.host_page_bytes("compressed") == 21 * (64 * 584 + 64 * 132) + 20 * 2 * 584
    assert layout.host_page_bytes("compressed") == 985_664
    assert layout.host_page_bytes("c4_state") == 21 * (4 * 8192 + 4 * 2048) == 860_160
    assert layout.host_page_bytes("c128_state") == 20 * 8 * 4096 == 655_360
    # Device bytes per block: every (layer, role) block padded to a multiple of 576 B
    # (FlashMLA pages): 37,376 -> 65 x 576 = 37,440; 8,448 -> 15 x 576 = 8,640;
    # 1,168 -> 3 x 576 = 1,728; 32,768 -> 57 x 576 = 32,832; 8,192 -> 15 x 576 = 8,640.
    assert layout.bytes_per_block("swa") == 44 * 65 * 576 == 1_647_360
    assert layout.bytes_per_block("compressed") == 21 * (65 * 576 + 15 * 576) + 20 * 3 * 576
    assert layout.bytes_per_block("compressed") == 1_002_240  # 967,680 + 34,560
    assert layout.bytes_per_block("c4_state") == 21 * (57 * 576 + 15 * 576) == 870_912
    assert layout.bytes_per_block("c128_state") == 20 * 57 * 576 == 656_640
    # One token's device share of the full group (256-token blocks), exact: 1,002,240 / 256
    # = 3,915 (whole, so an int)
    assert layout.kv_bytes_per_token() == Fraction(1_002_240, 256) == 3_915
    assert isinstance(layout.kv_bytes_per_token(), int)


def test_deepseek_v4_tiny():
    backends = from_hf_config("deepseek-v4-tiny")
    assert [b.compress_ratio for b in backends.values()] == [0, 0, 4, 128, 4, 128]
    assert roles_in(CacheLayout(backends), "swa") == {"swa_kv": 6}
    backends = from_hf_config("deepseek-v4-tiny", num_speculative_tokens=1)
    assert [b.compress_ratio for b in backends.values()] == [0, 0, 4, 128, 4, 128, 0]
    layout = CacheLayout(backends)
    assert roles_in(layout, "swa") == {"swa_kv": 7}
    assert roles_in(layout, "compressed") == {"compressed_kv": 4, "indexer": 2}
    assert roles_in(layout, "c4_state") == {"compressor_state": 2, "indexer_compressor_state": 2}
    assert roles_in(layout, "c128_state") == {"compressor_state": 2}


def test_v4_mtp_ratio_defaults_to_zero_when_the_list_stops_at_the_main_layers():
    backends = from_hf_config(v4(compress_ratios=[0, 0, 4, 128, 4, 128]), num_speculative_tokens=1)
    assert list(backends) == list(range(7)) and backends[6].compress_ratio == 0


def test_v4_mtp_ratio_comes_from_the_list():
    cfg = v4(num_hidden_layers=2, compress_ratios=[0, 4, 128])
    backends = from_hf_config(cfg, num_speculative_tokens=1)
    assert [b.compress_ratio for b in backends.values()] == [0, 4, 128]
    assert [b.compress_ratio for b in from_hf_config(cfg).values()] == [0, 4]


def test_v4_mtp_ratio_is_not_read_without_speculative_decoding():
    cfg = v4(compress_ratios=[0, 0, 4, 128, 4, 128, 64])
    assert len(from_hf_config(cfg)) == 6
    with pytest.raises(ValueError, match=r"compress_ratios\[6\]=64 is not one of"):
        from_hf_config(cfg, num_speculative_tokens=1)


@pytest.mark.parametrize(
    ("ratios", "loaded"),
    [
        ([1, 1, 4, 128], [0, 0, 4, 128]),  # vllm-ascend's test config
        ([0, 1, 128, 4], [0, 0, 128, 4]),
    ],
)
def test_v4_ratio_1_loads_as_an_uncompressed_layer(ratios, loaded):
    cfg = v4(num_hidden_layers=4, num_nextn_predict_layers=..., compress_ratios=ratios)
    backends = from_hf_config(cfg)
    assert [b.compress_ratio for b in backends.values()] == loaded
    # a ratio-1 layer is the same layer kind (the same instance) as a ratio-0 layer
    assert backends[0] is backends[1]
    assert roles_in(CacheLayout(backends), "swa") == {"swa_kv": 4}


def test_v4_entries_past_the_last_cache_layer_are_ignored():
    # A published V4-Flash variant ships 46 entries for 43 layers + 1 MTP layer.
    cfg = load_model_config("deepseek-v4-flash") | {
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]
    }
    backends = from_hf_config(cfg, num_speculative_tokens=1)
    assert len(backends) == 44 and backends[43].compress_ratio == 0


def test_v4_without_mtp():
    backends = from_hf_config(v4(num_nextn_predict_layers=...))
    assert list(backends) == list(range(6))


def test_v4_bf16():
    backends = from_hf_config("deepseek-v4-tiny", kv_cache_dtype="bf16")
    b = backends[2]
    assert b.kv_cache_dtype == "bf16"
    assert b.role("swa_kv").entry_bytes == 512 * 2 and b.role("swa_kv").dtype == "bfloat16"
    # the indexer stays fp8 + scale in bf16 mode: 128 fp8 + one float32 scale = 132 uint8 bytes
    assert b.role("indexer").entry_bytes == 128 + 4 == 132 and b.role("indexer").dtype == "uint8"


# ------------------------------------------------------------------ dispatch


def test_architectures_fallback_without_model_type():
    cfg = llama(model_type=..., architectures=["LlamaForCausalLM"])
    assert isinstance(from_hf_config(cfg)[0], GQABackend)


def test_architectures_fallback_with_unknown_model_type():
    cfg = deepseek_v3(model_type="my_finetune")
    assert isinstance(from_hf_config(cfg)[0], MLABackend)
    cfg = v4(model_type="my_finetune")
    assert isinstance(from_hf_config(cfg)[0], DeepseekV4Backend)


def test_bundled_families_are_registered_through_the_registry():
    types = registered_model_types()
    # plugins installed in the environment may add more; the bundled ones are exactly these
    bundled = {t: (e.builder, e.architectures) for t, e in types.items() if e.bundled}
    assert bundled == {
        "deepseek_v2": (build_mla, ("DeepseekV2ForCausalLM",)),
        "deepseek_v3": (build_mla, ("DeepseekV3ForCausalLM",)),
        "deepseek_v32": (build_dsa, ("DeepseekV32ForCausalLM",)),
        "deepseek_v4": (build_deepseek_v4, ("DeepseekV4ForCausalLM",)),
        "gemma2": (build_gemma2, ("Gemma2ForCausalLM",)),
        "gemma3": (build_gemma3, ("Gemma3ForConditionalGeneration",)),
        "gemma3_text": (build_gemma3, ("Gemma3ForCausalLM",)),
        "glm4_moe": (build_gqa, ("Glm4MoeForCausalLM",)),
        "gpt_oss": (build_gpt_oss, ("GptOssForCausalLM",)),
        "llama": (build_gqa, ("LlamaForCausalLM",)),
        "llama4": (build_llama4, ("Llama4ForConditionalGeneration",)),
        "llama4_text": (build_llama4, ("Llama4ForCausalLM",)),
        "mistral": (build_mistral, ("MistralForCausalLM",)),
        "mixtral": (build_mistral, ("MixtralForCausalLM",)),
        "qwen2": (build_qwen, ("Qwen2ForCausalLM",)),
        "qwen2_moe": (build_qwen, ("Qwen2MoeForCausalLM",)),
        "qwen3": (build_qwen, ("Qwen3ForCausalLM",)),
        "qwen3_moe": (build_qwen, ("Qwen3MoeForCausalLM",)),
        "qwen3_next": (build_qwen3_next, ("Qwen3NextForCausalLM",)),
        "phi3": (build_phi3, ("Phi3ForCausalLM",)),
        "olmo2": (build_olmo2, ("Olmo2ForCausalLM",)),
        "minimax_m2": (build_minimax_m2, ("MiniMaxM2ForCausalLM",)),
        "mistral3": (build_mistral3, ("Mistral3ForConditionalGeneration",)),
        "qwen2_5_vl": (build_qwen2_5_vl, ("Qwen2_5_VLForConditionalGeneration",)),
        "qwen3_vl": (build_qwen3_vl, ("Qwen3VLForConditionalGeneration",)),
        "qwen3_vl_moe": (build_qwen3_vl_moe, ("Qwen3VLMoeForConditionalGeneration",)),
        "qwen3_5": (build_qwen3_5, ("Qwen3_5ForConditionalGeneration",)),
        "qwen3_5_text": (build_qwen3_5, ("Qwen3_5ForCausalLM",)),
        "qwen3_5_moe": (build_qwen3_5_moe, ("Qwen3_5MoeForConditionalGeneration",)),
        "qwen3_5_moe_text": (build_qwen3_5_moe, ("Qwen3_5MoeForCausalLM",)),
        "step3p5": (build_step3p5, ("Step3p5ForCausalLM",)),
        "nemotron-nas": (build_nemotron_nas, ("DeciLMForCausalLM",)),
        "mimo_v2_flash": (build_mimo_v2, ("MiMoV2FlashForCausalLM",)),
        "mimo_v2": (build_mimo_v2, ("MiMoV2ForCausalLM",)),
        "gemma3n": (build_gemma3n, ("Gemma3nForConditionalGeneration",)),
        "gemma3n_text": (build_gemma3n, ("Gemma3nForCausalLM",)),
        "gemma4": (build_gemma4, ("Gemma4ForConditionalGeneration",)),
        "gemma4_text": (build_gemma4, ("Gemma4ForCausalLM",)),
        "glm4_moe_lite": (build_glm4_moe_lite, ("Glm4MoeLiteForCausalLM",)),
        "glm_moe_dsa": (build_glm_moe_dsa, ("GlmMoeDsaForCausalLM",)),
        "kimi_k25": (build_kimi_k25, ("KimiK25ForConditionalGeneration",)),
        "falcon_h1": (build_falcon_h1, ("FalconH1ForCausalLM",)),
        "nemotron_h": (build_nemotron_h, ("NemotronHForCausalLM",)),
        "granitemoehybrid": (build_granite_hybrid, ("GraniteMoeHybridForCausalLM",)),
    }
    assert list(types) == sorted(types)


@pytest.fixture
def isolated_registry(monkeypatch):
    """Registrations made by a test vanish with it."""
    monkeypatch.setattr(registry_module, "_model_types", dict(registry_module._model_types))
    monkeypatch.setattr(registry_module, "_backends", dict(registry_module._backends))


def test_a_registered_model_type_is_dispatched_to(isolated_registry):
    # A GQA model kvforge does not bundle reuses the public GQA builder.
    registry_module.register_model_type(
        "internlm3", build_gqa, architectures=("InternLM3ForCausalLM",)
    )
    backends = from_hf_config(llama(model_type="internlm3"))
    assert backends.model_type == "internlm3" and len(backends) == 4
    backends = from_hf_config(llama(model_type=..., architectures=["InternLM3ForCausalLM"]))
    assert backends.model_type == "internlm3"


@pytest.mark.parametrize(
    ("returned", "pattern"),
    [
        ([], r"returned list, not a mapping"),
        ({}, r"returned no layers"),
        ({-1: GQABackend(1, 8)}, r"returned layer id -1; ids are ints >= 0"),
        ({True: GQABackend(1, 8)}, r"returned layer id True"),
        ({"0": GQABackend(1, 8)}, r"returned layer id '0'"),
        ({0: "kv"}, r"returned str for layer 0, not an AttentionBackend"),
    ],
)
def test_a_builder_that_breaks_its_contract_is_a_type_error(isolated_registry, returned, pattern):
    registry_module.register_model_type("broken", lambda config, model_type, options: returned)
    with pytest.raises(TypeError, match=r"the builder of model_type 'broken' .*" + pattern):
        from_hf_config({"model_type": "broken"})


def test_a_builder_with_too_many_layers_is_refused(isolated_registry):
    b = GQABackend(1, 8)
    registry_module.register_model_type("huge", lambda c, t, o: dict.fromkeys(range(4097), b))
    with pytest.raises(
        ValueError, match=r"model_type 'huge' has 4097 cache layers; kvforge supports at most 4096"
    ):
        from_hf_config({"model_type": "huge"})


def test_result_is_a_dict_that_carries_max_position_embeddings():
    backends = from_hf_config("llama-3-8b")
    assert isinstance(backends, ModelBackends) and isinstance(backends, dict)
    assert (backends.model_type, backends.max_position_embeddings) == ("llama", 8192)
    assert backends == dict(backends) and backends[0] is backends[31]
    copy = backends.copy()
    assert isinstance(copy, ModelBackends) and copy.max_position_embeddings == 8192
    again = pickle.loads(pickle.dumps(backends))
    assert (again.model_type, again.max_position_embeddings, list(again)) == (
        "llama",
        8192,
        list(range(32)),
    )
    assert from_hf_config(llama()).max_position_embeddings is None


@pytest.mark.parametrize("value", ["8192", 0, -1, 8192.0, True])
def test_invalid_max_position_embeddings(value):
    with pytest.raises(ValueError) as info:
        from_hf_config(llama(max_position_embeddings=value))
    assert str(info.value) == (
        f"config field max_position_embeddings = {value!r} is invalid for model_type 'llama': "
        "it must be a positive integer"
    )


# ------------------------------------------------------------------ loading


def test_load_from_a_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_model_config("deepseek-v3")))
    for source in (path, str(path), tmp_path, str(tmp_path)):
        backends = from_hf_config(source)
        assert len(backends) == 61
    assert load_model_config(path) == load_model_config("deepseek-v3")


def test_load_from_a_dict_does_not_modify_it():
    cfg = load_model_config("deepseek-v4-flash")
    before = json.dumps(cfg, sort_keys=True)
    from_hf_config(cfg)
    assert json.dumps(cfg, sort_keys=True) == before


def test_an_existing_path_wins_over_a_bundled_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama-3-8b").mkdir()
    (tmp_path / "llama-3-8b" / "config.json").write_text(json.dumps(llama()))
    assert len(from_hf_config("llama-3-8b")) == 4


def test_missing_path(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        from_hf_config(missing)
    with pytest.raises(FileNotFoundError, match="no bundled model config named 'llama-9'"):
        load_model_config("llama-9")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no config\.json"):
        load_model_config(tmp_path)


def test_invalid_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"config file {str(path)!r} is not valid JSON")):
        from_hf_config(path)


def test_json_that_is_not_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"must hold a JSON object .* got list"):
        load_model_config(path)


def test_binary_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model_config(path)


@pytest.mark.parametrize("bad", [42, None, [("model_type", "llama")]])
def test_config_of_the_wrong_type(bad):
    with pytest.raises(TypeError, match="config must be a mapping"):
        from_hf_config(bad)


def test_load_model_config_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"name_or_path must be a str or os\.PathLike, got int"):
        load_model_config(3)


# ------------------------------------------------------------------ errors


def test_unknown_model_type():
    cfg = llama(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'") as info:
        from_hf_config(cfg)
    msg = str(info.value)
    assert "(architectures ['GPT2LMHeadModel']); registered model_type values: " in msg
    assert ", ".join(registered_model_types()) in msg
    for supported in ("llama", "qwen3", "deepseek_v3", "deepseek_v32", "deepseek_v4"):
        assert supported in msg


def test_unknown_model_type_lists_a_newly_registered_one(isolated_registry):
    registry_module.register_model_type("my_gqa", build_gqa)
    with pytest.raises(ValueError, match=r"registered model_type values: .*my_gqa"):
        from_hf_config(llama(model_type="gpt2"))


def test_no_model_type_and_no_architectures():
    with pytest.raises(ValueError, match=r"unsupported model_type None \(architectures None\)"):
        from_hf_config({"num_hidden_layers": 2})


@pytest.mark.parametrize(
    ("make", "field", "model_type"),
    [
        (deepseek_v3, "kv_lora_rank", "deepseek_v3"),
        (deepseek_v3, "qk_rope_head_dim", "deepseek_v3"),
        (deepseek_v3, "num_hidden_layers", "deepseek_v3"),
        (v4, "compress_ratios", "deepseek_v4"),
        (v4, "sliding_window", "deepseek_v4"),
        (v4, "head_dim", "deepseek_v4"),
        (v4, "index_head_dim", "deepseek_v4"),
        (llama, "num_attention_heads", "llama"),
    ],
)
def test_missing_field(make, field, model_type):
    cfg = make(**{field: ...})
    with pytest.raises(ValueError) as info:
        from_hf_config(cfg)
    assert str(info.value) == (
        f"config is missing {field!r} (needed for model_type {model_type!r})"
    )


def test_missing_index_head_dim_for_v32():
    cfg = load_model_config("deepseek-v3.2")
    del cfg["index_head_dim"]
    with pytest.raises(ValueError) as info:
        from_hf_config(cfg)
    assert (
        str(info.value)
        == "config is missing 'index_head_dim' (needed for model_type 'deepseek_v32')"
    )


def test_null_required_field():
    with pytest.raises(ValueError) as info:
        from_hf_config(deepseek_v3(kv_lora_rank=None))
    assert (
        str(info.value)
        == "config has null for 'kv_lora_rank' (needed for model_type 'deepseek_v3')"
    )


@pytest.mark.parametrize(
    ("make", "overrides", "pattern"),
    [
        (
            deepseek_v3,
            {"num_hidden_layers": "61"},
            r"num_hidden_layers = '61' is invalid for model_type 'deepseek_v3'",
        ),
        (
            deepseek_v3,
            {"num_hidden_layers": 0},
            r"num_hidden_layers = 0 is invalid .* greater than 0",
        ),
        (
            llama,
            {"num_hidden_layers": 1e9},
            r"num_hidden_layers = 1000000000\.0 is invalid for model_type 'llama': Input should be a valid integer",
        ),
        (
            llama,
            {"num_hidden_layers": 10**9},
            r"^config field num_hidden_layers = 1000000000 is out of range: kvforge supports at most 4096 cache layers per model \(MAX_LAYERS\)$",
        ),
        (
            deepseek_v3,
            {"num_nextn_predict_layers": 10**9},
            r"^config field num_nextn_predict_layers = 1000000000 is out of range",
        ),
        (
            llama,
            {"num_hidden_layers": 4097},
            r"num_hidden_layers = 4097 is out of range: kvforge supports at most 4096",
        ),
        (deepseek_v3, {"kv_lora_rank": True}, r"kv_lora_rank = True is invalid"),
        (
            deepseek_v3,
            {"num_nextn_predict_layers": -1},
            r"num_nextn_predict_layers = -1 is invalid",
        ),
        (
            llama,
            {"num_key_value_heads": 2.0},
            r"num_key_value_heads = 2\.0 is invalid for model_type 'llama'",
        ),
        (llama, {"use_sliding_window": "yes"}, r"use_sliding_window = 'yes' is invalid"),
        (
            v4,
            {"compress_ratios": [0, 0, "4", 128, 4, 128]},
            r"compress_ratios\[2\] = '4' is invalid for model_type 'deepseek_v4'",
        ),
        (v4, {"compress_ratios": 4}, r"compress_ratios = 4 is invalid"),
    ],
)
def test_invalid_field_values(make, overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_hf_config(make(**overrides))


def test_compress_ratios_shorter_than_num_hidden_layers():
    cfg = load_model_config("deepseek-v4-flash") | {"compress_ratios": FLASH_RATIOS[:40]}
    with pytest.raises(ValueError) as info:
        from_hf_config(cfg)
    assert str(info.value) == (
        "compress_ratios has 40 entries but num_hidden_layers=43 (model_type 'deepseek_v4'): "
        "every main layer needs a ratio"
    )


@pytest.mark.parametrize(("index", "ratio"), [(3, 8), (0, 2), (1, -1), (6, 64)])  # 6: MTP layer
def test_compress_ratio_not_allowed(index, ratio):
    ratios = [0, 0, 4, 128, 4, 128, 0]
    ratios[index] = ratio
    with pytest.raises(ValueError) as info:
        from_hf_config(v4(compress_ratios=ratios), num_speculative_tokens=1)
    assert str(info.value) == (
        f"compress_ratios[{index}]={ratio} is not one of [0, 1, 4, 128] (model_type 'deepseek_v4')"
    )


@pytest.mark.parametrize(
    ("source", "model_type"),
    [("llama-3-8b", "llama"), ("deepseek-v2-lite", "deepseek_v2"), ("qwen3-8b", "qwen3")],
)
def test_speculative_tokens_need_mtp_layers(source, model_type):
    with pytest.raises(ValueError) as info:
        from_hf_config(source, num_speculative_tokens=2)
    assert str(info.value) == (
        f"num_speculative_tokens=2 needs MTP layers, but the config has "
        f"num_nextn_predict_layers=0 (model_type {model_type!r})"
    )


@pytest.mark.parametrize(
    ("make", "model_type"),
    [
        (lambda: load_model_config("deepseek-v3.2"), "deepseek_v32"),
        (lambda: deepseek_v3(index_head_dim=128), "deepseek_v3"),  # DSA by its fields
        (lambda: v4(), "deepseek_v4"),
    ],
)
def test_dtype_does_not_apply_to_latent_caches_of_fixed_dtype(make, model_type):
    with pytest.raises(ValueError) as info:
        from_hf_config(make(), dtype="float16")
    assert str(info.value) == (
        f"dtype='float16' does not apply to model_type {model_type!r}: its cache dtype is set "
        "by kv_cache_dtype ('fp8' or 'bf16')"
    )


def test_deeply_nested_json_is_refused_not_a_recursion_error(tmp_path):
    path = tmp_path / "config.json"
    depth = 100_000
    path.write_text('{"model_type": "llama", "x": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ValueError) as info:
        from_hf_config(path)
    assert str(info.value) == (
        f"config file {str(path)!r} nests JSON arrays or objects too deeply to be a model config"
    )


def test_an_integer_literal_past_the_digit_limit_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "num_hidden_layers": 1' + "0" * 5000 + "}")
    with pytest.raises(ValueError, match=r"is not a usable JSON config: Exceeds the limit"):
        load_model_config(path)


def test_deeply_nested_values_give_short_messages():
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(ValueError) as info:
        from_hf_config(llama(layer_types=nested))
    assert str(info.value) == (
        "config field layer_types[0] = [[[[...]]]] is invalid for model_type 'llama': Input "
        "should be a valid string"
    )
    with pytest.raises(ValueError) as info:
        from_hf_config({"model_type": nested, "architectures": nested})
    assert str(info.value).startswith(
        "unsupported model_type [[[[...]]]] (architectures [[[[...]]]]); registered model_type values:"
    )


def test_v4_rope_not_smaller_than_head_dim():
    with pytest.raises(ValueError, match=r"qk_rope_head_dim=512 must be smaller than head_dim=512"):
        from_hf_config(v4(qk_rope_head_dim=512))


def test_v4_block_size_is_fixed():
    with pytest.raises(
        ValueError, match=r"block_size=64 cannot be set for model_type 'deepseek_v4'"
    ):
        from_hf_config("deepseek-v4-tiny", block_size=64)


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError) as info:
        from_hf_config(llama(num_key_value_heads=3))
    assert str(info.value) == (
        "num_attention_heads=8 is not divisible by num_key_value_heads=3 (model_type 'llama')"
    )


def test_head_dim_cannot_be_derived():
    with pytest.raises(ValueError, match=r"config is missing 'head_dim' and 'hidden_size'"):
        from_hf_config(llama(hidden_size=...))
    with pytest.raises(
        ValueError, match=r"hidden_size=500 is not divisible by num_attention_heads=8"
    ):
        from_hf_config(llama(hidden_size=500))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp_size", "pattern"),
    [
        (48, 8, 3, r"tp_size=3 and num_key_value_heads=8 do not fit"),
        (48, 8, 12, r"tp_size=12 and num_key_value_heads=8 do not fit"),
        (32, 8, 3, r"num_attention_heads=32 is not divisible by tp_size=3"),
    ],
)
def test_tp_size_does_not_fit_the_heads(heads, kv_heads, tp_size, pattern):
    cfg = llama(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128)
    with pytest.raises(ValueError, match=pattern):
        from_hf_config(cfg, tp_size=tp_size)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"tp_size": 0}, r"tp_size=0 is invalid"),
        ({"tp_size": 2.0}, r"tp_size=2\.0 is invalid"),
        ({"block_size": -16}, r"block_size=-16 is invalid"),
        ({"block_size": True}, r"block_size=True is invalid"),
        ({"num_speculative_tokens": -1}, r"num_speculative_tokens=-1 is invalid"),
        ({"num_speculative_tokens": 1.0}, r"num_speculative_tokens=1\.0 is invalid"),
        ({"num_speculative_tokens": None}, r"num_speculative_tokens=None is invalid"),
        ({"dtype": 16}, r"dtype=16 is invalid"),
        (
            {"dtype": "int8"},
            r"dtype='int8' is not a model dtype; use one of \['float16', 'bfloat16', 'float32'\]",
        ),
        ({"dtype": "nope"}, r"dtype='nope' is not a model dtype"),
    ],
)
def test_bad_options(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_hf_config(llama(), **kwargs)


def test_unknown_option():
    with pytest.raises(TypeError):
        from_hf_config(llama(), blocksize=16)


@pytest.mark.parametrize(
    ("source", "kv_cache_dtype", "pattern"),
    [
        (
            "llama-3-8b",
            "int4",
            r"kv_cache_dtype='int4' is not supported for model_type 'llama'; use 'auto', 'fp8', 'block_wise_fp8'",
        ),
        (
            "llama-3-8b",
            "fp8_e5m2",
            r"kv_cache_dtype='fp8_e5m2' is not supported for model_type 'llama'",
        ),
        (
            "deepseek-v3",
            "block_wise_fp8",
            r"kv_cache_dtype='block_wise_fp8' is not supported for model_type 'deepseek_v3'; use 'auto', 'fp8'",
        ),
        (
            "deepseek-v3.2",
            "float16",
            r"kv_cache_dtype='float16' is not supported for model_type 'deepseek_v32'; use 'fp8' or 'bf16'",
        ),
        (
            "deepseek-v4-flash",
            "auto",
            r"kv_cache_dtype='auto' is not supported for model_type 'deepseek_v4'; use 'fp8' or 'bf16'",
        ),
    ],
)
def test_bad_kv_cache_dtype(source, kv_cache_dtype, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_hf_config(source, kv_cache_dtype=kv_cache_dtype)


def test_layer_types_errors():
    with pytest.raises(ValueError, match=r"layer_types has 3 entries but num_hidden_layers=4"):
        from_hf_config(llama(layer_types=["full_attention"] * 3))
    with pytest.raises(ValueError, match=r"layer_types\[1\]='linear_attention' is not one of"):
        from_hf_config(llama(layer_types=["full_attention", "linear_attention"] * 2))
    with pytest.raises(ValueError, match=r"config is missing 'sliding_window' .*sliding_attention"):
        from_hf_config(llama(layer_types=["sliding_attention"] * 4))


def test_qwen_use_sliding_window_needs_its_fields():
    cfg = load_model_config("qwen2.5-7b") | {"use_sliding_window": True}
    del cfg["max_window_layers"]
    with pytest.raises(ValueError) as info:
        from_hf_config(cfg)
    assert str(info.value) == (
        "config is missing 'max_window_layers' (needed for model_type 'qwen2' with "
        "use_sliding_window=true)"
    )
    cfg = load_model_config("qwen3-8b") | {"use_sliding_window": True}
    with pytest.raises(
        ValueError, match=r"config is missing 'sliding_window' \(needed for model_type 'qwen3'"
    ):
        from_hf_config(cfg)
