"""The published configs of the MLA / DSA families (GLM-4.7-Flash, GLM-5, Kimi-K2.5, Kimi-K2)
plan the caches the engines allocate, with the arithmetic written beside each figure.

The shapes are those of each model's published ``config.json`` on Hugging Face, copied here
(only the fields a cache depends on, and the ones that identify the model):
``zai-org/GLM-4.7-Flash``, ``zai-org/GLM-5``, ``moonshotai/Kimi-K2.5`` (its ``text_config`` is
Kimi-K2's), ``moonshotai/Kimi-K2-Instruct``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from kvforge.attn_backends import DSABackend, MLABackend
from kvforge.core.layout import CacheLayout
from kvforge.models import from_hf_config, load_model_config
from kvforge.models.deepseek import index_sharing_layers
from kvforge.models.mla_families import ENGINE_DEFAULTS, with_engine_defaults
from kvforge.specs import GroupKind

GLM_4_7_FLASH: dict[str, Any] = {
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "dtype": "bfloat16",
    "hidden_size": 2048,
    "max_position_embeddings": 202752,
    "num_attention_heads": 20,
    "num_hidden_layers": 47,
    "num_key_value_heads": 20,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
}
GLM_5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "dtype": "bfloat16",
    "head_dim": 64,
    "hidden_size": 6144,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk": 2048,
    "indexer_rope_interleave": True,
    "kv_lora_rank": 512,
    "max_position_embeddings": 202752,
    "num_attention_heads": 64,
    "num_hidden_layers": 78,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
}
KIMI_K2_TEXT: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "dtype": "bfloat16",
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "max_position_embeddings": 262144,
    "num_attention_heads": 64,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
KIMI_K2_5: dict[str, Any] = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": KIMI_K2_TEXT,
}
KIMI_K2: dict[str, Any] = dict(KIMI_K2_TEXT, max_position_embeddings=131072)
# GLM-5.2 (zai-org/GLM-5.2) keeps GLM-5's shapes and adds the IndexCache schedule
GLM_5_2: dict[str, Any] = dict(GLM_5, index_topk_freq=4, index_skip_topk_offset=3)

FULL = GroupKind.FULL

# (name, config, options, model_type, layers, bytes a token per layer kind, max length)
CASES = [
    # 47 MLA layers, (512 latent + 64 rope) * 2 B (bf16) = 1,152 B each
    ("glm-4.7-flash", GLM_4_7_FLASH, {}, "glm4_moe_lite", 47, 47 * 1152, 202752),
    # the MTP layer gets a cache with speculative decoding: 48 * 1,152
    (
        "glm-4.7-flash mtp",
        GLM_4_7_FLASH,
        {"num_speculative_tokens": 1},
        "glm4_moe_lite",
        48,
        48 * 1152,
        202752,
    ),
    # fp8 latent: 576 B a layer
    (
        "glm-4.7-flash fp8",
        GLM_4_7_FLASH,
        {"kv_cache_dtype": "fp8"},
        "glm4_moe_lite",
        47,
        47 * 576,
        202752,
    ),
    # 78 DSA layers: fp8_ds_mla latent 512 + 4 * 4 (scales) + 64 * 2 (bf16 rope) = 656 B and the
    # indexer key 128 + 4 (float32 scale) = 132 B: 788 B a layer
    ("glm-5", GLM_5, {}, "glm_moe_dsa", 78, 78 * (656 + 132), 202752),
    # bf16 latent (vLLM's "auto"): 1,152 + 132 = 1,284 B a layer
    ("glm-5 bf16", GLM_5, {"kv_cache_dtype": "bf16"}, "glm_moe_dsa", 78, 78 * 1284, 202752),
    ("glm-5 mtp", GLM_5, {"num_speculative_tokens": 2}, "glm_moe_dsa", 79, 79 * 788, 202752),
    # Kimi-K2.5's language model: 61 MLA layers of 1,152 B; its length is the text config's
    ("kimi-k2.5", KIMI_K2_5, {}, "kimi_k25", 61, 61 * 1152, 262144),
    # Kimi-K2 (model_type kimi_k2) plans through its architecture, DeepseekV3ForCausalLM
    ("kimi-k2", KIMI_K2, {}, "deepseek_v3", 61, 61 * 1152, 131072),
    # GLM-5.2's shared-index schedule on GLM-5's shapes: 21 layers with the indexer (788 B),
    # 57 reusing their top-k with the latent only (656 B), all in one group
    ("glm-5.2", GLM_5_2, {}, "glm_moe_dsa", 78, 21 * 788 + 57 * 656, 202752),
]


@pytest.mark.parametrize(
    ("name", "config", "options", "model_type", "layers", "per_token", "max_len"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_published_configs(name, config, options, model_type, layers, per_token, max_len):
    backends = from_hf_config(config, **options)
    assert backends.model_type == model_type
    assert list(backends) == list(range(layers))
    # one backend per kind of layer (GLM-5.2: with and without the indexer)
    assert len({id(b) for b in backends.values()}) == (2 if name == "glm-5.2" else 1)
    assert backends.max_position_embeddings == max_len
    layout = CacheLayout(backends)
    assert [(g.name, g.kind, g.block_size, g.window) for g in layout.groups] == [
        ("kv", FULL, 64, None)
    ]
    assert layout.bytes_per_token_by_kind() == {FULL: Fraction(per_token)}
    assert layout.kv_bytes_per_token() == per_token
    assert layout.bytes_per_request() == 0  # no per-request state
    assert layout.bytes_per_block("kv") == 64 * per_token


def test_roles_of_each_family():
    glm_flash = from_hf_config(GLM_4_7_FLASH)[0]
    assert isinstance(glm_flash, MLABackend)
    assert [(r.name, r.entry_shape, r.dtype) for r in glm_flash.cache_roles()] == [
        ("key", (512 + 64,), "bfloat16")
    ]
    glm5 = from_hf_config(GLM_5)[0]
    assert isinstance(glm5, DSABackend)
    assert [(r.name, r.entry_shape, r.dtype) for r in glm5.cache_roles()] == [
        ("key", (512 + 4 * 4 + 64 * 2,), "uint8"),  # 656 B packed fp8_ds_mla
        ("indexer", (128 + 4,), "uint8"),
    ]
    kimi = from_hf_config(KIMI_K2_5)[0]
    assert isinstance(kimi, MLABackend) and kimi.role("key").entry_bytes == 1152


@pytest.mark.parametrize(
    ("bundled", "published"),
    [("glm-4.7-flash", GLM_4_7_FLASH), ("glm-5", GLM_5), ("kimi-k2.5", KIMI_K2_5)],
)
def test_bundled_configs_carry_the_published_shapes(bundled, published):
    config = load_model_config(bundled)
    for key, value in config.items():
        if key == "text_config":
            assert value.items() <= published["text_config"].items()
        elif key == "torch_dtype":  # the bundle spells it as the older saves do
            assert value == published.get("dtype", "bfloat16")
        else:
            assert published[key] == value, key
    ours = CacheLayout(from_hf_config(bundled))
    theirs = CacheLayout(from_hf_config(published))
    assert ours.bytes_per_token_by_kind() == theirs.bytes_per_token_by_kind()


# ------------------------------------------------------------------ engine defaults


@pytest.mark.parametrize(
    ("config", "layers", "per_layer", "max_len"),
    [
        # Glm4MoeLiteConfig: 47 layers, kv_lora_rank 512, qk_rope_head_dim 64, 202,752
        ({"model_type": "glm4_moe_lite"}, 47, 1152, 202752),
        # GlmMoeDsaConfig: 78 layers, 512 / 64, index_head_dim 128: 656 + 132 (fp8)
        ({"model_type": "glm_moe_dsa"}, 78, 788, 202752),
        # Kimi_K25Config's text_config is a DeepseekV3Config: 61 layers, 512 / 64, 4,096
        ({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}, 61, 1152, 4096),
        # a field the config sets wins over the default
        ({"model_type": "glm4_moe_lite", "kv_lora_rank": 256}, 47, (256 + 64) * 2, 202752),
    ],
)
def test_fields_left_out_take_the_engines_defaults(config, layers, per_layer, max_len):
    backends = from_hf_config(config)
    assert len(backends) == layers and backends.max_position_embeddings == max_len
    assert CacheLayout(backends).kv_bytes_per_token() == layers * per_layer


def test_with_engine_defaults_fills_only_what_is_missing():
    filled = with_engine_defaults({"kv_lora_rank": None, "x": 1}, "glm_moe_dsa")
    assert filled == dict(ENGINE_DEFAULTS["glm_moe_dsa"], kv_lora_rank=None, x=1)
    assert with_engine_defaults({"a": 1}, "llama") == {"a": 1}


# ------------------------------------------------------------------ index sharing


@pytest.mark.parametrize(
    ("fields", "sharing"),
    [
        ({}, []),
        ({"index_topk_freq": 1}, []),
        # GLM-5.2's schedule: freq 4 after offset 3: layers 0-2 full, then 6, 10, ... full
        (
            {"index_topk_freq": 4, "index_skip_topk_offset": 3},
            [i for i in range(3, 12) if (i - 2) % 4],
        ),
        # the default offset is 2: layer i shares when max(i - 1, 0) % freq != 0
        ({"index_topk_freq": 2}, [2, 4, 6, 8, 10]),
        # a pattern decides where it reaches; layers past its end do not share
        ({"index_topk_pattern": "FSSF"}, [1, 2]),
        ({"index_topk_pattern": ["F", "S"], "index_topk_freq": 2}, [1]),
    ],
)
def test_index_sharing_layers_follow_vllms_rule(fields, sharing):
    assert index_sharing_layers(fields, 12, "glm_moe_dsa") == sharing


# ------------------------------------------------------------------ bad input


def _glm5(**changes: Any) -> dict[str, Any]:
    return {**GLM_5, **changes}


def _kimi(**changes: Any) -> dict[str, Any]:
    return {**KIMI_K2_5, "text_config": {**KIMI_K2_TEXT, **changes}}


BAD = [
    (
        {"model_type": "kimi_k25"},
        {},
        "config is missing 'text_config' (needed for model_type 'kimi_k25': the language "
        "model's fields are nested there)",
    ),
    (
        {"model_type": "kimi_k25", "text_config": None},
        {},
        "config has null for 'text_config' (needed for model_type 'kimi_k25'",
    ),
    (
        {"model_type": "kimi_k25", "text_config": [1]},
        {},
        "config field text_config = [1] is invalid for model_type 'kimi_k25': it must be a "
        "JSON object",
    ),
    (
        _kimi(kv_lora_rank="512"),
        {},
        "config field text_config.kv_lora_rank = '512' is invalid for model_type 'kimi_k25'",
    ),
    (
        _kimi(num_hidden_layers=None),
        {},
        "config.text_config has null for 'num_hidden_layers' (needed for model_type 'kimi_k25')",
    ),
    (
        _kimi(),
        {"num_speculative_tokens": 1},
        "num_speculative_tokens=1 needs MTP layers, but the config has "
        "num_nextn_predict_layers=0 (model_type 'kimi_k25')",
    ),
    (
        {**GLM_4_7_FLASH, "qk_rope_head_dim": 0},
        {},
        "config field qk_rope_head_dim = 0 is invalid for model_type 'glm4_moe_lite'",
    ),
    (
        {**GLM_4_7_FLASH, "kv_lora_rank": None},
        {},
        "config has null for 'kv_lora_rank' (needed for model_type 'glm4_moe_lite')",
    ),
    (
        _glm5(index_topk_freq=0),
        {},
        "config field index_topk_freq = 0 is invalid for model_type 'glm_moe_dsa'",
    ),
    (
        _glm5(index_topk_pattern=5),
        {},
        "config field index_topk_pattern = 5 is invalid for model_type 'glm_moe_dsa'",
    ),
    (
        _glm5(),
        {"dtype": "float16"},
        "dtype='float16' does not apply to model_type 'glm_moe_dsa'",
    ),
    (
        _glm5(),
        {"kv_cache_dtype": "float16"},
        "kv_cache_dtype='float16' is not supported for model_type 'glm_moe_dsa'; use 'fp8' "
        "or 'bf16'",
    ),
]


@pytest.mark.parametrize(("config", "options", "message"), BAD)
def test_bad_configs_are_refused_by_name(config, options, message):
    before = repr(config)
    with pytest.raises(ValueError) as excinfo:
        from_hf_config(config, **options)
    assert str(excinfo.value).startswith(message), str(excinfo.value)
    assert repr(config) == before  # the caller's config is not changed


def test_glm_5_2_indexer_layers_are_the_configuration_classs():
    """transformers' GlmMoeDsaConfig derives ``indexer_types`` from the same schedule vLLM
    applies: kvforge's indexer layers are its ``"full"`` ones."""
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in GLM_5_2.items() if k not in ("architectures", "model_type")}
    types = transformers.GlmMoeDsaConfig(**fields).indexer_types
    backends = from_hf_config(GLM_5_2)
    assert [b.indexer for b in backends.values()] == [t == "full" for t in types]
    assert types.count("full") == 21  # layers 0, 1, 2, then 6, 10, ..., 74
