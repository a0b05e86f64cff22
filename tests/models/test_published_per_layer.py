"""Published configs whose layers differ in cache shape: Llama-Nemotron Super (NAS, layers
without attention), MiMo-V2-Flash (window and full layers with their own kv heads, keys and
values of different widths), Gemma-4 (full layers with ``global_head_dim`` and their own kv
heads), Gemma-3n and Gemma-4 E2B (the last layers read an earlier layer's cache).

The shapes are copied from the published ``config.json`` files (bundled ones by name); every
figure is checked against the arithmetic written beside it. bf16 is 2 bytes.
"""

from __future__ import annotations

import pytest

from kvforge.attn_backends import GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.models import from_hf_config, load_model_config
from kvforge.models.per_layer import kv_sharing
from kvforge.specs import GroupKind

# nvidia/Llama-3_3-Nemotron-Super-49B-v1: 80 blocks; attention no_op on these 31 layers
SUPER_NO_OP = [6, 7, 11, *range(42, 52), *range(53, 71)]
# XiaomiMiMo/MiMo-V2-Flash: hybrid_layer_pattern 0 (full) on layer 0 and every sixth layer
MIMO_FULL = [0, 5, 11, 17, 23, 29, 35, 41, 47]
# google/gemma-4-E2B-it text_config: 35 layers, [4 sliding + 1 full] x 7, 20 kv-shared layers
E2B = {
    "model_type": "gemma4",
    "text_config": {
        "model_type": "gemma4_text",
        "num_hidden_layers": 35,
        "hidden_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_kv_shared_layers": 20,
        "sliding_window": 512,
        "max_position_embeddings": 131072,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    },
    "torch_dtype": "bfloat16",
}


def _per_token(layout: CacheLayout, group: str) -> int:
    """Bytes one token occupies in ``group`` over all its layers."""
    g = next(g for g in layout.groups if g.name == group)
    return sum(b.role.block_bytes(g) for b in layout.buffers_of(group)) // g.block_size


def _shapes(backends) -> set[tuple[int, int, int, int | None]]:
    return {(b.num_kv_heads, b.head_dim, b.head_dim_v, b.sliding_window) for b in backends.values()}


def test_llama_nemotron_super_49b():
    cfg = load_model_config("llama-3.3-nemotron-super-49b")
    assert [i for i, b in enumerate(cfg["block_configs"]) if b["attention"]["no_op"]] == SUPER_NO_OP
    backends = from_hf_config(cfg)
    # 80 layers - 31 without attention = 49 cache layers, ids as in the model
    assert list(backends) == [i for i in range(80) if i not in SUPER_NO_OP] and len(backends) == 49
    # kv heads = num_attention_heads // n_heads_in_group = 64 // 8; head_dim = 8192 // 64
    assert _shapes(backends) == {(8, 128, 128, None)}
    layout = CacheLayout(backends)
    assert [(g.name, g.kind) for g in layout.groups] == [("kv", GroupKind.FULL)]
    # 49 layers * (K + V) * 8 heads * 128 * 2 B
    assert _per_token(layout, "kv") == 49 * 2 * 8 * 128 * 2 == 200_704
    assert backends.max_position_embeddings == 131_072


def test_nemotron_nas_kv_heads_per_layer():
    cfg = load_model_config("llama-3.3-nemotron-super-49b")
    blocks = [dict(b) for b in cfg["block_configs"]]
    blocks[0] = {"attention": {"n_heads_in_group": 16, "no_op": False}}  # 64 // 16 = 4 heads
    backends = from_hf_config({**cfg, "block_configs": blocks})
    assert (backends[0].num_kv_heads, backends[1].num_kv_heads) == (4, 8)
    # layer 0: (K + V) * 4 * 128 * 2 B, the other 48: (K + V) * 8 * 128 * 2 B
    assert _per_token(CacheLayout(backends), "kv") == 2 * 4 * 128 * 2 + 48 * 2 * 8 * 128 * 2
    # tp 8: 8 // 8 = 1 head per rank; 4 heads under tp 8 are replicated: max(1, 4 // 8) = 1
    tp8 = from_hf_config({**cfg, "block_configs": blocks}, tp_size=8)
    assert (tp8[0].num_kv_heads, tp8[1].num_kv_heads) == (1, 1)


