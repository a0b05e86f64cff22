"""to_vllm_specs of the per-layer families equals the specs vLLM's own model code declares,
and from_vllm_specs reads them back.

The expected specs are written as vLLM's ``Attention.get_kv_cache_spec``
(``vllm/model_executor/layers/attention/attention.py``) builds them for these models: a
``FullAttentionSpec`` or ``SlidingWindowSpec`` per attention layer with that layer's
``num_kv_heads``, ``head_size`` and ``head_size_v`` (MiMo-V2's ``MiMoV2Attention`` passes
``head_size_v=v_head_dim``; Gemma-4's ``Gemma4DecoderLayer`` the per-layer head dim and kv
heads), and no spec at all for a NAS ``no_op`` layer (``DeciLMDecoderLayer`` builds no
attention) or a KV-shared layer (``GPUModelRunner.get_kv_cache_spec`` skips a layer with a
``kv_sharing_target_layer_name``). Block size 16, bf16, the engine's default.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvforge.attn_backends import GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.integrations.vllm.specs import from_vllm_specs, layer_page_bytes, to_vllm_specs
from kvforge.models import from_hf_config, load_model_config

BF16 = torch.bfloat16


def _full(heads: int, k: int, v: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=heads, head_size=k, head_size_v=v, dtype=BF16
    )


def _swa(heads: int, k: int, v: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=16,
        num_kv_heads=heads,
        head_size=k,
        head_size_v=v,
        dtype=BF16,
        sliding_window=window,
    )


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _vllms_nemotron_super() -> dict:
    cfg = load_model_config("llama-3.3-nemotron-super-49b")
    return {
        _name(i): _full(64 // b["attention"]["n_heads_in_group"], 128, 128)
        for i, b in enumerate(cfg["block_configs"])
        if not b["attention"]["no_op"]
    }


def _vllms_mimo_v2_flash() -> dict:
    cfg = load_model_config("mimo-v2-flash")
    return {
        _name(i): _swa(8, 192, 128, 128) if kind == 1 else _full(4, 192, 128)
        for i, kind in enumerate(cfg["hybrid_layer_pattern"])
    }


def _vllms_gemma_4_31b() -> dict:
    types = load_model_config("gemma-4-31b")["text_config"]["layer_types"]
    return {
        _name(i): _swa(16, 256, 256, 1024) if t == "sliding_attention" else _full(4, 512, 512)
        for i, t in enumerate(types)
    }


def _vllms_gemma_3n_e4b() -> dict:
    types = load_model_config("gemma-3n-e4b")["text_config"]["layer_types"]
    return {
        _name(i): _swa(2, 256, 256, 512) if t == "sliding_attention" else _full(2, 256, 256)
        for i, t in enumerate(types[:20])  # layers 20..34 share a cache: no spec
    }


VLLMS = {
    "llama-3.3-nemotron-super-49b": _vllms_nemotron_super,
    "mimo-v2-flash": _vllms_mimo_v2_flash,
    "gemma-4-31b": _vllms_gemma_4_31b,
    "gemma-3n-e4b": _vllms_gemma_3n_e4b,
}


@pytest.mark.parametrize("model", sorted(VLLMS))
def test_to_vllm_specs_equals_vllms_declared_specs(model):
    expected = VLLMS[model]()
    ours = to_vllm_specs(from_hf_config(model))
    assert list(ours) == list(expected)
    assert ours == expected
    pages = layer_page_bytes(from_hf_config(model))
    for name, spec in expected.items():
        assert pages[name] == (spec.page_size_bytes, spec.real_page_size_bytes), name


@pytest.mark.parametrize("model", sorted(VLLMS))
def test_from_vllm_specs_reads_them_back(model):
    specs = VLLMS[model]()
    back = from_vllm_specs(specs)
    assert all(isinstance(b, GQABackend) for b in back.values())
    assert list(to_vllm_specs(back).values()) == list(specs.values())
    ours = CacheLayout(from_hf_config(model))
    theirs = CacheLayout(back)
    assert theirs.kv_bytes_per_token() == ours.kv_bytes_per_token()


def test_mimo_page_sizes_by_hand():
    specs = VLLMS["mimo-v2-flash"]()
    # full: 16 tokens * 4 heads * (192 + 128) * 2 B; window: 16 * 8 * (192 + 128) * 2 B
    assert specs[_name(0)].page_size_bytes == 16 * 4 * 320 * 2 == 40_960
    assert specs[_name(1)].page_size_bytes == 16 * 8 * 320 * 2 == 81_920
    back = from_vllm_specs(specs)
    assert (back[0].head_dim, back[0].head_dim_v, back[0].num_kv_heads) == (192, 128, 4)
    assert (back[1].head_dim_v, back[1].sliding_window) == (128, 128)


def test_gemma_4_page_sizes_by_hand():
    specs = VLLMS["gemma-4-31b"]()
    # window: 16 * 16 heads * (256 + 256) * 2 B; full: 16 * 4 * (512 + 512) * 2 B
    assert specs[_name(0)].page_size_bytes == 16 * 16 * 512 * 2 == 262_144
    assert specs[_name(5)].page_size_bytes == 16 * 4 * 1024 * 2 == 131_072


def test_block_size_and_fp8_follow_the_engine():
    ours = to_vllm_specs(from_hf_config("mimo-v2-flash", kv_cache_dtype="fp8"), block_size=32)
    spec = ours[_name(1)]
    assert (spec.block_size, spec.head_size, spec.head_size_v, spec.dtype) == (
        32,
        192,
        128,
        torch.uint8,
    )
    # 32 tokens * 8 heads * (192 + 128) * 1 B
    assert spec.page_size_bytes == 32 * 8 * 320 == 81_920
    assert from_vllm_specs(ours)[1].kv_cache_quant == "fp8"
