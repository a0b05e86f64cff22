"""The MLA / DSA families kvforge reads (GLM-4.7-Flash, GLM-5, Kimi-K2.5): ``to_vllm_specs`` of
kvforge's plan against the specs vLLM 0.33's own model classes declare for the same config.

vLLM's CPU build does not run these families, so the reference is the spec their model code
declares, built as the engine builds it:

- ``ModelConfig`` reads the bundled ``config.json`` through ``transformers``' configuration
  class (so a field the config leaves out takes the class's default, and Kimi-K2.5's
  ``text_config`` is vLLM's ``hf_text_config``), and resolves the model dtype;
- each decoder layer's latent cache is ``MLAAttention.get_kv_cache_spec``
  (``vllm/model_executor/layers/attention/mla_attention.py``), run on a stand-in carrying the
  attributes ``MLAAttention.__init__`` sets: ``head_size = kv_lora_rank + qk_rope_head_dim``,
  the cache dtype (``cache_config.cache_dtype``, which a sparse layer on FlashMLA-sparse
  canonicalises with ``_canonicalize_sparse_mla_kv_cache_dtype``: fp8 becomes
  ``fp8_ds_mla``), ``topk_buffer_width`` (the width of ``DeepseekV2Model``'s top-k buffer,
  ``index_topk``) and ``indexer`` (built on every layer of a model with ``index_topk``,
  ``DeepseekV2MLAAttention.__init__`` in ``vllm/model_executor/models/deepseek_v2.py``);
- a DSA layer's indexer cache is vLLM's own ``DeepseekV32IndexerCache`` module, built with
  the width ``Indexer.__init__`` gives it (``index_head_dim + index_head_dim // 128 * 4``
  uint8) and asked for its spec.

Layer names are vLLM's: ``model.layers.{i}.self_attn.attn`` and
``model.layers.{i}.self_attn.indexer.k_cache``; Kimi-K2.5's language model sits under
``language_model.`` (``vllm/model_executor/models/kimi_k25.py``).

Two fields of a DSA layer's ``MLAAttentionSpec`` are sparse-kernel metadata that kvforge's
declaration does not carry: ``topk_buffer_width`` (``index_topk``) and
``is_index_group_leader`` (the layer has an indexer). The comparison checks them on vLLM's
side and compares every other field, page sizes included, for equality.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import (
    MLAAttention,
    _canonicalize_sparse_mla_kv_cache_dtype,
)
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

from kvforge.core.layout import CacheLayout
from kvforge.integrations.vllm.specs import from_vllm_specs, layer_page_bytes, to_vllm_specs
from kvforge.models import from_hf_config, load_model_config

BLOCK = 64
# model -> (vLLM layer prefix, kvforge kv_cache_dtype -> vLLM cache_config.cache_dtype)
FAMILIES = {
    "glm-4.7-flash": ("model.layers.", {None: "auto", "fp8": "fp8"}),
    "glm-5": ("model.layers.", {None: "fp8", "bf16": "auto"}),
    "glm-5.2": ("model.layers.", {None: "fp8", "bf16": "auto"}),
    "kimi-k2.5": ("language_model.model.layers.", {None: "auto", "fp8": "fp8"}),
}
CASES = [(m, kv) for m, (_, dtypes) in FAMILIES.items() for kv in dtypes]


def config_of(model: str) -> dict:
    """A bundled config; ``glm-5.2``: GLM-5's with GLM-5.2's shared-index schedule (its
    published ``index_topk_freq`` 4 and ``index_skip_topk_offset`` 3: layers 0-2 and every
    fourth from 6 run the indexer, the other 57 of 78 reuse its top-k)."""
    if model == "glm-5.2":
        return {**load_model_config("glm-5"), "index_topk_freq": 4, "index_skip_topk_offset": 3}
    return load_model_config(model)


@functools.cache
def _model_config(model: str, tmp: str) -> ModelConfig:
    directory = Path(tmp) / model
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_of(model)))
    return ModelConfig(
        model=str(directory), skip_tokenizer_init=True, max_model_len=4096, dtype="auto"
    )


@pytest.fixture(scope="module")
def model_configs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm-configs"))
    return lambda model: _model_config(model, tmp)


def _vllm_config(model_config: ModelConfig, cache_dtype: str) -> VllmConfig:
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
    )


def vllm_declared_specs(cfg: VllmConfig, prefix: str, mtp: bool = False) -> dict:
    """The per-layer specs vLLM's DeepSeek-V2 model code declares under ``cfg`` (see the
    module docstring for what runs as vLLM's own code and what stands in)."""
    hf = cfg.model_config.hf_text_config
    sparse = hasattr(hf, "index_topk")  # DeepseekV2Model.is_v32
    cache_dtype = cfg.cache_config.cache_dtype
    if sparse:
        cache_dtype = _canonicalize_sparse_mla_kv_cache_dtype(FlashMLASparseBackend, cache_dtype)
    layers = hf.num_hidden_layers + (getattr(hf, "num_nextn_predict_layers", 0) if mtp else 0)
    specs = {}
    with set_current_vllm_config(cfg):
        for i in range(layers):
            indexer = sparse and has_indexer(hf, i)
            attn = SimpleNamespace(
                kv_cache_dtype=cache_dtype,
                head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
                sliding_window=None,
                topk_buffer_width=hf.index_topk if sparse else None,
                indexer=object() if indexer else None,
                non_causal_multi_token_decode=False,
            )
            specs[f"{prefix}{i}.self_attn.attn"] = MLAAttention.get_kv_cache_spec(attn, cfg)
            if indexer:
                cache = DeepseekV32IndexerCache(
                    head_dim=hf.index_head_dim + hf.index_head_dim // 128 * 4,
                    dtype=torch.uint8,
                    prefix=f"{prefix}{i}.self_attn.indexer.k_cache",
                    cache_config=cfg.cache_config,
                )
                specs[cache.prefix] = cache.get_kv_cache_spec(cfg)
    return specs