def test_mimo_v2_flash():
    cfg = load_model_config("mimo-v2-flash")
    assert [i for i, k in enumerate(cfg["hybrid_layer_pattern"]) if k == 0] == MIMO_FULL
    backends = from_hf_config(cfg)
    assert list(backends) == list(range(48))
    full, swa = backends[0], backends[1]
    assert (full.num_kv_heads, full.head_dim, full.head_dim_v, full.sliding_window) == (
        4,
        192,
        128,
        None,
    )
    assert (swa.num_kv_heads, swa.head_dim, swa.head_dim_v, swa.sliding_window) == (
        8,
        192,
        128,
        128,
    )
    layout = CacheLayout(backends)
    kinds = {g.name: (g.kind, g.window) for g in layout.groups}
    assert kinds == {"kv": (GroupKind.FULL, None), "swa": (GroupKind.SLIDING_WINDOW, 128)}
    # full: 9 layers * 4 heads * (192 + 128) * 2 B; window: 39 layers * 8 * (192 + 128) * 2 B
    assert _per_token(layout, "kv") == 9 * 4 * (192 + 128) * 2 == 23_040
    assert _per_token(layout, "swa") == 39 * 8 * (192 + 128) * 2 == 199_680
    # one MTP layer with speculative decoding (vLLM's _MIMO_V2_FLASH_NUM_MTP_LAYERS = 1),
    # shaped like a window layer
    spec = from_hf_config(cfg, num_speculative_tokens=2)
    assert list(spec) == list(range(49)) and spec[48] is spec[1]


def test_gemma_4_31b():
    backends = from_hf_config("gemma-4-31b")
    assert list(backends) == list(range(60))
    full, swa = backends[5], backends[0]
    # attention_k_eq_v: full layers take num_global_key_value_heads 4 and global_head_dim 512
    assert (full.num_kv_heads, full.head_dim, full.head_dim_v, full.sliding_window) == (
        4,
        512,
        512,
        None,
    )
    assert (swa.num_kv_heads, swa.head_dim, swa.sliding_window) == (16, 256, 1024)
    layout = CacheLayout(backends)
    # full: 10 layers * (K + V: vLLM stores both though K == V) * 4 * 512 * 2 B
    assert _per_token(layout, "kv") == 10 * 2 * 4 * 512 * 2 == 81_920
    # window: 50 layers * (K + V) * 16 * 256 * 2 B
    assert _per_token(layout, "swa") == 50 * 2 * 16 * 256 * 2 == 819_200
    assert backends.max_position_embeddings == 262_144


def test_gemma_4_without_k_eq_v_keeps_the_kv_heads():
    cfg = load_model_config("gemma-4-31b")
    text = {**cfg["text_config"], "attention_k_eq_v": False}
    full = from_hf_config({**cfg, "text_config": text})[5]
    assert (full.num_kv_heads, full.head_dim) == (16, 512)  # num_key_value_heads, global_head_dim


def test_gemma_4_per_layer_config_wins():
    cfg = load_model_config("gemma-4-31b")
    text = {
        **cfg["text_config"],
        "per_layer_config": {"05": {"head_dim": 128, "num_key_value_heads": 8}},
    }
    backends = from_hf_config({**cfg, "text_config": text})
    assert (backends[5].num_kv_heads, backends[5].head_dim) == (8, 128)
    assert (backends[11].num_kv_heads, backends[11].head_dim) == (16, 256)  # no override


def test_gemma_4_e2b_shares_kv():
    backends = from_hf_config(E2B)
    # 35 - 20 shared layers own caches: 0..14
    assert list(backends) == list(range(15))
    sharing = kv_sharing(E2B)
    # a shared layer reads the last non-shared layer of its type: full 14, sliding 13
    assert sharing == {i: (14 if (i + 1) % 5 == 0 else 13) for i in range(15, 35)}
    layout = CacheLayout(backends)
    # full: layers 4, 9, 14 * (K + V) * 1 head * 512 * 2 B; sliding: 12 * 2 * 1 * 256 * 2 B
    assert _per_token(layout, "kv") == 3 * 2 * 1 * 512 * 2 == 6_144
    assert _per_token(layout, "swa") == 12 * 2 * 1 * 256 * 2 == 12_288


def test_gemma_3n_e4b():
    cfg = load_model_config("gemma-3n-e4b")
    backends = from_hf_config(cfg)
    # 35 - 15 shared layers own caches
    assert list(backends) == list(range(20))
    assert _shapes(backends) == {(2, 256, 256, None), (2, 256, 256, 512)}
    # vLLM's Gemma3nAttention: shared full layers read 20 - 1, shared sliding ones 20 - 2
    assert kv_sharing(cfg) == {i: (19 if (i + 1) % 5 == 0 else 18) for i in range(20, 35)}
    layout = CacheLayout(backends)
    # full: 4 layers * (K + V) * 2 * 256 * 2 B; sliding: 16 layers * 2 * 2 * 256 * 2 B
    assert _per_token(layout, "kv") == 4 * 2 * 2 * 256 * 2 == 8_192
    assert _per_token(layout, "swa") == 16 * 2 * 2 * 256 * 2 == 32_768
    assert backends.max_position_embeddings == 32_768


def test_gemma_3n_defaults_are_e4b():
    # transformers' Gemma3nTextConfig defaults: 35 layers, 15 shared, every fifth full
    assert from_hf_config({"model_type": "gemma3n_text"}).keys() == set(range(20))


