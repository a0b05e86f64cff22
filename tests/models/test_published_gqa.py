"""Published configs of the GQA-shaped families and Qwen3.5, planned from what they state.

Each case is a published ``config.json`` (the cache fields copied here, or the bundled copy
under ``kvforge/models/configs/``), and the figures a reader can check by hand:
bytes per token per layer kind (``layers * 2 (key and value) * kv_heads * head_dim *
itemsize``), windows, per-request state bytes, and groups. Fields a config leaves out take
the defaults of its Hugging Face configuration class, as the engines do
(``kvforge/models/engine_defaults.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvforge.core.layout import CacheLayout
from kvforge.models import from_hf_config, load_model_config
from kvforge.models.engine_defaults import GEMMA3_TEXT, engine_window, with_defaults

BF16 = 2
F32 = 4


def _types(n: int, full_every: int) -> list[str]:
    return ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(n)]


GEMMA3_27B = {  # google/gemma-3-27b-it (text_config only; the wrapper's dtype bfloat16)
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "head_dim": 128,
        "hidden_size": 5376,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "sliding_window": 1024,
    },
}
PHI3_MINI_4K = {  # microsoft/Phi-3-mini-4k-instruct
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "torch_dtype": "bfloat16",
    "hidden_size": 3072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "sliding_window": 2047,
}
PHI4_MINI = {  # microsoft/Phi-4-mini-instruct
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "torch_dtype": "bfloat16",
    "hidden_size": 3072,
    "num_attention_heads": 24,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75,
    "max_position_embeddings": 131072,
    "sliding_window": 262144,
}
OLMO2_32B = {  # allenai/OLMo-2-0325-32B
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "torch_dtype": "bfloat16",
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
}
QWEN3_VL_235B = {  # Qwen/Qwen3-VL-235B-A22B-Instruct
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe",
    "text_config": {
        "model_type": "qwen3_vl_moe_text",
        "dtype": "bfloat16",
        "head_dim": 128,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_hidden_layers": 94,
        "num_key_value_heads": 4,
        "max_position_embeddings": 262144,
    },
}

# (case, config, {kind: bytes per token}, {group: (kind, window)}, bytes per request, max len)
CASES: list[tuple[str, Any, dict[str, int], dict[str, tuple[str, int | None]], int, int]] = [
    # Gemma-3-4B states no head_dim nor head counts: Gemma3TextConfig's 8 heads, 4 kv heads of
    # 256, pattern 6 (layers 5, 11, 17, 23, 29 global), 34 layers
    (
        "gemma-3-4b",
        "gemma-3-4b",
        {"full": 5 * 2 * 4 * 256 * BF16, "sliding_window": 29 * 2 * 4 * 256 * BF16},
        {"kv": ("full", None), "swa": ("sliding_window", 1024)},
        0,
        131072,
    ),
    # Gemma-3-12B: 8 kv heads of 256 (not 3840 / 16 = 240), 48 layers, 8 global
    (
        "gemma-3-12b",
        "gemma-3-12b",
        {"full": 8 * 2 * 8 * 256 * BF16, "sliding_window": 40 * 2 * 8 * 256 * BF16},
        {"kv": ("full", None), "swa": ("sliding_window", 1024)},
        0,
        131072,
    ),
    # Gemma-3-27B: head_dim 128 stated, 16 kv heads, 62 layers, 10 global (5, 11, ..., 59)
    (
        "gemma-3-27b",
        GEMMA3_27B,
        {"full": 10 * 2 * 16 * 128 * BF16, "sliding_window": 52 * 2 * 16 * 128 * BF16},
        {"kv": ("full", None), "swa": ("sliding_window", 1024)},
        0,
        131072,
    ),
    # Phi-4: 40 layers, 10 kv heads of 5120 / 40 = 128, window null: full
    ("phi-4", "phi-4", {"full": 40 * 2 * 10 * 128 * BF16}, {"kv": ("full", None)}, 0, 16384),
    # Phi-3-mini: window 2047 on every layer (vLLM's model-level window), 32 heads of 96
    (
        "phi-3-mini-4k",
        PHI3_MINI_4K,
        {"sliding_window": 32 * 2 * 32 * 96 * BF16},
        {"swa": ("sliding_window", 2047)},
        0,
        4096,
    ),
    # Phi-4-mini: 8 kv heads of 3072 / 24 = 128; its window (262,144) outlasts its context,
    # yet vLLM declares sliding-window layers, and so does kvforge
    (
        "phi-4-mini",
        PHI4_MINI,
        {"sliding_window": 32 * 2 * 8 * 128 * BF16},
        {"swa": ("sliding_window", 262144)},
        0,
        131072,
    ),
    # OLMo-2-7B: float32 config served in bfloat16, 32 kv heads of 128, 32 layers
    (
        "olmo-2-1124-7b",
        "olmo-2-1124-7b",
        {"full": 32 * 2 * 32 * 128 * BF16},
        {"kv": ("full", None)},
        0,
        4096,
    ),
    ("olmo-2-32b", OLMO2_32B, {"full": 64 * 2 * 8 * 128 * BF16}, {"kv": ("full", None)}, 0, 4096),
    # MiniMax-M2: 62 layers, 8 kv heads of 128; its 3 MTP modules are no cache layers
    (
        "minimax-m2",
        "minimax-m2",
        {"full": 62 * 2 * 8 * 128 * BF16},
        {"kv": ("full", None)},
        0,
        196608,
    ),
    # Mistral-Small-3.1-24B: text_config (model_type mistral), window null: full, 40 layers
    (
        "mistral-small-3.1-24b",
        "mistral-small-3.1-24b",
        {"full": 40 * 2 * 8 * 128 * BF16},
        {"kv": ("full", None)},
        0,
        131072,
    ),
    # Qwen2.5-VL-7B: top-level fields, 4 kv heads of 3584 / 28 = 128, use_sliding_window false
    (
        "qwen2.5-vl-7b",
        "qwen2.5-vl-7b",
        {"full": 28 * 2 * 4 * 128 * BF16},
        {"kv": ("full", None)},
        0,
        128000,
    ),
    # Qwen3-VL-8B: 36 layers, 8 kv heads of 128
    (
        "qwen3-vl-8b",
        "qwen3-vl-8b",
        {"full": 36 * 2 * 8 * 128 * BF16},
        {"kv": ("full", None)},
        0,
        262144,
    ),
    # Qwen3-VL-30B-A3B: 48 layers, 4 kv heads of 128
    (
        "qwen3-vl-30b-a3b",
        "qwen3-vl-30b-a3b",
        {"full": 48 * 2 * 4 * 128 * BF16},
        {"kv": ("full", None)},
        0,
        262144,
    ),
    (
        "qwen3-vl-235b-a22b",
        QWEN3_VL_235B,
        {"full": 94 * 2 * 4 * 128 * BF16},
        {"kv": ("full", None)},
        0,
        262144,
    ),
    # Qwen3.5-27B: 16 full layers (every fourth) of 4 kv heads of 256; 48 Gated DeltaNet
    # layers, each a conv state of (16 * 128 * 2 + 48 * 128) channels x (4 - 1) in bf16 and a
    # recurrent state of 48 x 128 x 128 in float32 (the config's mamba_ssm_dtype)
    (
        "qwen3.5-27b",
        "qwen3.5-27b",
        {"full": 16 * 2 * 4 * 256 * BF16},
        {"kv": ("full", None), "linear_state": ("per_request", None)},
        48 * ((16 * 128 * 2 + 48 * 128) * 3 * BF16 + 48 * 128 * 128 * F32),
        262144,
    ),
    # Qwen3.5-35B-A3B: 10 full layers of 2 kv heads of 256; 30 linear layers,
    # conv (16 * 128 * 2 + 32 * 128) x 3 in bf16, recurrent 32 x 128 x 128 in float32
    (
        "qwen3.5-35b-a3b",
        "qwen3.5-35b-a3b",
        {"full": 10 * 2 * 2 * 256 * BF16},
        {"kv": ("full", None), "linear_state": ("per_request", None)},
        30 * ((16 * 128 * 2 + 32 * 128) * 3 * BF16 + 32 * 128 * 128 * F32),
        262144,
    ),
    # Step-3.5-Flash: 45 layers, full at 0, 4, ..., 44 (12), the other 33 slide over 512
    # tokens; 8 kv heads (num_attention_groups) of 128; the 3 trailing layer_types entries
    # are the MTP layers', not cached without speculative decoding
    (
        "step-3.5-flash",
        "step-3.5-flash",
        {"full": 12 * 2 * 8 * 128 * BF16, "sliding_window": 33 * 2 * 8 * 128 * BF16},
        {"kv": ("full", None), "swa": ("sliding_window", 512)},
        0,
        262144,
    ),
]


def _groups(layout: CacheLayout) -> dict[str, tuple[str, int | None]]:
    return {g.name: (getattr(g.kind, "value", g.kind), g.window) for g in layout.groups}


@pytest.mark.parametrize(
    ("config", "by_kind", "groups", "per_request", "max_len"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_published_config_plans_the_hand_figures(config, by_kind, groups, per_request, max_len):
    backends = from_hf_config(config)
    layout = CacheLayout(backends)
    found = {getattr(k, "value", k): v for k, v in layout.bytes_per_token_by_kind().items()}
    assert found == by_kind
    assert _groups(layout) == groups
    assert layout.bytes_per_request() == per_request
    assert backends.max_position_embeddings == max_len


def test_step_mtp_layers_take_their_own_type_from_the_padded_layer_types():
    # with speculative decoding the 3 MTP layers (45, 46, 47) are cached; the padded
    # layer_types says they slide (45 % 4, 46 % 4, 47 % 4 are not 0)
    layout = CacheLayout(from_hf_config("step-3.5-flash", num_speculative_tokens=1))
    found = {getattr(k, "value", k): v for k, v in layout.bytes_per_token_by_kind().items()}
    assert found == {"full": 12 * 2 * 8 * 128 * BF16, "sliding_window": 36 * 2 * 8 * 128 * BF16}


def test_step_mtp_layer_types_in_their_own_list():
    cfg = {
        "model_type": "step3p5",
        "num_hidden_layers": 4,
        "num_attention_groups": 2,
        "head_dim": 64,
        "sliding_window": 16,
        "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
        "mtp_layer_types": ["full_attention"],
        "num_nextn_predict_layers": 1,
    }
    backends = from_hf_config(cfg, num_speculative_tokens=2)
    assert [b.sliding_window for _, b in sorted(backends.items())] == [None, 16, 16, 16, None]
    # no layer_types: every layer, MTP included, is full attention
    plain = {k: v for k, v in cfg.items() if k not in ("layer_types", "mtp_layer_types")}
    backends = from_hf_config(plain, num_speculative_tokens=1)
    assert [b.sliding_window for _, b in sorted(backends.items())] == [None] * 5


def test_gemma3_following_the_pattern_hint_plans_256_wide_heads():
    # the case: a 12B text config plus sliding_window_pattern, no head_dim
    cfg = load_model_config("gemma-3-12b")
    cfg["text_config"] = dict(cfg["text_config"], sliding_window_pattern=6)
    layer = from_hf_config(cfg)[0]
    assert (layer.num_kv_heads, layer.head_dim) == (8, 256)  # not 3840 // 16 = 240


def test_gemma3_text_config_with_only_its_layer_count_takes_every_default():
    backends = from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 6})
    assert [b.sliding_window for _, b in sorted(backends.items())] == [4096] * 5 + [None]
    assert (backends[5].num_kv_heads, backends[5].head_dim) == (4, 256)
    assert backends.max_position_embeddings == GEMMA3_TEXT["max_position_embeddings"]


def test_qwen3_5_without_mamba_ssm_dtype_keeps_the_state_in_the_model_dtype():
    text = dict(load_model_config("qwen3.5-35b-a3b")["text_config"])
    del text["mamba_ssm_dtype"]
    layer = from_hf_config({"model_type": "qwen3_5_moe", "text_config": text})[0]
    assert (layer.conv_dtype, layer.recurrent_dtype) == ("bfloat16", "bfloat16")
    explicit = from_hf_config({"model_type": "qwen3_5_moe", "text_config": text}, dtype="float16")
    assert explicit[0].recurrent_dtype == "float16"


def test_qwen3_5_mtp_layers_are_full_attention():
    backends = from_hf_config("qwen3.5-27b", num_speculative_tokens=2)
    assert sorted(backends)[-1] == 64  # mtp_num_hidden_layers = 1
    assert backends[64] is backends[3]  # the full-attention backend
    assert backends[0].num_speculative_tokens == 2  # the draft tokens widen the conv state


def test_qwen3_5_text_only_types_read_the_top_level():
    text = dict(load_model_config("qwen3.5-27b")["text_config"])
    as_text = {k: repr(v) for k, v in from_hf_config(text).items()}
    assert as_text == {k: repr(v) for k, v in from_hf_config("qwen3.5-27b").items()}
    moe = dict(load_model_config("qwen3.5-35b-a3b")["text_config"])
    assert from_hf_config(moe).model_type == "qwen3_5_moe_text"


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        # a mistral text config that leaves sliding_window out takes MistralConfig's 4096
        ({"model_type": "mistral3", "text_config": {"num_hidden_layers": 2}}, [4096, 4096]),
        # a stated null is no window; a ministral3 text config has none by default
        (
            {
                "model_type": "mistral3",
                "text_config": {"num_hidden_layers": 2, "sliding_window": None},
            },
            [None, None],
        ),
        (
            {
                "model_type": "mistral3",
                "text_config": {"model_type": "ministral3", "num_hidden_layers": 2},
            },
            [None, None],
        ),
        # no text_config at all: Mistral3Config's own 24B text config, 40 full layers
        ({"model_type": "mistral3"}, [None] * 40),
        # a window of 0 is none (vLLM's ModelConfig)
        ({**PHI3_MINI_4K, "sliding_window": 0}, [None] * 32),
        # Qwen2.5-VL slides from max_window_layers on only with use_sliding_window
        (
            {
                "model_type": "qwen2_5_vl",
                "text_config": {
                    "num_hidden_layers": 3,
                    "use_sliding_window": True,
                    "max_window_layers": 1,
                    "sliding_window": 64,
                },
            },
            [None, 64, 64],
        ),
        # Qwen3-VL-MoE drops any window its config states
        (
            {
                "model_type": "qwen3_vl_moe",
                "text_config": {"num_hidden_layers": 2, "sliding_window": 64},
            },
            [None, None],
        ),
    ],
)
def test_windows_follow_the_engines_rules(config, windows):
    backends = from_hf_config(config)
    assert [b.sliding_window for _, b in sorted(backends.items())] == windows


def test_defaults_fill_only_absent_fields():
    assert with_defaults({"a": None, "b": 1}, {"a": 2, "c": 3}) == {"a": None, "b": 1, "c": 3}
    assert engine_window({"sliding_window": 0}) == {"sliding_window": None}
    assert engine_window({"sliding_window": 5}) == {"sliding_window": 5}


STEP = {
    "model_type": "step3p5",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_attention_groups": 2,
    "head_dim": 64,
    "sliding_window": 16,
    "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
}


@pytest.mark.parametrize(
    ("config", "options", "message"),
    [
        (
            {**STEP, "num_key_value_heads": 4},
            {},
            "config fields num_attention_groups = 2 and num_key_value_heads = 4 disagree "
            "(model_type 'step3p5')",
        ),
        (
            {**STEP, "layer_types": ["full_attention"] * 5},
            {},
            "layer_types has 5 entries but num_hidden_layers=4 (or 4 + "
            "num_nextn_predict_layers=0) (model_type 'step3p5')",
        ),
        (
            {**STEP, "num_nextn_predict_layers": 1},
            {"num_speculative_tokens": 1},
            "mtp_layer_types = None does not give one type per MTP layer "
            "(num_nextn_predict_layers=1, model_type 'step3p5')",
        ),
        (
            STEP,
            {"num_speculative_tokens": 1},
            "num_speculative_tokens=1 needs MTP layers, but the config has "
            "num_nextn_predict_layers=0 (model_type 'step3p5')",
        ),
        (
            {**STEP, "sliding_window": None},
            {},
            "config is missing 'sliding_window' (needed for model_type 'step3p5': layer_types "
            "has sliding_attention layers)",
        ),
        (
            {
                "model_type": "mistral3",
                "text_config": {"model_type": "llama", "num_hidden_layers": 2},
            },
            {},
            "config field text_config.model_type = 'llama' is not supported for model_type "
            "'mistral3': use one of ['ministral3', 'mistral']",
        ),
        (
            {
                "model_type": "qwen3_5",
                "text_config": {"num_hidden_layers": 4, "mamba_ssm_dtype": "int8"},
            },
            {},
            "config field text_config.mamba_ssm_dtype = 'int8' is invalid for model_type 'qwen3_5'",
        ),
        (
            {"model_type": "gemma3", "text_config": {"num_hidden_layers": 2, "head_dim": "x"}},
            {},
            "config field text_config.head_dim = 'x' is invalid for model_type 'gemma3'",
        ),
        (
            {
                "model_type": "gemma3",
                "text_config": {"num_hidden_layers": 2, "use_bidirectional_attention": True},
            },
            {},
            "config field text_config.use_bidirectional_attention = True is not supported for "
            "model_type 'gemma3': a bidirectional Gemma-3 (an embedding model) runs "
            "encoder-only attention in vLLM",
        ),
        (
            {"model_type": "mistral3", "text_config": [1]},
            {},
            "config field text_config = [1] is invalid for model_type 'mistral3': it must be a "
            "JSON object",
        ),
        (
            {**PHI3_MINI_4K, "num_key_value_heads": 7},
            {},
            "num_attention_heads=32 is not divisible by num_key_value_heads=7 (model_type 'phi3')",
        ),
        (
            {"model_type": "qwen3_vl", "text_config": {"num_hidden_layers": 0}},
            {},
            "config field text_config.num_hidden_layers = 0 is invalid for model_type 'qwen3_vl'",
        ),
        (
            {"model_type": "olmo2", "num_hidden_layers": 2, "max_position_embeddings": -1},
            {},
            "config field max_position_embeddings = -1 is invalid for model_type 'olmo2'",
        ),
        (
            {"model_type": "minimax_m2", "num_hidden_layers": 2},
            {"tp_size": 5},
            "num_attention_heads=48 is not divisible by tp_size=5 (model_type 'minimax_m2')",
        ),
    ],
)
def test_bad_configs_are_refused_by_name(config, options, message):
    before = repr(config)
    with pytest.raises(ValueError) as info:
        from_hf_config(config, **options)
    assert str(info.value).startswith(message)
    assert repr(config) == before  # the caller's config is not changed


# ------------------------------------------------ against the configuration classes themselves


def _engine_layers(config: dict[str, Any]) -> list[Any]:
    """Per main layer, what vLLM builds from ``config`` loaded by its Hugging Face class:
    ``(kv_heads, head_dim, window)`` of an attention layer, ``"linear"`` for Gated DeltaNet.

    The class fills the defaults; the window follows vLLM: a ``"sliding_attention"`` layer
    gets ``sliding_window``, any other layer the model-level window, which
    ``EngineArgs.create_engine_config`` sets only when ``layer_types`` is absent or all
    sliding (``vllm/engine/arg_utils.py``); 0 is no window (``vllm/config/model.py``).
    """
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    text = transformers.AutoConfig.for_model(config["model_type"], **fields).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    window = getattr(text, "sliding_window", None) or None
    types = getattr(text, "layer_types", None)
    everywhere = types is None or all(t == "sliding_attention" for t in types)
    model_level = window if everywhere and config["model_type"] != "step3p5" else None
    layers: list[Any] = []
    for i in range(text.num_hidden_layers):
        kind = types[i] if types else "full_attention"
        if kind == "linear_attention":
            layers.append("linear")
        else:
            w = window if kind == "sliding_attention" else model_level
            layers.append((text.num_key_value_heads, head_dim, w))
    return layers


def _kvforge_layers(config: dict[str, Any]) -> list[Any]:
    backends = from_hf_config(config)
    return [
        "linear"
        if hasattr(b, "recurrent_dtype")
        else (b.num_kv_heads, b.head_dim, b.sliding_window)
        for _, b in sorted(backends.items())
    ]


ENGINE_CASES = {
    **{
        name: name
        for name in (
            "gemma-3-4b",
            "gemma-3-12b",
            "phi-4",
            "olmo-2-1124-7b",
            "minimax-m2",
            "mistral-small-3.1-24b",
            "qwen2.5-vl-7b",
            "qwen3-vl-8b",
            "qwen3-vl-30b-a3b",
            "qwen3.5-27b",
            "qwen3.5-35b-a3b",
            "step-3.5-flash",
        )
    },
    "gemma-3-27b": GEMMA3_27B,
    "phi-3-mini-4k": PHI3_MINI_4K,
    "phi-4-mini": PHI4_MINI,
    "olmo-2-32b": OLMO2_32B,
    "qwen3-vl-235b-a22b": QWEN3_VL_235B,
    "gemma3_text-bare": {"model_type": "gemma3_text", "num_hidden_layers": 7},
    "mistral3-no-window-field": {"model_type": "mistral3", "text_config": {"num_hidden_layers": 2}},
    "qwen3_5_text": {"model_type": "qwen3_5_text", "num_hidden_layers": 8},
    "qwen3_5_moe_text": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4},
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_layers_equal_what_the_configuration_class_gives_vllm(case):
    config = ENGINE_CASES[case]
    if isinstance(config, str):
        config = load_model_config(config)
    assert _kvforge_layers(config) == _engine_layers(config)