def has_indexer(hf, layer: int) -> bool:
    """Whether vLLM builds an indexer on ``layer`` of a DSA model: on every layer, except the
    main layers the configuration class marks ``"shared"`` in ``indexer_types`` (GlmMoeDsaConfig
    derives it from ``index_topk_freq`` / ``index_skip_topk_offset``, the same schedule
    ``DeepseekV2MLAAttention.__init__`` computes; MTP layers always keep theirs)."""
    types = getattr(hf, "indexer_types", None)
    return not (types and layer < hf.num_hidden_layers and types[layer] == "shared")


def _without_kernel_metadata(spec, index_topk: int | None):
    """A DSA latent spec with the two sparse-kernel fields kvforge does not declare reset,
    after checking what vLLM sets them to: every sparse layer reads the model's top-k buffer
    (``topk_buffer_width``, ``index_topk`` wide), and a layer with an indexer leads its index
    group (``is_index_group_leader``)."""
    if spec.cache_role is SparseCacheRole.INDEXER or index_topk is None:
        assert (spec.topk_buffer_width, spec.is_index_group_leader) == (None, False)
        return spec
    assert spec.topk_buffer_width == index_topk
    return dataclasses.replace(spec, topk_buffer_width=None, is_index_group_leader=False)


@pytest.mark.parametrize(("model", "kv_cache_dtype"), CASES)
def test_to_vllm_specs_equal_the_specs_vllms_model_code_declares(
    model_configs, model: str, kv_cache_dtype: str | None
) -> None:
    prefix, dtypes = FAMILIES[model]
    cfg = _vllm_config(model_configs(model), dtypes[kv_cache_dtype])
    theirs = vllm_declared_specs(cfg, prefix)
    backends = from_hf_config(config_of(model), kv_cache_dtype=kv_cache_dtype)
    ours = to_vllm_specs(backends, prefix=prefix)
    assert list(ours) == list(theirs)  # the same layers, in vLLM's order
    topk = getattr(cfg.model_config.hf_text_config, "index_topk", None)
    pages = layer_page_bytes(backends, prefix=prefix)
    for name, spec in theirs.items():
        assert isinstance(spec, MLAAttentionSpec), name
        assert ours[name] == _without_kernel_metadata(spec, topk), name
        assert pages[name] == (spec.page_size_bytes, spec.real_page_size_bytes), name
        if name.endswith(".self_attn.attn"):  # leads an index group iff it has an indexer
            indexer = name.replace(".self_attn.attn", ".self_attn.indexer.k_cache")
            assert spec.is_index_group_leader == (indexer in theirs), name


