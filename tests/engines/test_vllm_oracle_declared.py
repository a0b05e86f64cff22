"""The Gated DeltaNet hybrids the CPU build of vLLM cannot load, against the state spec vLLM's
model classes declare (issue 35, item 3). No engine starts here: this runs with vLLM 0.33 in
the main environment.

vLLM's ``qwen3_5.py`` imports ``qwen3_vl.py``, which imports transformers' image processors,
which need ``torchvision``; the CPU build's environment has none, so Qwen3.5 (dense and MoE)
does not load there, not even its language model. Its Gated DeltaNet layers declare their
state through two calculators (``vllm/model_executor/layers/mamba/mamba_utils.py``), called by
``QwenGatedDeltaNetAttention.get_state_shape`` (``layers/mamba/gdn/qwen_gdn_linear_attn.py``)
and ``GatedDeltaNetAttention.get_state_dtype`` (``layers/mamba/gdn/base.py``), the same
calls ``Qwen3_5ForCausalLM.get_mamba_state_shape_from_config`` /
``get_mamba_state_dtype_from_config`` make (``models/qwen3_5.py``):

- ``MambaStateShapeCalculator.gated_delta_net_state_shape(tp, linear_num_key_heads,
  linear_num_value_heads, linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim,
  num_spec)``;
- ``MambaStateDtypeCalculator.gated_delta_net_state_dtype(model dtype, mamba_cache_dtype,
  mamba_ssm_cache_dtype)``, where ``mamba_ssm_cache_dtype`` ``"auto"`` becomes the text
  config's ``mamba_ssm_dtype`` for Qwen3.5 (``Qwen3_5ForConditionalGenerationConfig.
  verify_and_update_config`` in ``models/config.py``) and stays ``"auto"`` (the conv state's
  dtype, the model dtype) for Qwen3-Next.

The test feeds them the bundled configs' fields and compares with the ``MambaSpec`` that
``to_vllm_specs`` gives each linear-attention layer of kvforge's plan: equal, with vLLM's
default options and with ``mamba_cache_dtype`` / ``mamba_ssm_cache_dtype`` set on both sides
(an explicit ``mamba_ssm_cache_dtype`` wins over Qwen3.5's config, as in vLLM).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

import torch
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from kvforge.integrations.vllm.specs import to_vllm_specs
from kvforge.models import from_hf_config, load_model_config

MAMBA_BLOCK = 4096  # vLLM's mamba_block_size without prefix caching: max_model_len
BLOCK = 16

# case -> (bundled config, model_type, kvforge's options = vLLM's mamba_cache_dtype and
# mamba_ssm_cache_dtype as passed, vLLM's mamba_ssm_cache_dtype after its config hook)
CASES: dict[str, tuple[str, str, dict[str, str], str]] = {
    "qwen3.5-27b": ("qwen3.5-27b", "qwen3_5", {}, "float32"),  # the config's mamba_ssm_dtype
    "qwen3.5-35b-a3b": ("qwen3.5-35b-a3b", "qwen3_5_moe", {}, "float32"),
    # an explicit option wins over the config's mamba_ssm_dtype (vLLM warns and uses it)
    "qwen3.5-27b-bf16": (
        "qwen3.5-27b",
        "qwen3_5",
        {"mamba_ssm_cache_dtype": "bfloat16"},
        "bfloat16",
    ),
    "qwen3-next-80b-a3b": ("qwen3-next-80b-a3b", "qwen3_next", {}, "auto"),  # the model dtype
    "qwen3-next-80b-a3b-fp32": (
        "qwen3-next-80b-a3b",
        "qwen3_next",
        {"mamba_ssm_cache_dtype": "float32"},
        "float32",
    ),
    "qwen3-next-80b-a3b-conv-fp32": (
        "qwen3-next-80b-a3b",
        "qwen3_next",
        {"mamba_cache_dtype": "float32"},
        "auto",  # the conv state's dtype
    ),
}


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


def vllms_state(name: str) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    """The state shapes and dtypes vLLM's Gated DeltaNet layer declares for a bundled config
    (tensor parallelism 1, no speculative tokens, the model served in bfloat16)."""
    config, _, options, ssm = CASES[name]
    text = _text(dict(load_model_config(config)))
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1,
        text["linear_num_key_heads"],
        text["linear_num_value_heads"],
        text["linear_key_head_dim"],
        text["linear_value_head_dim"],
        text["linear_conv_kernel_dim"],
        0,
    )
    conv = options.get("mamba_cache_dtype", "auto")
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, conv, ssm)
    return tuple(tuple(s) for s in shapes), tuple(dtypes)


@pytest.mark.parametrize("name", sorted(CASES))
def test_linear_attention_state_is_vllms(name: str) -> None:
    config, model_type, options, _ = CASES[name]
    plan = from_hf_config(config, **options)
    assert plan.model_type == model_type
    specs = to_vllm_specs(plan, BLOCK, mamba_block_size=MAMBA_BLOCK)
    states = {n: s for n, s in specs.items() if isinstance(s, MambaSpec)}
    assert states and all(n.endswith(".linear_attn") for n in states)
    shapes, dtypes = vllms_state(name)
    theirs = MambaSpec(
        shapes=shapes,
        dtypes=dtypes,
        block_size=MAMBA_BLOCK,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    for layer, spec in states.items():
        assert spec == theirs, (layer, spec, theirs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_attention_layers_are_vllms(name: str) -> None:
    """The full-attention layers: ``Attention.get_kv_cache_spec`` of a plain layer is a
    ``FullAttentionSpec`` of the config's kv heads and head dim in the model dtype."""
    config, _, options, _ = CASES[name]
    text = _text(dict(load_model_config(config)))
    specs = to_vllm_specs(from_hf_config(config, **options), BLOCK, mamba_block_size=MAMBA_BLOCK)
    attention = {n: s for n, s in specs.items() if not isinstance(s, MambaSpec)}
    theirs = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=text["num_key_value_heads"],
        head_size=text["head_dim"],
        dtype=torch.bfloat16,
    )
    assert attention and all(n.endswith(".self_attn.attn") for n in attention)
    assert all(spec == theirs for spec in attention.values()), attention
    # one full-attention layer in full_attention_interval (4), the rest linear attention
    assert len(specs) == text["num_hidden_layers"]
    assert len(attention) * text.get("full_attention_interval", 4) == len(specs)
