"""``dtype="auto"``: configs are planned in the dtype the engines serve them in.

vLLM's ``_resolve_auto_dtype`` (``vllm/config/model.py``) keeps a 16-bit config dtype,
downcasts a float32 one ("Downcast for float32 models") to the platform's first supported
dtype, bfloat16, and never runs Gemma-2 / Gemma-3 / GLM-4 in float16. An explicit ``dtype``
wins, float32 included. Byte counts are written as the arithmetic a reader can check by hand.
"""

from __future__ import annotations

import pytest

from kvforge.attn_backends import DeepseekV4Backend, DSABackend, GQABackend, MLABackend
from kvforge.core.layout import CacheLayout
from kvforge.models import from_hf_config, load_model_config
from kvforge.models.reading import FLOAT16_UNSUPPORTED, model_dtype


def llama(**extra):
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
    }
    cfg.update(extra)
    return cfg


def with_dtype(name: str, torch_dtype: str) -> dict:
    """A bundled config with its (top-level) ``torch_dtype`` replaced."""
    return load_model_config(name) | {"torch_dtype": torch_dtype}


def dtypes(backends) -> set[str]:
    return {r.dtype for b in backends.values() for r in b.cache_roles()}


# Gemma-2-9B: 21 sliding + 21 full layers, 8 kv heads of 256, 16 tokens per block:
#   21 * 16 * (2 * 8 * 256) * itemsize
# Gemma-3-12B: 40 local + 8 global layers, 8 kv heads of 256, 16 tokens per block.
G2_BF16 = 21 * 16 * 2 * 8 * 256 * 2
G3_SWA_BF16 = 40 * 16 * 2 * 8 * 256 * 2
G3_KV_BF16 = 8 * 16 * 2 * 8 * 256 * 2

# (source, dtype option, expected dtype, {group: bytes per block})
PLANS = [
    # Gemma-2-9B's published config says float32: served (and planned) in bfloat16
    ("gemma-2-9b", "auto", "bfloat16", {"swa": G2_BF16, "kv": G2_BF16}),
    ("gemma-2-9b", None, "bfloat16", {"swa": G2_BF16, "kv": G2_BF16}),
    # float32 on purpose: twice the bytes
    ("gemma-2-9b", "float32", "float32", {"swa": 2 * G2_BF16, "kv": 2 * G2_BF16}),
    ("gemma-2-9b", "fp32", "float32", {"swa": 2 * G2_BF16, "kv": 2 * G2_BF16}),
    ("gemma-2-9b", "float16", "float16", {"swa": G2_BF16, "kv": G2_BF16}),
    # Gemma-3-12B's published config is bfloat16: unchanged
    ("gemma-3-12b", "auto", "bfloat16", {"swa": G3_SWA_BF16, "kv": G3_KV_BF16}),
    ("gemma-3-12b", "float32", "float32", {"swa": 2 * G3_SWA_BF16, "kv": 2 * G3_KV_BF16}),
    # a Gemma-3 checkpoint saved in float32 (the dtype sits outside text_config, as published)
    (("gemma-3-12b", "float32"), "auto", "bfloat16", {"swa": G3_SWA_BF16, "kv": G3_KV_BF16}),
    (
        ("gemma-3-12b", "float32"),
        "float32",
        "float32",
        {"swa": 2 * G3_SWA_BF16, "kv": 2 * G3_KV_BF16},
    ),
    # vLLM never runs Gemma in float16: "auto" serves a float16 Gemma config in bfloat16
    (("gemma-2-9b", "float16"), "auto", "bfloat16", {"swa": G2_BF16, "kv": G2_BF16}),
    (("gemma-3-12b", "float16"), "auto", "bfloat16", {"swa": G3_SWA_BF16, "kv": G3_KV_BF16}),
    # 16-bit configs are kept as they are: 32 layers * 16 * (2 * 8 * 128) * 2
    ("llama-3-8b", "auto", "bfloat16", {"kv": 32 * 16 * 2 * 8 * 128 * 2}),
    (("llama-3-8b", "float16"), "auto", "float16", {"kv": 32 * 16 * 2 * 8 * 128 * 2}),
    (("llama-3-8b", "float32"), "auto", "bfloat16", {"kv": 32 * 16 * 2 * 8 * 128 * 2}),
    (("llama-3-8b", "float32"), "float32", "float32", {"kv": 32 * 16 * 2 * 8 * 128 * 4}),
    # gpt-oss-20b (bfloat16): 12 + 12 layers * 16 * (2 * 8 * 64) * 2
    (
        "gpt-oss-20b",
        "auto",
        "bfloat16",
        {"swa": 12 * 16 * 2 * 8 * 64 * 2, "kv": 12 * 16 * 2 * 8 * 64 * 2},
    ),
    # MLA: 27 layers * 64 tokens * (512 + 64) * itemsize
    (("deepseek-v2-lite", "float32"), "auto", "bfloat16", {"kv": 27 * 64 * 576 * 2}),
    (("deepseek-v2-lite", "float32"), "float32", "float32", {"kv": 27 * 64 * 576 * 4}),
]


def _source(source):
    return with_dtype(*source) if isinstance(source, tuple) else source


@pytest.mark.parametrize(("source", "dtype", "expected", "block_bytes"), PLANS)
def test_plan_dtype_and_bytes_per_block(source, dtype, expected, block_bytes):
    backends = from_hf_config(_source(source), dtype=dtype)
    assert dtypes(backends) == {expected}
    layout = CacheLayout(backends)
    assert {g.name: layout.bytes_per_block(g.name) for g in layout.groups} == block_bytes