# vLLM's view of each family, by hand: the page of one 64-token block of one layer
@pytest.mark.parametrize(
    ("model", "kv_cache_dtype", "layers", "pages"),
    [
        # MLA bf16: (512 latent + 64 rope) * 2 B = 1,152 B a token
        ("glm-4.7-flash", None, 47, {"self_attn.attn": 64 * 1152}),
        # MLA fp8: 576 one-byte values a token
        ("glm-4.7-flash", "fp8", 47, {"self_attn.attn": 64 * 576}),
        # DSA fp8_ds_mla: 512 fp8 + 4 float32 tile scales + 64 bf16 rope = 656 B; indexer
        # 128 fp8 + one float32 scale = 132 B
        ("glm-5", None, 78, {"self_attn.attn": 64 * 656, "self_attn.indexer.k_cache": 64 * 132}),
        # DSA with vLLM's "auto" (bf16 latent): 1,152 B; the indexer stays 132 B
        (
            "glm-5",
            "bf16",
            78,
            {"self_attn.attn": 64 * 1152, "self_attn.indexer.k_cache": 64 * 132},
        ),
        ("kimi-k2.5", None, 61, {"self_attn.attn": 64 * 1152}),
    ],
)
def test_page_sizes_by_hand(model_configs, model, kv_cache_dtype, layers, pages) -> None:
    prefix, dtypes = FAMILIES[model]
    theirs = vllm_declared_specs(_vllm_config(model_configs(model), dtypes[kv_cache_dtype]), prefix)
    assert len(theirs) == layers * len(pages)
    for name, spec in theirs.items():
        module = name.removeprefix(prefix).split(".", 1)[1]
        assert spec.page_size_bytes == spec.real_page_size_bytes == pages[module], name
    layout = CacheLayout(from_hf_config(config_of(model), kv_cache_dtype=kv_cache_dtype))
    assert layout.bytes_per_block("kv") == layers * sum(pages.values())


@pytest.mark.parametrize("model", ["glm-4.7-flash", "glm-5"])
def test_mtp_layers_with_speculative_decoding(model_configs, model: str) -> None:
    """With an MTP draft, vLLM's DeepSeekMTP / Glm4MoeLiteMTP build one more decoder layer at
    ``model.layers.{num_hidden_layers}`` (an indexer included for DSA): so does kvforge."""
    prefix, dtypes = FAMILIES[model]
    cfg = _vllm_config(model_configs(model), dtypes[None])
    theirs = vllm_declared_specs(cfg, prefix, mtp=True)
    ours = to_vllm_specs(from_hf_config(config_of(model), num_speculative_tokens=1), prefix=prefix)
    assert list(ours) == list(theirs)
    mtp = cfg.model_config.hf_text_config.num_hidden_layers
    assert f"{prefix}{mtp}.self_attn.attn" in ours
    topk = getattr(cfg.model_config.hf_text_config, "index_topk", None)
    assert all(ours[n] == _without_kernel_metadata(s, topk) for n, s in theirs.items())


