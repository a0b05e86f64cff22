"""Builders of the families published on DeepSeek's latent-attention shapes: GLM-4.7-Flash
(``glm4_moe_lite``, MLA), GLM-5 (``glm_moe_dsa``, DSA) and Kimi-K2.5 (``kimi_k25``, a
multimodal wrapper whose ``text_config`` is Kimi-K2, a DeepSeek-V3-shaped MLA model).

Their caches are those of :mod:`kvforge.models.deepseek` (:func:`build_mla`,
:func:`build_dsa`): one latent per token on every rank, plus the DSA indexer key. What these
builders add is the engines' reading of each family's ``config.json``:

- **Engine defaults.** A field the config leaves out takes the default of the family's
  ``transformers`` configuration class, which vLLM loads the config with
  (:data:`ENGINE_DEFAULTS`, one entry per model type, each citing its class). A field set to
  ``null`` is an error, as it is for the configuration class.
- **GLM-4.7-Flash** is DeepSeek-V3's MLA under another name: vLLM's
  ``model_executor/models/glm4_moe_lite.py`` builds ``Glm4MoeLiteMLAAttention``, a
  ``DeepseekV2MLAAttention`` (one ``MLAAttentionSpec`` of ``kv_lora_rank + qk_rope_head_dim``
  per layer, at ``model.layers.{i}.self_attn.attn``).
- **GLM-5** is DeepSeek-V3.2's DSA: vLLM serves ``GlmMoeDsaForCausalLM`` with
  ``DeepseekV2ForCausalLM`` (``model_executor/models/deepseek_v2.py``; CUDA:
  ``models/deepseek_v32``), every layer an MLA latent and an indexer key
  (``DeepseekV32IndexerCache``), the MTP layer included, except the layers a shared-index
  schedule (GLM-5.2) lets reuse another layer's top-k: the latent only.
- **Kimi-K2.5** nests its language model under ``text_config``; vLLM's
  ``model_executor/models/kimi_k25.py`` builds it as ``DeepseekV2ForCausalLM`` under the prefix
  ``language_model`` (cache layers ``language_model.model.layers.{i}.self_attn.attn``), and
  ``transformers``' ``Kimi_K25Config`` reads a ``text_config`` of model type ``kimi_k2`` as
  ``deepseek_v3``. Errors name the fields inside ``text_config``. Kimi-K2 itself
  (``model_type`` ``kimi_k2``, ``architectures`` ``["DeepseekV3ForCausalLM"]``) plans through
  its architecture as ``deepseek_v3``.

MTP / next-n layers (``num_nextn_predict_layers``) follow the rule of
:mod:`kvforge.models.hf_config`: cache layers only with ``num_speculative_tokens > 0``, with the
main layers' backend (vLLM's ``DeepSeekMTP`` and ``Glm4MoeLiteMTP`` build the same decoder
layer, and an MTP layer of a DSA model always has its indexer).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvforge.attn_backends.base import AttentionBackend
from kvforge.models.base import ModelBackends, ModelOptions
from kvforge.models.deepseek import build_dsa, build_mla
from kvforge.models.engine_defaults import with_defaults
from kvforge.models.reading import max_position_embeddings, nested_errors, text_config

__all__ = [
    "ENGINE_DEFAULTS",
    "build_glm4_moe_lite",
    "build_glm_moe_dsa",
    "build_kimi_k25",
    "with_engine_defaults",
]

ENGINE_DEFAULTS: Mapping[str, Mapping[str, int]] = MappingProxyType(
    {
        # transformers/models/glm4_moe_lite/configuration_glm4_moe_lite.py (Glm4MoeLiteConfig)
        "glm4_moe_lite": MappingProxyType(
            {
                "num_hidden_layers": 47,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "max_position_embeddings": 202752,
            }
        ),
        # transformers/models/glm_moe_dsa/configuration_glm_moe_dsa.py (GlmMoeDsaConfig)
        "glm_moe_dsa": MappingProxyType(
            {
                "num_hidden_layers": 78,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "index_head_dim": 128,
                "index_topk": 2048,
                "max_position_embeddings": 202752,
            }
        ),
        # the text_config of transformers/models/kimi_k25/configuration_kimi_k25.py
        # (Kimi_K25Config): transformers/models/deepseek_v3/configuration_deepseek_v3.py
        # (DeepseekV3Config)
        "kimi_k25": MappingProxyType(
            {
                "num_hidden_layers": 61,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "max_position_embeddings": 4096,
            }
        ),
    }
)
"""``model_type -> {field: default}``: what the engines read for a field the config leaves
out (the defaults of the ``transformers`` configuration class vLLM loads it with). For
``kimi_k25`` the fields are those of its ``text_config``. ``num_nextn_predict_layers`` is 0
when absent (no class declares it; vLLM reads it with ``getattr(..., 0)``)."""


def with_engine_defaults(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """``config`` with the fields of :data:`ENGINE_DEFAULTS` ``[model_type]`` it leaves out
    filled in (:func:`~kvforge.models.engine_defaults.with_defaults`: a field present with
    ``null`` stays ``null``, and the builders refuse it as the configuration class does). A
    model type without defaults gets a plain copy."""
    return with_defaults(config, ENGINE_DEFAULTS.get(model_type, {}))


def _with_max_len(
    backends: Mapping[int, AttentionBackend], text: Mapping[str, Any], model_type: str
) -> ModelBackends:
    """The backends plus the ``max_position_embeddings`` of the (defaulted) text config."""
    return ModelBackends(
        backends,
        model_type=model_type,
        max_position_embeddings=max_position_embeddings(text, model_type),
    )


def build_glm4_moe_lite(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's MLA, one latent per token and layer,
    with :data:`ENGINE_DEFAULTS` for the fields the config leaves out."""
    text = with_engine_defaults(config, "glm4_moe_lite")
    return _with_max_len(build_mla(text, model_type, options), text, model_type)


def build_glm_moe_dsa(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's DSA, an MLA latent and an indexer key per
    token and layer (:func:`~kvforge.models.deepseek.build_dsa`: ``"fp8"`` by default,
    ``kv_cache_dtype="bf16"`` as vLLM's ``auto`` stores it before SM100), with
    :data:`ENGINE_DEFAULTS` for the fields the config leaves out."""
    text = with_engine_defaults(config, "glm_moe_dsa")
    return _with_max_len(build_dsa(text, model_type, options), text, model_type)


def build_kimi_k25(
    config: Mapping[str, Any], model_type: str, options: ModelOptions
) -> ModelBackends:
    """Kimi-K2.5 (``kimi_k25``): the DeepSeek-V3-shaped language model of its ``text_config``
    (MLA; DSA if that config has ``index_head_dim``), with :data:`ENGINE_DEFAULTS`.

    Raises:
        ValueError: the config has no ``text_config`` (the wrapper's language model), or a
            field inside it is invalid (named as ``text_config.<field>``).
    """
    if config.get("text_config") is None:
        state = "is missing" if "text_config" not in config else "has null for"
        raise ValueError(
            f"config {state} 'text_config' (needed for model_type {model_type!r}: the "
            "language model's fields are nested there)"
        )
    text = with_engine_defaults(text_config(config, model_type), "kimi_k25")
    try:
        return _with_max_len(build_mla(text, model_type, options), text, model_type)
    except ValueError as exc:
        raise nested_errors(config, exc) from None
