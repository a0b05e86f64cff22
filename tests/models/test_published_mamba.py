"""The Mamba2 hybrids from their published configs: every figure against hand arithmetic.

Shapes copied from the published ``config.json`` files (the bundled configs keep the same
numbers): Falcon-H1-7B-Instruct (``tiiuae``), NVIDIA-Nemotron-Nano-9B-v2 (``nvidia``),
Granite-4.0-H-Small (``ibm-granite``). A Mamba2 mixer's state per request (vLLM's
``mamba2_state_shape``): conv ``(d_conv - 1) * (width + 2 * n_groups * d_state) * itemsize``,
SSM ``heads * head_dim * d_state * itemsize``. An attention layer: ``2 (key, value) *
kv_heads * head_dim * itemsize`` per token.
"""

from __future__ import annotations

import pytest

from kvforge.attn_backends import GQABackend, Mamba2Backend
from kvforge.core.layout import CacheLayout
from kvforge.models import from_hf_config, load_model_config

FALCON_H1_7B = {
    "architectures": ["FalconH1ForCausalLM"],
    "model_type": "falcon_h1",
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 44,
    "hidden_size": 3072,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_d_ssm": 3072,
    "mamba_n_heads": 24,
    "mamba_d_head": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 262144,
}
NEMOTRON_NANO_9B_V2 = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 56,
    "hidden_size": 4480,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "mamba_num_heads": 128,
    "mamba_head_dim": 80,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "max_position_embeddings": 131072,
}
GRANITE_4_H_SMALL = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 40,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 131072,
}
NEMOTRON_ATTENTION = (14, 21, 30, 39)  # the "*" of the pattern
NEMOTRON_MIXERS = [
    i for i, c in enumerate(NEMOTRON_NANO_9B_V2["hybrid_override_pattern"]) if c == "M"
]