def test_engine_defaults_are_vllms(model_configs, tmp_path) -> None:
    """A GLM-5 config without its cache fields: transformers' GlmMoeDsaConfig (which vLLM
    loads it with) fills them, and kvforge's defaults plan the same specs."""
    config = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}
    directory = tmp_path / "glm-5-bare"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(
        model=str(directory), skip_tokenizer_init=True, max_model_len=4096, dtype="auto"
    )
    cfg = _vllm_config(model_config, "fp8")
    theirs = vllm_declared_specs(cfg, "model.layers.")
    ours = to_vllm_specs(from_hf_config(config), prefix="model.layers.")
    assert len(ours) == 2 * 78
    assert all(ours[n] == _without_kernel_metadata(s, 2048) for n, s in theirs.items())


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_one_group_as_vllm_groups_them(model_configs, model: str) -> None:
    """vLLM's ``get_kv_cache_groups`` (``vllm/v1/core/kv_cache_planning.py``) puts every
    layer of these models in one group (DSA: latent and indexer as one
    ``UniformTypeKVCacheSpecs``); kvforge plans one group ``kv`` of the same block size
    holding every layer's roles."""
    prefix, dtypes = FAMILIES[model]
    cfg = _vllm_config(model_configs(model), dtypes[None])
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # as on CUDA
    theirs = vllm_declared_specs(cfg, prefix)
    (group,) = get_kv_cache_groups(cfg, theirs)
    assert sorted(group.layer_names) == sorted(theirs)
    assert group.kv_cache_spec.block_size == BLOCK
    layout = CacheLayout(from_hf_config(config_of(model)))
    assert [(g.name, g.block_size) for g in layout.groups] == [("kv", BLOCK)]
    assert sorted(to_vllm_specs(layout, prefix=prefix)) == sorted(group.layer_names)


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_both_ways(model_configs, model: str) -> None:
    """vLLM's own specs read back into kvforge (``from_vllm_specs``) plan the same bytes per
    layer, and kvforge's specs survive the round trip through kvforge unchanged."""
    prefix, dtypes = FAMILIES[model]
    theirs = vllm_declared_specs(_vllm_config(model_configs(model), dtypes[None]), prefix)
    back = from_vllm_specs(theirs)
    layout = CacheLayout(back)
    for layer, name in enumerate(back.layer_names):
        buffers = [b for b in layout.buffers if b.layer == layer]
        assert sum(b.device_block_bytes for b in buffers) == theirs[name].page_size_bytes, name
        assert sum(b.block_bytes for b in buffers) == theirs[name].real_page_size_bytes, name
    ours = to_vllm_specs(from_hf_config(config_of(model)), prefix=prefix)
    assert to_vllm_specs(from_vllm_specs(ours)) == ours


def test_glm_5_2_shared_index_layers_by_hand(model_configs) -> None:
    """GLM-5.2's schedule (``index_topk_freq`` 4 after ``index_skip_topk_offset`` 3): the
    indexer runs on layers 0, 1, 2, 6, 10, ..., 74 (3 + 18 = 21 of 78); the other 57 keep the
    656-byte fp8_ds_mla latent only. 21 * (656 + 132) + 57 * 656 = 53,940 B a token."""
    theirs = vllm_declared_specs(_vllm_config(model_configs("glm-5.2"), "fp8"), "model.layers.")
    indexed = sorted(int(n.split(".")[2]) for n in theirs if n.endswith("indexer.k_cache"))
    assert indexed == [0, 1, 2, *range(6, 78, 4)]
    assert sum(s.real_page_size_bytes for s in theirs.values()) == 64 * 53_940
    backends = from_hf_config(config_of("glm-5.2"))
    assert sorted(i for i, b in backends.items() if b.indexer) == indexed
    assert CacheLayout(backends).kv_bytes_per_token() == 21 * (656 + 132) + 57 * 656 == 53_940
    # an MTP layer always keeps its indexer
    assert from_hf_config(config_of("glm-5.2"), num_speculative_tokens=1)[78].indexer
