"""What kvforge registers itself: its backends (with their CLI builders) and its model types.

Plain tables, no registration: :mod:`kvforge.models.registry` seeds its tables from them when
it is imported, so no one can observe (or register into) a registry that lacks the bundled
entries, and a plugin that claims a bundled name is refused whatever the import order. The
bundled entries are registered through the same checks a plugin's go through.

MLA and DSA backends are built by their classes (every parameter has a default); GQA, MHA and
DeepSeek-V4 have builders that fix the CLI's defaults (8 kv heads of 128) or leave out what
the CLI does not set (V4's head_dim and window are those of the published model).
"""

from __future__ import annotations

from collections.abc import Callable

from kvforge.attn_backends.base import AttentionBackend
from kvforge.attn_backends.deepseek_v4 import DeepseekV4Backend
from kvforge.attn_backends.dsa import DSABackend
from kvforge.attn_backends.gqa import GQABackend, MHABackend
from kvforge.attn_backends.mla import MLABackend
from kvforge.models.base import ModelBuilder
from kvforge.models.deepseek import build_deepseek_v4, build_dsa, build_mla
from kvforge.models.families import (
    build_gemma2,
    build_gemma3,
    build_gpt_oss,
    build_gqa,
    build_llama4,
    build_mistral,
    build_qwen,
    build_qwen3_next,
)
from kvforge.models.mamba_hybrids import build_falcon_h1, build_granite_hybrid, build_nemotron_h
from kvforge.models.mla_families import build_glm4_moe_lite, build_glm_moe_dsa, build_kimi_k25
from kvforge.models.per_layer import build_gemma3n, build_gemma4, build_mimo_v2, build_nemotron_nas
from kvforge.models.published_gqa import (
    build_minimax_m2,
    build_mistral3,
    build_olmo2,
    build_phi3,
    build_qwen2_5_vl,
    build_qwen3_vl,
    build_qwen3_vl_moe,
    build_step3p5,
)
from kvforge.models.published_hybrid import build_qwen3_5, build_qwen3_5_moe

__all__ = ["BUNDLED_BACKENDS", "BUNDLED_MODEL_TYPES"]


def _gqa_from_cli(
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: str = "bfloat16",
    kv_cache_quant: str | None = None,
) -> AttentionBackend:
    return GQABackend(num_kv_heads, head_dim, block_size, dtype, kv_cache_quant)  # type: ignore[arg-type]


def _mha_from_cli(
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: str = "bfloat16",
    kv_cache_quant: str | None = None,
) -> AttentionBackend:
    return MHABackend(num_kv_heads, head_dim, block_size, dtype, kv_cache_quant)  # type: ignore[arg-type]


def _v4_from_cli(
    compress_ratio: int = 4,
    qk_rope_head_dim: int = 64,
    index_head_dim: int = 128,
    kv_cache_dtype: str = "fp8",
) -> AttentionBackend:
    return DeepseekV4Backend(
        compress_ratio,
        qk_rope_head_dim=qk_rope_head_dim,
        index_head_dim=index_head_dim,
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
    )


BUNDLED_BACKENDS: tuple[
    tuple[str, type[AttentionBackend], Callable[..., AttentionBackend] | None], ...
] = (
    ("gqa", GQABackend, _gqa_from_cli),
    ("mha", MHABackend, _mha_from_cli),
    ("mla", MLABackend, None),
    ("dsa", DSABackend, None),
    ("deepseek-v4", DeepseekV4Backend, _v4_from_cli),
)
"""``(name, class, cli_builder)`` of every bundled backend (``None``: the class is the builder)."""

BUNDLED_MODEL_TYPES: tuple[tuple[str, ModelBuilder, str], ...] = (
    ("llama", build_gqa, "LlamaForCausalLM"),
    ("mistral", build_mistral, "MistralForCausalLM"),
    ("mixtral", build_mistral, "MixtralForCausalLM"),
    ("qwen2", build_qwen, "Qwen2ForCausalLM"),
    ("qwen2_moe", build_qwen, "Qwen2MoeForCausalLM"),
    ("qwen3", build_qwen, "Qwen3ForCausalLM"),
    ("qwen3_moe", build_qwen, "Qwen3MoeForCausalLM"),
    ("deepseek_v2", build_mla, "DeepseekV2ForCausalLM"),
    ("deepseek_v3", build_mla, "DeepseekV3ForCausalLM"),
    ("deepseek_v32", build_dsa, "DeepseekV32ForCausalLM"),
    ("deepseek_v4", build_deepseek_v4, "DeepseekV4ForCausalLM"),
    ("gemma2", build_gemma2, "Gemma2ForCausalLM"),
    ("gemma3", build_gemma3, "Gemma3ForConditionalGeneration"),
    ("gemma3_text", build_gemma3, "Gemma3ForCausalLM"),
    ("gpt_oss", build_gpt_oss, "GptOssForCausalLM"),
    ("llama4", build_llama4, "Llama4ForConditionalGeneration"),
    ("llama4_text", build_llama4, "Llama4ForCausalLM"),
    ("glm4_moe", build_gqa, "Glm4MoeForCausalLM"),
    ("qwen3_next", build_qwen3_next, "Qwen3NextForCausalLM"),
    ("phi3", build_phi3, "Phi3ForCausalLM"),
    ("olmo2", build_olmo2, "Olmo2ForCausalLM"),
    ("minimax_m2", build_minimax_m2, "MiniMaxM2ForCausalLM"),
    ("mistral3", build_mistral3, "Mistral3ForConditionalGeneration"),
    ("qwen2_5_vl", build_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration"),
    ("qwen3_vl", build_qwen3_vl, "Qwen3VLForConditionalGeneration"),
    ("qwen3_vl_moe", build_qwen3_vl_moe, "Qwen3VLMoeForConditionalGeneration"),
    ("qwen3_5", build_qwen3_5, "Qwen3_5ForConditionalGeneration"),
    ("qwen3_5_text", build_qwen3_5, "Qwen3_5ForCausalLM"),
    ("qwen3_5_moe", build_qwen3_5_moe, "Qwen3_5MoeForConditionalGeneration"),
    ("qwen3_5_moe_text", build_qwen3_5_moe, "Qwen3_5MoeForCausalLM"),
    ("step3p5", build_step3p5, "Step3p5ForCausalLM"),
    ("nemotron-nas", build_nemotron_nas, "DeciLMForCausalLM"),
    ("mimo_v2_flash", build_mimo_v2, "MiMoV2FlashForCausalLM"),
    ("mimo_v2", build_mimo_v2, "MiMoV2ForCausalLM"),
    ("gemma3n", build_gemma3n, "Gemma3nForConditionalGeneration"),
    ("gemma3n_text", build_gemma3n, "Gemma3nForCausalLM"),
    ("gemma4", build_gemma4, "Gemma4ForConditionalGeneration"),
    ("gemma4_text", build_gemma4, "Gemma4ForCausalLM"),
    ("glm4_moe_lite", build_glm4_moe_lite, "Glm4MoeLiteForCausalLM"),
    ("glm_moe_dsa", build_glm_moe_dsa, "GlmMoeDsaForCausalLM"),
    ("kimi_k25", build_kimi_k25, "KimiK25ForConditionalGeneration"),
    ("falcon_h1", build_falcon_h1, "FalconH1ForCausalLM"),
    ("nemotron_h", build_nemotron_h, "NemotronHForCausalLM"),
    ("granitemoehybrid", build_granite_hybrid, "GraniteMoeHybridForCausalLM"),
)
"""``(model_type, builder, architecture)`` of every bundled Hugging Face model type."""