# (name, bundled, config, attention layers, mixer layers, bytes/token/attention layer,
#  conv shape, conv dtype, ssm shape, ssm dtype, bytes per mixer and request)
TABLE = [
    (
        "falcon-h1-7b", FALCON_H1_7B, list(range(44)), list(range(44, 88)),
        2 * 2 * 128 * 2,  # 1,024
        (3, 3072 + 2 * 1 * 256), "bfloat16",  # conv [3, 3584]
        (24, 128, 256), "bfloat16",
        3 * 3584 * 2 + 24 * 128 * 256 * 2,  # 21,504 + 1,572,864 = 1,594,368
    ),
    (
        "nemotron-nano-9b-v2", NEMOTRON_NANO_9B_V2, list(NEMOTRON_ATTENTION), NEMOTRON_MIXERS,
        2 * 8 * 128 * 2,  # 4,096
        (3, 128 * 80 + 2 * 8 * 128), "bfloat16",  # conv [3, 12288]
        (128, 80, 128), "float32",  # vLLM's NemotronH default for the SSM state
        3 * 12288 * 2 + 128 * 80 * 128 * 4,  # 73,728 + 5,242,880 = 5,316,608
    ),
    (
        "granite-4.0-h-small", GRANITE_4_H_SMALL, [5, 15, 25, 35],
        [i for i in range(40) if i not in (5, 15, 25, 35)],
        2 * 8 * (4096 // 32) * 2,  # head_dim is hidden // heads = 128: 4,096
        (3, 2 * 4096 + 2 * 1 * 128), "bfloat16",  # conv [3, 8448]
        (128, 64, 128), "bfloat16",
        3 * 8448 * 2 + 128 * 64 * 128 * 2,  # 50,688 + 2,097,152 = 2,147,840
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "config", "attention", "mixers", "per_token", "conv", "conv_dtype", "ssm",
     "ssm_dtype", "state"),
    TABLE,
)  # fmt: skip
def test_published_config_against_hand_arithmetic(
    name, config, attention, mixers, per_token, conv, conv_dtype, ssm, ssm_dtype, state
):
    for source in (config, name):  # the published shapes and the bundled config agree
        backends = from_hf_config(source)
        assert sorted(backends) == sorted(attention + mixers)
        assert all(type(backends[i]) is GQABackend for i in attention)
        assert all(type(backends[i]) is Mamba2Backend for i in mixers)
        gqa, mixer = backends[attention[0]], backends[mixers[0]]
        assert sum(r.bytes_per_token for r in gqa.cache_roles()) == per_token
        assert [(g.name, g.kind.value) for g in gqa.cache_groups()] == [("kv", "full")]
        assert [(g.name, g.kind.value) for g in mixer.cache_groups()] == [
            ("mamba_state", "per_request")
        ]
        assert (mixer.role("conv_state").entry_shape, mixer.role("conv_state").dtype) == (
            conv,
            conv_dtype,
        )
        assert (mixer.role("ssm_state").entry_shape, mixer.role("ssm_state").dtype) == (
            ssm,
            ssm_dtype,
        )
        assert mixer.state_bytes_per_request() == state
        layout = CacheLayout(backends)
        assert layout.bytes_per_request() == len(mixers) * state
        assert backends.max_position_embeddings == config["max_position_embeddings"]


def test_bundled_configs_keep_the_published_numbers():
    for name, config, *_ in TABLE:
        bundled = load_model_config(name)
        assert {k: bundled[k] for k in config} == config, name


def test_per_request_totals():
    # Falcon-H1-7B: 44 mixers * 1,594,368 = 70,152,192 B per request, whatever its length
    assert CacheLayout(from_hf_config("falcon-h1-7b")).bytes_per_request() == 70_152_192
    # Nemotron-Nano-9B-v2: 27 mixers * 5,316,608 = 143,548,416 B
    assert CacheLayout(from_hf_config("nemotron-nano-9b-v2")).bytes_per_request() == 143_548_416
    # Granite-4.0-H-Small: 36 mixers * 2,147,840 = 77,322,240 B
    assert CacheLayout(from_hf_config("granite-4.0-h-small")).bytes_per_request() == 77_322_240


# (model, options, conv shape, conv dtype, ssm shape, ssm dtype, kv heads per rank)
OPTIONS = [
    # tp 2: Falcon's one group is replicated (2 groups): (3072 + 2 * 2 * 256) / 2 = 2048
    ("falcon-h1-7b", dict(tp_size=2), (3, 2048), "bfloat16", (12, 128, 256), "bfloat16", 1),
    # tp 4 divides Nemotron's 8 groups: 12288 / 4 = 3072 channels, 32 heads, 2 kv heads
    ("nemotron-nano-9b-v2", dict(tp_size=4), (3, 3072), "bfloat16", (32, 80, 128), "float32", 2),
    # vLLM's --mamba-ssm-cache-dtype float32 for Falcon / Granite (auto is the conv dtype)
    ("falcon-h1-7b", dict(mamba_ssm_cache_dtype="float32"), (3, 3584), "bfloat16",
     (24, 128, 256), "float32", 2),
    # "auto" for Nemotron-H stays its float32 default; a conv dtype applies to the conv only
    ("nemotron-nano-9b-v2", dict(mamba_ssm_cache_dtype="auto", mamba_cache_dtype="float32"),
     (3, 12288), "float32", (128, 80, 128), "float32", 8),
    ("nemotron-nano-9b-v2", dict(mamba_ssm_cache_dtype="bfloat16"), (3, 12288), "bfloat16",
     (128, 80, 128), "bfloat16", 8),
    # dtype float16: the conv state and "auto" SSM state follow the model dtype
    ("granite-4.0-h-small", dict(dtype="float16"), (3, 8448), "float16", (128, 64, 128),
     "float16", 8),
]  # fmt: skip


@pytest.mark.parametrize(("name", "options", "conv", "cdt", "ssm", "sdt", "kv"), OPTIONS)
def test_options(name, options, conv, cdt, ssm, sdt, kv):
    backends = from_hf_config(name, **options)
    mixer = next(b for b in backends.values() if isinstance(b, Mamba2Backend))
    gqa = next(b for b in backends.values() if isinstance(b, GQABackend))
    assert (mixer.role("conv_state").entry_shape, mixer.role("conv_state").dtype) == (conv, cdt)
    assert (mixer.role("ssm_state").entry_shape, mixer.role("ssm_state").dtype) == (ssm, sdt)
    assert gqa.num_kv_heads == kv


def test_kv_cache_dtype_applies_to_attention_only():
    backends = from_hf_config("granite-4.0-h-small", kv_cache_dtype="fp8")
    assert backends[5].role("key").dtype == "float8_e4m3fn"
    assert backends[0].role("conv_state").dtype == "bfloat16"
    assert backends[0].role("ssm_state").dtype == "bfloat16"


def test_the_config_mamba_ssm_cache_dtype_is_nemotrons_auto():
    backends = from_hf_config(NEMOTRON_NANO_9B_V2 | {"mamba_ssm_cache_dtype": "bfloat16"})
    assert backends[0].role("ssm_state").dtype == "bfloat16"


def test_layers_block_type_lists_are_read_like_the_pattern():
    pattern = NEMOTRON_NANO_9B_V2["hybrid_override_pattern"]
    names = {"M": "mamba", "*": "attention", "-": "mlp"}
    listed = {k: v for k, v in NEMOTRON_NANO_9B_V2.items() if k != "hybrid_override_pattern"}
    listed["layers_block_type"] = [names[c] for c in pattern]
    a, b = from_hf_config(listed), from_hf_config(NEMOTRON_NANO_9B_V2)
    assert {i: repr(x) for i, x in a.items()} == {i: repr(x) for i, x in b.items()}
    # transformers 5's names for the same layers
    new = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp"}
    listed["layers_block_type"] = [new[n] for n in listed["layers_block_type"]]
    assert sorted(from_hf_config(listed)) == sorted(b)


def test_class_defaults_fill_fields_a_config_leaves_out():
    # Granite's mamba_d_head "auto" is mamba_expand * hidden // mamba_n_heads = 8192 // 128
    granite = {k: v for k, v in GRANITE_4_H_SMALL.items() if k != "mamba_d_head"}
    assert from_hf_config(granite)[0].role("ssm_state").entry_shape == (128, 64, 128)
    # all-Mamba Granite without layer_types (GraniteMoeHybridConfig's default)
    plain = {k: v for k, v in GRANITE_4_H_SMALL.items() if k != "layer_types"}
    assert {type(b) for b in from_hf_config(plain).values()} == {Mamba2Backend}
    # Nemotron-H without head_dim: NemotronHConfig's 128 (not 4480 // 40 = 112)
    nemo = {k: v for k, v in NEMOTRON_NANO_9B_V2.items() if k != "head_dim"}
    assert from_hf_config(nemo)[14].role("key").entry_shape == (8, 128)
    # Falcon-H1 without head_dim: hidden // heads = 3072 // 12 = 256 (vLLM's falcon_h1.py)
    falcon = {k: v for k, v in FALCON_H1_7B.items() if k != "head_dim"}
    assert from_hf_config(falcon)[0].role("key").entry_shape == (2, 256)
    # Falcon-H1 with mamba_d_ssm null: mamba_expand * hidden_size = 6144 channels of x
    wide = FALCON_H1_7B | {"mamba_d_ssm": None, "mamba_d_head": "auto"}
    mixer = from_hf_config(wide)[44]
    assert mixer.role("conv_state").entry_shape == (3, 6144 + 2 * 256)
    assert mixer.role("ssm_state").entry_shape == (24, 6144 // 24, 256)


BAD = [
    (FALCON_H1_7B | {"mamba_d_conv": 1}, "config field mamba_d_conv = 1 is invalid"),
    (FALCON_H1_7B | {"mamba_n_heads": 0}, "config field mamba_n_heads = 0 is invalid"),
    (FALCON_H1_7B | {"mamba_d_head": "auto", "mamba_n_heads": 7},
     "mamba_d_head = 'auto' cannot be derived for model_type 'falcon_h1'"),
    ({k: v for k, v in FALCON_H1_7B.items() if k != "num_attention_heads"},
     "config is missing 'num_attention_heads' (needed for model_type 'falcon_h1')"),
    (NEMOTRON_NANO_9B_V2 | {"hybrid_override_pattern": "MX*"},
     "config field hybrid_override_pattern[1] = 'X' is invalid for model_type 'nemotron_h'"),
    (NEMOTRON_NANO_9B_V2 | {"hybrid_override_pattern": "--E"},
     "has no 'M' or '*' layer for model_type 'nemotron_h'"),
    ({k: v for k, v in NEMOTRON_NANO_9B_V2.items() if k != "hybrid_override_pattern"},
     "config is missing 'hybrid_override_pattern' (needed for model_type 'nemotron_h'"),
    (NEMOTRON_NANO_9B_V2 | {"mamba_ssm_cache_dtype": "int4"},
     "config field mamba_ssm_cache_dtype = 'int4' is invalid for model_type 'nemotron_h'"),
    (GRANITE_4_H_SMALL | {"layer_types": ["mamba"] * 39},
     "it needs one 'mamba' or 'attention' entry per layer (num_hidden_layers=40)"),
    (GRANITE_4_H_SMALL | {"layer_types": ["mamba"] * 39 + ["moe"]},
     "it needs one 'mamba' or 'attention' entry per layer"),
    (GRANITE_4_H_SMALL | {"layer_types": ["mamba"] * 39 + ["cross"]},
     "config field layer_types[39] = 'cross' is invalid for model_type 'granitemoehybrid'"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "message"), BAD)
def test_bad_configs_name_the_field_and_value(config, message):
    with pytest.raises(ValueError) as info:
        from_hf_config(config)
    assert message in str(info.value)


BAD_OPTIONS = [
    ("falcon-h1-7b", dict(tp_size=5), "tp_size=5"),
    ("nemotron-nano-9b-v2", dict(tp_size=3), "tp_size=3"),
    ("falcon-h1-7b", dict(mamba_ssm_cache_dtype="fp8"), "mamba_ssm_cache_dtype='fp8' is invalid"),
    ("granite-4.0-h-small", dict(mamba_cache_dtype="int8"), "mamba_cache_dtype='int8' is invalid"),
    ("llama-3-8b", dict(mamba_ssm_cache_dtype="float32"),
     "mamba_ssm_cache_dtype='float32' does not apply to model_type 'llama': the model has no "
     "Mamba2 or linear-attention layer"),
    ("gpt-oss-20b", dict(mamba_cache_dtype="float32"),
     "mamba_cache_dtype='float32' does not apply to model_type 'gpt_oss'"),
    ("qwen3-next-80b-a3b", dict(mamba_ssm_cache_dtype="fp8"),
     "mamba_ssm_cache_dtype='fp8' is invalid"),
    ("nemotron-nano-9b-v2", dict(num_speculative_tokens=1),
     "num_speculative_tokens=1 does not apply to model_type 'nemotron_h'"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "options", "message"), BAD_OPTIONS)
def test_bad_options_name_the_option_and_value(name, options, message):
    with pytest.raises(ValueError) as info:
        from_hf_config(name, **options)
    assert message in str(info.value)


# ------------------------------------------------------------------ kvforge plan


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    from kvforge.cli.main import main

    rc = main(["plan", *args, "--device-memory", "80GiB", "--max-num-seqs", "8"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize(
    ("model", "args", "ssm_line"),
    [
        # the plan's role table shows the state dtype it used: Nemotron-H's float32 default
        ("nemotron-nano-9b-v2", (), ("(128, 80, 128)", "float32", "5,242,880")),
        # --mamba-ssm-cache-dtype matches an engine started with it: 128 * 80 * 128 * 2 B
        ("nemotron-nano-9b-v2", ("--mamba-ssm-cache-dtype", "bfloat16"),
         ("(128, 80, 128)", "bfloat16", "2,621,440")),
        # Falcon-H1: 24 * 128 * 256 * 4 B with float32
        ("falcon-h1-7b", ("--mamba-ssm-cache-dtype", "float32"),
         ("(24, 128, 256)", "float32", "3,145,728")),
        # a float32 conv state takes the "auto" SSM state along (vLLM's _mamba_state_dtype)
        ("granite-4.0-h-small", ("--mamba-cache-dtype", "float32"),
         ("(128, 64, 128)", "float32", "4,194,304")),
    ],
)  # fmt: skip
def test_kvforge_plan_shows_and_takes_the_state_dtypes(capsys, model, args, ssm_line):
    rc, out, _ = _plan(capsys, "--model", model, *args)
    assert rc == 0
    [line] = [row for row in out.splitlines() if "ssm_state " in row and "mamba_state" in row]
    assert all(cell in line for cell in ssm_line), line


@pytest.mark.parametrize(
    ("model", "args", "recurrent_line"),
    [
        # Qwen3-Next: vLLM's "auto", the model dtype: 32 * 128 * 128 * 2 B
        ("qwen3-next-80b-a3b", (), ("(32, 128, 128)", "bfloat16", "1,048,576")),
        # SGLang's float32 (and vLLM's CPU build on AVX512-BF16): 32 * 128 * 128 * 4 B
        ("qwen3-next-80b-a3b", ("--mamba-ssm-cache-dtype", "float32"),
         ("(32, 128, 128)", "float32", "2,097,152")),
        # Qwen3.5-27B: its config's mamba_ssm_dtype float32, 48 * 128 * 128 * 4 B ...
        ("qwen3.5-27b", (), ("(48, 128, 128)", "float32", "3,145,728")),
        # ... unless the option says otherwise, as in vLLM: 48 * 128 * 128 * 2 B
        ("qwen3.5-27b", ("--mamba-ssm-cache-dtype", "bfloat16"),
         ("(48, 128, 128)", "bfloat16", "1,572,864")),
    ],
)  # fmt: skip
def test_kvforge_plan_shows_and_takes_the_linear_state_dtypes(capsys, model, args, recurrent_line):
    rc, out, _ = _plan(capsys, "--model", model, *args)
    assert rc == 0
    [line] = [row for row in out.splitlines() if "recurrent_state " in row]
    assert all(cell in line for cell in recurrent_line), line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "llama-3-8b", "--mamba-cache-dtype", "float32"),
         "mamba_cache_dtype='float32' does not apply to model_type 'llama'"),
        (("--backend", "gqa", "--mamba-ssm-cache-dtype", "float32"),
         "--mamba-ssm-cache-dtype does not apply to --backend gqa"),
    ],
)  # fmt: skip
def test_kvforge_plan_refuses_state_dtypes_that_do_not_apply(capsys, args, message):
    rc, _, err = _plan(capsys, *args)
    assert rc == 2 and message in err
