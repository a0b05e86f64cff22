"""Hybrid families: Gemma-2, Gemma-3, gpt-oss, Llama-4 (chunked), GLM-4.5, Qwen3-Next (linear).

Every figure is checked against arithmetic written next to it: per-layer bytes per token are
``2 (key, value) * kv_heads * head_dim * itemsize``; a linear-attention layer holds a fixed
``conv_state + recurrent_state`` per request.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from kvforge.attn_backends.gqa import GQABackend
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.cli.main import main
from kvforge.controller import CacheController
from kvforge.core.layout import CacheLayout
from kvforge.models.hf_config import from_hf_config, load_model_config
from kvforge.specs import GroupKind, SwapPurpose, TokenRange
from kvforge.verify import verify_request, write_request

NEW_MODELS = [
    "gemma-2-9b",
    "gemma-3-12b",
    "gpt-oss-20b",
    "glm-4.5-air",
    "llama-4-scout-17b-16e",
    "qwen3-next-80b-a3b",
]


def kinds_of(name: str, **options) -> dict[int, tuple[str, int | None]]:
    """layer -> (group kind, window) of a bundled model."""
    out: dict[int, tuple[str, int | None]] = {}
    for layer, backend in from_hf_config(name, **options).items():
        (group,) = backend.cache_groups()
        out[layer] = (group.kind.value, group.window)
    return out


# ------------------------------------------------------------------ layer -> kind, exactly

# (model, layer count, {layer: (kind, window)} for the layers the rule is about, full-layer ids)
SLIDING_FULL = "sliding_window"


def test_gemma2_alternates_sliding_4096_and_full():
    kinds = kinds_of("gemma-2-9b")
    assert len(kinds) == 42
    # Hugging Face: layer i slides when (i + 1) % 2 != 0, i.e. even layers
    assert kinds[0] == kinds[2] == kinds[4] == kinds[40] == ("sliding_window", 4096)
    assert kinds[1] == kinds[3] == kinds[41] == ("full", None)
    assert {i for i, k in kinds.items() if k[0] == "full"} == set(range(1, 42, 2))


def test_gemma3_five_local_one_global():
    kinds = kinds_of("gemma-3-12b")
    assert len(kinds) == 48
    # (i + 1) % 6 == 0 is global: 5, 11, ..., 47 (8 layers); the other 40 slide over 1024
    assert {i for i, k in kinds.items() if k == ("full", None)} == set(range(5, 48, 6))
    assert {i for i, k in kinds.items() if k == ("sliding_window", 1024)} == (
        set(range(48)) - set(range(5, 48, 6))
    )


def test_gpt_oss_alternates_128_window_and_full():
    kinds = kinds_of("gpt-oss-20b")
    assert len(kinds) == 24
    assert kinds[0] == kinds[22] == ("sliding_window", 128)
    assert kinds[1] == kinds[23] == ("full", None)
    assert sum(k[0] == "full" for k in kinds.values()) == 12


def test_llama4_chunks_three_of_four_layers():
    kinds = kinds_of("llama-4-scout-17b-16e")
    assert len(kinds) == 48
    # no_rope_layers is [] in the published config: HF's default int((i + 1) % 4 != 0) makes
    # 3, 7, ..., 47 the NoPE (global) layers; the RoPE layers attend within 8192-token chunks
    assert {i for i, k in kinds.items() if k == ("full", None)} == set(range(3, 48, 4))
    assert kinds[0] == kinds[1] == kinds[2] == kinds[46] == ("chunked", 8192)


def test_glm45_air_full_gqa_and_its_mtp_layer():
    kinds = kinds_of("glm-4.5-air")
    assert len(kinds) == 46 and set(kinds.values()) == {("full", None)}
    with_mtp = from_hf_config("glm-4.5-air", num_speculative_tokens=1)
    assert sorted(with_mtp) == list(range(47))  # 46 main + layer 46 (num_nextn_predict_layers 1)
    assert with_mtp[46] is with_mtp[0]


def test_qwen3_next_every_fourth_layer_is_full():
    backends = from_hf_config("qwen3-next-80b-a3b")
    assert len(backends) == 48
    full = {i for i, b in backends.items() if isinstance(b, GQABackend)}
    assert full == set(range(3, 48, 4))  # (i + 1) % 4 == 0
    linear = {i for i, b in backends.items() if isinstance(b, LinearAttentionBackend)}
    assert linear == set(range(48)) - full and len(linear) == 36
    (group,) = backends[0].cache_groups()
    assert (group.name, group.kind, group.block_size, group.slots_per_request) == (
        "linear_state",
        GroupKind.PER_REQUEST,
        1,
        1,
    )


# ------------------------------------------------------------------ bytes, exactly

# (model, {group: (layers, bytes per token per layer)}, max_position_embeddings)
BYTES = [
    # published as float32, served in bfloat16 (dtype="auto", as vLLM's _resolve_auto_dtype):
    # 2 * 8 heads * 256 * 2 B = 8,192 B; 21 sliding + 21 full layers
    ("gemma-2-9b", {"swa": (21, 8_192), "kv": (21, 8_192)}, 8192),
    # bf16: 2 * 8 * 256 * 2 = 8,192 B; 40 local + 8 global
    ("gemma-3-12b", {"swa": (40, 8_192), "kv": (8, 8_192)}, 131_072),
    # 2 * 8 * 64 * 2 = 2,048 B; 12 + 12
    ("gpt-oss-20b", {"swa": (12, 2_048), "kv": (12, 2_048)}, 131_072),
    # 2 * 8 * 128 * 2 = 4,096 B; 36 chunked + 12 global
    ("llama-4-scout-17b-16e", {"chunked": (36, 4_096), "kv": (12, 4_096)}, 262_144),
    # 2 * 8 * 128 * 2 = 4,096 B; 46 layers
    ("glm-4.5-air", {"kv": (46, 4_096)}, 131_072),
    # full layers: 2 * 2 * 256 * 2 = 2,048 B; 12 of them
    ("qwen3-next-80b-a3b", {"kv": (12, 2_048)}, 262_144),
]


@pytest.mark.parametrize(("name", "groups", "max_len"), BYTES)
def test_bytes_per_token_per_layer_and_group(name, groups, max_len):
    backends = from_hf_config(name)
    assert backends.max_position_embeddings == max_len
    layout = CacheLayout(backends)
    token_groups = {g.name for g in layout.groups if g.kind is not GroupKind.PER_REQUEST}
    assert token_groups == set(groups)
    for group, (layers, per_layer) in groups.items():
        entries = layout.buffers_of(group)
        assert len({e.layer for e in entries}) == layers
        per_token = sum(e.role.bytes_per_token for e in entries)
        assert per_token == layers * per_layer
        # block-amortised device bytes agree: no padding in these layouts
        block = layout.group(group).block_size
        assert Fraction(layout.bytes_per_block(group), block) == layers * per_layer
        for layer in {e.layer for e in entries}:
            assert sum(e.role.bytes_per_token for e in entries if e.layer == layer) == per_layer


def test_qwen3_next_state_bytes_per_request():
    backends = from_hf_config("qwen3-next-80b-a3b")
    linear = backends[0]
    assert isinstance(linear, LinearAttentionBackend)
    # conv_dim = 2 * 16 * 128 + 32 * 128 = 8,192; conv [8192, 4 - 1] bf16 = 49,152 B
    assert linear.role("conv_state").entry_shape == (8192, 3)
    assert linear.role("conv_state").dtype == "bfloat16"
    assert linear.conv_state_bytes == 8192 * 3 * 2 == 49_152
    # recurrent [32, 128, 128] in the model dtype, as vLLM's "auto" (bf16) = 1,048,576 B
    assert linear.role("recurrent_state").entry_shape == (32, 128, 128)
    assert linear.role("recurrent_state").dtype == "bfloat16"
    assert linear.recurrent_state_bytes == 32 * 128 * 128 * 2 == 1_048_576
    assert linear.state_bytes_per_request() == 49_152 + 1_048_576 == 1_097_728
    # 36 linear layers: 39,518,208 B per request, whatever its length
    assert CacheLayout(backends).bytes_per_request() == 36 * 1_097_728 == 39_518_208


@pytest.mark.parametrize(
    ("options", "conv_dtype", "recurrent_dtype", "per_layer"),
    [
        # vLLM's defaults ("auto", "auto"): both states in the model dtype (bf16)
        ({}, "bfloat16", "bfloat16", 8192 * 3 * 2 + 32 * 128 * 128 * 2),  # 1,097,728
        # SGLang's default / vLLM's CPU build with AVX512-BF16: a float32 recurrent state
        (
            {"mamba_ssm_cache_dtype": "float32"},
            "bfloat16",
            "float32",
            8192 * 3 * 2 + 32 * 128 * 128 * 4,  # 49,152 + 2,097,152 = 2,146,304
        ),
        # the conv dtype set, recurrent "auto": the conv state's dtype (vLLM's rule)
        ({"mamba_cache_dtype": "float32"}, "float32", "float32", 8192 * 3 * 4 + 32 * 128 * 128 * 4),
        (
            {"mamba_cache_dtype": "float16", "mamba_ssm_cache_dtype": "auto"},
            "float16",
            "float16",
            8192 * 3 * 2 + 32 * 128 * 128 * 2,
        ),
        # an explicit model dtype moves both "auto" states with it
        ({"dtype": "float16"}, "float16", "float16", 8192 * 3 * 2 + 32 * 128 * 128 * 2),
    ],
)
def test_qwen3_next_state_dtypes_follow_vllm(options, conv_dtype, recurrent_dtype, per_layer):
    linear = from_hf_config("qwen3-next-80b-a3b", **options)[0]
    assert isinstance(linear, LinearAttentionBackend)
    assert (linear.conv_dtype, linear.recurrent_dtype) == (conv_dtype, recurrent_dtype)
    assert linear.state_bytes_per_request() == per_layer


@pytest.mark.parametrize(
    ("tp", "conv", "recurrent", "kv_heads"),
    [
        # tp 2: conv 8192 / 2 = 4096 channels, 32 / 2 = 16 v heads; GQA 2 / 2 = 1 kv head
        (2, (4096, 3), (16, 128, 128), 1),
        # tp 4: 2048 channels, 8 v heads; GQA's 2 kv heads replicated: 1 per rank
        (4, (2048, 3), (8, 128, 128), 1),
    ],
)
def test_qwen3_next_tensor_parallel_split(tp, conv, recurrent, kv_heads):
    backends = from_hf_config("qwen3-next-80b-a3b", tp_size=tp)
    assert backends[0].role("conv_state").entry_shape == conv
    assert backends[0].role("recurrent_state").entry_shape == recurrent
    assert backends[3].num_kv_heads == kv_heads


def test_qwen3_next_kv_cache_dtype_leaves_states_alone():
    backends = from_hf_config("qwen3-next-80b-a3b", kv_cache_dtype="fp8", dtype="float16")
    assert backends[3].role("key").dtype == "float8_e4m3fn"
    assert backends[0].role("conv_state").dtype == "float16"  # the model dtype
    assert backends[0].role("recurrent_state").dtype == "float16"  # "auto": the conv dtype


# ------------------------------------------------------------------ the linear backend

SMALL_NEXT = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "full_attention_interval": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "torch_dtype": "bfloat16",
}
# conv_dim = 2 * 2 * 8 + 4 * 16 = 96: conv [96, 3] bf16 = 576 B; recurrent [4, 8, 16] f32 =
# 2,048 B (mamba_ssm_cache_dtype="float32", as SGLang keeps it); 2,624 B per layer, layers 0,
# 1, 2 linear: 7,872 B per request
SMALL_STATE_BYTES = 3 * (96 * 3 * 2 + 4 * 8 * 16 * 4)


def small_controller(linear_slots: int = 4) -> CacheController:
    ctl = CacheController(from_hf_config(SMALL_NEXT, mamba_ssm_cache_dtype="float32"))
    ctl.initialize_kv_cache(
        num_blocks={"linear_state": linear_slots, "kv": 40}, max_num_seqs=4, max_model_len=512
    )
    return ctl


def test_controller_sizes_and_names_linear_state():
    assert SMALL_STATE_BYTES == 7_872
    ctl = small_controller()
    assert ctl.layout.bytes_per_request() == SMALL_STATE_BYTES
    assert ctl.bytes_per_block("linear_state") == SMALL_STATE_BYTES
    assert ctl.storage_names[:7] == [
        "conv_state_caches_0_rank0.device0",
        "recurrent_state_caches_0_rank0.device0",
        "conv_state_caches_1_rank0.device0",
        "recurrent_state_caches_1_rank0.device0",
        "conv_state_caches_2_rank0.device0",
        "recurrent_state_caches_2_rank0.device0",
        "key_caches_3_rank0.device0",
    ]
    conv, recurrent = ctl.get("conv_state", 1), ctl.get("recurrent_state", 1)
    assert (tuple(conv.shape), conv.dtype) == ((4, 1, 96, 3), torch.bfloat16)
    assert (tuple(recurrent.shape), recurrent.dtype) == ((4, 1, 4, 8, 16), torch.float32)
    assert ctl.index_of("recurrent_state", 2) == 5


def test_a_request_holds_one_slot_whatever_its_length():
    ctl = small_controller()
    free = ctl.num_free_blocks("linear_state")
    for n in (1, 17, 100, 333):
        ctl.allocate("r", n)
        assert len(ctl.block_table("r", "linear_state")) == 1
        assert ctl.num_free_blocks("linear_state") == free - 1
    assert len(ctl.block_table("r", "kv")) == 21  # cdiv(333, 16)
    ctl.free_request("r")
    assert ctl.num_free_blocks("linear_state") == free


def _write_states(ctl: CacheController, rid: str, seed: int) -> dict[tuple[str, int], bytes]:
    (slot,) = ctl.block_table(rid, "linear_state")
    written = {}
    gen = torch.Generator().manual_seed(seed)
    for layer in (0, 1, 2):
        for role in ("conv_state", "recurrent_state"):
            raw = ctl.get(role, layer)[slot].view(torch.uint8).view(-1)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
            written[(role, layer)] = raw.clone().numpy().tobytes()
    return written


def _read_states(ctl: CacheController, rid: str) -> dict[tuple[str, int], bytes]:
    (slot,) = ctl.block_table(rid, "linear_state")
    return {
        (role, layer): ctl.get(role, layer)[slot].view(torch.uint8).view(-1).numpy().tobytes()
        for layer in (0, 1, 2)
        for role in ("conv_state", "recurrent_state")
    }


@pytest.mark.parametrize("purpose", ["preempt", "prefix"])
def test_swap_round_trip_is_byte_exact(purpose):
    ctl = small_controller()
    ctl.initialize_host_cache(num_pages={"linear_state": 4, "kv": 8})
    ctl.allocate("other", 5)
    ctl.allocate("r", 40)
    states = _write_states(ctl, "r", seed=7)
    write_request(ctl, "r", 11, range(40), groups=["kv"])
    (old_slot,) = ctl.block_table("r", "linear_state")
    handle = ctl.swap_out("r", purpose=purpose)
    handle.wait()
    # the whole state moves for either purpose: one slot, plus the 3 kv blocks of 40 tokens
    assert handle.blocks_moved == {"linear_state": 1, "kv": 3}
    for layer in (0, 1, 2):  # scribble over the freed slot
        for role in ("conv_state", "recurrent_state"):
            ctl.get(role, layer)[old_slot].view(torch.uint8).fill_(0xAB)
    ctl.allocate("intruder", 3)  # takes a free slot (maybe the old one) and writes over it
    _write_states(ctl, "intruder", seed=99)
    ctl.swap_in("r").wait()
    assert _read_states(ctl, "r") == states
    check = verify_request(ctl, "r", 11, skip_groups=["linear_state"])
    assert (check.entries, check.mismatched) == (2 * 40, 0)  # key and value of layer 3


def test_offload_selection_is_the_whole_state():
    backend = LinearAttentionBackend(2, 4, 8, 16, 4)
    for role in backend.cache_roles():
        for purpose in SwapPurpose:
            assert backend.offload_selection(role, 57, purpose) == TokenRange(start=0, end=57)


def test_speculative_tokens_widen_the_conv_state():
    backend = LinearAttentionBackend(2, 4, 8, 16, 4, num_speculative_tokens=2)
    assert backend.role("conv_state").entry_shape == (96, 3 + 2)


BAD_LINEAR = [
    (dict(num_key_heads=0), "num_key_heads must be a positive number of heads, got 0"),
    (dict(num_value_heads=2.0), "num_value_heads must be an int, got 2.0"),
    (dict(conv_kernel_size=1), "conv_kernel_size must be >= 2, got 1"),
    (dict(tp_size=4), "tp_size=4 does not divide num_key_heads=2"),
    (dict(tp_size=2, num_value_heads=3), "tp_size=2 does not divide num_value_heads=3"),
    (dict(conv_dtype="int4"), "dtype 'int4' is not supported"),
]


@pytest.mark.parametrize(("change", "message"), BAD_LINEAR)
def test_linear_backend_bad_input(change, message):
    args = dict(
        num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=16, conv_kernel_size=4
    )
    args.update(change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        LinearAttentionBackend(**args)


# ------------------------------------------------------------------ builders: bad configs

BAD_CONFIGS = [
    (
        {**SMALL_NEXT, "linear_conv_kernel_dim": None},
        "config has null for 'linear_conv_kernel_dim' (needed for model_type 'qwen3_next')",
    ),
    (
        {k: v for k, v in SMALL_NEXT.items() if k != "full_attention_interval"},
        "config is missing 'full_attention_interval' (needed for model_type 'qwen3_next' "
        "without layer_types)",
    ),
    (
        {**SMALL_NEXT, "layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
        "layer_types[3]='sliding_attention' is not one of ['full_attention', "
        "'linear_attention'] (model_type 'qwen3_next')",
    ),
    (
        {**SMALL_NEXT, "linear_num_value_heads": 0},
        "config field linear_num_value_heads = 0 is invalid for model_type 'qwen3_next'",
    ),
    (
        {"model_type": "gemma2", "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 8},
        "config is missing 'sliding_window' (needed for model_type 'gemma2'",
    ),
    (
        {
            "model_type": "gemma3",
            "text_config": {
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "head_dim": 8,
                "sliding_window": 4,
            },
        },
        # a field the config leaves out takes Gemma3TextConfig's default: 4 kv heads, which
        # 2 query heads cannot share
        "num_attention_heads=2 is not divisible by num_key_value_heads=4 (model_type 'gemma3')",
    ),
    (
        {
            "model_type": "gemma3",
            "text_config": {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "head_dim": 8,
                "sliding_window": 4,
                "sliding_window_pattern": 0,
            },
        },
        "config field text_config.sliding_window_pattern = 0 is invalid for model_type 'gemma3'",
    ),
    (
        {"model_type": "gemma3", "text_config": [1]},
        "config field text_config = [1] is invalid for model_type 'gemma3'",
    ),
    (
        {
            "model_type": "llama4",
            "text_config": {
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "head_dim": 8,
                "attention_chunk_size": 0,
            },
        },
        "config field text_config.attention_chunk_size = 0 is invalid for model_type 'llama4'",
    ),
    (
        {
            "model_type": "llama4_text",
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 8,
            "attention_chunk_size": 16,
            "no_rope_layers": [1, 2],
        },
        "no_rope_layers[1]=2 is not 0 (NoPE, global) or 1 (RoPE, chunked) "
        "(model_type 'llama4_text')",
    ),
    (
        {
            "model_type": "llama4_text",
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 8,
            "attention_chunk_size": 16,
            "no_rope_layers": [1],
        },
        "no_rope_layers has 1 entries but num_hidden_layers=2 (model_type 'llama4_text')",
    ),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS)
def test_bad_configs_name_field_value_and_model_type(config, message):
    before = repr(config)
    with pytest.raises(ValueError) as info:
        from_hf_config(config)
    assert message in str(info.value)
    assert repr(config) == before  # the config is read, never changed


def test_linear_heads_must_split_across_ranks():
    config = {**SMALL_NEXT, "linear_num_key_heads": 3, "num_attention_heads": 4}
    with pytest.raises(ValueError, match=r"linear_num_key_heads=3 is not divisible by tp_size=2"):
        from_hf_config(config, tp_size=2)


def test_text_config_dtype_comes_from_the_wrapper():
    raw = load_model_config("gemma-3-12b")
    assert "torch_dtype" not in raw["text_config"]
    assert from_hf_config(raw)[0].dtype == "bfloat16"


# ------------------------------------------------------------------ Llama-4 chunk boundary


def test_chunked_layer_keeps_only_the_current_chunk():
    config = {
        "model_type": "llama4_text",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "attention_chunk_size": 32,
    }
    ctl = CacheController(from_hf_config(config))  # block 16: two blocks per chunk
    ctl.initialize_kv_cache(num_blocks={"chunked": 8, "kv": 12}, max_num_seqs=4)
    ctl.allocate("r", 32)  # tokens 0..31: chunk 0, blocks 0 and 1
    first_chunk = ctl.block_table("r", "chunked")
    assert len(first_chunk) == 2 and 0 not in first_chunk
    assert ctl.num_used_blocks("chunked") == 2
    ctl.allocate("r", 33)  # token 32 opens chunk 1: chunk 0's blocks go back
    table = ctl.block_table("r", "chunked")
    assert table[:2] == [0, 0] and len(table) == 3 and table[2] != 0
    assert ctl.num_used_blocks("chunked") == 1
    assert len(ctl.block_table("r", "kv")) == 3  # the global layer keeps everything
    for n in range(34, 65):  # decode to the end of chunk 1
        ctl.allocate("r", n)
    assert ctl.num_used_blocks("chunked") == 2
    ctl.allocate("r", 65)  # chunk 2
    assert ctl.block_table("r", "chunked")[:4] == [0, 0, 0, 0]
    assert ctl.num_used_blocks("chunked") == 1


# ------------------------------------------------------------------ CLI


@pytest.mark.parametrize("name", NEW_MODELS)
def test_kvforge_plan_runs(name, capsys):
    rc = main(
        [
            "plan",
            "--model",
            name,
            "--device-memory",
            "80GiB",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "32768",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert f"kvforge plan: {name}" in out