def test_auto_is_the_default():
    for name in ("gemma-2-9b", "gemma-3-12b", "llama-3-8b", "deepseek-v4-flash"):
        default = CacheLayout(from_hf_config(name))
        auto = CacheLayout(from_hf_config(name, dtype="auto"))
        assert {g.name: default.bytes_per_block(g.name) for g in default.groups} == {
            g.name: auto.bytes_per_block(g.name) for g in auto.groups
        }


@pytest.mark.parametrize(
    ("config", "option", "model_type", "expected"),
    [
        # the config's dtype, as vLLM's _resolve_auto_dtype serves it
        ({"torch_dtype": "float32"}, None, "llama", "bfloat16"),
        ({"torch_dtype": "float32"}, "auto", "llama", "bfloat16"),
        ({"torch_dtype": "float16"}, "auto", "llama", "float16"),
        ({"torch_dtype": "bfloat16"}, "auto", "llama", "bfloat16"),
        ({"torch_dtype": "fp16"}, "auto", "qwen2", "float16"),
        ({"dtype": "float16"}, "auto", "llama", "float16"),  # newer transformers' key
        ({"dtype": "float32"}, "auto", "llama", "bfloat16"),
        ({}, "auto", "llama", "bfloat16"),  # missing: vLLM assumes float32, then downcasts
        ({"torch_dtype": None}, "auto", "llama", "bfloat16"),
        ({"torch_dtype": "int8"}, "auto", "llama", "bfloat16"),
        ({"torch_dtype": "float8_e4m3fn"}, "auto", "llama", "bfloat16"),
        ({"torch_dtype": "int8", "dtype": "float16"}, "auto", "llama", "float16"),
        # model types vLLM refuses to run in float16
        ({"torch_dtype": "float16"}, "auto", "gemma2", "bfloat16"),
        ({"torch_dtype": "float16"}, "auto", "gemma3", "bfloat16"),
        ({"torch_dtype": "float16"}, "auto", "gemma3_text", "bfloat16"),
        ({"torch_dtype": "float16"}, "auto", "glm4", "bfloat16"),
        ({"torch_dtype": "float32"}, "auto", "gemma2", "bfloat16"),
        # an explicit dtype wins, whatever the config says
        ({"torch_dtype": "bfloat16"}, "float32", "llama", "float32"),
        ({"torch_dtype": "float32"}, "float32", "gemma2", "float32"),
        ({"torch_dtype": "float32"}, "float16", "gemma2", "float16"),
    ],
)
def test_model_dtype_rule(config, option, model_type, expected):
    assert model_dtype(config, option, model_type) == expected


def test_float16_unsupported_is_vllms_table():
    # vllm/config/model.py: _FLOAT16_NOT_SUPPORTED_MODELS
    assert {"gemma2", "gemma3", "gemma3_text", "glm4"} == FLOAT16_UNSUPPORTED


def test_qwen3_next_conv_state_follows_the_model_dtype():
    cfg = with_dtype("qwen3-next-80b-a3b", "float32")
    linear = from_hf_config(cfg)[0]
    assert linear.role("conv_state").dtype == "bfloat16"
    # vLLM's "auto" mamba_ssm_cache_dtype: the conv state's dtype
    assert linear.role("recurrent_state").dtype == "bfloat16"
    linear = from_hf_config(cfg, dtype="float32")[0]
    assert linear.role("conv_state").dtype == "float32"
    assert linear.role("recurrent_state").dtype == "float32"


@pytest.mark.parametrize("name", ["deepseek-v3.2", "deepseek-v4-flash"])
def test_latent_caches_take_auto_and_refuse_a_dtype(name):
    expected = DSABackend if name == "deepseek-v3.2" else DeepseekV4Backend
    assert isinstance(from_hf_config(name, dtype="auto")[0], expected)
    with pytest.raises(ValueError, match=r"dtype='float32' does not apply to model_type"):
        from_hf_config(name, dtype="float32")


def test_explicit_dtype_with_a_float_kv_cache_dtype():
    # kv_cache_dtype still decides the cache storage; dtype the model's
    b = from_hf_config("gemma-2-9b", kv_cache_dtype="float32")[0]
    assert isinstance(b, GQABackend) and b.dtype == "float32"
    b = from_hf_config(with_dtype("deepseek-v2-lite", "float32"), kv_cache_dtype="fp8")[0]
    assert isinstance(b, MLABackend) and b.dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
    ("dtype", "message"),
    [
        (
            "int8",
            "dtype='int8' is not a model dtype; use one of ['float16', 'bfloat16', 'float32'] or 'auto'",
        ),
        (
            "fp8",
            "dtype='fp8' is not a model dtype; use one of ['float16', 'bfloat16', 'float32'] or 'auto'",
        ),
        ("float64", "dtype='float64' is not a model dtype"),
        ("Auto", "dtype='Auto' is not a model dtype"),
        ("", "dtype='' is not a model dtype"),
        ("torch.float128", "dtype='torch.float128' is not a model dtype"),
        (16, "dtype=16 is invalid"),
        (True, "dtype=True is invalid"),
        (b"float32", "dtype=b'float32' is invalid"),
    ],
)
def test_bad_dtype_names_the_field_and_value(dtype, message):
    with pytest.raises(ValueError) as info:
        from_hf_config(llama(torch_dtype="float32"), dtype=dtype)
    assert message in str(info.value)