def test_kv_sharing_of_other_models_is_empty():
    assert kv_sharing(load_model_config("llama-3-8b")) == {}
    assert kv_sharing(load_model_config("gemma-4-31b")) == {}  # num_kv_shared_layers 0


NAS = load_model_config("llama-3.3-nemotron-super-49b")
MIMO = load_model_config("mimo-v2-flash")
G4 = load_model_config("gemma-4-31b")


def _blocks(i: int, attention: object) -> dict:
    blocks = list(NAS["block_configs"])
    blocks[i] = {"attention": attention}
    return {**NAS, "block_configs": blocks}


def _text(**fields) -> dict:
    return {**G4, "text_config": {**G4["text_config"], **fields}}


@pytest.mark.parametrize(
    ("config", "kwargs", "message"),
    [
        (
            {**NAS, "block_configs": NAS["block_configs"][:3]},
            {},
            "block_configs has 3 entries but num_hidden_layers=80",
        ),
        (
            _blocks(0, {"no_op": False}),
            {},
            "config is missing 'block_configs[0].attention.n_heads_in_group'",
        ),
        (
            _blocks(2, {"no_op": False, "n_heads_in_group": 3}),
            {},
            "block_configs[2].attention.n_heads_in_group=3 does not divide num_attention_heads=64",
        ),
        (
            _blocks(0, {"no_op": False, "n_heads_in_group": 8, "replace_with_linear": True}),
            {},
            "block_configs[0].attention.replace_with_linear=true is not supported",
        ),
        (
            _blocks(0, {"no_op": "yes"}),
            {},
            "config field block_configs[0].attention.no_op = 'yes' is invalid",
        ),
        (
            {**NAS, "block_configs": [{"attention": {"no_op": True}}] * 80},
            {},
            "block_configs has no block with attention",
        ),
        (
            NAS,
            {"num_speculative_tokens": 1},
            "needs MTP layers, but the config has num_nextn_predict_layers=0",
        ),
        (
            NAS,
            {"tp_size": 3},
            "tp_size=3 does not fit num_attention_heads=64 and num_key_value_heads=8",
        ),
        (
            {**MIMO, "hybrid_layer_pattern": [0, 1]},
            {},
            "hybrid_layer_pattern has 2 entries but num_hidden_layers=48",
        ),
        (
            {**MIMO, "hybrid_layer_pattern": [2] * 48},
            {},
            "config field hybrid_layer_pattern[0] = 2 is invalid for model_type 'mimo_v2_flash'",
        ),
        (
            {k: v for k, v in MIMO.items() if k != "sliding_window_size"},
            {},
            "config is missing 'sliding_window_size' (needed for model_type 'mimo_v2_flash')",
        ),
        (
            {**MIMO, "swa_num_key_value_heads": 7},
            {},
            "swa layers: num_attention_heads=64 is not divisible by num_key_value_heads=7",
        ),
        (
            _text(layer_types=["full_attention"] * 3),
            {},
            "layer_types has 3 entries but num_hidden_layers=60",
        ),
        (
            _text(layer_types=["local"] * 60),
            {},
            "layer_types[0]='local' is not one of ['full_attention', 'sliding_attention']",
        ),
        (
            _text(num_kv_shared_layers=60),
            {},
            "config field text_config.num_kv_shared_layers = 60 is invalid for model_type 'gemma4': it must be below num_hidden_layers=60",
        ),
        (
            _text(per_layer_config={"x": {}}),
            {},
            "per_layer_config key 'x' is not a layer index below num_hidden_layers=60",
        ),
        (
            _text(per_layer_config={"5": {"head_dim": 0}}),
            {},
            "head_dim = 0 is invalid for model_type 'gemma4'",
        ),
        (
            _text(
                num_kv_shared_layers=6,
                layer_types=["sliding_attention"] * 54 + ["full_attention"] * 6,
            ),
            {},
            "layer 54 (full_attention) is one of the num_kv_shared_layers=6 last layers, but no earlier layer is full_attention",
        ),
    ],
)
def test_bad_configs(config, kwargs, message):
    with pytest.raises(ValueError) as info:
        from_hf_config(config, **kwargs)
    assert message in str(info.value)


def test_cache_dtype_options_apply_to_every_layer():
    backends = from_hf_config("mimo-v2-flash", kv_cache_dtype="fp8", block_size=32)
    assert {(b.kv_cache_quant, b.block_size) for b in backends.values()} == {("fp8", 32)}
    assert all(isinstance(b, GQABackend) for b in backends.values())
    f32 = from_hf_config("gemma-3n-e4b", kv_cache_dtype="float32")
    assert {b.dtype for b in f32.values()} == {"float32"}
    with pytest.raises(
        ValueError, match="kv_cache_dtype='int4' is not supported for model_type 'nemotron-nas'"
    ):
        from_hf_config("llama-3.3-nemotron-super-49b", kv_cache_dtype="int4")
